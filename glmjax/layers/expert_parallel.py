"""Expert parallelism: experts split over the mesh's `expert` axis, tokens exchanged all-to-all.

Inside `shard_map`, each device holds its tokens (split over data / fsdp / expert /
sequence) and E / n_ep experts (and, with a `tensor` axis, a slice of their hidden F):

  1. each routed copy of a local token goes to the device that owns its expert: copies
     are packed into a send buffer [n_ep, capacity, D], in order, with local expert ids;
  2. all_to_all over `expert` delivers every device the rows for its experts;
  3. the local experts run as one grouped matmul (layers/gmm.py), partial sums over a
     split F are added with psum over `tensor`;
  4. all_to_all back, and each token sums its X results times its routing weights.

With `capacity_factor=None` (the default) the capacity is every local copy, so no token
is dropped whatever the routing; a capacity factor c bounds the buffer at
c * copies / n_ep per destination and drops the overflow (the copy contributes zero).
The exchange is the padded `all_to_all`, which every backend runs (XLA:CPU has no
`ragged_all_to_all`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from glmjax.layers.gmm import swiglu_experts

TOKEN_AXES = ("data", "fsdp", "expert", "sequence")


def _token_axes(mesh) -> tuple[str, ...]:
    return tuple(a for a in TOKEN_AXES if mesh.shape[a] > 1)


def enabled(num_experts: int) -> bool:
    """Whether the ambient mesh splits the experts evenly over its `expert` axis."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or "expert" not in mesh.shape or mesh.shape["expert"] == 1:
        return False
    return num_experts % mesh.shape["expert"] == 0


def _dispatch_compute_combine(x, experts, weights, gate, up, down, *, capacity_factor, split_hidden):
    """Per device: x [n, D], experts / weights [n, X], local gate/up [E_l, D, F_l], down [E_l, F_l, D]."""
    n_ep = jax.lax.axis_size("expert")
    e_local = gate.shape[0]
    n, k = experts.shape
    m = n * k
    flat_e = experts.reshape(-1)
    dest = flat_e // e_local  # owner device of each copy  [M]
    rank = jnp.cumsum(jax.nn.one_hot(dest, n_ep, dtype=jnp.int32), axis=0) - 1
    pos = jnp.take_along_axis(rank, dest[:, None], axis=1)[:, 0]  # order among copies to the same owner
    cap = m if capacity_factor is None else max(1, math.ceil(m / n_ep * capacity_factor))
    keep = pos < cap
    slot = jnp.where(keep, dest * cap + pos, n_ep * cap)  # out of range: dropped

    send_x = jnp.zeros((n_ep * cap, x.shape[-1]), x.dtype).at[slot].set(x[jnp.arange(m) // k], mode="drop")
    send_e = jnp.full((n_ep * cap,), -1, jnp.int32).at[slot].set(flat_e % e_local, mode="drop")
    exchange = lambda a: jax.lax.all_to_all(a.reshape(n_ep, cap, *a.shape[1:]), "expert", 0, 0)  # noqa: E731
    recv_x, recv_e = exchange(send_x), exchange(send_e)

    rows, ids = recv_x.reshape(-1, x.shape[-1]), recv_e.reshape(-1)
    valid = ids >= 0
    y = swiglu_experts(rows, jnp.where(valid, ids, 0)[:, None], valid[:, None].astype(rows.dtype), gate, up, down)
    if split_hidden:
        y = jax.lax.psum(y, "tensor")
    back = exchange(y).reshape(n_ep * cap, -1)
    copies = jnp.where(keep[:, None], back[jnp.minimum(slot, n_ep * cap - 1)], 0)  # [M, D]
    return jnp.einsum("NXD,NX->ND", copies.reshape(n, k, -1), weights.astype(copies.dtype))


def experts_forward(x, experts, weights, gate, up, down, *, capacity_factor=None):
    """x [N, D], experts / weights [N, X], gate / up [E, D, F], down [E, F, D] -> [N, D],
    computed with experts split over the ambient mesh's `expert` axis.

    N need not divide over the token axes (a decode step of a few rows, a prefill of one
    sequence): the tokens are padded to a multiple with rows of routing weight 0, which
    come last on their device, so that a capacity bound drops them before any real copy."""
    mesh = jax.sharding.get_abstract_mesh()
    axes = _token_axes(mesh)
    n, pad = x.shape[0], -x.shape[0] % math.prod(mesh.shape[a] for a in axes)
    if pad:
        e = gate.shape[0]
        fill = jnp.arange(pad * experts.shape[1], dtype=experts.dtype).reshape(pad, -1) % e  # spread over experts
        x = jnp.pad(x, ((0, pad), (0, 0)))
        experts = jnp.concatenate([experts, fill])
        weights = jnp.pad(weights, ((0, pad), (0, 0)))
    tokens = P(axes or None, None)
    f = gate.shape[-1]
    split_hidden = mesh.shape["tensor"] > 1 and f % mesh.shape["tensor"] == 0
    hidden = "tensor" if split_hidden else None
    fn = jax.shard_map(
        lambda *a: _dispatch_compute_combine(*a, capacity_factor=capacity_factor, split_hidden=split_hidden),
        in_specs=(tokens, tokens, tokens, P("expert", None, hidden), P("expert", None, hidden),
                  P("expert", hidden, None)),
        out_specs=tokens,
        check_vma=False,
    )
    return fn(x, experts, weights, gate, up, down)[:n]
