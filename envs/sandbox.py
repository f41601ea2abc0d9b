"""Isolated command execution: a private directory, resource limits, no network.

What is enforced, and how (``probe()`` says which of these this machine allows):

- **Own user.** As root, each ``Sandbox`` claims a dedicated numeric uid (from
  ``UID_BASE``, claimed with an ``flock`` so concurrent processes never share one) and
  every command drops to it (``setgroups([])``, ``setgid``, ``setuid``) after
  ``PR_SET_NO_NEW_PRIVS``. Because the uid is private to the sandbox, ``RLIMIT_NPROC``
  (ignored for root, counted per uid) caps this sandbox's processes only: a fork bomb
  stops at ``Limits.processes`` and cannot touch other tasks.
- **Resource limits** (``setrlimit`` in the child): CPU seconds, address space
  (``RLIMIT_AS``: a 10 GB allocation fails with ENOMEM), processes, file size (SIGXFSZ),
  open files; no core files.
- **Processes and wall clock.** Every command runs in its own session and, where the
  kernel allows (``processes="pidns"``), as PID 1 of its own PID namespace: when it exits
  the kernel kills and reaps everything it left behind, so no orphan or zombie outlives
  it or counts against the next command's process limit, and ``/proc`` shows only the
  sandbox's processes. At the deadline every process of the sandbox uid gets SIGKILL
  (``kill -9 -1`` run as that uid: it also reaches processes that left the group with
  ``setsid``); without a PID namespace (``"kill-sweep"``) the process group is killed
  too and the same sweep runs after every command. Files persist between commands,
  processes do not.
- **Output cap.** stdout and stderr are read together; past ``Limits.output_bytes`` the
  command is killed and the output kept so far is returned (``killed="output_limit"``).
- **No network.** A new network namespace (``unshare(CLONE_NEWNET)``) whose only
  interface is its own loopback: the host's listeners, even on 127.0.0.1, are
  unreachable. Where the kernel refuses the namespace, ``Sandbox`` refuses to run unless
  the caller passes ``network="host"`` explicitly.
- **Filesystem** (``filesystem="chroot"``, the default where a mount namespace is
  allowed): each command gets a new mount namespace and a chroot whose root is a
  read-only tmpfs holding read-only, nosuid bind mounts of ``/usr /etc /opt /var`` (and
  ``/bin /lib ...`` where they are directories), a minimal ``/dev`` (null, zero, full,
  random, urandom, a private ``/dev/shm``), ``/proc`` with ``hidepid`` (a sandbox sees
  only its own processes), and the sandbox's own directories at the paths tasks expect:
  ``/app`` (the working directory), ``/logs`` (``/logs/verifier`` for the verifier),
  ``/tmp``, ``/tests`` and ``/solution`` (filled when the tests or the oracle run).
  Nothing outside the sandbox
  directory is writable or even visible besides the system directories.
  ``filesystem="plain"`` (the fallback without mount namespaces): the same uid and
  limits, ``cwd`` is the host directory, and writes are confined by permissions only:
  the sandbox uid owns nothing outside its directory, but world-writable directories
  (``/tmp``, ``/var/tmp``, ``/dev/shm``) stay writable and world-readable files
  readable. Virtual paths (``/app`` ...) are then the host paths that ``path()``
  returns, and scripts are rewritten with ``rewrite()``.
- **Memory of all processes together** (``Isolation.memory``): each sandbox has its own
  memory cgroup (``envs/cgroup.py``, v2 or v1) capped at ``Limits.memory_bytes``; every
  command joins it before it drops root, and a command whose processes pass the cap
  between them is killed by the kernel (``killed="memory_limit"``). Without a cgroup
  (not root, or no memory controller) only ``RLIMIT_AS`` holds: ``processes`` x
  ``memory_bytes`` is the bound, and ``describe()`` says ``memory=per-process``.
- **Tools.** ``/glmjax`` holds what a task image would have installed
  (``envs/host_tools.py``): ``python3``/``python`` (the host interpreter, with pytest),
  ``pytest``, and stand-ins for ``apt-get``, ``pip``, ``uv`` and ``uvx`` that resolve
  installs against the host; its ``bin/`` is first on PATH. The host interpreter's
  prefix is mounted read-only at its own path so that it runs inside the chroot.
- **Environment.** Commands see only ``PATH``, ``HOME=/tmp``, ``TMPDIR=/tmp``, a UTF-8
  locale, ``PYTHONDONTWRITEBYTECODE=1``, ``PYTHONHASHSEED=0``, ``APP_DIR``, ``LOGS_DIR``,
  ``TEST_DIR`` and what the caller passes.
- **Any tree.** ``snapshot``, ``reset_dir`` and ``close`` walk and remove directories
  through directory descriptors (``envs/tree.py``): a tree thousands of levels deep, or
  with paths past ``PATH_MAX``, is hashed and removed like any other, and ``close``
  releases the sandbox's uid even when a step before it fails.

Commands are forked by small helper processes (``envs/launcher.py``), never by the caller:
a fork's cost grows with the forking process's memory, and a multithreaded process (a
trainer running JAX) must not run a ``preexec_fn`` in a forked child.

Not enforced: total disk use inside the sandbox directory (``RLIMIT_FSIZE`` caps each
file), and total memory where no cgroup can be made (above). Without root there is no
dedicated uid, so the process limit counts all of the user's processes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import resource
import signal
import stat
import subprocess
import sys
import tempfile
import threading
from typing import Mapping

from envs import cgroup, host_tools, launcher, tree
from envs.isolation import VIRTUAL_DIRS, Isolation, Plan, claim_uid

__all__ = ["Isolation", "Limits", "RunResult", "Sandbox", "SandboxError", "VIRTUAL_DIRS", "probe"]
TOOLS = "/glmjax"  # where the tool directory (envs/host_tools.py) is mounted under chroot
_SYSTEM_TOPS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/opt", "/var")
_PROBED: Isolation | None = None
_TOOL_DIR: str | None = None
_LOCK = threading.Lock()


def probe() -> Isolation:
    """The strongest isolation this machine allows, as the helpers that fork the commands
    find it (``envs/launcher.py``), with the memory cgroup this process can make (tried
    once per process, cached)."""
    global _PROBED
    with _LOCK:
        if _PROBED is None:
            found = launcher.call("probe")
            memory = cgroup.available() if found.user == "dedicated-uid" else None
            _PROBED = dataclasses.replace(found, memory=f"cgroup-{memory[0]}" if memory else "per-process")
        return _PROBED


def tool_dir() -> str:
    """The host directory a sandbox mounts at ``TOOLS`` (``envs/host_tools.py`` builds
    it), made once per machine for this interpreter and this version of the tools."""
    global _TOOL_DIR
    with _LOCK:
        if _TOOL_DIR is None:
            with open(host_tools.__file__, "rb") as f:
                key = hashlib.sha256(f.read() + sys.executable.encode()).hexdigest()[:16]
            final = os.path.join(tempfile.gettempdir(), f"glmjax-tools-{key}")
            if not os.path.isdir(final):
                staging = tempfile.mkdtemp(prefix=f"glmjax-tools-{key}.")
                host_tools.build(staging)
                os.chmod(staging, 0o755)
                try:
                    os.rename(staging, final)
                except OSError:  # another process made it first
                    tree.rmtree(staging)
            _TOOL_DIR = final
        return _TOOL_DIR


def _interpreter_binds() -> tuple[tuple[str, str], ...]:
    """The host interpreter's prefixes, mounted at their own paths so that the tools'
    ``python3`` runs inside the chroot (those under a system directory are there already)."""
    dirs = dict.fromkeys(os.path.realpath(p) for p in (sys.base_prefix, sys.prefix))
    return tuple((d, d) for d in dirs
                 if not d.startswith(_SYSTEM_TOPS) and not d.startswith(tuple(v + "/" for v in VIRTUAL_DIRS)))


def kill_uid(uid: int) -> None:
    """SIGKILL every process of ``uid`` (from a helper process)."""
    launcher.call("kill_uid", uid=uid)


class SandboxError(RuntimeError):
    """The sandbox cannot run commands with the isolation that was asked for."""


@dataclasses.dataclass(frozen=True)
class Limits:
    """Per-command limits. ``memory_bytes`` caps the memory of all the sandbox's processes
    together where a cgroup is available (``Isolation.memory``) and each process's address
    space everywhere; without a cgroup, ``processes`` x ``memory_bytes`` is the bound."""

    wall_seconds: float = 30.0
    cpu_seconds: int = 30
    memory_bytes: int = 2 << 30
    processes: int = 64
    file_bytes: int = 64 << 20
    open_files: int = 256
    output_bytes: int = 256 << 10

    def __post_init__(self):
        for field in dataclasses.fields(self):
            if getattr(self, field.name) <= 0:
                raise ValueError(f"Limits.{field.name} must be > 0, got {getattr(self, field.name)!r}")

    def replace(self, **changes) -> "Limits":
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class RunResult:
    """One command. ``killed``: None | "timeout" | "output_limit" | "memory_limit" (the
    sandbox's cgroup passed its limit and the kernel killed a process); ``signal``: the signal
    that ended the command (SIGXCPU/SIGKILL for CPU, SIGXFSZ for file size) or None."""

    returncode: int
    output: str
    seconds: float
    killed: str | None = None
    truncated: bool = False

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.killed is None

    @property
    def signal(self) -> str | None:
        return signal.Signals(-self.returncode).name if self.returncode < 0 else None

    def summary(self, timing: bool = True) -> str:
        why = self.killed or self.signal or f"exit {self.returncode}"
        return f"[{why}{f', {self.seconds:.2f}s' if timing else ''}{', output truncated' if self.truncated else ''}]"


class Sandbox:
    """A private directory tree in which commands run isolated (see the module docstring).

    ``Sandbox(network="none", filesystem="auto")``: network "none" requires a network
    namespace (``SandboxError`` where there is none), "host" allows the host network;
    filesystem "auto" picks "chroot" where allowed, else "plain". The directory is made
    under ``base_dir`` (default ``$GLMJAX_SANDBOX_DIR``, else the system temp dir) and
    removed by ``close()`` (or leaving the ``with`` block) unless ``keep=True``.
    ``isolation`` says what this sandbox actually has.
    """

    def __init__(self, *, limits: Limits = Limits(), network: str = "none", filesystem: str = "auto",
                 base_dir: str | None = None, keep: bool = False):
        if network not in ("none", "host"):
            raise ValueError(f"network must be 'none' or 'host', got {network!r}")
        if filesystem not in ("auto", "chroot", "plain"):
            raise ValueError(f"filesystem must be 'auto', 'chroot' or 'plain', got {filesystem!r}")
        avail = probe()
        if network == "none" and avail.network != "netns":
            raise SandboxError("no network namespace on this machine (" + "; ".join(avail.notes)
                               + "); pass network='host' to run commands with the host's network")
        if filesystem == "chroot" and avail.filesystem != "chroot":
            raise SandboxError("mount namespaces are refused here; use filesystem='plain' or 'auto'")
        self.filesystem = avail.filesystem if filesystem == "auto" else filesystem
        self.limits, self.keep = limits, keep
        self.isolation = Isolation("netns" if network == "none" else "host", self.filesystem, avail.user,
                                   avail.processes, memory=avail.memory)
        self._closed, self.memory, self.root = True, None, None
        self.uid, self._lock_fd = claim_uid() if avail.user == "dedicated-uid" else (None, None)
        try:
            if self.uid is not None:
                kill_uid(self.uid)  # leftovers of a crashed earlier holder
            if avail.memory != "per-process":
                self.memory = cgroup.MemoryGroup(*cgroup.available(), limits.memory_bytes)
            self.root = tempfile.mkdtemp(prefix="glmjax-sbx-", dir=base_dir or os.environ.get("GLMJAX_SANDBOX_DIR"))
            os.chmod(self.root, 0o711)
            os.mkdir(os.path.join(self.root, ".root"))
            for virtual in VIRTUAL_DIRS:
                self.reset_dir(virtual)
            self.reset_dir("/logs/verifier")
            self.reset_dir("/logs/agent")
        except BaseException:
            self._closed = False
            self.close()
            raise
        self.tools = TOOLS if self.filesystem == "chroot" else tool_dir()
        self._binds = ((tool_dir(), TOOLS),) + _interpreter_binds() if self.filesystem == "chroot" else ()
        self._closed = False

    # ----- paths -----------------------------------------------------------------------
    def host_path(self, virtual: str) -> str:
        """Where a virtual path (``/app/x``, ``/logs/verifier``) lives on the host."""
        for top in VIRTUAL_DIRS:
            if virtual == top or virtual.startswith(top + "/"):
                return os.path.join(self.root, virtual[1:])
        raise ValueError(f"{virtual!r} is not under one of the sandbox directories {VIRTUAL_DIRS}")

    def path(self, virtual: str) -> str:
        """The path commands must use for ``virtual``: itself under chroot, else the host path."""
        return virtual if self.filesystem == "chroot" else self.host_path(virtual)

    def rewrite(self, script: str) -> str:
        """``script`` with the virtual directories replaced by ``path()`` (identity under chroot)."""
        if self.filesystem == "chroot":
            return script
        pattern = r"(?<![\w./-])(" + "|".join(map(re.escape, VIRTUAL_DIRS)) + r")(?=[/\s\"'`;:)|&<>]|$)"
        return re.sub(pattern, lambda m: self.host_path(m.group(1)), script)

    def _owner(self, virtual: str) -> int | None:
        return None if virtual == "/logs" else self.uid

    def _safe(self, virtual: str) -> str:
        """The host path of ``virtual``, refusing one that a symlink leads out of the sandbox."""
        host, top = self.host_path(virtual), os.path.realpath(self.root)
        if not os.path.realpath(host).startswith(top + os.sep):
            raise SandboxError(f"{virtual!r} resolves outside the sandbox")
        return host

    # ----- files (host side, as the caller) ----------------------------------------------
    def reset_dir(self, virtual: str) -> None:
        """Make ``virtual`` an empty directory (symlinks are removed, never followed),
        the sandbox uid's with mode 0700 (``/logs`` itself stays root's, so that
        ``/logs/verifier`` cannot be replaced): other sandboxes cannot look in."""
        host = self.host_path(virtual)
        tree.rmtree(host)
        os.makedirs(host, mode=0o755)
        if self.uid is not None and self._owner(virtual) is not None:
            os.chown(host, self.uid, self.uid)
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
            top = self.host_path("/" + virtual.strip("/").split("/")[0])
            for path in [host] + [d for d in _parents(parent, top)]:
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
        (any depth: ``envs/tree.py``)."""
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

    def run(self, command: str, *, limits: Limits | None = None, cwd: str = "/app",
            env: Mapping[str, str] | None = None, stdin: str | None = None) -> RunResult:
        """Run ``command`` with ``bash -c`` in the sandbox; never raises for what the command does."""
        if self._closed:
            raise SandboxError("this sandbox is closed")
        limits = limits or self.limits
        chroot = self.filesystem == "chroot"
        rlimits = [(resource.RLIMIT_CPU, limits.cpu_seconds), (resource.RLIMIT_AS, limits.memory_bytes),
                   (resource.RLIMIT_FSIZE, limits.file_bytes), (resource.RLIMIT_NOFILE, limits.open_files),
                   (resource.RLIMIT_CORE, 0)]
        if self.uid is not None:  # root ignores RLIMIT_NPROC; the sandbox uid does not
            rlimits.append((resource.RLIMIT_NPROC, limits.processes))
        plan = Plan(root=self.root, uid=self.uid, network_ns=self.isolation.network == "netns", chroot=chroot,
                    pid_ns=self.isolation.processes == "pidns", rlimits=rlimits,
                    cwd=cwd if chroot else self.host_path(cwd), binds=self._binds, cgroup_procs=self.memory.procs if self.memory else None)
        oom_kills = 0
        if self.memory is not None:
            self.memory.set_limit(limits.memory_bytes)
            oom_kills = self.memory.oom_kills()
        try:
            returncode, output, killed, truncated, seconds = launcher.call(
                "run", argv=["/bin/bash", "-c", command], env=self.env(env), plan=plan,
                stdin=stdin.encode() if stdin else None, wall_seconds=limits.wall_seconds,
                output_bytes=limits.output_bytes)
        except (subprocess.SubprocessError, launcher.HelperDied) as err:
            raise SandboxError(f"could not start a sandboxed command ({self.isolation.describe()}): {err}") from err
        if killed is None and self.memory is not None and self.memory.oom_kills() > oom_kills:
            killed = "memory_limit"
        return RunResult(returncode, output.decode("utf-8", errors="replace"), seconds, killed, truncated)

    # ----- lifetime ----------------------------------------------------------------------------
    def close(self) -> None:
        """Kill what is left, remove the memory group and the directory (any depth), and
        release the uid, which happens even when a step before it fails."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.uid is not None:
                kill_uid(self.uid)
            if self.memory is not None:
                self.memory.close()
            if not self.keep and self.root is not None:
                tree.rmtree(self.root)
        finally:
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: best effort only
            pass


def _parents(path: str, top: str):
    """``path`` and its parents up to (excluding) ``top``."""
    path, top = os.path.normpath(path), os.path.normpath(top)
    while path.startswith(top + os.sep):
        yield path
        path = os.path.dirname(path)
