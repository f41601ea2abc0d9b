"""What a sandboxed command's child process does before ``exec``, and what this machine allows.

``Plan`` (the ``preexec_fn``), in order: join the sandbox's memory cgroup; ``unshare`` a
network namespace (and bring its own loopback up) and, under chroot, a mount namespace;
build the chroot (``_enter_root``: a read-only tmpfs root, read-only nosuid binds of the
system directories, a minimal ``/dev``, ``/proc`` with ``hidepid``, the sandbox's own
directories at ``/app /logs /tmp /tests /solution`` and the read-only ``binds``: the
tool directory at ``/glmjax``, the host interpreter's prefix); ``PR_SET_NO_NEW_PRIVS``;
the rlimits; drop to the sandbox's uid. Everything the child needs is computed in the
parent: the child of a threaded process should only make system calls.

``probe()`` tries each namespace; ``claim_uid()`` hands out a uid no
other live sandbox holds (an ``flock`` per uid, released when its holder exits);
``kill_uid()`` kills every process of a uid. ``envs/sandbox.py`` documents the guarantees.
"""

from __future__ import annotations

import ctypes
import dataclasses
import fcntl
import os
import platform
import re
import resource
import signal
import socket
import struct
import subprocess
import tempfile
import time

UID_BASE = 420000
UID_SPAN = 4096
VIRTUAL_DIRS = ("/app", "/logs", "/tests", "/solution", "/tmp")
_SYSTEM_DIRS = ("usr", "etc", "opt", "var", "bin", "sbin", "lib", "lib32", "lib64", "libx32")
_DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
_CLONE_NEWNS, _CLONE_NEWNET, _CLONE_NEWPID = 0x00020000, 0x40000000, 0x20000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 32, 4096, 16384, 1 << 18
_PR_SET_NO_NEW_PRIVS, _SIOCSIFFLAGS, _IFF_UP_LOOPBACK_RUNNING = 38, 0x8914, 0x1 | 0x8 | 0x40
_libc = ctypes.CDLL(None, use_errno=True)


@dataclasses.dataclass(frozen=True)
class Isolation:
    """Which isolation a sandbox has: network "netns" | "host"; filesystem "chroot" |
    "plain"; user "dedicated-uid" | "same-user"; processes "pidns" (each command is PID 1
    of its own PID namespace) | "kill-sweep" (process group and uid killed after it);
    memory "cgroup-v1" | "cgroup-v2" (all of a sandbox's processes together are capped)
    | "per-process" (only each process's address space is: N processes may hold N times
    the limit)."""

    network: str
    filesystem: str
    user: str
    processes: str
    notes: tuple[str, ...] = ()
    memory: str = "per-process"

    def describe(self) -> str:
        text = (f"network={self.network} filesystem={self.filesystem} user={self.user} processes={self.processes} "
                f"memory={self.memory}")
        return text + "".join(f"; {note}" for note in self.notes)


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(_libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {target}")


def _bind(source: str, target: str, read_only: bool) -> None:
    _mount(source, target, None, _MS_BIND)
    flags = _MS_BIND | _MS_REMOUNT | _MS_NOSUID | _MS_NODEV | (_MS_RDONLY if read_only else 0)
    _mount(None, target, None, flags)


def _loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        fcntl.ioctl(sock.fileno(), _SIOCSIFFLAGS, struct.pack("16sH22x", b"lo", _IFF_UP_LOOPBACK_RUNNING))


def _kernel_at_least(major: int, minor: int) -> bool:
    found = re.match(r"(\d+)\.(\d+)", platform.release())
    return bool(found) and (int(found.group(1)), int(found.group(2))) >= (major, minor)


class Plan:
    """Everything the child does before exec, computed in the parent (the child of a
    threaded process should only make system calls)."""

    def __init__(self, *, root: str, uid: int | None, network_ns: bool, chroot: bool, pid_ns: bool,
                 rlimits: list[tuple[int, int]], cwd: str, binds: tuple[tuple[str, str], ...] = (),
                 cgroup_procs: str | None = None):
        """``binds``: (host directory, path inside the chroot) pairs mounted read-only;
        ``cgroup_procs``: the ``cgroup.procs`` file of the group the command joins."""
        self.root, self.uid, self.network_ns, self.chroot, self.cwd = root, uid, network_ns, chroot, cwd
        self.pid_ns, self.rlimits, self.binds, self.cgroup_procs = pid_ns, rlimits, binds, cgroup_procs
        self.system = [(f"/{d}", os.path.islink(f"/{d}") and os.readlink(f"/{d}")) for d in _SYSTEM_DIRS
                       if os.path.lexists(f"/{d}")]
        self.devices = [d for d in _DEVICES if os.path.exists(f"/dev/{d}")]
        self.proc_options = "hidepid=2" if _kernel_at_least(5, 8) else None

    def __call__(self) -> None:
        if self.cgroup_procs:  # first, so that everything the command starts is in the group
            fd = os.open(self.cgroup_procs, os.O_WRONLY)
            os.write(fd, str(os.getpid()).encode())
            os.close(fd)
        flags = ((_CLONE_NEWNET if self.network_ns else 0) | (_CLONE_NEWNS if self.chroot else 0)
                 | (_CLONE_NEWPID if self.pid_ns else 0))
        if flags:
            _check(_libc.unshare(flags), "unshare")
        if self.network_ns:
            _loopback_up()
        if self.chroot:
            self._build_root()
        if self.pid_ns:
            _become_init()
        if self.chroot:
            self._enter_root()
        if self.uid is not None:
            _check(_libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
        for which, value in self.rlimits:
            resource.setrlimit(which, (value, value))
        if self.uid is not None:
            os.setgroups([])
            os.setgid(self.uid)
            os.setuid(self.uid)
        os.chdir(self.cwd)

    def _build_root(self) -> None:
        new = os.path.join(self.root, ".root")
        _mount(None, "/", None, _MS_REC | _MS_PRIVATE)
        _mount("tmpfs", new, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=1m,mode=755")
        for path, link in self.system:
            if link:
                os.symlink(link, new + path)
            elif os.path.isdir(path):
                os.mkdir(new + path)
                _bind(path, new + path, read_only=True)
        for virtual in VIRTUAL_DIRS:
            os.makedirs(new + virtual)
            _bind(os.path.join(self.root, virtual[1:]), new + virtual, read_only=False)
        for host, inside in self.binds:
            os.makedirs(new + inside, exist_ok=True)
            _bind(host, new + inside, read_only=True)
        os.mkdir(new + "/dev")
        _mount("tmpfs", new + "/dev", "tmpfs", _MS_NOSUID, "size=64k,mode=755")
        for device in self.devices:
            open(f"{new}/dev/{device}", "w").close()
            _mount(f"/dev/{device}", f"{new}/dev/{device}", None, _MS_BIND)
        for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                             ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
            os.symlink(target, f"{new}/dev/{name}")
        os.mkdir(new + "/dev/shm")
        _mount("tmpfs", new + "/dev/shm", "tmpfs", _MS_NOSUID | _MS_NODEV, "size=16m,mode=1777")
        _mount(None, new + "/dev", None, _MS_REMOUNT | _MS_NOSUID | _MS_RDONLY)
        os.mkdir(new + "/proc")

    def _enter_root(self) -> None:
        """Mount /proc (from inside the new PID namespace, so it shows only the sandbox's
        processes), make the root read-only, chroot."""
        new = os.path.join(self.root, ".root")
        _mount("proc", new + "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, self.proc_options)
        _mount(None, new, None, _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)
        os.chroot(new)


def _become_init() -> None:
    """Fork after ``unshare(CLONE_NEWPID)``: the child, PID 1 of the new namespace, returns
    and goes on to exec the command; when it exits the kernel kills and reaps everything
    left in the namespace (no orphans, no zombies counted against the process limit).
    The parent stays behind only to wait and pass on the exit status or signal; it closes
    every descriptor first, so ``subprocess`` sees the exec and the output's end."""
    child = os.fork()
    if child == 0:
        return
    os.closerange(0, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    while True:
        try:
            _, status = os.waitpid(child, 0)
            break
        except InterruptedError:
            continue
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        os.kill(os.getpid(), sig)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 255)


def probe() -> Isolation:
    """The strongest isolation this machine allows: each namespace tried with ``/bin/true``
    (``envs.sandbox.probe`` runs this once per process, in a helper, and caches it)."""
    notes, root = [], os.geteuid() == 0
    if not root:
        notes.append("not root: no dedicated uid, no namespaces; the process limit counts all of this user's processes")
        return Isolation("host", "plain", "same-user", "kill-sweep", tuple(notes))

    def works(**kw) -> bool:
        with tempfile.TemporaryDirectory(prefix="glmjax-probe-") as tmp:
            for virtual in VIRTUAL_DIRS + ("/.root",):
                os.makedirs(tmp + virtual, exist_ok=True)
            plan = Plan(root=tmp, uid=None, rlimits=[], cwd="/", **{"network_ns": False, "chroot": False,
                                                                    "pid_ns": False, **kw})
            try:
                return subprocess.run(["/bin/true"], preexec_fn=plan, timeout=10).returncode == 0
            except (subprocess.SubprocessError, OSError) as err:
                notes.append(f"{kw}: {err}")
                return False

    network = "netns" if works(network_ns=True) else "host"
    filesystem = "chroot" if works(chroot=True) else "plain"
    processes = "pidns" if works(pid_ns=True, chroot=filesystem == "chroot") else "kill-sweep"
    if network == "host":
        notes.append("network namespaces are refused here: sandboxes refuse to run unless network='host' is passed")
    return Isolation(network, filesystem, "dedicated-uid", processes, tuple(notes))


def claim_uid() -> tuple[int, int]:
    """A uid no other live sandbox holds: (uid, fd of its held lock file)."""
    lock_dir = os.path.join(tempfile.gettempdir(), "glmjax-sandbox-uids")
    os.makedirs(lock_dir, mode=0o700, exist_ok=True)
    start = (os.getpid() * 7919 + time.monotonic_ns()) % UID_SPAN
    for step in range(UID_SPAN):
        uid = UID_BASE + (start + step) % UID_SPAN
        fd = os.open(os.path.join(lock_dir, str(uid)), os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return uid, fd
        except BlockingIOError:
            os.close(fd)
    raise RuntimeError(f"all {UID_SPAN} sandbox uids from {UID_BASE} are in use")


def kill_uid(uid: int) -> None:
    """SIGKILL every process of ``uid``: ``kill(-1)`` from a child that became ``uid``
    reaches exactly those (all processes it may signal, itself excepted). The child only
    makes system calls and ``_exit``s, so forking from a threaded process is safe."""
    child = os.fork()
    if child == 0:
        code = 0
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass  # nothing of that uid is running
        except BaseException:
            code = 1
        os._exit(code)
    os.waitpid(child, 0)
