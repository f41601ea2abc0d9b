"""The attention ops the layers call: `pallas_kernels.ops` by `ModelConfig.kernel_impl`,
and under a mesh the Pallas ones inside `shard_map`.

XLA cannot partition a Pallas call (Triton or Mosaic), so under a mesh each runs per
device: every device attends for its own rows of the batch (and its own heads, over
`tensor`) with the whole key sequence, by the ops' logical axes below and the ambient
rules (glmjax/sharding.py). The jnp references ("xla") are partitioned by XLA itself.
"""

from __future__ import annotations

import functools

import jax
from jax.sharding import PartitionSpec as P

from glmjax.sharding import logical_spec
from pallas_kernels import ops

_Q = ("batch", None, "act_heads", None)  # q_c, q_r [B, T, H, .] and the output o_c
_KEYS = ("batch", None, None)  # c_kv, k_r [B, S, .]; index_k [B, S, I]; topk_idx [B, T, P]
_ROWS = ("batch", None)  # q_pos [B, T]
# op -> (logical axes of each argument, of the result); the indexer's heads stay whole (summed)
LOGICAL_AXES = {
    "mla_attention": ((_Q, _Q, _KEYS, _KEYS, _ROWS), _Q),
    "sparse_mla_attention": ((_Q, _Q, _KEYS, _KEYS, _ROWS, _KEYS), _Q),
    "indexer_topk": ((("batch", None, None, None), _KEYS, _KEYS, _ROWS), _KEYS),
}


def _on_mesh(name: str, op, *args, **kwargs):
    """op(*args, **kwargs), inside shard_map over the ambient mesh when there is one."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return op(*args, **kwargs)
    arg_axes, out_axes = LOGICAL_AXES[name]
    specs = tuple(logical_spec(axes, a.shape, mesh=mesh) for axes, a in zip(arg_axes, args))
    out = jax.eval_shape(lambda *a: op(*a, **kwargs), *args)
    # every argument with a batch dimension is split alike: the batch spec of the first
    batch = specs[0][0]
    specs = tuple(P(batch, *s[1:]) for s in specs)
    out_spec = logical_spec(out_axes, out.shape, mesh=mesh)
    out_spec = P(batch, *out_spec[1:])
    return jax.shard_map(lambda *a: op(*a, **kwargs), mesh=mesh, in_specs=specs, out_specs=out_spec,
                         check_vma=False)(*args)


def get(name: str, kernel_impl: str):
    """The op `name` for an implementation (pallas_kernels.ops.get), partitioned per device
    under a mesh when it is a Pallas kernel."""
    op = ops.get(name, kernel_impl)
    return op if kernel_impl == "xla" else functools.partial(_on_mesh, name, op)
