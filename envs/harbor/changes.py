"""What a run changed in a sandbox's working directory, and states that apply only part of it.

The unfinished check (``envs/harbor/validate.py``) needs runs that stopped partway. Cutting the
oracle script between statements finds them only when it has several statements; most
real oracles are one command (``python3 /solution/solve.py``) or one here-document. The
oracle's *effect* on the file system gives unfinished states for any oracle:

1. ``listing`` before and after the oracle; ``diff`` gives the change: files written
   (with their new bytes and mode), directories made, symlinks made, paths removed.
2. The changed paths are ordered by when they last changed (``st_ctime``: a write, a
   ``chmod`` or the rename that put them in place); changes within one timestamp tick form
   one group, and the last group is the write that completed the work.
3. ``partial_states`` derives runs that stopped before it: *without the last write*
   (every earlier change applied), *the last write cut short* (every file of the last
   group truncated to half of its text, trailing whitespace aside) and, with four or more
   groups, *halfway* (the first half of the groups). A state equal to the untouched
   directory (the no-op check's) is left out.

``apply`` reproduces a state in a fresh, prepared sandbox (host side, as the owner of the
sandbox's files), for the verifier to score.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import posixpath
import stat

from envs.sandbox import tree

MAX_BYTES = 64 << 20  # changes larger than this are not copied out for probes


@dataclasses.dataclass(frozen=True)
class Node:
    kind: str  # "file" | "dir" | "link"
    mode: int
    digest: str  # sha256 of a file's bytes, a link's target, "" for a directory
    ctime_ns: int


@dataclasses.dataclass(frozen=True)
class Op:
    """One change: ``kind`` "write" (``data``, ``mode``) | "mkdir" | "symlink" (``data``: the
    target) | "remove"."""

    path: str
    kind: str
    data: bytes = b""
    mode: int = 0o644


def listing(top: str) -> dict[str, Node]:
    """Every entry below the host directory ``top``."""
    out = {}
    for entry in tree.walk(top):
        st = entry.stat
        if stat.S_ISREG(st.st_mode):
            node = Node("file", st.st_mode & 0o7777, hashlib.sha256(entry.read()).hexdigest(), st.st_ctime_ns)
        elif stat.S_ISDIR(st.st_mode):
            node = Node("dir", st.st_mode & 0o7777, "", st.st_ctime_ns)
        elif stat.S_ISLNK(st.st_mode):
            node = Node("link", 0, os.readlink(entry.name, dir_fd=entry.dir_fd), st.st_ctime_ns)
        else:
            continue
        out[entry.path] = node
    return out


def digest(nodes: dict[str, Node]) -> str:
    """A hash of a listing: two directories with the same paths, types, modes and
    contents have the same digest."""
    h = hashlib.sha256()
    for path, node in sorted(nodes.items()):
        h.update(f"{path}\0{node.kind}\0{node.mode}\0{node.digest}\0".encode())
    return h.hexdigest()


@dataclasses.dataclass
class Changes:
    """``groups``: the changes in the order they happened (see the module docstring)."""

    groups: list[list[Op]]
    too_large: bool = False

    @property
    def ops(self) -> list[Op]:
        return [op for g in self.groups for op in g]

    def partial_states(self) -> list[tuple[str, list[Op], list[str]]]:
        """(name, the ops that make the state, the paths it leaves out or cuts short)."""
        if not self.groups or self.too_large:
            return []
        *earlier, last = self.groups
        states = []
        before = [op for g in earlier for op in g]
        missing = lambda ops: sorted({op.path for op in ops if op.kind != "mkdir"})  # noqa: E731
        if any(op.kind != "mkdir" for op in before):
            states.append(("without the last write", before, missing(last)))
        cut = [_truncated(op) for op in last]
        if any(c is not op for c, op in zip(cut, last)):
            states.append(("the last write cut short", before + cut,
                           sorted(op.path for c, op in zip(cut, last) if c is not op)))
        if len(self.groups) >= 4:
            half = len(self.groups) // 2
            states.append(("halfway", [op for g in self.groups[:half] for op in g],
                           missing([op for g in self.groups[half:] for op in g])))
        return states


def _truncated(op: Op) -> Op:
    if op.kind != "write":
        return op
    text = op.data.rstrip()
    if not text:
        return op
    return dataclasses.replace(op, data=text[: len(text) // 2])


def diff(before: dict[str, Node], after: dict[str, Node], top: str) -> Changes:
    """The change from ``before`` to ``after`` (listings of the host directory ``top``,
    whose current contents are ``after``'s)."""
    timed: list[tuple[int, Op]] = []
    size = 0
    for path, node in after.items():
        old = before.get(path)
        if old is not None and (old.kind, old.mode, old.digest) == (node.kind, node.mode, node.digest):
            continue
        if node.kind == "dir":
            timed.append((-1, Op(path, "mkdir", mode=node.mode)))  # made as needed, before anything in them
            continue
        if node.kind == "link":
            timed.append((node.ctime_ns, Op(path, "symlink", node.digest.encode())))
            continue
        data = tree.read_path(top, path)
        size += len(data)
        if size > MAX_BYTES:
            return Changes([], too_large=True)
        timed.append((node.ctime_ns, Op(path, "write", data, node.mode)))
    for path in before.keys() - after.keys():
        if posixpath.dirname(path) in before.keys() - after.keys():
            continue  # inside a removed directory
        parent = after.get(posixpath.dirname(path))
        timed.append((parent.ctime_ns if parent else 0, Op(path, "remove")))
    timed.sort(key=lambda t: (t[0], t[1].path))
    groups: list[list[Op]] = []
    last = None
    for when, op in timed:
        if when != last or not groups:
            groups.append([])
            last = when
        groups[-1].append(op)
    if groups and all(op.kind == "mkdir" for op in groups[0]) and len(groups) > 1:
        groups[1] = groups[0] + groups[1]
        groups = groups[1:]
    return Changes(groups)


def apply(sandbox, ops: list[Op], virtual: str = "/app") -> None:
    """Make ``ops`` happen in ``sandbox`` below ``virtual`` (a prepared, untouched sandbox)."""
    top = sandbox.host_path(virtual)
    for op in ops:
        target = f"{virtual}/{op.path}"
        if op.kind == "remove":
            tree.rmtree(sandbox.host_path(target))
        elif op.kind == "mkdir":
            os.makedirs(sandbox.host_path(target), exist_ok=True)
            _own(sandbox, top, op.path)
            os.chmod(sandbox.host_path(target), op.mode & 0o7777)
        elif op.kind == "symlink":
            host = sandbox.host_path(target)
            os.makedirs(os.path.dirname(host), exist_ok=True)
            if os.path.lexists(host):
                tree.rmtree(host)
            os.symlink(op.data.decode(), host)
            _own(sandbox, top, op.path)
        else:
            sandbox.write_file(target, op.data, mode=op.mode & 0o7777)


def _own(sandbox, top: str, path: str) -> None:
    if sandbox.uid is None:
        return
    parts = path.split("/")
    for i in range(1, len(parts) + 1):
        os.lchown(os.path.join(top, *parts[:i]), sandbox.uid, sandbox.uid)
