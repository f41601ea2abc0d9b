"""What a sandboxed command's child process does before ``exec``, and what this machine allows.

``Plan`` (the ``preexec_fn``), in order:

1. join the sandbox's cgroups (its memory cap and CPU quota, ``envs/sandbox/cgroup.py``);
2. ``unshare`` new network, IPC, UTS, mount and PID namespaces: its own loopback, its own
   System V IPC objects and POSIX message queues (gone when the command ends), the
   hostname ``sandbox``;
3. build the new root (``_build_root``): a read-only tmpfs holding read-only, nosuid binds
   of the system directories that programs need (``/usr /etc /bin /sbin /lib*``, and of
   ``/var`` only ``/var/lib/dpkg``), the sandbox's own directories (``mounts``), empty
   read-only masks over ``hidden`` paths, a minimal ``/dev``;
4. fork: the child becomes PID 1 of the new PID namespace (``_become_init``);
5. mount ``/proc`` (``hidepid``), ``pivot_root`` into the new root and detach the host's:
   no path, ``..`` or a second ``chroot`` included, leads back to the host's tree;
6. ``PR_SET_NO_NEW_PRIVS``, the rlimits;
7. drop to the sandbox's uid; or, for the verifier (``verifier_of``), become root of a
   user namespace that maps only the verifier's uid (as 0) and the agent's. Root's
   override of file permissions then reaches the files of those two uids and nothing
   else: the verifier reads and writes ``/app`` whatever modes the agent left, as Docker's
   root verifier does, while the host's root-owned files (``/etc/shadow``,
   ``/proc/sysrq-trigger``) stay as closed as they are to any other user.

An episode's agent commands take none of these steps: ``Plan.anchor`` makes the namespaces
and the root once, for an *anchor* process (``envs/sandbox/anchor.py``) that stays as init
of that PID namespace and forks each command inside them.

Everything the child needs is computed in the parent: the child of a threaded process
should only make system calls.

``probe()`` tries each of these; ``claim_uid()`` hands out a uid no other live sandbox holds
(an ``flock`` per uid in ``LOCK_DIR``, a fixed path: two runs with different ``TMPDIR``s
see the same locks); ``kill_uids()`` kills every process of some uids. ``envs/sandbox/sandbox.py``
documents the guarantees.
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
from typing import NamedTuple

UID_BASE = 420000
UID_SPAN = 4096  # agent uids UID_BASE + [0, SPAN); each one's verifier uid is SPAN above it
LOCK_DIR = "/run/glmjax-sandbox-uids"
HOSTNAME = b"sandbox"
VIRTUAL_DIRS = ("/app", "/logs", "/tests", "/solution", "/tmp")
_SYSTEM_DIRS = ("usr", "etc", "bin", "sbin", "lib", "lib32", "lib64", "libx32")
_EMPTY_DIRS = ("/home", "/mnt", "/media", "/opt", "/root", "/run", "/srv", "/var/backups", "/var/cache",
               "/var/lib", "/var/local", "/var/log", "/var/mail", "/var/opt", "/var/spool")
_VAR_BINDS = ("/var/lib/dpkg",)  # what dpkg-query (the apt stand-in) reads; the rest of /var stays out
_DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
_CLONE_NEWNS, _CLONE_NEWUTS, _CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
_CLONE_NEWUSER, _CLONE_NEWPID, _CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 32, 4096, 16384, 1 << 18
_MNT_DETACH, _IPC_RMID = 2, 0
_PR_CAPBSET_DROP, _PR_SET_NO_NEW_PRIVS = 24, 38
_SIOCSIFFLAGS, _IFF_UP_LOOPBACK_RUNNING = 0x8914, 0x1 | 0x8 | 0x40
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "ppc64le": 203, "s390x": 217}
# Docker's default capabilities for a container's root, which a verifier has inside its user namespace:
# CHOWN DAC_OVERRIDE FOWNER FSETID KILL SETGID SETUID SETPCAP NET_BIND_SERVICE NET_RAW SYS_CHROOT MKNOD
# AUDIT_WRITE SETFCAP. Held in a namespace that owns nothing but itself, they reach only its two uids' files.
_VERIFIER_CAPS = frozenset({0, 1, 3, 4, 5, 6, 7, 8, 10, 13, 18, 27, 29, 31})
# What a build step's root keeps of them (``Plan(build_caps=...)``): no MKNOD, NET_RAW or AUDIT_WRITE, and never
# SYS_ADMIN (it cannot mount), SYS_MODULE, SYS_PTRACE, SYS_BOOT, SYS_TIME or DAC_READ_SEARCH.
BUILD_CAPS = frozenset({0, 1, 3, 4, 5, 6, 7, 8, 10, 18, 31})
_libc = ctypes.CDLL(None, use_errno=True)


@dataclasses.dataclass(frozen=True)
class Isolation:
    """Which isolation a sandbox has: network "netns" | "host"; filesystem "chroot" (its own
    root, entered with ``pivot_root``) | "plain"; user "dedicated-uid" | "same-user";
    processes "pidns" (each command is PID 1 of its own PID namespace) | "kill-sweep"
    (process group and uid killed after it); ipc "ipcns" (System V IPC, message queues and
    the hostname are each command's own) | "host"; memory "cgroup-v1" | "cgroup-v2" (all
    of a sandbox's processes together are capped) | "per-process" (only each process's
    address space is: N processes may hold N times the limit); cpu "cgroup-v1" |
    "cgroup-v2" (a quota of cores for all its processes) | "per-process" (only CPU
    seconds per process); disk "tmpfs" (a size-capped filesystem holds all its files) |
    "none"; verifier "userns-root" (root of its own user namespace, its own uid) |
    "agent-uid" (the agent's uid and permissions); entry "episode" (an agent command
    enters the namespaces and root made once for the episode, as ``docker exec`` does) |
    "command" (each command makes its own)."""

    network: str
    filesystem: str
    user: str
    processes: str
    notes: tuple[str, ...] = ()
    memory: str = "per-process"
    cpu: str = "per-process"
    ipc: str = "host"
    disk: str = "none"
    verifier: str = "agent-uid"
    entry: str = "command"

    def describe(self) -> str:
        text = (f"network={self.network} filesystem={self.filesystem} user={self.user} processes={self.processes} "
                f"ipc={self.ipc} memory={self.memory} cpu={self.cpu} disk={self.disk} verifier={self.verifier} "
                f"entry={self.entry}")
        return text + "".join(f"; {note}" for note in self.notes)


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(_libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {target}")


def unmount(target: str) -> None:
    """Detach the mount at ``target`` (lazily: it goes once nothing uses it)."""
    _check(_libc.umount2(target.encode(), _MNT_DETACH), f"umount {target}")


def _bind(source: str, target: str, read_only: bool) -> None:
    mount(source, target, None, _MS_BIND)
    flags = _MS_BIND | _MS_REMOUNT | _MS_NOSUID | _MS_NODEV | (_MS_RDONLY if read_only else 0)
    mount(None, target, None, flags)


def _loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        fcntl.ioctl(sock.fileno(), _SIOCSIFFLAGS, struct.pack("16sH22x", b"lo", _IFF_UP_LOOPBACK_RUNNING))


def _kernel_at_least(major: int, minor: int) -> bool:
    found = re.match(r"(\d+)\.(\d+)", platform.release())
    return bool(found) and (int(found.group(1)), int(found.group(2))) >= (major, minor)


def _under(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


class Overlay(NamedTuple):
    """An overlay filesystem as the source of a mount (``Plan``'s ``mounts``): ``lowers``,
    the top one first, read-only; with ``upper`` and ``work`` (two directories of one
    filesystem) writes land in ``upper``, whiteouts included. Mounted at ``/`` it is the
    root itself (a build step's: ``envs/sandbox/build.py``), whose mount points go in the
    lowest layer so that only what the command writes lands in ``upper``."""

    lowers: tuple[str, ...]
    upper: str | None = None
    work: str | None = None

    def options(self) -> str:
        bad = [p for p in (*self.lowers, self.upper, self.work) if p and re.search(r"[:,\\\s]", p)]
        if bad:
            raise ValueError(f"overlay layers must be paths without ':', ',', '\\' or spaces, got {bad[0]!r}")
        # index off: several sandboxes mount the same layers; no redirects or metacopy, so that
        # a layer written here reads the same in any later overlay
        text = f"lowerdir={':'.join(self.lowers)},index=off,redirect_dir=off,metacopy=off"
        return text + (f",upperdir={self.upper},workdir={self.work}" if self.upper else "")


class Symlink(NamedTuple):
    """A symbolic link as the source of a mount (``Plan``'s ``mounts``): made in the new
    root, resolved inside it."""

    target: str


def _mount_point(base: str, source, inside: str) -> None:
    """Make what ``source`` is mounted on at ``base + inside``: a directory, an empty file
    for a file, or the link itself for a ``Symlink``."""
    path = base + inside
    if isinstance(source, Symlink) or (isinstance(source, str) and not os.path.isdir(source)):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if not os.path.lexists(path):
            if isinstance(source, Symlink):
                os.symlink(source.target, path)
            else:
                open(path, "w").close()
    else:
        os.makedirs(path, exist_ok=True)


def _mount_overlay(layers: Overlay, target: str, writable: bool) -> None:
    flags = _MS_NOSUID | _MS_NODEV | (0 if writable and layers.upper else _MS_RDONLY)
    mount("overlay", target, "overlay", flags, layers.options())


def root_layout() -> dict[str, str]:
    """What a sandbox's new root holds at each path an image's layer may add to: "host" (a
    host directory, bound read-only), "dir" (an empty directory of the root's own) or
    "link" (a symbolic link of the host's, such as ``/bin`` -> ``usr/bin``)."""
    layout = {"/": "dir", "/var": "dir", "/var/lib": "dir", **{p: "dir" for p in _EMPTY_DIRS}}
    for name in _SYSTEM_DIRS:
        path = f"/{name}"
        if os.path.islink(path):
            layout[path] = "link"
        elif os.path.isdir(path):
            layout[path] = "host"
    layout.update({path: "host" for path in _VAR_BINDS if os.path.isdir(path)})
    layout["/var/tmp"] = "link"
    return layout


class Plan:
    """Everything the child does before exec, computed in the parent (the child of a
    threaded process should only make system calls)."""

    def __init__(self, *, root: str, uid: int | None, network_ns: bool, chroot: bool, pid_ns: bool,
                 rlimits: list[tuple[int, int]], cwd: str, mounts: tuple[tuple[str, str, bool], ...] = (),
                 hidden: tuple[str, ...] = (), cgroup_procs: tuple[str, ...] = (), ipc_ns: bool = False,
                 verifier_of: int | None = None,
                 build_caps: frozenset[int] | None = None):
        """``root``: an empty directory, the new root's mount point; ``mounts``: (host
        directory, path inside, writable) binds after the system's, in order; the source may
        also be a file, an ``Overlay`` (one at ``/`` is the root itself, writable) or a
        ``Symlink``; ``build_caps``: a build step's plan (``envs/sandbox/build.py``), which
        stays root with only these capabilities (``_limit_build``); ``hidden``:
        host paths masked where a system bind would show them; ``cgroup_procs``: the
        ``cgroup.procs`` files of the groups the command joins; ``verifier_of``: the agent's
        uid, for a verifier command running as ``uid`` (needs ``pid_ns`` and ``chroot``)."""
        if verifier_of is not None and not (pid_ns and chroot and uid is not None):
            raise ValueError("a verifier plan needs a uid, a PID namespace and its own root")
        self.root, self.uid, self.network_ns, self.chroot, self.cwd = root, uid, network_ns, chroot, cwd
        self.pid_ns, self.rlimits, self.mounts, self.cgroup_procs = pid_ns, rlimits, mounts, cgroup_procs
        self.ipc_ns, self.verifier_of = ipc_ns, verifier_of
        self.root_layer = next((host for host, inside, _ in mounts if inside == "/" and isinstance(host, Overlay)),
                               None)
        self.mounts = tuple(m for m in mounts if m[1] != "/")
        if build_caps is not None and not (pid_ns and chroot and verifier_of is None):
            raise ValueError("a build step's plan needs a PID namespace and its own root")
        self.build_caps = build_caps
        self.system = [(f"/{d}", os.path.islink(f"/{d}") and os.readlink(f"/{d}")) for d in _SYSTEM_DIRS
                       if os.path.lexists(f"/{d}")]
        self.var = [path for path in _VAR_BINDS if os.path.isdir(path)]
        tops = ([os.path.realpath(p) for p, _ in self.system] + self.var
                + [inside for host, inside, _ in mounts if host == inside])  # where host paths show through
        needed = [inside for _, inside, _ in mounts]
        self.hidden = tuple(dict.fromkeys(
            p for p in map(os.path.realpath, hidden)
            if any(_under(p, top) and p != top for top in tops) and not any(_under(n, p) for n in needed)))
        self.devices = [d for d in _DEVICES if os.path.exists(f"/dev/{d}")]
        self.proc_options = "hidepid=2" if _kernel_at_least(5, 8) else None
        if build_caps is not None:  # root's /proc: its processes only, no /proc/sys or /proc/sysrq-trigger to write
            if self.proc_options is None:
                raise OSError("a build step's /proc needs subset=pid (Linux 5.8 or later)")
            self.proc_options += ",subset=pid"
            with open("/proc/sys/kernel/cap_last_cap") as f:
                self.drop_build_caps = [cap for cap in range(int(f.read()) + 1) if cap not in build_caps]
        self.pivot_root = _SYS_PIVOT_ROOT.get(platform.machine())
        if chroot and self.pivot_root is None:
            raise OSError(f"pivot_root's system call number on {platform.machine()} is not known here")
        if verifier_of is not None:
            with open("/proc/sys/kernel/cap_last_cap") as f:
                last = int(f.read())
            self.drop_caps = [cap for cap in range(last + 1) if cap not in _VERIFIER_CAPS]
            self.user_map = f"0 {uid} 1\n{verifier_of} {verifier_of} 1\n".encode()

    error_fd: int | None = None  # where the child writes why it failed (``subprocess`` reports only that it did)

    def __call__(self) -> None:
        try:
            self._prepare()
        except BaseException as err:
            if self.error_fd is not None:
                os.write(self.error_fd, f"{type(err).__name__}: {err}".encode()[:4096])
            raise

    def _prepare(self) -> None:
        self._join_cgroups()
        self._make_namespaces()
        if self.uid is not None:
            _check(_libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
        for which, value in self.rlimits:
            resource.setrlimit(which, (value, value))
        if self.verifier_of is not None:
            self._become_verifier(*self._sync)
        elif self.uid is not None:
            os.setgroups([])
            os.setgid(self.uid)
            os.setuid(self.uid)
        try:
            os.chdir(self.cwd)
        except PermissionError:  # the agent took its working directory's permissions away: it starts at /
            os.chdir("/")

    def _join_cgroups(self) -> None:
        for procs in self.cgroup_procs:  # first, so that everything the command starts is in the groups
            fd = os.open(procs, os.O_WRONLY)
            os.write(fd, str(os.getpid()).encode())
            os.close(fd)

    def _make_namespaces(self) -> None:
        flags = ((_CLONE_NEWNET if self.network_ns else 0) | (_CLONE_NEWNS if self.chroot else 0)
                 | (_CLONE_NEWPID if self.pid_ns else 0) | (_CLONE_NEWIPC | _CLONE_NEWUTS if self.ipc_ns else 0))
        if flags:
            _check(_libc.unshare(flags), "unshare")
        if self.ipc_ns:
            _check(_libc.sethostname(HOSTNAME, len(HOSTNAME)), "sethostname")
        if self.network_ns:
            _loopback_up()
        if self.chroot:
            self._build_root()
        self._sync = _become_init(self.user_map if self.verifier_of is not None else None) if self.pid_ns else None
        if self.chroot:
            self._enter_root()

    def anchor(self, report: int) -> None:
        """Become an episode's anchor (in a fork of a helper; ``envs/sandbox/anchor.py``):
        join the sandbox's cgroups, make the namespaces and the root, and fork the init of
        the new PID namespace, which enters the root and returns; the parent writes
        ``pid N`` (the anchor's host pid) to ``report`` and exits. Needs ``uid``."""
        if self.uid is None:
            raise ValueError("an anchor needs the sandbox's uid")
        self._join_cgroups()
        flags = _CLONE_NEWNS | _CLONE_NEWPID | (_CLONE_NEWNET if self.network_ns else 0) | (
            _CLONE_NEWIPC | _CLONE_NEWUTS if self.ipc_ns else 0)
        _check(_libc.unshare(flags), "unshare")
        if self.ipc_ns:
            _check(_libc.sethostname(HOSTNAME, len(HOSTNAME)), "sethostname")
        if self.network_ns:
            _loopback_up()
        self._build_root()
        child = os.fork()
        if child:
            os.write(report, f"pid {child}\n".encode())
            os._exit(0)
        self._enter_root()
        _check(_libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
        # real ids the sandbox's, effective and saved root's: a command spawned with resetids is the sandbox's
        # uid from its first instruction (anchor.py); the agent's uid may renice the anchor, never signal it (it
        # is its PID namespace's init) nor trace it (its effective and saved ids are root's)
        os.setgroups([])
        os.setresgid(self.uid, 0, 0)
        os.setresuid(self.uid, 0, 0)

    def _build_root(self) -> None:
        new = self.root
        mount(None, "/", None, _MS_REC | _MS_PRIVATE)
        if self.root_layer is None:
            mount("tmpfs", new, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=1m,mode=755")
            self._mount_points(new)
        else:
            self._mount_points(self.root_layer.lowers[-1])
            _mount_overlay(self.root_layer, new, writable=True)
        for path, link in self.system:
            if not link and os.path.isdir(path):
                _bind(path, new + path, read_only=True)
        for path in self.var:
            _bind(path, new + path, read_only=True)
        for host, inside, writable in self.mounts:
            _mount_point(new, host, inside)  # a mount nested in an earlier one needs its point in that one
            if isinstance(host, Symlink):
                continue
            if os.path.realpath(new + inside) != os.path.realpath(new) + inside:  # a link the agent left in /tmp
                raise OSError(f"the mount point {inside} is reached through a symbolic link")
            if isinstance(host, Overlay):
                _mount_overlay(host, new + inside, writable)
            else:
                _bind(host, new + inside, read_only=not writable)
        for path in self.hidden:
            if os.path.isdir(new + path):
                mount("tmpfs", new + path, "tmpfs", _MS_NOSUID | _MS_NODEV | _MS_RDONLY, "size=4k,mode=755")
        mount("tmpfs", new + "/dev", "tmpfs", _MS_NOSUID, "size=64k,mode=755")
        for device in self.devices:
            open(f"{new}/dev/{device}", "w").close()
            mount(f"/dev/{device}", f"{new}/dev/{device}", None, _MS_BIND)
        for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                             ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
            os.symlink(target, f"{new}/dev/{name}")
        os.mkdir(new + "/dev/shm")
        mount("tmpfs", new + "/dev/shm", "tmpfs", _MS_NOSUID | _MS_NODEV, "size=16m,mode=1777")
        mount(None, new + "/dev", None, _MS_REMOUNT | _MS_NOSUID | _MS_RDONLY)
        if self.build_caps is not None:
            self._limit_build()

    def _mount_points(self, base: str) -> None:
        """The directories, files and links the new root's mounts need, made under ``base``
        (the new root's tmpfs, or the lowest layer of a build step's root, where making
        them leaves the layer the step writes untouched)."""
        for path, link in self.system:
            if link and not os.path.lexists(base + path):
                os.symlink(link, base + path)
            elif not link and os.path.isdir(path):
                os.makedirs(base + path, exist_ok=True)
        for skeleton in _EMPTY_DIRS:  # where images have directories: present, empty, read-only
            os.makedirs(base + skeleton, mode=0o755, exist_ok=True)
        if not os.path.lexists(base + "/var/tmp"):
            os.symlink("/tmp", base + "/var/tmp")
        for path in self.var:
            os.makedirs(base + path, mode=0o755, exist_ok=True)
        for host, inside, _ in self.mounts:
            _mount_point(base, host, inside)
        for path in ("/dev", "/proc"):
            os.makedirs(base + path, exist_ok=True)

    def _limit_build(self) -> None:
        """A build step runs as root, as Docker's RUN does; from its exec on it holds only
        ``build_caps`` and gains nothing more (NO_NEW_PRIVS). The bounding set limits what
        the exec grants, so dropping it here leaves ``_enter_root`` its CAP_SYS_ADMIN."""
        for cap in self.drop_build_caps:
            _check(_libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0), f"prctl(CAPBSET_DROP, {cap})")
        _check(_libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")

    def _enter_root(self) -> None:
        """Mount /proc (from inside the new PID namespace, so it shows only the sandbox's
        processes), make the root read-only, ``pivot_root`` into it and detach the host's
        root, so that nothing of the host's tree is left in this mount namespace."""
        new = self.root
        mount("proc", new + "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, self.proc_options)
        if self.root_layer is None:  # a build step's root is its layer, written through
            mount(None, new, None, _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)
        os.chdir(new)
        _check(_libc.syscall(self.pivot_root, b".", b"."), "pivot_root")  # the old root now sits on top of "."
        unmount(".")
        os.chdir("/")

    def _become_verifier(self, ready: int, go: int) -> None:
        """Root of a new user namespace whose id maps (written by the waiting parent, which
        keeps root's rights over the host's namespace) hold the verifier's uid as 0 and the
        agent's as itself; capabilities beyond Docker's default set are dropped."""
        os.setgroups([])
        _check(_libc.unshare(_CLONE_NEWUSER), "unshare(CLONE_NEWUSER)")
        os.write(ready, b"u")
        os.close(ready)
        if os.read(go, 1) != b"g":
            raise OSError("the verifier's user namespace got no id maps")
        os.close(go)
        os.setresgid(0, 0, 0)
        os.setresuid(0, 0, 0)
        for cap in self.drop_caps:
            _check(_libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0), f"prctl(CAPBSET_DROP, {cap})")


def _become_init(user_map: bytes | None) -> tuple[int, int] | None:
    """Fork after ``unshare(CLONE_NEWPID)``: the child, PID 1 of the new namespace, returns
    and goes on to exec the command; when it exits the kernel kills and reaps everything
    left in the namespace (no orphans, no zombies counted against the process limit).
    The parent stays behind to write the child's user-namespace id maps (``user_map``:
    the child says when it has its namespace, and waits for them), then only to wait and
    pass on the exit status or signal; it closes every descriptor first, so
    ``subprocess`` sees the exec and the output's end. Returns the child's ends of the
    two pipes (ready, go) when there is a map to write."""
    pipes = (os.pipe2(os.O_CLOEXEC), os.pipe2(os.O_CLOEXEC)) if user_map else None
    host_proc = os.open("/proc", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC) if user_map else None
    child = os.fork()
    if child == 0:
        if not pipes:
            return None
        os.close(host_proc)
        os.close(pipes[0][0])
        os.close(pipes[1][1])
        return pipes[0][1], pipes[1][0]
    if pipes:  # the host's /proc, opened before the fork: the child may pivot away from it at any time
        os.close(pipes[0][1])
        os.close(pipes[1][0])
        try:
            task = os.open(str(child), os.O_RDONLY | os.O_DIRECTORY, dir_fd=host_proc)
            if os.read(pipes[0][0], 1) == b"u":
                for name in ("uid_map", "gid_map"):
                    fd = os.open(name, os.O_WRONLY, dir_fd=task)
                    try:
                        os.write(fd, user_map)
                    finally:
                        os.close(fd)
                os.write(pipes[1][1], b"g")
        except OSError:
            pass  # the child reads no "g", raises, and subprocess reports it
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


def mount_tmpfs(path: str, size: int) -> None:
    """A disk of ``size`` bytes at ``path`` (nosuid, nodev): a tmpfs, its inodes capped at one
    per 4 KiB (at least 8,192) so that empty files cannot take the kernel's memory either."""
    mount("tmpfs", path, "tmpfs", _MS_NOSUID | _MS_NODEV, f"size={size},nr_inodes={max(size // 4096, 8192)},mode=755")


def can_mount_tmpfs() -> bool:
    """Whether this process may mount a tmpfs (the sandbox's size-capped disk)."""
    with tempfile.TemporaryDirectory(prefix="glmjax-probe-") as tmp:
        try:
            mount_tmpfs(tmp, 64 << 10)
        except OSError:
            return False
        unmount(tmp)
        return True


def probe() -> Isolation:
    """The strongest isolation this machine allows: each namespace tried with ``/bin/true``
    (``envs.sandbox.sandbox.probe`` runs this once per process, in a helper, and caches it)."""
    notes, root = [], os.geteuid() == 0
    if not root:
        notes.append("not root: no dedicated uid, no namespaces, no disk quota; the process limit counts all of "
                     "this user's processes")
        return Isolation("host", "plain", "same-user", "kill-sweep", tuple(notes))

    def works(**kw) -> bool:
        with tempfile.TemporaryDirectory(prefix="glmjax-probe-") as tmp:
            os.mkdir(tmp + "/root")
            os.mkdir(tmp + "/app")
            plan = Plan(root=tmp + "/root", rlimits=[], cwd="/", mounts=((tmp + "/app", "/app", True),),
                        **{"uid": None, "network_ns": False, "chroot": False, "pid_ns": False, **kw})
            try:
                return subprocess.run(["/bin/true"], preexec_fn=plan, timeout=10).returncode == 0
            except (subprocess.SubprocessError, OSError) as err:
                notes.append(f"{kw}: {err}")
                return False

    network = "netns" if works(network_ns=True) else "host"
    ipc = "ipcns" if works(ipc_ns=True) else "host"
    filesystem = "chroot" if works(chroot=True) else "plain"
    processes = "pidns" if works(pid_ns=True, chroot=filesystem == "chroot") else "kill-sweep"
    verifier = "agent-uid"
    if processes == "pidns" and filesystem == "chroot":
        nobody = UID_BASE - 1
        if works(pid_ns=True, chroot=True, uid=nobody, verifier_of=nobody - 1):
            verifier = "userns-root"
    if network == "host":
        notes.append("network namespaces are refused here: sandboxes refuse to run unless network='host' is passed")
    if verifier == "agent-uid":
        notes.append("no user namespaces under the sandbox's root: the verifier runs as the agent's uid")
    disk = "tmpfs" if can_mount_tmpfs() else "none"
    return Isolation(network, filesystem, "dedicated-uid", processes, tuple(notes), ipc=ipc, disk=disk,
                     verifier=verifier)


def verifier_uid(uid: int) -> int:
    """The uid a sandbox's verifier runs as: its own, held by the same lock as the agent's."""
    return uid + UID_SPAN


def _first_candidate() -> int:
    return (os.getpid() * 7919 + time.monotonic_ns()) % UID_SPAN


def claim_uid() -> tuple[int, int]:
    """A uid no other live sandbox on this machine holds, whichever process or ``TMPDIR``
    it runs under: (uid, fd of its held lock file in ``LOCK_DIR``). The lock covers the
    verifier's uid too (``verifier_uid``)."""
    os.makedirs(LOCK_DIR, mode=0o700, exist_ok=True)
    start = _first_candidate()
    for step in range(UID_SPAN):
        uid = UID_BASE + (start + step) % UID_SPAN
        fd = os.open(os.path.join(LOCK_DIR, str(uid)), os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return uid, fd
        except BlockingIOError:
            os.close(fd)
    raise RuntimeError(f"all {UID_SPAN} sandbox uids from {UID_BASE} are in use")


def remove_ipc(uids: tuple[int, ...] | None) -> int:
    """Remove every System V shared-memory segment, semaphore set and message queue of this
    IPC namespace that one of ``uids`` (None: anyone) owns or made; returns how many. (A
    sandbox whose commands share the host's IPC namespace, ``ipc="host"``, leaves its
    objects there; an episode's anchor clears its own namespace's.)"""
    removed = 0
    for kind, column, rm in (("shm", "shmid", lambda i: _libc.shmctl(i, _IPC_RMID, None)),
                             ("sem", "semid", lambda i: _libc.semctl(i, 0, _IPC_RMID)),
                             ("msg", "msqid", lambda i: _libc.msgctl(i, _IPC_RMID, None))):
        try:
            with open(f"/proc/sysvipc/{kind}") as f:
                header, *rows = [line.split() for line in f]
        except OSError:
            continue
        ident, owners = header.index(column), (header.index("uid"), header.index("cuid"))
        for row in rows:
            if (uids is None or any(int(row[i]) in uids for i in owners)) and rm(int(row[ident])) == 0:
                removed += 1
    return removed


def kill_uids(uids: tuple[int, ...]) -> None:
    """SIGKILL every process of each of ``uids``: ``kill(-1)`` from a child that became the
    uid reaches exactly those (all processes it may signal, itself excepted; a verifier's
    processes too, whose user namespace maps its uid to 0). The child only makes system
    calls and ``_exit``s, so forking from a threaded process is safe."""
    for uid in uids:
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
