"""What a fetch from the registries did (``Report``), and the machine's cache of what was
fetched, shared by ``envs/image/pypi.py`` and ``envs/image/debian.py``.

The cache, ``$GLMJAX_CACHE/packages`` (default ``~/.cache/glmjax/packages``), is kept across
tasks: downloads (wheels, Debian archives) and each package unpacked once (``once``),
copied into every layer that needs it (``lay``), which is much cheaper than unpacking it
again. Builds run in parallel: each part of the cache is written under a lock (``locked``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import shutil
import subprocess


@dataclasses.dataclass
class Report:
    """What one call did: ``installed`` ("name version" put into the layer), ``notes`` (every
    deviation from what was asked), ``missing`` (what could not be had, each naming the
    package and why)."""

    installed: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    missing: list[str] = dataclasses.field(default_factory=list)

    def add(self, other: Report) -> Report:
        self.installed += other.installed
        self.notes += other.notes
        self.missing += other.missing
        return self


def cache_dir() -> str:
    root = os.environ.get("GLMJAX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "glmjax")
    return os.path.join(root, "packages")


@contextlib.contextmanager
def locked(directory: str):
    """One process at a time fetches into a cache directory (builds run in parallel)."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield directory


def once(path: str, make) -> str:
    """``path``, made by ``make(staging)`` the first time (an unpacked package, kept for every
    later layer: copying it is much cheaper than unpacking it again)."""
    if not os.path.isdir(path):
        staging = path + ".partial"
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
        make(staging)
        os.rename(staging, path)
    return path


def lay(tree: str, layer: str) -> None:
    """Copy ``tree`` over ``layer`` (the directories they share merged)."""
    os.makedirs(layer, exist_ok=True)
    subprocess.run(["cp", "-a", "--reflink=auto", f"{tree}/.", f"{layer}/"], check=True, capture_output=True)


def last_error(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith(("ERROR:", "E:"))]
    return (errors or lines or ["no output"])[0 if errors else -1].removeprefix("ERROR: ").removeprefix("E: ")


def read_text(path: str) -> str | None:
    """A text file's contents, or None where it cannot be read."""
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None
