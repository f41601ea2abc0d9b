"""An episode's commands enter one set of namespaces (``entry="episode"``), and the sandbox's
python runs from any prefix: what changes for the agent, and what must not."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from envs.sandbox import sandbox as sandbox_module
from envs.sandbox.sandbox import Sandbox, SandboxError, probe

ISO = probe()
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
needs_entry = pytest.mark.skipif(ISO.filesystem != "chroot" or ISO.processes != "pidns",
                                 reason="no mount or PID namespaces here: " + ISO.describe())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


@needs_entry
def test_an_episodes_commands_share_a_root_but_not_what_each_one_leaves_running():
    with Sandbox() as box:
        assert box.isolation.entry == "episode"
        first = box.run("echo x > /dev/shm/left; sleep 60 & echo $$; readlink /proc/self/ns/net /proc/self/ns/mnt")
        anchor = box._anchor[0]
        second = box.run("ls /dev/shm; ps -e -o comm=; readlink /proc/self/ns/net /proc/self/ns/mnt")
        assert first.ok and second.ok, (first, second)
        assert first.output.split()[1:] == second.output.split()[-2:]  # the same network and mount namespaces
        assert second.output.split()[:-2] == ["bash", "ps"]  # no sleep, no /dev/shm file: both went with their command
        with open(f"/proc/{anchor}/status") as f:  # effective and saved ids root's: hidden (hidepid), not traceable
            assert f"\nUid:\t{box.uid}\t0\t0\t0\n" in f.read()
        box.run("for s in KILL INT TERM HUP USR1 STOP; do kill -$s 1; done")  # init of its namespace: none arrives
        assert box.run("ls /proc/1").returncode != 0 and box.run("echo again").output == "again\n"
        assert _alive(anchor) and box._anchor[0] == anchor
        own = box.run("grep -E '^(Uid|Gid|Groups|CapPrm|CapEff|NoNewPrivs)' /proc/self/status").output.split("\n")
        assert own[:6] == [f"Uid:\t{box.uid}\t{box.uid}\t{box.uid}\t{box.uid}",
                           f"Gid:\t{box.uid}\t{box.uid}\t{box.uid}\t{box.uid}", "Groups:\t ", "CapPrm:\t0000000000000000",
                           "CapEff:\t0000000000000000", "NoNewPrivs:\t1"], own


@needs_entry
def test_a_killed_anchor_is_made_again_and_the_files_stay():
    with Sandbox() as box:
        box.run("echo kept > f")
        anchor = box._anchor[0]
        os.kill(anchor, signal.SIGKILL)
        deadline = time.monotonic() + 5.0
        while _alive(anchor) and time.monotonic() < deadline:
            time.sleep(0.02)
        again = box.run("cat f; hostname")
        assert again.output.split() == ["kept", "sandbox"], again
        assert box._anchor[0] != anchor


@needs_entry
def test_the_anchor_exits_with_the_process_that_owns_the_sandbox():
    code = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {REPO!r})
        from envs.sandbox.sandbox import Sandbox
        box = Sandbox()
        box.run("true")
        print(box._anchor[0], box.root, flush=True)
        time.sleep(60)
    """)
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    anchor, root = owner.stdout.readline().split()
    owner.kill()
    owner.wait()
    deadline = time.monotonic() + 5.0
    while _alive(int(anchor)) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not _alive(int(anchor))
    Sandbox().close()  # a later sandbox of this machine runs; the killed one's root is its uid's next holder's to clear


@needs_entry
def test_per_command_entry_keeps_the_same_guarantees():
    with Sandbox(per_command=True) as box:
        assert box.isolation.entry == "command" and box._anchor is None
        box.run("sleep 60 & echo x > /dev/shm/left")
        found = box.run("ps -e -o comm=; ls /dev/shm; hostname")
        assert found.output.split() == ["bash", "ps", "sandbox"], found
        assert box._anchor is None


@pytest.mark.skipif(ISO.filesystem != "chroot", reason="no mount namespaces here: " + ISO.describe())
def test_a_virtualenv_under_tmp_runs_the_agents_and_the_verifiers_python(tmp_path):
    """A CI runner's virtualenv in /tmp: the sandbox's /tmp is its own, so the prefix is
    mounted over a directory of it, which the agent can neither remove nor replace."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)], check=True)
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {REPO!r})
        from envs.sandbox.sandbox import Sandbox
        with Sandbox() as box:
            print(box.run("python3 -c 'import sys; print(sys.prefix)'").output.strip())
            print(box.run("python3 -m pytest --version 2>&1", verifier=True).output.split()[0])
            print(box.run("rm -rf {venv} 2>/dev/null; mv {venv} /tmp/moved 2>/dev/null; ls -d {venv}").output.strip())
    """)
    out = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(venv), "pytest", str(venv)], out.stdout


def test_an_interpreter_under_another_sandbox_directory_is_refused_with_the_fix(monkeypatch):
    monkeypatch.setattr(sys, "prefix", "/app/.venv")
    with pytest.raises(SandboxError, match=r"/app/.venv.*install glmjax into an interpreter elsewhere"):
        sandbox_module._interpreter_binds()
