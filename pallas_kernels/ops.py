"""Dispatch of the attention ops: `kernel_impl="xla"` runs the jnp references (the CPU
default); `"pallas"` runs the Pallas kernels: interpret mode on a CPU, Triton on a GPU
(see `_backend.py`). Both sets share names and signatures, so a model switches with
`ModelConfig.kernel_impl` (or `from_pretrained(..., kernel_impl=...)`) alone."""

from __future__ import annotations

from pallas_kernels import reference

_XLA = {
    "mla_attention": reference.mla_attention,
    "sparse_mla_attention": reference.sparse_mla_attention,
    "indexer_topk": reference.indexer_topk,
}


def _pallas_ops():
    from pallas_kernels import (
        pallas_ops,  # imported lazily: Pallas is only needed when asked for
    )

    return pallas_ops.OPS


def get(name: str, kernel_impl: str):
    """The op `name` for an implementation: "xla" or "pallas"."""
    if kernel_impl == "xla":
        table = _XLA
    elif kernel_impl == "pallas":
        table = _pallas_ops()
    else:
        raise ValueError(f"kernel_impl={kernel_impl!r} is invalid: expected 'xla' or 'pallas'")
    if name not in table:
        raise KeyError(f"no op {name!r}: expected one of {sorted(table)}")
    return table[name]
