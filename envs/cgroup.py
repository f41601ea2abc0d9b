"""One memory cgroup per sandbox: a cap on the memory of all its processes together.

``RLIMIT_AS`` caps each process's address space, so N processes under a limit of M can
hold N x M between them. A cgroup caps their sum: every command of a ``Sandbox`` joins
the sandbox's group (its child writes its pid to ``cgroup.procs`` before dropping root),
and when the group passes its limit the kernel's OOM killer ends one of its processes
(counted by ``oom_kills``; the command then reports ``killed="memory_limit"``).

Both hierarchies are supported: cgroup v2 where its memory controller can be enabled for
a child of this process's group (or of the hierarchy's root), else v1's memory
controller. ``available()`` says which one works here (None: neither; then the
per-process limits are all there is). The group is made below this process's own group,
so it stays inside whatever limit a container already sets.
"""

from __future__ import annotations

import os
import re
import time
import uuid

_V1_FILES = ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes")
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


def _candidates() -> list[tuple[str, str]]:
    """(version, parent directory) to try, best first."""
    found = []
    for fstype, mount, root, options in _mounts():
        if fstype == "cgroup2":
            own = _inside(mount, root, _own_path(None))
            found += [("v2", own), ("v2", mount)]
    for fstype, mount, root, options in _mounts():
        if fstype == "cgroup" and "memory" in options.split(","):
            own = _inside(mount, root, _own_path("memory"))
            found += [("v1", own), ("v1", mount)]
    return list(dict.fromkeys(found))


def _v2_ready(parent: str) -> bool:
    try:
        with open(os.path.join(parent, "cgroup.subtree_control")) as f:
            if "memory" in f.read().split():
                return True
        with open(os.path.join(parent, "cgroup.controllers")) as f:
            if "memory" not in f.read().split():
                return False
        with open(os.path.join(parent, "cgroup.subtree_control"), "w") as f:
            f.write("+memory")
        return True
    except OSError:
        return False


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


class MemoryGroup:
    """A fresh cgroup under ``parent`` capped at ``limit_bytes`` (swap included where the
    kernel accounts it). ``procs`` is the file a process writes its pid to, to join."""

    def __init__(self, version: str, parent: str, limit_bytes: int):
        self.version, self.limit = version, None
        self.path = os.path.join(parent, f"glmjax-sbx-{uuid.uuid4().hex[:12]}")
        os.mkdir(self.path)
        try:
            if version == "v2" and os.path.exists(os.path.join(self.path, "memory.swap.max")):
                _write(os.path.join(self.path, "memory.swap.max"), "0")
            self.set_limit(limit_bytes)
        except OSError:
            os.rmdir(self.path)
            raise
        self.procs = os.path.join(self.path, "cgroup.procs")

    def set_limit(self, limit_bytes: int) -> None:
        if limit_bytes == self.limit:
            return
        if self.version == "v2":
            _write(os.path.join(self.path, "memory.max"), str(limit_bytes))
        else:  # memsw (memory + swap) may not go below memory, nor memory above memsw: order matters
            names = [n for n in _V1_FILES if os.path.exists(os.path.join(self.path, n))]
            for name in names if self.limit is None or limit_bytes > self.limit else reversed(names):
                _write(os.path.join(self.path, name), str(limit_bytes))
        self.limit = limit_bytes

    def oom_kills(self) -> int:
        """Processes the kernel has killed in this group for passing its limit."""
        name = "memory.events" if self.version == "v2" else "memory.oom_control"
        try:
            with open(os.path.join(self.path, name)) as f:
                found = re.search(r"^oom_kill (\d+)$", f.read(), re.M)
        except OSError:
            return 0
        return int(found.group(1)) if found else 0

    def peak_bytes(self) -> int | None:
        for name in ("memory.peak", "memory.max_usage_in_bytes"):
            try:
                with open(os.path.join(self.path, name)) as f:
                    return int(f.read().split()[0])
            except (OSError, ValueError):
                continue
        return None

    def close(self, wait: float = 2.0) -> None:
        """Remove the group; its processes must be gone (they are killed first by the caller)."""
        deadline = time.monotonic() + wait
        while True:
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)


def available() -> tuple[str, str] | None:
    """(version, parent) of a hierarchy where a capped child group can be made, tried once
    per process (a group is made, capped and removed); None where there is none."""
    global _available
    if _available is _UNSET:
        _available = None
        if os.geteuid() == 0:
            for version, parent in _candidates():
                if version == "v2" and not _v2_ready(parent):
                    continue
                try:
                    MemoryGroup(version, parent, 64 << 20).close()
                except OSError:
                    continue
                _available = (version, parent)
                break
    return _available
