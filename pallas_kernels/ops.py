"""Dispatch of the attention ops: `kernel_impl="xla"` runs the jnp references (the CPU
default); `"pallas"` runs the Pallas kernels (interpret mode on a CPU)."""

from __future__ import annotations

from pallas_kernels import reference

_XLA = {
    "mla_attention": reference.mla_attention,
    "sparse_mla_attention": reference.sparse_mla_attention,
    "indexer_topk": reference.indexer_topk,
}


def _pallas_ops():
    from pallas_kernels import pallas_ops  # imported lazily: Pallas is only needed when asked for

    return pallas_ops.OPS


def get(name: str, kernel_impl: str):
    """The op `name` for an implementation: "xla" or "pallas"."""
    if kernel_impl == "xla":
        return _XLA[name]
    if kernel_impl == "pallas":
        return _pallas_ops()[name]
    raise ValueError(f"kernel_impl={kernel_impl!r} is invalid: expected 'xla' or 'pallas'")
