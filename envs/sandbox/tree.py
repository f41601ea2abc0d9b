"""Directory trees of any depth: walk, hash, read and remove them through directory fds.

A sandboxed agent controls the shape of its working directory; a tree 1,100 levels deep
makes Python 3.11's ``os.walk`` and ``shutil.rmtree`` (both recursive) raise
``RecursionError``, and its paths pass ``PATH_MAX`` (4,096 bytes), so no call that takes
a whole path can reach its bottom. Everything here is iterative and works one level at a
time with ``dir_fd`` calls, never following a symlink: memory grows with the depth, stack
and open descriptors do not (at most ``_OPEN`` directories are held open; an ancestor
closed on the way down is reopened through ``..`` on the way up and checked to be the
same directory).
"""

from __future__ import annotations

import dataclasses
import os
import stat
from typing import Iterator

_OPEN = 64
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclasses.dataclass
class Entry:
    """One entry below the top: ``path`` relative to it ("a/b/c"), its ``lstat``, and the
    open directory that holds it with its name there (valid until the walk moves on)."""

    path: str
    stat: os.stat_result
    dir_fd: int
    name: str

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.stat.st_mode)

    def read(self, limit: int | None = None) -> bytes:
        fd = os.open(self.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=self.dir_fd)
        with os.fdopen(fd, "rb") as f:
            return f.read() if limit is None else f.read(limit)


@dataclasses.dataclass
class _Level:
    fd: int | None
    names: list[str]
    prefix: str
    ident: tuple[int, int]
    name: str = ""  # this directory's name in its parent


def walk(top: str, *, bottom_up: bool = False) -> Iterator[Entry]:
    """Every entry below ``top`` (not ``top`` itself), names sorted, parents before their
    contents (or, ``bottom_up``, each directory after its contents)."""
    fd = os.open(top, _DIR_FLAGS)
    st = os.fstat(fd)
    stack = [_Level(fd, sorted(os.listdir(fd), reverse=True), "", (st.st_dev, st.st_ino))]
    try:
        while stack:
            level = stack[-1]
            if not level.names:
                stack.pop()
                if stack:
                    parent = stack[-1]
                    if parent.fd is None:
                        parent.fd = _reopen_parent(level.fd, parent.ident)
                    if bottom_up:
                        yield Entry(parent.prefix + level.name, os.stat(level.name, dir_fd=parent.fd,
                                                                           follow_symlinks=False),
                                    parent.fd, level.name)
                os.close(level.fd)
                continue
            name = level.names.pop()
            st = os.stat(name, dir_fd=level.fd, follow_symlinks=False)
            entry = Entry(level.prefix + name, st, level.fd, name)
            if not stat.S_ISDIR(st.st_mode):
                yield entry
                continue
            if not bottom_up:
                yield entry
            child = os.open(name, _DIR_FLAGS, dir_fd=level.fd)
            stack.append(_Level(child, sorted(os.listdir(child), reverse=True), entry.path + "/",
                                (st.st_dev, st.st_ino), name))
            if len(stack) > _OPEN and stack[-_OPEN - 1].fd is not None:
                os.close(stack[-_OPEN - 1].fd)
                stack[-_OPEN - 1].fd = None
    finally:
        for level in stack:
            if level.fd is not None:
                os.close(level.fd)


def _reopen_parent(child_fd: int, ident: tuple[int, int]) -> int:
    fd = os.open("..", _DIR_FLAGS, dir_fd=child_fd)
    st = os.fstat(fd)
    if (st.st_dev, st.st_ino) != ident:
        os.close(fd)
        raise OSError(f"a directory was moved while its tree was walked (expected inode {ident})")
    return fd


def rmtree(path: str) -> None:
    """Remove ``path`` and everything below it; a missing path is fine. Directories made
    unreadable (mode 0) by their owner are opened up first when the caller is not root."""
    if not os.path.lexists(path):
        return
    if os.path.islink(path) or not os.path.isdir(path):
        os.unlink(path)
        return
    _open_up(path)
    for entry in walk(path, bottom_up=True):
        if entry.is_dir:
            os.rmdir(entry.name, dir_fd=entry.dir_fd)
        else:
            os.unlink(entry.name, dir_fd=entry.dir_fd)
    os.rmdir(path)


def _open_up(path: str) -> None:
    if os.geteuid() == 0:
        return
    os.chmod(path, 0o700)
    for entry in walk(path):
        if entry.is_dir and entry.stat.st_mode & 0o700 != 0o700:
            os.chmod(entry.name, 0o700, dir_fd=entry.dir_fd)


def files(top: str) -> Iterator[Entry]:
    """The regular files below ``top``."""
    return (e for e in walk(top) if stat.S_ISREG(e.stat.st_mode))


def read_tree(top: str) -> dict[str, bytes]:
    """Every regular file below ``top`` by relative path (``{}`` when ``top`` is not a directory)."""
    if not os.path.isdir(top):
        return {}
    return {e.path: e.read() for e in files(top)}


def read_path(top: str, path: str) -> bytes:
    """The file ``path`` (relative, "a/b/c") below ``top``, opened one directory at a time
    and never through a symlink, so any depth reads."""
    fd = os.open(top, _DIR_FLAGS)
    try:
        *parents, leaf = path.split("/")
        for part in parents:
            nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = nxt
        with os.fdopen(os.open(leaf, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd), "rb") as f:
            return f.read()
    finally:
        os.close(fd)
