"""Sandbox: each escape attempt is stopped within its limit, scores 0, and harms nothing else."""

import dataclasses
import os
import pathlib
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from envs.cli import main
from envs.harbor import dirs as harbor_dirs
from envs.harbor.task import HarborTask
from envs.sandbox import cgroup, isolation, tree
from envs.sandbox import sandbox as sandbox_module
from envs.sandbox.sandbox import Isolation, Limits, Sandbox, SandboxError, probe
from envs.shell import ShellEnv
from tests.harbor_util import write_task

ISO = probe()
needs_netns = pytest.mark.skipif(ISO.network != "netns", reason="no network namespaces here: " + ISO.describe())
needs_chroot = pytest.mark.skipif(ISO.filesystem != "chroot", reason="no mount namespaces here: " + ISO.describe())
needs_uid = pytest.mark.skipif(ISO.user != "dedicated-uid", reason="not root: no dedicated uid")


def _uid_processes(uid: int) -> list[int]:
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{pid}").st_uid == uid:
                pids.append(int(pid))
        except FileNotFoundError:
            pass
    return pids


def _answer_task(secret: str = "") -> HarborTask:
    tests = {"test.sh": f"#!/bin/bash\n# {secret}\ntest \"$(cat /app/answer.txt)\" = 42\n"}
    return HarborTask(id="answer", instruction="Write 42 to /app/answer.txt.\n", domain="terminal",
                      solution="echo 42 > /app/answer.txt\n", tests=tests, agent_timeout=30.0, verifier_timeout=10.0)


def test_probe_reports_what_is_active(capsys):
    assert ISO.network in ("netns", "host") and ISO.filesystem in ("chroot", "plain")
    assert ISO.processes in ("pidns", "kill-sweep") and "network=" in ISO.describe()
    assert main(["info"]) == 0 and ISO.describe() in capsys.readouterr().out


def test_without_network_namespaces_the_sandbox_refuses_by_default(monkeypatch):
    refused = Isolation("host", "plain", ISO.user, "kill-sweep", ("unshare(CLONE_NEWNET): EPERM",))
    monkeypatch.setattr(sandbox_module, "probe", lambda: refused)
    with pytest.raises(SandboxError, match="network='host'"):
        Sandbox()
    with pytest.raises(SandboxError, match="mount namespaces"):
        Sandbox(network="host", filesystem="chroot")
    with Sandbox(network="host") as box:  # explicitly allowed: runs, and says what it has
        assert box.isolation.network == "host" and box.run("echo ok").output == "ok\n"


def test_basic_command_runs_in_private_workdir():
    with Sandbox() as box:
        result = box.run("pwd; echo hi > x; cat x; env | sort")
        assert result.ok, result.output
        assert result.output.splitlines()[:2] == [box.path("/app"), "hi"]
        env = dict(line.split("=", 1) for line in result.output.splitlines()[2:] if "=" in line)
        assert "OPENAI_API_KEY" not in env and env["TMPDIR"] == box.path("/tmp")
        assert box.read_bytes("/app/x") == b"hi\n"


def test_files_persist_processes_do_not():
    with Sandbox() as box:
        box.run("sleep 30 & echo started")
        if box.uid is not None:
            assert _uid_processes(box.uid) == []
        box.run("echo one > f")
        assert box.run("cat f").output == "one\n"


BAD_COMMANDS = {
    "infinite_loop": ("while :; do :; done", Limits(wall_seconds=1.5), 4.0),
    "cpu_limit": ("while :; do :; done", Limits(wall_seconds=10.0, cpu_seconds=1), 5.0),
    "fork_bomb": ("bomb() { bomb | bomb & }; bomb; sleep 20", Limits(wall_seconds=2.0, processes=32), 6.0),
    "alloc_10gb": ("python3 -c 'x = bytearray(10 * 1024 ** 3)'", Limits(memory_bytes=512 << 20), 5.0),
    "big_output": ("head -c 100000000 /dev/zero | tr '\\0' x", Limits(output_bytes=1 << 20), 5.0),
    "setsid_escape": ("setsid sleep 60 & disown; sleep 60", Limits(wall_seconds=1.0), 4.0),
    "write_outside": ("echo 42 > /answer.txt; echo 42 > /etc/answer.txt; echo 42 > ../answer.txt", Limits(), 4.0),
}


@pytest.mark.parametrize("name", sorted(BAD_COMMANDS))
def test_bad_command_is_stopped_within_limits_and_scores_zero(name):
    command, limits, seconds = BAD_COMMANDS[name]
    env = ShellEnv(limits=limits)
    env.reset(_answer_task())
    uid = env.sandbox.uid
    start = time.monotonic()
    obs, reward, done, info = env.step(f"<bash>{command}</bash>")
    took = time.monotonic() - start
    assert not done and took < seconds, (name, took, obs[-300:])
    if uid is not None:
        assert _uid_processes(uid) == [], f"{name} left processes behind"
    _, reward, done, info = env.step("<submit/>")
    assert done and reward == 0.0
    env.close()
    if name == "big_output":
        assert "output_limit" in obs and len(obs) < 8192
    if name == "alloc_10gb":
        assert "MemoryError" in obs
    if name == "write_outside":
        assert obs.count("Read-only file system") + obs.count("Permission denied") >= 2, obs
    with Sandbox() as other:  # the host can still run sandboxes
        assert other.run("echo ok").output == "ok\n"


@needs_uid
def test_fork_bomb_leaves_concurrent_task_unharmed():
    results = {}

    def neighbour():
        with Sandbox() as box:
            outputs = [box.run("echo $((6 * 7))").output for _ in range(5)]
            results["neighbour"] = outputs

    with Sandbox(limits=Limits(wall_seconds=2.0, processes=16)) as bomb:
        thread = threading.Thread(target=neighbour)
        thread.start()
        result = bomb.run("bomb() { bomb | bomb & }; bomb; sleep 20")
        thread.join(30)
    assert result.killed == "timeout"
    assert results["neighbour"] == ["42\n"] * 5
    assert os.getpid() > 0 and os.system("true") == 0


@needs_chroot
def test_writes_outside_the_sandbox_fail(tmp_path):
    outside = tmp_path / "outside.txt"
    marker = f"glmjax-escape-{os.getpid()}"
    with Sandbox() as box:
        result = box.run(f"echo x > {outside}; echo x > /etc/{marker}; echo x > /{marker}; echo x > /usr/{marker}; "
                         f"echo x > /tmp/{marker} && echo tmp-ok; echo x > /dev/shm/{marker}; ls /work /root 2>&1")
    assert "tmp-ok" in result.output  # its own /tmp is writable ...
    assert not outside.exists()
    for path in (f"/etc/{marker}", f"/{marker}", f"/usr/{marker}", f"/tmp/{marker}", f"/dev/shm/{marker}"):
        assert not os.path.exists(path), path  # ... but nothing on the host changed


def test_host_side_reads_do_not_follow_symlinks_out():
    with Sandbox() as box:
        box.run("ln -s /etc/hostname leak; mkdir d; ln -s /etc d/up")
        assert box.read_bytes("/app/leak") is None
        assert box.read_bytes("/app/d/up/hostname") is None


@needs_netns
def test_network_connection_is_refused():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.2)
    port = listener.getsockname()[1]
    env = ShellEnv()
    env.reset(_answer_task())
    obs, *_ = env.step(f"<bash>python3 -c \"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2)\"; "
                       f"echo hi > /dev/tcp/127.0.0.1/{port} && echo CONNECTED</bash>")
    _, reward, done, _ = env.step("<submit/>")
    env.close()
    with pytest.raises(socket.timeout):
        listener.accept()
    listener.close()
    assert "CONNECTED" not in obs and ("refused" in obs.lower() or "unreachable" in obs.lower())
    assert done and reward == 0.0


def test_tests_are_invisible_until_the_agent_finishes():
    secret = "SECRET-TOKEN-7319"
    task = _answer_task(secret)
    env = ShellEnv()
    env.reset(task)
    host_tests = "/tmp /work /root /home"  # where the task's files live on the host: not in the sandbox
    obs, *_ = env.step(f"<bash>ls -la /tests; cat /tests/test.sh; grep -rs SECRET-TOKEN /app /tests /solution /logs "
                       f"/etc {host_tests} | head</bash>")
    assert secret not in obs
    _, reward, done, _ = env.step("<bash>echo 41 > /app/answer.txt</bash><submit/>")
    env.close()
    assert done and reward == 0.0


def test_agent_cannot_forge_the_reward_file():
    env = ShellEnv()
    env.reset(_answer_task())
    env.step("<bash>mkdir -p /logs/verifier; echo 1 > /logs/verifier/reward.txt</bash>")
    _, reward, _, info = env.step("<submit/>")
    env.close()
    assert reward == 0.0 and info["reward_source"] == "exit status"


def test_plain_filesystem_fallback_runs_with_rewritten_paths():
    with Sandbox(filesystem="plain") as box:
        assert box.path("/app") == box.host_path("/app") != "/app"
        script = box.rewrite("cd /app && echo 1 > /app/x && cat /app/x > /logs/verifier/y; echo /apple")
        assert "/apple" in script and box.root in script
        result = box.run(script)
        assert result.ok, result.output
        assert box.read_bytes("/logs/verifier/y") == b"1\n"
        if box.uid is not None:
            assert not box.run("touch /etc/glmjax-plain-escape").ok


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="network"):
        Sandbox(network="bridge")
    with pytest.raises(ValueError, match="Limits.wall_seconds"):
        Limits(wall_seconds=0)
    with Sandbox() as box:
        with pytest.raises(ValueError, match="not under one of the sandbox directories"):
            box.host_path("/etc/passwd")
    box.close()
    with pytest.raises(SandboxError, match="closed"):
        box.run("true")


def test_commands_are_forked_by_helpers_never_by_the_caller(monkeypatch):
    """The caller may be a trainer with JAX's threads and gigabytes resident: it never
    forks (os.fork, or subprocess with a preexec_fn); four threads run at once, each in
    its own helper; a helper killed mid-command costs that command only."""
    from envs.sandbox import launcher

    def no_fork(*args, **kwargs):
        raise AssertionError("the caller forked")

    launcher.close()
    monkeypatch.setattr(os, "fork", no_fork)
    real_popen = launcher.subprocess.Popen
    monkeypatch.setattr(launcher.subprocess, "Popen", lambda *a, **k: no_fork() if k.get("preexec_fn") else
                        real_popen(*a, **k))
    outputs = {}

    def run(i):
        with Sandbox() as box:
            outputs[i] = box.run(f"sleep 0.5; echo {i * i}").output

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert outputs == {i: f"{i * i}\n" for i in range(4)}
    assert time.monotonic() - start < 4 * 0.5  # side by side: one after another takes longer
    assert len(launcher._POOL.idle) == 4

    with Sandbox(per_command=True) as box:
        helper = launcher._POOL.idle[-1]  # the next run takes the last idle helper
        threading.Timer(0.3, helper.proc.kill).start()
        with pytest.raises(SandboxError, match="helper process exited"):
            box.run("sleep 5")
        assert helper not in launcher._POOL.idle
        assert box.run("echo ok").output == "ok\n"
    with Sandbox() as box:  # an episode's commands: the anchor, killed mid-command, takes that command with it
        box.run("true")
        threading.Timer(0.3, os.kill, (box._anchor[0], signal.SIGKILL)).start()
        start = time.monotonic()
        assert box.run("sleep 5").returncode == -signal.SIGKILL and time.monotonic() - start < 3.0
        assert box.run("echo ok").output == "ok\n"


def _lock_is_free(uid: int) -> bool:
    import fcntl

    fd = os.open(os.path.join(isolation.LOCK_DIR, str(uid)), os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def test_a_tree_1100_levels_deep_is_hashed_checked_and_removed():
    from envs import evaluate

    env = ShellEnv(max_turns=3)
    env.reset(_answer_task())
    box = env.sandbox
    root, uid = box.root, box.uid
    obs, *_ = env.step("<bash>python3 -c \"import os\nfor _ in range(1100): os.mkdir('d'); os.chdir('d')\n"
                       "open('bad.py', 'w').write('def broken(:')\nprint(len(os.getcwd()))\"</bash>")
    assert "[exit 0" in obs and int(obs.split()[0]) > 2200, obs  # deeper than os.walk's recursion limit allows
    before = box.snapshot("/app")
    box.run("f=$(find /app -name bad.py); echo 'x = 1' > \"$f\"")
    assert box.snapshot("/app") != before  # the bottom of the tree is part of the hash
    assert evaluate._python_files_parse(env) is True
    box.run("f=$(find /app -name bad.py); echo 'def broken(:' > \"$f\"")
    assert evaluate._python_files_parse(env) is False  # the file at the bottom is found and read
    env.close()
    assert not os.path.exists(root)
    if uid is not None:
        assert _lock_is_free(uid) and _uid_processes(uid) == []


@needs_uid
def test_close_releases_the_uid_even_when_removing_the_directory_fails(monkeypatch):
    box = Sandbox()
    root, uid = box.root, box.uid
    monkeypatch.setattr(tree, "rmtree", lambda path: (_ for _ in ()).throw(OSError(f"cannot remove {path}")))
    with pytest.raises(OSError, match="cannot remove"):
        box.close()
    assert _lock_is_free(uid)
    monkeypatch.undo()
    tree.rmtree(root)


# Each holder sleeps long enough that all four overlap even on a loaded machine.
HOLD = ("python3 -c \"import time; a = bytearray(300 << 20); a[::4096] = b'x' * len(a[::4096]); "
        "print('held', flush=True); time.sleep(8); print('done', flush=True)\"")


def test_memory_is_capped_as_the_report_says():
    """With a cgroup all processes together stay under the cap; without one each process
    does (the report says which, and both are checked: the second by taking the cgroup away)."""
    with Sandbox(limits=Limits(memory_bytes=512 << 20, wall_seconds=30.0)) as box:
        assert f"memory={box.isolation.memory}" in box.isolation.describe()
        one = box.run(HOLD)
        assert one.ok and "held" in one.output, one  # one 300 MB process fits under 512 MB either way
        four = box.run(f"for i in 1 2 3 4; do {HOLD} & done; wait")
        if box.isolation.memory.startswith("cgroup"):
            # The OOM killer picks its victim: a process that already printed "held" may be the
            # one killed when the next allocates, so two "held" lines are possible. What the cap
            # guarantees is that no two 300 MB processes live through the sleep together.
            assert four.killed == "memory_limit" and four.output.splitlines().count("done") <= 1, four
            assert box.group.peak_bytes() <= 512 << 20


def test_without_a_cgroup_each_process_is_capped_and_the_report_says_so(monkeypatch):
    monkeypatch.setattr(sandbox_module, "_PROBED", None)
    monkeypatch.setattr(cgroup, "available", lambda: {"memory": None, "cpu": None})
    found = sandbox_module.probe()
    assert found.memory == "per-process" and "memory=per-process" in found.describe()
    with Sandbox(limits=Limits(memory_bytes=512 << 20, wall_seconds=30.0)) as box:
        assert box.group is None
        four = box.run(f"for i in 1 2 3 4; do {HOLD} & done; wait")
        assert four.ok and four.output.splitlines().count("held") == 4, four  # 1.2 GB between them
        big = box.run("python3 -c 'bytearray(600 << 20)'")
        assert not big.ok and "MemoryError" in big.output, big


# ----- a hostile agent: each way out that was found open, tried again --------------------------
SHM = ("python3 -c \"import ctypes, sys\nlibc = ctypes.CDLL(None, use_errno=True)\n"
       "libc.shmat.restype = ctypes.c_void_p\n"
       "key, size = 0x676c6d6a, int(sys.argv[1])\n"
       "shmid = libc.shmget(key, size, 0o1666 if size else 0)\n"  # IPC_CREAT | 0666, or look it up
       "if shmid < 0: print('no segment', ctypes.get_errno()); sys.exit(0)\n"
       "addr = libc.shmat(shmid, None, 0)\n"
       "ctypes.memset(addr, ord('x'), size) if size else None\n"
       "ctypes.memmove(addr, b'SHM-SECRET', 10) if size else print('read', ctypes.string_at(addr, 10))\" ")


def _host_shm_keys() -> set[int]:
    with open("/proc/sysvipc/shm") as f:
        return {int(line.split()[0]) for line in f.readlines()[1:]}


@pytest.mark.skipif(ISO.ipc != "ipcns", reason="no IPC namespaces here: " + ISO.describe())
def test_shared_memory_is_seen_by_no_other_episode_and_freed_with_its_command():
    """A 256 MB segment of mode 0666 with a secret: the next command, the next episode and
    the host find none, and the memory it pinned is back once the command ends."""
    first, second = Sandbox(), Sandbox()
    made = first.run(SHM + str(256 << 20) + "; ipcs -m | grep -c 0x676c6d6a; hostname")
    assert made.ok and made.output.split() == ["1", "sandbox"], made.output
    assert 0x676C6D6A not in _host_shm_keys()
    assert "no segment" in first.run(SHM + "0").output  # gone with the command that made it
    assert "no segment" in second.run(SHM + "0").output and "SHM-SECRET" not in second.run("ipcs -m").output
    if first.group is not None and first.isolation.memory.startswith("cgroup"):
        deadline = time.monotonic() + 5.0  # the kernel frees a namespace's objects from a work queue
        while first.group.usage_bytes() > 64 << 20 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert first.group.usage_bytes() <= 64 << 20
    first.close()
    second.close()
    assert 0x676C6D6A not in _host_shm_keys()


@needs_uid
def test_without_ipc_namespaces_close_removes_what_the_sandbox_made(monkeypatch):
    """Where commands share the host's IPC namespace, the segment outlives its command (as
    the host's) and ``close()`` removes it."""
    monkeypatch.setattr(sandbox_module, "_PROBED", dataclasses.replace(probe(), ipc="host"))
    box = Sandbox()
    assert box.run(SHM + str(1 << 20)).ok
    assert 0x676C6D6A in _host_shm_keys()
    box.close()
    assert 0x676C6D6A not in _host_shm_keys()


@pytest.fixture
def host_secrets():
    """A world-readable file and a listening unix socket under /var/tmp and /opt, where
    other runs' task directories, work directories and services live; an abstract socket."""
    made, servers, accepted = [], [], []
    for top in ("/var/tmp", "/opt"):
        folder = f"{top}/glmjax-attack-{os.getpid()}"
        os.makedirs(folder, mode=0o755)
        made.append(folder)
        with open(f"{folder}/secret.txt", "w") as f:
            f.write("HOST-SECRET-5501\n")
        os.chmod(f"{folder}/secret.txt", 0o644)
        servers.append(socket.socket(socket.AF_UNIX))
        servers[-1].bind(f"{folder}/service.sock")
        os.chmod(f"{folder}/service.sock", 0o777)
    servers.append(socket.socket(socket.AF_UNIX))
    servers[-1].bind(f"\0glmjax-attack-{os.getpid()}")
    for server in servers:
        server.listen(4)
        server.settimeout(0.05)
    yield made, servers, accepted
    for server in servers:
        try:
            accepted.append(server.accept())
        except OSError:
            pass
        server.close()
    for folder in made:
        for name in os.listdir(folder):
            os.unlink(f"{folder}/{name}")
        os.rmdir(folder)


CONNECT = ("python3 -c \"import socket, sys\ns = socket.socket(socket.AF_UNIX)\ns.settimeout(2)\n"
           "address = sys.argv[1].replace('@', chr(0), 1)\n"  # @name: an abstract socket
           "try: s.connect(address); print('CONNECTED')\nexcept OSError as e: print('refused', e)\" ")


@needs_chroot
def test_no_host_file_or_socket_under_var_or_opt_is_reachable(host_secrets):
    made, servers, accepted = host_secrets
    script = "; ".join([f"cat {d}/secret.txt; ls {d}; {CONNECT}{d}/service.sock" for d in made]
                       + [f"{CONNECT}@glmjax-attack-{os.getpid()}",
                          "ls -A /var /var/tmp /var/lib /opt /srv /home /run"])
    with Sandbox() as box:
        outputs = [box.run(script).output, box.run(script, verifier=True).output]
    for output in outputs:
        assert "HOST-SECRET" not in output and "CONNECTED" not in output, output
        assert sum(line.startswith("refused") for line in output.splitlines()) == 3, output
        listing = output[output.index("/var:"):]
        assert "glmjax-attack" not in listing and set(listing.split()) <= {
            "/var:", "/var/tmp:", "/var/lib:", "/opt:", "/srv:", "/home:", "/run:", "backups", "cache", "lib", "local",
            "log", "mail", "opt", "spool", "tmp", "dpkg"}, listing
    for server in servers:
        with pytest.raises(OSError):
            server.accept()


@needs_chroot
@pytest.mark.parametrize("top", ["/var/tmp", "/opt", "prefix"])
def test_a_task_directorys_tests_are_not_there_for_the_agent(top):
    """A Harbor task directory wherever a team keeps one (under /var, /opt, or installed
    with a Python package under the interpreter's prefix, which the sandbox binds): the
    agent finds neither the task's tests nor its solution, and cannot score by them."""
    token = f"ANSWER-{secrets.token_hex(6)}"
    base = (os.path.join(sys.prefix, "share") if top == "prefix" else top) + f"/glmjax-tasks-{os.getpid()}"
    test = f"#!/bin/bash\n[ \"$(cat /app/answer.txt)\" = {token} ] && echo 1 > /logs/verifier/reward.txt\n"
    path = write_task(pathlib.Path(base), "leak", solve=f"#!/bin/bash\necho {token} > /app/answer.txt\n", test=test,
                      instruction="Write the answer to /app/answer.txt.\n")
    try:
        task = harbor_dirs.load_task(str(path))
        env = ShellEnv()
        env.reset(task)
        obs, *_ = env.step(f"<bash>ls {base} {path}; cat {path}/tests/test.sh {path}/solution/solve.sh; "
                           f"grep -rhos 'ANSWER-[0-9a-f]*' /var /opt /srv /home /run /root /tmp {sys.prefix}/share "
                           "| head -1 > /app/answer.txt; cat /app/answer.txt</bash>")
        _, reward, done, info = env.step("<submit/>")
        env.close()
        assert token not in obs, obs
        assert done and reward == 0.0, info
        env.reset(task)  # the honest episode on the same task scores 1
        _, reward, done, _ = env.step(f"<bash>echo {token} > /app/answer.txt</bash><submit/>")
        env.close()
        assert done and reward == 1.0
    finally:
        tree.rmtree(base)


def test_filling_the_disk_stops_at_the_quota_and_the_verifier_still_scores():
    """1.5 GB written in 64 MB files (each under the file-size cap) after the right answer:
    the writes stop at the 1 GiB quota with a clear error, the host's disk is untouched,
    and the verifier, on a disk of its own, scores the answer 1."""
    env = ShellEnv(limits=Limits(wall_seconds=30.0))
    env.reset(_answer_task())
    box = env.sandbox
    if box.isolation.disk != "tmpfs":
        pytest.skip("no disk quota here: " + box.isolation.describe())
    obs, *_ = env.step("<bash>echo 42 > /app/answer.txt; for i in $(seq 24); do head -c 64M /dev/zero > "
                       "/app/fill$i || break; done; du -sm /app /tmp | cut -f1</bash>")
    assert "No space left on device" in obs and "disk full: 1024 MiB quota" in obs, obs
    used = sum(os.path.getsize(os.path.join(box.host_path("/app"), n)) for n in os.listdir(box.host_path("/app")))
    assert (1 << 30) - (64 << 20) < used <= 1 << 30, used
    assert box.run("echo more > /tmp/x").returncode != 0  # /tmp is on the same full disk ...
    _, reward, done, info = env.step("<submit/>")  # ... the verifier's is not
    env.close()
    assert done and reward == 1.0, info


SPIN = ("pids=; for i in 1 2 3 4 5 6 7 8; do (while :; do :; done) & pids=\"$pids $!\"; done; sleep 3; t=0; "
        "for p in $pids; do set -- $(cut -d' ' -f14,15 /proc/$p/stat); t=$((t + $1 + $2)); done; "
        "echo $t $(getconf CLK_TCK); kill $pids")


def test_eight_spinners_share_one_core():
    """Eight busy loops for 3 s of wall time: the kernel's own count of their CPU time
    (utime + stime of each) is at most about one core's worth."""
    with Sandbox() as box:
        if box.isolation.cpu == "per-process":
            pytest.skip("no CPU cgroup here: " + box.isolation.describe())
        result = box.run(SPIN)
        ticks, hz = map(int, result.output.split()[-2:])
        assert 0.5 * 3.0 <= ticks / hz <= 1.2 * 3.0, result.output  # they ran, on one core between them
        assert box.group.throttled() > 0


@needs_uid
@pytest.mark.parametrize("lockout", ["chmod 000 /app", "chmod 000 /app/answer.txt", "chmod -R 000 /app", None])
def test_the_agent_cannot_lock_the_verifier_out(lockout):
    """A right answer, then the agent takes every permission away: the verifier still reads
    it (as Docker's root verifier would) and scores 1; so does the honest episode."""
    env = ShellEnv()
    env.reset(_answer_task())
    obs, *_ = env.step(f"<bash>echo 42 > /app/answer.txt; {lockout or 'true'}; ls /app; "
                       "touch /logs/verifier/reward.txt; ls /logs/verifier /tests</bash>")
    if lockout and env.sandbox.isolation.verifier == "userns-root":
        assert obs.count("Permission denied") >= 3, obs
    obs, _, done, info = env.step("<bash>echo still here</bash>")  # its own next command starts, at / if need be
    assert not done and "still here" in obs and "error" not in info, (obs, info)
    _, reward, done, info = env.step("<submit/>")
    env.close()
    assert done and reward == 1.0, info


@needs_uid
def test_the_verifiers_root_reaches_the_sandboxs_files_only():
    with Sandbox() as box:
        if box.isolation.verifier != "userns-root":
            pytest.skip("no user namespaces here: " + box.isolation.describe())
        box.run("echo secret > /app/mine; chmod 000 /app/mine /app")
        lines = box.run("id -u; cat /app/mine; echo made > /app/by-verifier; cat /etc/shadow; touch /usr/x; "
                        "echo 3 > /proc/sys/vm/drop_caches", verifier=True, cwd="/").output.splitlines()
        assert lines[:2] == ["0", "secret"], lines  # root over the agent's files ...
        assert "/etc/shadow: Permission denied" in lines[2], lines  # ... and no more than any user over the host's
        assert "Read-only file system" in lines[3] and "Permission denied" in lines[4], lines
        box.run("chmod 700 /app")
        assert box.run("cat by-verifier && rm by-verifier && echo gone").output == "made\ngone\n"  # handed back


@needs_uid
def test_two_runs_with_different_tmpdirs_never_share_a_uid(tmp_path, monkeypatch):
    """Another process (with its own TMPDIR) holds a sandbox; this one, with another TMPDIR,
    is steered at the same uid: it gets a different one, and the other's commands go on."""
    code = ("import sys; from envs.sandbox.sandbox import Sandbox\nbox = Sandbox()\nprint(box.uid, flush=True)\n"
            "sys.stdin.readline()\nprint(box.run('echo alive').output.strip(), flush=True)\nbox.close()\n")
    (tmp_path / "a").mkdir()
    other = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env=dict(os.environ, TMPDIR=str(tmp_path / "a")),
                             cwd=str(pathlib.Path(__file__).resolve().parents[3]))
    held = int(other.stdout.readline())
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "b"))
    (tmp_path / "b").mkdir()
    monkeypatch.setattr(isolation, "_first_candidate", lambda: held - isolation.UID_BASE)
    with Sandbox() as box:
        assert box.uid != held
        assert box.run("echo ok").output == "ok\n"
        other.stdin.write("\n")
        other.stdin.flush()
        assert other.stdout.readline().strip() == "alive"
    assert other.wait(30) == 0


@needs_uid
def test_a_killed_runs_sandbox_is_cleared_by_the_next_holder_of_its_uid(tmp_path, monkeypatch):
    """A process killed with its sandbox open leaves its disks mounted, its cgroup and its
    directory; the next sandbox to claim that uid unmounts and removes them."""
    code = ("from envs.sandbox.sandbox import Sandbox\nbox = Sandbox(base_dir=%r)\nbox.run('echo x > /app/x')\n"
            "print(box.uid, box.root, flush=True)\nimport time; time.sleep(60)\n" % str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            cwd=str(pathlib.Path(__file__).resolve().parents[3]))
    uid, root = proc.stdout.readline().split()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    mounted = lambda: [line for line in open("/proc/self/mountinfo") if root in line]  # noqa: E731
    if ISO.disk == "tmpfs":
        assert mounted(), "the killed process's disks should still be mounted"
    groups = [os.path.join(where[1], os.path.basename(root)) for where in cgroup.available().values() if where]
    assert all(os.path.isdir(group) for group in groups)
    monkeypatch.setattr(isolation, "_first_candidate", lambda: int(uid) - isolation.UID_BASE)
    with Sandbox() as box:
        assert box.uid == int(uid)
    assert mounted() == [] and not os.path.exists(root)
    assert not any(os.path.exists(group) for group in groups)
