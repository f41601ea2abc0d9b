"""Where a job's files live: local directories or object stores (gs://, s3://), through
etils.epath, which reaches Cloud Storage with the machine's own credentials.

    run = storage.path("gs://bucket/glm53-sao")          # an epath.Path: run / "summary.json"
    storage.write_text(run / "summary.json", text)
    with storage.reading(run / "base") as local:         # a local directory to read
        model = glmjax.from_pretrained(local)
    with storage.writing(run / "export" / "final") as local:   # written here, uploaded on exit
        glmjax.save_pretrained(model, local)
    log = storage.AppendLog(run / "metrics.jsonl")        # appended locally, uploaded by flush()

Local paths pass through untouched: no copies, the same files as before. A remote
directory is copied whole to a local temporary directory to be read (safetensors and
tokenizers read files), and a directory to be written is written locally and uploaded
file by file once complete, so that a reader never sees half of it; an object store has
no append, so a log is kept locally and uploaded whole at each flush. Orbax checkpoints
take the epath as it is: orbax writes arrays to gs:// through TensorStore itself.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator

from etils import epath

SCHEMES = ("gs://", "s3://", "az://")


def is_remote(p) -> bool:
    """Whether `p` names an object store (gs://, s3://, az://) rather than a local path."""
    return str(p).startswith(SCHEMES)


def path(p) -> epath.Path:
    """`p` as an epath.Path: a local path made absolute, a URI as given."""
    return epath.Path(p) if is_remote(p) else epath.Path(os.path.abspath(os.fspath(p)))


def makedirs(p) -> epath.Path:
    out = path(p)
    out.mkdir(parents=True, exist_ok=True)
    return out


def exists(p) -> bool:
    return path(p).exists()


def write_text(p, text: str) -> None:
    target = path(p)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)


def read_text(p) -> str:
    return path(p).read_text()


def set_aside(p) -> str:
    """Renames `p` (a file or directory that does not read) to `<p>.corrupt` (`.corrupt-2`,
    ... if taken), keeping it for inspection; returns the new name. A remote directory is
    copied to the new name and removed (object stores rename object by object)."""
    src = path(p)
    dst, n = epath.Path(f"{src}.corrupt"), 1
    while dst.exists():
        n += 1
        dst = epath.Path(f"{src}.corrupt-{n}")
    if is_remote(src) and src.is_dir():
        _copy_tree(src, dst)
        src.rmtree()
    else:
        src.rename(dst)
    return str(dst)


def _copy_tree(src: epath.Path, dst: epath.Path) -> None:
    """Every file under `src` to the same place under `dst`; config.json last, so that a
    checkpoint directory is loadable only once whole."""
    files = sorted(_files(src), key=lambda item: item.name == "config.json")
    for item in files:
        target = dst / item.relative_to(src)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(item.read_bytes())


def _files(root: epath.Path) -> list[epath.Path]:
    """Every file under `root`, one listing per directory (epath refuses `**` on object stores)."""
    out = []
    for item in root.iterdir():
        out.extend(_files(item) if item.is_dir() else [item])
    return out


@contextlib.contextmanager
def reading(p) -> Iterator[str]:
    """A local directory holding `p`'s files: `p` itself, or a temporary copy of a remote one."""
    if not is_remote(p):
        yield os.fspath(p)
        return
    with tempfile.TemporaryDirectory(prefix="glmjax-read-") as local:
        _copy_tree(path(p), epath.Path(local))
        yield local


@contextlib.contextmanager
def writing(p) -> Iterator[str]:
    """A local directory whose files end up in `p`: `p` itself (created), or a temporary
    directory uploaded to the remote `p` once the block completes (nothing on an error)."""
    if not is_remote(p):
        os.makedirs(p, exist_ok=True)
        yield os.fspath(p)
        return
    with tempfile.TemporaryDirectory(prefix="glmjax-write-") as local:
        yield local
        _copy_tree(epath.Path(local), path(p))


_FETCHED: dict[str, tempfile.TemporaryDirectory] = {}


def fetched(p) -> str:
    """A local path holding `p` (a file or a directory) for the rest of the process: `p`
    itself, or a copy of a remote one made once (task directories whose files the
    environments read while the job runs)."""
    if not is_remote(p):
        return os.fspath(p)
    key = str(p)
    if key not in _FETCHED:
        _FETCHED[key] = tempfile.TemporaryDirectory(prefix="glmjax-fetched-")
        source = path(p)
        target = epath.Path(_FETCHED[key].name) / source.name
        if source.is_dir():
            _copy_tree(source, target)
        else:
            target.write_bytes(source.read_bytes())
    return os.path.join(_FETCHED[key].name, path(p).name)


class AppendLog:
    """A text file appended line by line: `p` itself when local; for a remote `p` a local
    copy (its earlier lines first, so that a resumed run appends) uploaded whole by
    `flush()`."""

    def __init__(self, p):
        self.remote = path(p) if is_remote(p) else None
        if self.remote is None:
            os.makedirs(os.path.dirname(os.path.abspath(p)), exist_ok=True)
            self.local, self._tmp = os.fspath(p), None
        else:
            self._tmp = tempfile.TemporaryDirectory(prefix="glmjax-log-")
            self.local = os.path.join(self._tmp.name, self.remote.name)
            if self.remote.exists():
                shutil.copyfileobj(self.remote.open("rb"), open(self.local, "wb"))
        self.file = open(self.local, "a")

    def write(self, text: str) -> None:
        self.file.write(text)

    def flush(self) -> None:
        self.file.flush()
        if self.remote is not None:
            self.remote.parent.mkdir(parents=True, exist_ok=True)
            self.remote.write_bytes(open(self.local, "rb").read())

    def close(self) -> None:
        self.flush()
        self.file.close()
        if self._tmp is not None:
            self._tmp.cleanup()


class MirroredDir:
    """A directory written by a library that needs a local path (tensorboardX's event
    files): `local` is `p` itself, or for a remote `p` a temporary directory copied up by
    `sync()`."""

    def __init__(self, p):
        self.remote = path(p) if is_remote(p) else None
        self._tmp = tempfile.TemporaryDirectory(prefix="glmjax-mirror-") if self.remote is not None else None
        self.local = self._tmp.name if self._tmp is not None else os.fspath(p)

    def sync(self) -> None:
        if self.remote is not None:
            _copy_tree(epath.Path(self.local), self.remote)

    def close(self) -> None:
        self.sync()
        if self._tmp is not None:
            self._tmp.cleanup()
