"""One cgroup per sandbox: a cap on the memory of all its processes together, and a CPU quota.

``RLIMIT_AS`` caps each process's address space, so N processes under a limit of M can
hold N x M between them; ``RLIMIT_CPU`` caps each process's CPU seconds, so N spinning
processes take N cores. A cgroup caps their sum: every command of a ``Sandbox`` joins the
sandbox's group (its child writes its pid to ``cgroup.procs`` before dropping root). When
the group passes its memory limit the kernel's OOM killer ends one of its processes
(counted by ``oom_kills``; the command then reports ``killed="memory_limit"``); its
processes together get at most ``cpus`` cores of CPU time per period (the CFS quota;
``throttled`` counts the periods in which they were held back).

Both hierarchies are supported, per controller: cgroup v2 where the controller can be
enabled for a child of this process's group (or of the hierarchy's root), else v1's
controller of that name (v1 mounts each controller as a hierarchy of its own, so a
sandbox may have a memory group and a cpu group, and its commands join both).
``available()`` says which works here for each controller (None: neither; then the
per-process limits are all there is). A group is made below this process's own group, so
it stays inside whatever limit a container already sets.
"""

from __future__ import annotations

import os
import re
import time
import uuid

CONTROLLERS = ("memory", "cpu")
PERIOD_US = 100_000
_V1_MEMORY_FILES = ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes")
_UNSET = object()
_available = _UNSET


def _mounts() -> list[tuple[str, str, str, str]]:
    """(fstype, mount point, root within the hierarchy, super options) of each cgroup mount."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, tail = left.split(), right.split()
            if tail and tail[0] in ("cgroup", "cgroup2"):
                out.append((tail[0], fields[4], fields[3], tail[2] if len(tail) > 2 else ""))
    return out


def _own_path(controller: str | None) -> str:
    """This process's group in the hierarchy of ``controller`` (None: the v2 hierarchy)."""
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, names, path = line.rstrip("\n").split(":", 2)
            if (controller is None and names == "") or (controller and controller in names.split(",")):
                return path
    return "/"


def _inside(mount: str, root: str, path: str) -> str:
    rel = os.path.relpath(path, root) if path.startswith(root) else "."
    return os.path.normpath(os.path.join(mount, rel))


def _candidates(controller: str) -> list[tuple[str, str]]:
    """(version, parent directory) to try for ``controller``, best first."""
    found = []
    for fstype, mount, root, options in _mounts():
        if fstype == "cgroup2":
            own = _inside(mount, root, _own_path(None))
            found += [("v2", own), ("v2", mount)]
    for fstype, mount, root, options in _mounts():
        if fstype == "cgroup" and controller in options.split(","):
            own = _inside(mount, root, _own_path(controller))
            found += [("v1", own), ("v1", mount)]
    return list(dict.fromkeys(found))


def _v2_ready(parent: str, controller: str) -> bool:
    try:
        with open(os.path.join(parent, "cgroup.subtree_control")) as f:
            if controller in f.read().split():
                return True
        with open(os.path.join(parent, "cgroup.controllers")) as f:
            if controller not in f.read().split():
                return False
        with open(os.path.join(parent, "cgroup.subtree_control"), "w") as f:
            f.write(f"+{controller}")
        return True
    except OSError:
        return False


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


class Group:
    """A sandbox's fresh groups, called ``name``: ``memory`` and ``cpu`` are each a
    (version, parent) from ``available()`` or None. Memory is capped at ``memory_bytes`` (swap included where the
    kernel accounts it), CPU at ``cpus`` cores. ``procs`` are the files a process writes
    its pid to, to join (one under v2, one per controller under v1)."""

    def __init__(self, *, memory: tuple[str, str] | None, cpu: tuple[str, str] | None, memory_bytes: int,
                 cpus: float, name: str | None = None):
        name = name or f"glmjax-sbx-{uuid.uuid4().hex[:12]}"
        self.paths: dict[str, tuple[str, str]] = {}  # controller -> (version, group directory)
        self.memory_limit = self.cpu_limit = None
        made: list[str] = []
        try:
            for controller, where in (("memory", memory), ("cpu", cpu)):
                if where is None:
                    continue
                version, parent = where
                path = os.path.join(parent, name)
                if path not in made:
                    os.mkdir(path)
                    made.append(path)
                self.paths[controller] = (version, path)
            swap = self._file("memory", "memory.swap.max")
            if memory and memory[0] == "v2" and os.path.exists(swap):
                _write(swap, "0")
            self.set_limits(memory_bytes, cpus)
        except OSError:
            for path in reversed(made):
                os.rmdir(path)
            raise
        self.procs = tuple(os.path.join(p, "cgroup.procs") for p in made)

    def _file(self, controller: str, name: str) -> str | None:
        return os.path.join(self.paths[controller][1], name) if controller in self.paths else None

    def set_limits(self, memory_bytes: int, cpus: float) -> None:
        if "memory" in self.paths and memory_bytes != self.memory_limit:
            version, path = self.paths["memory"]
            if version == "v2":
                _write(os.path.join(path, "memory.max"), str(memory_bytes))
            else:  # memsw (memory + swap) may not go below memory, nor memory above memsw: order matters
                names = [n for n in _V1_MEMORY_FILES if os.path.exists(os.path.join(path, n))]
                up = self.memory_limit is not None and memory_bytes > self.memory_limit  # a new group's are unlimited
                for name in reversed(names) if up else names:
                    _write(os.path.join(path, name), str(memory_bytes))
            self.memory_limit = memory_bytes
        if "cpu" in self.paths and cpus != self.cpu_limit:
            version, path = self.paths["cpu"]
            quota = max(int(cpus * PERIOD_US), 1000)
            if version == "v2":
                _write(os.path.join(path, "cpu.max"), f"{quota} {PERIOD_US}")
            else:
                _write(os.path.join(path, "cpu.cfs_period_us"), str(PERIOD_US))
                _write(os.path.join(path, "cpu.cfs_quota_us"), str(quota))
            self.cpu_limit = cpus

    def oom_kills(self) -> int:
        """Processes the kernel has killed in this group for passing its memory limit."""
        if "memory" not in self.paths:
            return 0
        version, path = self.paths["memory"]
        text = _read(os.path.join(path, "memory.events" if version == "v2" else "memory.oom_control")) or ""
        found = re.search(r"^oom_kill (\d+)$", text, re.M)
        return int(found.group(1)) if found else 0

    def usage_bytes(self) -> int | None:
        """The memory the group holds now: its processes' and the pages charged to it
        (tmpfs files, shared memory) that outlive them."""
        for name in ("memory.current", "memory.usage_in_bytes"):
            text = _read(self._file("memory", name) or "")
            if text:
                return int(text.split()[0])
        return None

    def peak_bytes(self) -> int | None:
        for name in ("memory.peak", "memory.max_usage_in_bytes"):
            text = _read(self._file("memory", name) or "")
            if text:
                return int(text.split()[0])
        return None

    def throttled(self) -> int:
        """CFS periods in which the group's processes had used their CPU quota and waited."""
        text = _read(self._file("cpu", "cpu.stat") or "") or ""
        found = re.search(r"^nr_throttled (\d+)$", text, re.M)
        return int(found.group(1)) if found else 0

    def close(self, wait: float = 2.0) -> None:
        """Remove the groups; their processes must be gone (they are killed first by the caller)."""
        deadline = time.monotonic() + wait
        for path in dict.fromkeys(p for _, p in self.paths.values()):
            _rmdir_by(path, deadline)


def remove(name: str, wait: float = 2.0) -> None:
    """Remove the groups called ``name`` that a killed process left, wherever ``available()``
    makes groups; their processes must be gone, or be exiting (killed by the caller) within
    ``wait`` seconds."""
    deadline = time.monotonic() + wait
    for where in dict.fromkeys(w for w in available().values() if w):
        _rmdir_by(os.path.join(where[1], name), deadline)


def _rmdir_by(path: str, deadline: float) -> None:
    """Remove the group at ``path`` (gone already is fine), retrying while its last
    processes exit, until ``deadline``."""
    while True:
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def available() -> dict[str, tuple[str, str] | None]:
    """For each of ``CONTROLLERS``, (version, parent) of a hierarchy where a limited child
    group can be made, or None; tried once per process (a group is made, limited and removed)."""
    global _available
    if _available is _UNSET:
        _available = dict.fromkeys(CONTROLLERS)
        if os.geteuid() == 0:
            for controller in CONTROLLERS:
                for version, parent in _candidates(controller):
                    if version == "v2" and not _v2_ready(parent, controller):
                        continue
                    chosen = [w for w in _available.values() if w and w[0] == "v2"]
                    if version == "v2" and chosen and chosen[0][1] != parent:
                        continue  # a process is in one v2 group only: all v2 controllers share the sandbox's
                    try:
                        where = {"memory": None, "cpu": None, controller: (version, parent)}
                        Group(**where, memory_bytes=64 << 20, cpus=1.0).close()
                    except OSError:
                        continue
                    _available[controller] = (version, parent)
                    break
    return _available
