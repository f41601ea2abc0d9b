"""safetensors checkpoint directories: slices read from any file, tensors written one at a time.

A directory holds `model.safetensors`, or shards `model-0000K-of-0000N.safetensors` with
`model.safetensors.index.json` ({"weight_map": {name: file}}).

  * `Reader.read(name, index)` reads one slice of one tensor (safetensors' `get_slice`
    over the memory-mapped file), so a process touches only the parts its devices hold.
  * `write(path, entries, values, ...)` lays out every file and its header from the
    tensors' names, shapes and dtypes first, then streams the values in the same order:
    each is written where its header says and dropped before the next is asked for.

The file format: an 8-byte little-endian header length, a JSON header
{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}} padded with
spaces to a multiple of 8, then the tensors' bytes back to back.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import numpy as np
from safetensors import safe_open

INDEX = "model.safetensors.index.json"
_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "int32": "I32", "int64": "I64"}


class Reader:
    """Random access to slices of the tensors of a checkpoint directory."""

    def __init__(self, path: str):
        index = os.path.join(path, INDEX)
        if os.path.exists(index):
            with open(index) as f:
                files = {name: os.path.join(path, fn) for name, fn in json.load(f)["weight_map"].items()}
        else:
            shards = sorted(fn for fn in os.listdir(path) if fn.endswith(".safetensors"))
            if not shards:
                raise FileNotFoundError(f"no *.safetensors files in {path}")
            files = {}
            for fn in shards:
                with safe_open(os.path.join(path, fn), "np") as f:
                    files.update({name: os.path.join(path, fn) for name in f.keys()})
        self.files = files
        self._open = {}

    def names(self) -> set[str]:
        return set(self.files)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """tensor[index] for one slice per dimension; only those bytes are read."""
        return self._handle(name).get_slice(name)[index]

    def _handle(self, name):
        fn = self.files[name]
        if fn not in self._open:
            self._open[fn] = safe_open(fn, "np")
        return self._open[fn]


class Entry(NamedTuple):
    """What `write` needs to know of a tensor before its values exist."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


def _header(entries: Sequence[Entry]) -> bytes:
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for e in entries:
        header[e.name] = {"dtype": _DTYPES[np.dtype(e.dtype).name], "shape": list(e.shape),
                          "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _split(entries: Sequence[Entry], max_file_bytes: int) -> list[list[Entry]]:
    """Consecutive groups, a new one started where the next tensor would pass max_file_bytes."""
    files, current, size = [], [], 0
    for e in entries:
        if current and size + e.nbytes > max_file_bytes:
            files.append(current)
            current, size = [], 0
        current.append(e)
        size += e.nbytes
    return files + [current]


def write(path: str, entries: Sequence[Entry], values: Iterable[np.ndarray], *, max_file_bytes: int) -> None:
    """Writes the tensors `entries` describe into `path`: one file, or files of at most
    max_file_bytes (a tensor larger than that gets a file of its own) with an index.
    `values` yields each tensor's array in the order of `entries`; one is held at a time."""
    files = _split(entries, max_file_bytes)
    names = (["model.safetensors"] if len(files) == 1 else
             [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))])
    values = iter(values)
    for fname, group in zip(names, files):
        with open(os.path.join(path, fname), "wb") as f:
            f.write(_header(group))
            for e in group:
                value = next(values)
                if value.shape != e.shape or value.dtype != e.dtype:
                    raise ValueError(f"tensor {e.name!r} is {value.dtype}{list(value.shape)}, "
                                     f"its header says {np.dtype(e.dtype)}{list(e.shape)}")
                np.ascontiguousarray(value).tofile(f)
                del value  # before the next is made, so that two are never held at once
    if len(files) > 1:
        index = {"metadata": {"total_size": sum(e.nbytes for e in entries)},
                 "weight_map": {e.name: fname for fname, group in zip(names, files) for e in group}}
        with open(os.path.join(path, INDEX), "w") as f:
            json.dump(index, f, indent=2)
