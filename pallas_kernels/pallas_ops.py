"""The Pallas implementations of the model's attention ops, under the names and
signatures of the references in `reference.py` (what `ops.get(name, "pallas")` returns).

Each op runs the Triton kernels (interpret mode on a CPU) or, on "tpu" and
"tpu-interpret", their Mosaic versions in `pallas_kernels/tpu/` (see `_backend.py`)."""

from __future__ import annotations

import functools
import importlib

from pallas_kernels import absorbed_mla, indexer, sparse_mla
from pallas_kernels._backend import MOSAIC, resolve

def _dispatch(triton_op, mosaic_module: str, name: str):
    """An op that takes the references' arguments and runs triton_op, or on a Mosaic backend
    `pallas_kernels.tpu.<mosaic_module>.<name>`."""

    @functools.wraps(triton_op)
    def op(*args, backend: str | None = None, **kwargs):
        backend = resolve(backend)
        if backend in MOSAIC:
            mosaic_op = getattr(importlib.import_module(f"pallas_kernels.tpu.{mosaic_module}"), name)
            return mosaic_op(*args, backend=backend, **kwargs)
        return triton_op(*args, backend=backend, **kwargs)

    return op


OPS = {
    "mla_attention": _dispatch(absorbed_mla.mla_attention, "mla", "mla_attention"),
    "sparse_mla_attention": _dispatch(sparse_mla.sparse_mla_attention, "sparse_mla", "sparse_mla_attention"),
    "indexer_topk": _dispatch(indexer.indexer_topk, "indexer", "indexer_topk"),
}
