"""Isolated command execution for a hostile agent: a private tree, resource quotas, no network.

What is enforced, and how (``probe()`` says which of these this machine allows;
``Isolation.describe()`` names each; ``glmjax-envs info`` prints it):

- **Own users.** As root, each ``Sandbox`` claims a dedicated numeric uid (from
  ``UID_BASE``) with an ``flock`` in a fixed directory (``isolation.LOCK_DIR``), so no two
  sandboxes on the machine share one, whichever process or ``TMPDIR`` made them. Every
  agent command drops to it (``setgroups([])``, ``setgid``, ``setuid``) after
  ``PR_SET_NO_NEW_PRIVS``. Because the uid is private to the sandbox, ``RLIMIT_NPROC``
  (ignored for root, counted per uid) caps this sandbox's processes only: a fork bomb
  stops at ``Limits.processes``. The verifier has a uid of its own (below).
- **Resource limits** (``setrlimit`` in the child): CPU seconds, address space
  (``RLIMIT_AS``: a 10 GB allocation fails with ENOMEM), processes, file size (SIGXFSZ),
  open files; no core files.
- **Memory and CPU of all processes together** (``Isolation.memory``, ``Isolation.cpu``):
  each sandbox has its own cgroup (``envs/sandbox/cgroup.py``, v2 or v1) capped at
  ``Limits.memory_bytes`` and at ``Limits.cpus`` cores of CPU time; every command joins
  it before it drops root. A command whose processes pass the memory cap between them is
  killed by the kernel (``killed="memory_limit"``); eight spinning processes share one
  core. Without a cgroup (not root, or no controller) only the rlimits hold:
  ``processes`` x ``memory_bytes`` is the memory bound, and ``describe()`` says
  ``memory=per-process cpu=per-process``.
- **Disk** (``Isolation.disk="tmpfs"``): the sandbox's files live on size-capped tmpfs
  mounts of ``Limits.disk_bytes`` (read when the sandbox is made): one for the agent's
  ``/app /tmp /solution /logs``, one for the verifier's ``/tests``, ``/logs/verifier``
  and ``/tmp``, so an agent that fills its disk ("No space left on device") leaves the
  verifier room to write its reward. Their pages count against the memory cap as well:
  files and processes together stay under ``memory_bytes``. ``RLIMIT_FSIZE`` still caps
  each file at ``Limits.file_bytes``.
- **One set of namespaces per episode** (``entry="episode"``, where mount and PID
  namespaces are allowed; ``Sandbox(per_command=True)`` or ``GLMJAX_SANDBOX_ENTRY=command``
  gives ``"command"``). The first agent command makes the episode's network, UTS, IPC,
  mount and PID namespaces and its root (below), joins its cgroup once, and leaves an
  *anchor* there (``envs/sandbox/anchor.py``): init of that PID namespace, which starts
  every agent command of the episode inside them, as a container's shim does for
  ``docker exec``, and exits with the sandbox's process. A command is then one
  ``posix_spawn`` of that small process (about a fifth of the CPU of a command that makes
  its own namespaces: ``benchmarks/env_bench.py --entry``); it runs as the sandbox's uid
  with no root id and no capability, and its limits are taken by its own bash before the
  command is read (``anchor.LIMITS_SCRIPT``). What each command had of its own is kept
  where it matters: when a command ends and no other runs, everything it left (processes,
  System V IPC objects, ``/dev/shm`` files) is gone before its result returns. The
  verifier still makes its own namespaces (its user namespace, its ``/tmp``, ``/tests``).
- **Processes and wall clock.** Every command runs in its own session and, where the
  kernel allows (``processes="pidns"``), either as PID 1 of its own PID namespace (a
  verifier, or ``entry="command"``) or in the episode's, whose init kills what it left
  (``entry="episode"``): when it exits everything it left behind is killed and reaped,
  so no orphan or zombie outlives it or counts against the next command's process
  limit, and ``/proc`` shows only the sandbox's processes. At the deadline every process of the sandbox's uids gets SIGKILL
  (``kill -9 -1`` run as that uid: it also reaches processes that left the group with
  ``setsid``); without a PID namespace (``"kill-sweep"``) the process group is killed
  too and the same sweep runs after every command. Files persist between commands;
  processes, System V IPC objects, POSIX message queues and ``/dev/shm`` do not.
- **IPC and host name** (``ipc="ipcns"``): each episode (``entry="command"``: each
  command) has its own IPC and UTS namespaces, so a shared-memory segment or semaphore
  it makes (any mode) is seen by no other episode or host process, and is removed when
  its command ends (with ``entry="episode"``, by the anchor, once no other command of
  the episode runs); the host name is ``sandbox``.
- **Output cap.** stdout and stderr are read together; past ``Limits.output_bytes`` the
  command is killed and the output kept so far is returned (``killed="output_limit"``).
- **No network.** A new network namespace (``unshare(CLONE_NEWNET)``) whose only
  interface is its own loopback: the host's listeners, even on 127.0.0.1, and its
  abstract unix sockets are unreachable. Where the kernel refuses the namespace,
  ``Sandbox`` refuses to run unless the caller passes ``network="host"`` explicitly.
- **Filesystem** (``filesystem="chroot"``, the default where a mount namespace is
  allowed): each command gets a new mount namespace and ``pivot_root``s into a root of
  its own (the host's root is then detached: no ``..``, second ``chroot`` or open
  directory leads back). That root is a read-only tmpfs holding read-only, nosuid binds of
  what programs need to run (``/usr /etc /bin /sbin /lib*``, the host interpreter's
  prefix, the tools at ``/glmjax``, and of ``/var`` only ``/var/lib/dpkg``), a minimal
  ``/dev`` (null, zero, full, random, urandom, a private ``/dev/shm``), ``/proc`` with
  ``hidepid``, and the sandbox's own directories at the paths tasks expect: ``/app``
  (the working directory), ``/logs`` (``/logs/agent``; ``/logs/verifier`` for the
  verifier), ``/tmp`` (``/var/tmp`` leads there), ``/tests`` and ``/solution``. No host
  directory where task directories, work directories, logs or sockets live (``/var``,
  ``/opt``, ``/srv``, ``/home``, ``/root``, ``/run``, ``/tmp``, ``/mnt``) is there, and
  ``hide`` paths (a task's own directory: ``ShellEnv`` passes ``HarborTask.source``) are
  masked where a bind would show them. Task files reach the sandbox only as copies:
  ``/tests`` is filled when the verifier runs and ``/solution`` for oracle runs. A task's
  image (``Sandbox(layer=...)``: what its Dockerfile's build changed, ``envs/image/build.py``)
  lies over that root read-only: an overlay over each system directory it changes, binds of
  what it adds elsewhere (``/data.csv``, ``/opt/tool``; ``envs/sandbox/layers.py``).
  ``filesystem="plain"`` (the fallback without mount namespaces): the same uid and
  limits, ``cwd`` is the host directory, and writes are confined by permissions only:
  the sandbox uid owns nothing outside its directory, but world-writable directories
  (``/tmp``, ``/var/tmp``, ``/dev/shm``) stay writable and world-readable files
  readable. Virtual paths (``/app`` ...) are then the host paths that ``path()``
  returns, and scripts are rewritten with ``rewrite()``.
- **The verifier** (``run(..., verifier=True)``; ``verifier="userns-root"``) runs as root
  of a user namespace of its own whose only ids are its own uid (``verifier_uid``, 0
  inside) and the agent's: it reads and writes ``/app`` whatever modes the agent left
  (``chmod 000 /app`` does not lock it out), as Docker's root verifier does, while
  root-owned host files stay closed to it. ``/tests`` and ``/logs/verifier`` are its own
  (mode 0700): the agent's uid cannot read, write or replace them; files it leaves in
  ``/app`` are handed back to the agent's uid. Without user namespaces
  (``verifier="agent-uid"``) it runs as the agent's uid.
- **Tools.** ``/glmjax`` holds what a task image would have installed
  (``envs/image/host_tools.py``): ``python3``/``python`` (the host interpreter, with pytest: never the agent's copies),
  ``pytest``, and stand-ins for ``apt-get``, ``pip``, ``uv`` and ``uvx`` that resolve
  installs against the host; its ``bin/`` is first on PATH.
- **Environment.** Commands see only ``PATH``, ``HOME=/tmp``, ``TMPDIR=/tmp``, a UTF-8
  locale, ``PYTHONDONTWRITEBYTECODE=1``, ``PYTHONHASHSEED=0``, ``APP_DIR``, ``LOGS_DIR``,
  ``TEST_DIR`` and what the caller passes.
- **Any tree.** ``snapshot``, ``reset_dir`` and ``close`` walk and remove directories
  through directory descriptors (``envs/sandbox/tree.py``): a tree thousands of levels deep, or
  with paths past ``PATH_MAX``, is hashed and removed like any other, and ``close``
  releases the sandbox's uid even when a step before it fails. A sandbox left behind by a
  killed process (its processes, cgroup, mounts, directory) is cleared by the next one
  that claims its uid.

Commands are forked by small helper processes (``envs/sandbox/launcher.py``), never by the caller:
a fork's cost grows with the forking process's memory, and a multithreaded process (a
trainer running JAX) must not run a ``preexec_fn`` in a forked child.

Not enforced: what the system directories hold is readable where its modes allow (the
host's ``/usr`` and ``/etc`` are the image); the kernel is the host's (a kernel exploit
is out of scope: that needs a VM); time on the CPU quota's clock is shared fairly, not
reserved. Without root there is no dedicated uid, no namespace, no quota on disk, memory
or CPU beyond the per-process rlimits.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import resource
import select
import signal
import stat
import subprocess
import sys
import tempfile
import threading
from typing import Mapping

from envs.image import host_tools
from envs.sandbox import anchor, cgroup, isolation, launcher, layers, tree
from envs.sandbox.isolation import VIRTUAL_DIRS, Isolation, Plan, claim_uid
from envs.sandbox.results import Limits, RunResult, SandboxError
from envs.sandbox.tools import TOOLS, tool_dir
from envs.sandbox.tools import interpreter_binds as _interpreter_binds

__all__ = ["Isolation", "Limits", "RunResult", "Sandbox", "SandboxError", "VIRTUAL_DIRS", "probe"]
# Where each virtual directory lives under the sandbox's root: (disk, directory on it). The
# agent's disk holds what it writes; the verifier's what only the verifier may write.
_LAYOUT = {"/app": ("agent", "app"), "/tmp": ("agent", "tmp"), "/solution": ("agent", "solution"),
           "/logs": ("agent", "logs"), "/logs/verifier": ("verifier", "logs"), "/tests": ("verifier", "tests")}
_TOPS = sorted(_LAYOUT, key=len, reverse=True)  # the longest first: /logs/verifier before /logs
_VERIFIER_TMP = ("verifier", "tmp")  # the verifier's own /tmp (and HOME) under chroot
_VERIFIER_DIRS = ("/tests", "/logs/verifier")
_PROBED: Isolation | None = None
_TOOLS_STARTED = False  # the tools' python was seen to start in a sandbox (Sandbox._check_tools)
_ANCHORS_CPU = 0.0  # CPU seconds of the anchors this process's sandboxes closed, and of what they started
_LOCK = threading.Lock()


def probe() -> Isolation:
    """The strongest isolation this machine allows, as the helpers that fork the commands
    find it (``envs/sandbox/launcher.py``), with the cgroups this process can make (tried once per
    process, cached)."""
    global _PROBED
    with _LOCK:
        if _PROBED is None:
            found = launcher.call("probe")
            groups = cgroup.available() if found.user == "dedicated-uid" else {}
            name = lambda where: f"cgroup-{where[0]}" if where else "per-process"  # noqa: E731
            entry = "episode" if found.filesystem == "chroot" and found.processes == "pidns" else "command"
            _PROBED = dataclasses.replace(found, memory=name(groups.get("memory")), cpu=name(groups.get("cpu")),
                                          entry=entry)
        return _PROBED


def anchor_cpu_seconds(pid: int | None = None) -> float:
    """CPU seconds of the anchor ``pid`` and the commands it started (an anchor is no child
    of the sandbox's process, so its time is not in this process's ``RUSAGE_CHILDREN``);
    without ``pid``, of every anchor this process's sandboxes have closed."""
    if pid is None:
        return _ANCHORS_CPU
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(v) for v in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def kill_uids(*uids: int) -> None:
    """SIGKILL every process of each of ``uids`` (from a helper process)."""
    launcher.call("kill_uids", uids=uids)


def _mount_points() -> list[str]:
    """Every mount point of this mount namespace, decoded from ``/proc/self/mountinfo``."""
    with open("/proc/self/mountinfo") as f:
        return [re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), line.split()[4]) for line in f]


def _clear_leftovers(uid: int, lock_fd: int) -> None:
    """What a killed process's sandbox of ``uid`` left: its processes, its cgroup, its
    disks' mounts, its directory. A sandbox writes its root into its uid's lock file and empties the file
    when it has closed cleanly, so only a sandbox that did not close leaves a path there;
    the caller holds the lock, so no live sandbox owns what is cleared."""
    root = os.pread(lock_fd, 4096, 0).decode(errors="replace")
    if not root:
        return
    kill_uids(uid, isolation.verifier_uid(uid))
    cgroup.remove(os.path.basename(root))
    for point in sorted(_mount_points(), key=len, reverse=True):
        if point.startswith(root + "/"):
            isolation.unmount(point)
    tree.rmtree(root)
    os.ftruncate(lock_fd, 0)


def _remove_owned(dirs: tuple[str, ...], uids: tuple[int, ...]) -> None:
    """Remove what ``uids`` own at the top of each of ``dirs`` (any depth below it)."""
    for top in dirs:
        try:
            names = os.listdir(top)
        except OSError:
            continue
        for name in names:
            path = os.path.join(top, name)
            try:
                if os.lstat(path).st_uid in uids:
                    tree.rmtree(path)
            except OSError:
                continue


class Sandbox:
    """A private directory tree in which commands run isolated (see the module docstring).

    ``Sandbox(network="none", filesystem="auto")``: network "none" requires a network
    namespace (``SandboxError`` where there is none), "host" allows the host network;
    filesystem "auto" picks "chroot" where allowed, else "plain". The directory is made
    under ``base_dir`` (default ``$GLMJAX_SANDBOX_DIR``, else the system temp dir) and
    removed by ``close()`` (or leaving the ``with`` block). ``hide``: host directories
    (a task's source) that must not show through the system binds. ``isolation`` says
    what this sandbox actually has. ``per_command``: each agent command makes its
    namespaces and root afresh, in place of entering the episode's (``Isolation.entry``;
    default: ``$GLMJAX_SANDBOX_ENTRY``, "episode" or "command", else "episode").
    ``layer``: an image's layer (``envs/sandbox/build.py`` builds it), laid read-only over
    the root (``envs/sandbox/layers.py``); it needs ``filesystem="chroot"``. ``user``: the
    image's user name (its ``USER``, a task's ``[agent] user``), which ``/etc/passwd`` and
    ``/etc/group`` give to the sandbox's uid, so that ``whoami`` and ``~user`` answer as in
    the image.
    """

    def __init__(self, *, limits: Limits = Limits(), network: str = "none", filesystem: str = "auto",
                 base_dir: str | None = None, hide: tuple[str, ...] = (), per_command: bool | None = None,
                 layer: str | None = None, user: str = ""):
        if network not in ("none", "host"):
            raise ValueError(f"network must be 'none' or 'host', got {network!r}")
        if filesystem not in ("auto", "chroot", "plain"):
            raise ValueError(f"filesystem must be 'auto', 'chroot' or 'plain', got {filesystem!r}")
        if per_command is None:
            entry = os.environ.get("GLMJAX_SANDBOX_ENTRY", "episode")
            if entry not in ("episode", "command"):
                raise ValueError(f"GLMJAX_SANDBOX_ENTRY must be 'episode' or 'command', got {entry!r}")
            per_command = entry == "command"
        avail = probe()
        base_dir = base_dir or os.environ.get("GLMJAX_SANDBOX_DIR")
        if network == "none" and avail.network != "netns":
            raise SandboxError("no network namespace on this machine (" + "; ".join(avail.notes)
                               + "); pass network='host' to run commands with the host's network")
        if filesystem == "chroot" and avail.filesystem != "chroot":
            raise SandboxError("mount namespaces are refused here; use filesystem='plain' or 'auto'")
        self.filesystem = avail.filesystem if filesystem == "auto" else filesystem
        chroot = self.filesystem == "chroot"
        if layer and not chroot:
            raise SandboxError(f"an image's layer ({layer}) is laid over a sandbox's own root, and mount "
                               f"namespaces are refused here ({'; '.join(avail.notes)})")
        self.limits = limits
        self.isolation = dataclasses.replace(
            avail, network="netns" if network == "none" else "host", filesystem=self.filesystem,
            verifier=avail.verifier if chroot else "agent-uid", notes=(),
            entry="episode" if chroot and avail.processes == "pidns" and not per_command else "command")
        self._closed, self.group, self.root, self._disks = True, None, None, []
        self._anchor: tuple[int, int] | None = None  # the episode's anchor: (host pid, pidfd)
        self._lock, self._in_flight = threading.Lock(), 0
        self._disk_bytes = limits.disk_bytes
        self.uid, self._lock_fd = claim_uid() if avail.user == "dedicated-uid" else (None, None)
        self.verifier_uid = (isolation.verifier_uid(self.uid) if self.isolation.verifier == "userns-root"
                             else self.uid)
        try:
            if self.uid is not None:
                _clear_leftovers(self.uid, self._lock_fd)
            self.root = tempfile.mkdtemp(prefix=f"glmjax-sbx-{self.uid if self.uid is not None else 'u'}-",
                                         dir=base_dir)
            os.chmod(self.root, 0o711)
            if self._lock_fd is not None:
                os.pwrite(self._lock_fd, self.root.encode(), 0)
            groups = cgroup.available() if self.uid is not None else {}
            if any(groups.values()):  # named as the root is, so that a killed run's group is found
                self.group = cgroup.Group(**groups, memory_bytes=limits.memory_bytes, cpus=limits.cpus,
                                          name=os.path.basename(self.root))
            os.mkdir(os.path.join(self.root, ".root"))
            for disk in ("agent", "verifier"):
                path = os.path.join(self.root, disk)
                os.mkdir(path, 0o755)
                if avail.disk == "tmpfs":
                    isolation.mount_tmpfs(path, limits.disk_bytes)
                    self._disks.append(path)
            for virtual in VIRTUAL_DIRS + ("/logs/verifier", "/logs/agent"):
                self.reset_dir(virtual)
            self.reset_verifier_tmp()
            if not chroot:  # $LOGS_DIR/verifier: the verifier's directory, as the mount shows it under chroot
                os.symlink(self.host_path("/logs/verifier"), os.path.join(self.host_path("/logs"), "verifier"))
        except BaseException:
            self._closed = False
            self.close()
            raise
        self.tools = TOOLS if chroot else tool_dir()
        self._binds = ((tool_dir(), TOOLS, False),) + _interpreter_binds() if chroot else ()
        own = (*VIRTUAL_DIRS, "/logs/verifier", *(inside for _, inside, _ in self._binds))
        self._layer = layers.graft(layer, skip=own) if layer else ()
        if user and chroot and self.uid is not None:
            self._layer += layers.named_user(user, self.uid, layer, self.root)
        sandbox_dirs = (self.root, base_dir or tempfile.gettempdir())
        self._hidden = tuple(p for p in (*hide, *sandbox_dirs) if p)
        self._closed = False
        if chroot:
            self._check_tools()

    def _check_tools(self) -> None:
        """Once per process: the tools' ``python3`` starts inside a sandbox, so that a tool
        that cannot start is refused here, never reported as a verifier's verdict."""
        global _TOOLS_STARTED
        if _TOOLS_STARTED:
            return
        found = self.run(f"{TOOLS}/bin/python3 -c 'import sys; print(sys.prefix)'",
                         limits=self.limits.replace(wall_seconds=max(self.limits.wall_seconds, 30.0)))
        if not found.ok:
            self.close()
            raise SandboxError(f"the sandbox's python ({sys.executable}) does not start inside the sandbox: "
                               f"{found.summary()} {found.output.strip()[-400:]}")
        _TOOLS_STARTED = True

    # ----- paths -----------------------------------------------------------------------
    def host_path(self, virtual: str) -> str:
        """Where a virtual path (``/app/x``, ``/logs/verifier``) lives on the host."""
        top = _top(virtual)
        rest = virtual[len(top) + 1:]
        return os.path.join(self.root, *_LAYOUT[top], *([rest] if rest else []))

    def path(self, virtual: str) -> str:
        """The path commands must use for ``virtual``: itself under chroot, else the host path."""
        return virtual if self.filesystem == "chroot" else self.host_path(virtual)

    def rewrite(self, script: str) -> str:
        """``script`` with the virtual directories replaced by ``path()`` (identity under chroot)."""
        if self.filesystem == "chroot":
            return script
        pattern = r"(?<![\w./-])(" + "|".join(map(re.escape, _TOPS)) + r")(?=[/\s\"'`;:)|&<>]|$)"
        return re.sub(pattern, lambda m: self.host_path(m.group(1)), script)

    def _owner(self, virtual: str) -> int | None:
        if virtual == "/logs" or self.uid is None:
            return None
        return self.verifier_uid if virtual in _VERIFIER_DIRS or virtual.startswith(_VERIFIER_DIRS) else self.uid

    def _safe(self, virtual: str) -> str:
        """The host path of ``virtual``, refusing one that a symlink leads out of the sandbox."""
        host, top = self.host_path(virtual), os.path.realpath(self.root)
        if not os.path.realpath(host).startswith(top + os.sep):
            raise SandboxError(f"{virtual!r} resolves outside the sandbox")
        return host

    # ----- files (host side, as the caller) ----------------------------------------------
    def reset_dir(self, virtual: str) -> None:
        """Make ``virtual`` an empty directory (symlinks are removed, never followed) with
        mode 0700, the agent's uid's, or the verifier's for ``/tests`` and
        ``/logs/verifier`` (``/logs`` itself stays root's, so that neither can be
        replaced): other sandboxes cannot look in."""
        self._fresh(self.host_path(virtual), self._owner(virtual))

    def reset_verifier_tmp(self) -> None:
        """A fresh ``/tmp`` (and ``HOME``) for the verifier: its own under chroot, where the
        agent's ``/tmp`` is left as it was; the agent's, emptied, in the plain fallback."""
        if self.filesystem == "chroot":
            self._fresh(os.path.join(self.root, *_VERIFIER_TMP), self.verifier_uid)
        else:
            self.reset_dir("/tmp")

    def _fresh(self, host: str, owner: int | None) -> None:
        if os.path.isdir(host) and not os.path.islink(host):  # emptied in place: the episode's root binds it
            for name in os.listdir(host):
                tree.rmtree(os.path.join(host, name))
            os.chmod(host, 0o755)
        else:
            tree.rmtree(host)
            os.makedirs(host, mode=0o755)
        if owner is not None:
            os.chown(host, owner, owner)
            os.chmod(host, 0o700)

    def write_file(self, virtual: str, data: str | bytes, mode: int | None = None) -> None:
        host = self._safe(virtual)
        parent = os.path.dirname(host)
        os.makedirs(parent, exist_ok=True)
        if os.path.lexists(host):
            os.unlink(host)
        data = data.encode() if isinstance(data, str) else data
        with open(host, "wb") as f:
            f.write(data)
        os.chmod(host, mode if mode is not None else (0o755 if data.startswith(b"#!") else 0o644))
        owner = self._owner(virtual)
        if owner is not None:
            for path in [host] + [d for d in _parents(parent, self.host_path(_top(virtual)))]:
                os.lchown(path, owner, owner)

    def make_dir(self, virtual: str, mode: int = 0o755) -> None:
        """A directory (and its parents) at ``virtual``, owned as ``write_file``'s files are."""
        host = self._safe(virtual)
        os.makedirs(host, exist_ok=True)
        os.chmod(host, mode & 0o7777)
        owner = self._owner(virtual)
        if owner is not None:
            for path in _parents(host, self.host_path(_top(virtual))):
                os.lchown(path, owner, owner)

    def read_bytes(self, virtual: str, limit: int = 1 << 20) -> bytes | None:
        """A regular file's first ``limit`` bytes, or None when it is missing or not a regular file."""
        try:
            fd = os.open(self._safe(virtual), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except (OSError, SandboxError):
            return None
        with os.fdopen(fd, "rb") as f:
            return f.read(limit) if stat.S_ISREG(os.fstat(fd).st_mode) else None

    def snapshot(self, virtual: str = "/app") -> str:
        """A hash of the tree under ``virtual``: paths, types, permission bits, contents
        (any depth: ``envs/sandbox/tree.py``)."""
        digest = hashlib.sha256()
        for entry in tree.walk(self._safe(virtual)):
            st = entry.stat
            digest.update(f"{entry.path}\0{stat.S_IFMT(st.st_mode)}\0{st.st_mode & 0o777}\0".encode())
            if stat.S_ISLNK(st.st_mode):
                digest.update(os.readlink(entry.name, dir_fd=entry.dir_fd).encode())
            elif stat.S_ISREG(st.st_mode):
                digest.update(hashlib.sha256(entry.read()).digest())
        return digest.hexdigest()

    # ----- commands -------------------------------------------------------------------------
    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        env = {"PATH": f"{self.tools}/bin:{host_tools.SYSTEM_PATH}", "HOME": self.path("/tmp"),
               "TMPDIR": self.path("/tmp"), "LANG": "C.UTF-8",
               "LC_ALL": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0",
               "APP_DIR": self.path("/app"), "LOGS_DIR": self.path("/logs"), "TEST_DIR": self.path("/tests")}
        env.update(extra or {})
        return env

    def _mounts(self, verifier: bool) -> tuple[tuple[str, str, bool], ...]:
        """The sandbox's directories as a command's new root holds them, then the read-only binds."""
        own = tuple((self.host_path(v), v, True) for v in ("/app", "/solution", "/logs", "/logs/verifier", "/tests"))
        tmp = os.path.join(self.root, *_VERIFIER_TMP) if verifier else self.host_path("/tmp")
        return own + ((tmp, "/tmp", True),) + self._binds + self._layer

    def run(self, command: str, *, limits: Limits | None = None, cwd: str = "/app",
            env: Mapping[str, str] | None = None, stdin: str | None = None, verifier: bool = False) -> RunResult:
        """Run ``command`` with ``bash -c`` in the sandbox; never raises for what the command
        does. ``verifier``: as the verifier (its uid, its ``/tmp``; see the module docstring)."""
        if self._closed:
            raise SandboxError("this sandbox is closed")
        limits = limits or self.limits
        chroot = self.filesystem == "chroot"
        rlimits = [(resource.RLIMIT_CPU, limits.cpu_seconds), (resource.RLIMIT_AS, limits.memory_bytes),
                   (resource.RLIMIT_FSIZE, limits.file_bytes), (resource.RLIMIT_NOFILE, limits.open_files),
                   (resource.RLIMIT_CORE, 0)]
        if self.uid is not None:  # root ignores RLIMIT_NPROC; the sandbox uid does not
            rlimits.append((resource.RLIMIT_NPROC, limits.processes))
        as_verifier = verifier and self.verifier_uid != self.uid
        through_anchor = self.isolation.entry == "episode" and not verifier
        plan = None if through_anchor else Plan(
            root=os.path.join(self.root, ".root"), uid=self.verifier_uid if as_verifier else self.uid,
            network_ns=self.isolation.network == "netns", chroot=chroot, pid_ns=self.isolation.processes == "pidns",
            ipc_ns=self.isolation.ipc == "ipcns", rlimits=rlimits, cwd=cwd if chroot else self.host_path(cwd),
            mounts=self._mounts(verifier) if chroot else (), hidden=self._hidden,
            cgroup_procs=self.group.procs if self.group else (), verifier_of=self.uid if as_verifier else None)
        oom_kills = 0
        if self.group is not None:
            self.group.set_limits(limits.memory_bytes, limits.cpus)
            oom_kills = self.group.oom_kills()
        with self._lock:
            self._in_flight += 1
        returned = False
        command_io = dict(argv=["/bin/bash", "-c", command], env=self.env(env), stdin=stdin.encode() if stdin else None,
                          wall_seconds=limits.wall_seconds, output_bytes=limits.output_bytes)
        try:
            if through_anchor:
                for attempt in (1, 2):
                    try:
                        returncode, output, killed, truncated, seconds = anchor.run(
                            self._anchor_socket(wait=attempt > 1), cwd=cwd, uid=self.uid, rlimits=rlimits,
                            bash_env=f"{TOOLS}/limits.sh", **command_io)
                        break
                    except anchor.Gone:  # killed and not yet seen to have exited: once it has, a new one
                        if attempt == 2:
                            raise
            else:
                returncode, output, killed, truncated, seconds = launcher.call("run", plan=plan, **command_io)
            returned = True
        except (OSError, subprocess.SubprocessError, launcher.HelperDied) as err:
            raise SandboxError(f"could not start a sandboxed command ({self.isolation.describe()}): {err}") from err
        finally:
            if not returned and self.uid is not None:  # the helper died or the caller was interrupted (a
                kill_uids(*self._uids())  # signal): nothing watches the command any more, so it ends now
            with self._lock:
                self._in_flight -= 1
            if as_verifier:
                self._hand_back("/app")
        if killed is None and self.group is not None and self.group.oom_kills() > oom_kills:
            killed = "memory_limit"
        full = None
        if self._disks and not verifier:
            disk = os.statvfs(self._disks[0])
            full = self._disk_bytes if disk.f_bavail * disk.f_frsize < 64 << 10 else None
        return RunResult(returncode, output.decode("utf-8", errors="replace"), seconds, killed, truncated, full)

    def _anchor_socket(self, wait: bool = False) -> str:
        """Where the episode's anchor (``envs/sandbox/anchor.py``) listens: it is made, with
        the namespaces and the root, at the first agent command, and again if it was killed
        (its processes went with it; the files stay). ``wait``: it stopped listening, so
        wait for it to have exited."""
        path = os.path.join(isolation.LOCK_DIR, f"{self.uid}.sock")  # short (a socket's path is at most 107 bytes)
        # and root's alone (the directory is 0700); the uid's lock makes it this sandbox's
        with self._lock:
            if self._anchor is not None and select.select([self._anchor[1]], [], [], 5.0 if wait else 0)[0]:
                os.close(self._anchor[1])
                self._anchor = None
            if self._anchor is None:
                if os.path.lexists(path):
                    os.unlink(path)
                plan = Plan(root=os.path.join(self.root, ".root"), uid=self.uid, rlimits=[], cwd="/",
                            network_ns=self.isolation.network == "netns", chroot=True, pid_ns=True,
                            ipc_ns=self.isolation.ipc == "ipcns", mounts=self._mounts(False), hidden=self._hidden,
                            cgroup_procs=self.group.procs if self.group else ())
                try:
                    pid = launcher.call("anchor", plan=plan, owner=os.getpid(), path=path)
                except (OSError, launcher.HelperDied) as err:
                    raise SandboxError(f"could not make the sandbox's namespaces ({self.isolation.describe()}): "
                                       f"{err}") from err
                self._anchor = (pid, os.pidfd_open(pid))
        return path

    def _stop_anchor(self) -> None:
        global _ANCHORS_CPU
        if self._anchor is not None:
            pid, fd = self._anchor
            self._anchor = None
            with _LOCK:
                _ANCHORS_CPU += anchor_cpu_seconds(pid)
            try:
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            except ProcessLookupError:
                pass
            select.select([fd], [], [], 5.0)  # its namespace's processes are gone once it has exited
            os.close(fd)
            try:
                os.unlink(os.path.join(isolation.LOCK_DIR, f"{self.uid}.sock"))
            except FileNotFoundError:
                pass

    def _hand_back(self, virtual: str) -> None:
        """Give what the verifier made under ``virtual`` to the agent's uid (as files a root
        verifier made stay usable by a root agent), so that a next step can change them."""
        for entry in tree.walk(self.host_path(virtual)):
            if entry.stat.st_uid == self.verifier_uid or entry.stat.st_gid == self.verifier_uid:
                os.chown(entry.name, self.uid, self.uid, dir_fd=entry.dir_fd, follow_symlinks=False)

    def _uids(self) -> tuple[int, ...]:
        return tuple(dict.fromkeys((self.uid, self.verifier_uid)))

    # ----- lifetime ----------------------------------------------------------------------------
    def close(self) -> None:
        """Kill what is left (a command still running in another thread), remove the
        cgroup, the disks and the directory (any depth), and release the uid. Every step is
        tried even when one before it fails (the first failure is raised after them); a
        sandbox not wholly cleared leaves its root in its uid's lock file, for the uid's
        next holder to clear."""
        if self._closed:
            return
        self._closed = True
        failed: list[BaseException] = []

        def attempt(step, *args) -> None:
            try:
                step(*args)
            except Exception as err:
                failed.append(err)

        if self.uid is not None:
            # A command's processes end with it (its PID namespace, or the launcher's sweep after
            # it), so only a command still running in another thread can leave any.
            if self._in_flight or self.isolation.processes != "pidns":
                attempt(kill_uids, *self._uids())
            if self.isolation.ipc == "host":  # its commands shared the host's IPC namespace: clear its objects
                attempt(isolation.remove_ipc, self._uids())
            if self.filesystem == "plain":  # and the host's shared directories: clear its files there
                attempt(_remove_owned, ("/tmp", "/var/tmp", "/dev/shm"), self._uids())
        attempt(self._stop_anchor)
        if self.group is not None:
            attempt(self.group.close)
        while self._disks:
            attempt(isolation.unmount, self._disks.pop())
        if self.root is not None:
            attempt(tree.rmtree, self.root)
        if self._lock_fd is not None:
            if not failed:
                attempt(os.ftruncate, self._lock_fd, 0)  # closed cleanly: nothing for the next holder to clear
            os.close(self._lock_fd)
            self._lock_fd = None
        if failed:
            raise failed[0]

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: best effort only
            pass


def _top(virtual: str) -> str:
    """The sandbox directory (a key of ``_LAYOUT``) that holds ``virtual``."""
    for top in _TOPS:
        if virtual == top or virtual.startswith(top + "/"):
            return top
    raise ValueError(f"{virtual!r} is not under one of the sandbox directories {VIRTUAL_DIRS}")


def _parents(path: str, top: str):
    """``path`` and its parents up to (excluding) ``top``."""
    path, top = os.path.normpath(path), os.path.normpath(top)
    while path.startswith(top + os.sep):
        yield path
        path = os.path.dirname(path)
