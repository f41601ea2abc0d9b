"""The Pallas implementations of the model's attention ops, under the names and
signatures of the references in `reference.py` (what `ops.get(name, "pallas")` returns).

Each op runs the Triton kernels (interpret mode on a CPU) or, on "tpu" and
"tpu-interpret", their Mosaic versions in `pallas_kernels/tpu/` (see `_backend.py`).
XLA cannot partition a Mosaic kernel, so under a mesh each runs inside `shard_map`: every
device attends for its own rows of the batch (and its own heads, over `tensor`), with the
whole key sequence (the ops' logical axes below, glmjax/sharding.py's rules)."""

from __future__ import annotations

import functools
import importlib

import jax

from pallas_kernels import absorbed_mla, indexer, sparse_mla
from pallas_kernels._backend import MOSAIC, resolve

_Q = ("batch", None, "act_heads", None)  # q_c, q_r [B, T, H, .] and the output o_c
_KEYS = ("batch", None, None)  # c_kv, k_r [B, S, .]; index_k [B, S, I]; topk_idx [B, T, P]
_ROWS = ("batch", None)  # q_pos [B, T]
# op -> (logical axes of each argument, of the result); the indexer's heads stay whole (summed)
LOGICAL_AXES = {
    "mla_attention": ((_Q, _Q, _KEYS, _KEYS, _ROWS), _Q),
    "sparse_mla_attention": ((_Q, _Q, _KEYS, _KEYS, _ROWS, _KEYS), _Q),
    "indexer_topk": ((("batch", None, None, None), _KEYS, _KEYS, _ROWS), _KEYS),
}


def _on_mesh(op, name: str, args, kwargs):
    """op(*args, **kwargs), inside shard_map over the ambient mesh when there is one."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return op(*args, **kwargs)
    from glmjax.sharding import logical_spec

    arg_axes, out_axes = LOGICAL_AXES[name]
    specs = tuple(logical_spec(axes, a.shape, mesh=mesh) for axes, a in zip(arg_axes, args))
    out = jax.eval_shape(lambda *a: op(*a, **kwargs), *args)
    # every argument with a batch dimension is split alike: the batch spec of the first
    batch = specs[0][0]
    specs = tuple(jax.sharding.PartitionSpec(batch, *s[1:]) for s in specs)
    out_spec = logical_spec(out_axes, out.shape, mesh=mesh)
    out_spec = jax.sharding.PartitionSpec(batch, *out_spec[1:])
    return jax.shard_map(lambda *a: op(*a, **kwargs), mesh=mesh, in_specs=specs, out_specs=out_spec,
                         check_vma=False)(*args)


def _dispatch(triton_op, mosaic_module: str, name: str):
    """An op that takes the references' arguments and runs triton_op, or on a Mosaic backend
    `pallas_kernels.tpu.<mosaic_module>.<name>`."""

    @functools.wraps(triton_op)
    def op(*args, backend: str | None = None, **kwargs):
        backend = resolve(backend)
        if backend in MOSAIC:
            mosaic_op = getattr(importlib.import_module(f"pallas_kernels.tpu.{mosaic_module}"), name)
            return _on_mesh(mosaic_op, name, args, dict(kwargs, backend=backend))
        return triton_op(*args, backend=backend, **kwargs)

    return op


OPS = {
    "mla_attention": _dispatch(absorbed_mla.mla_attention, "mla", "mla_attention"),
    "sparse_mla_attention": _dispatch(sparse_mla.sparse_mla_attention, "sparse_mla", "sparse_mla_attention"),
    "indexer_topk": _dispatch(indexer.indexer_topk, "indexer", "indexer_topk"),
}
