"""Expert parallelism: experts split over the devices that store them, routed copies exchanged all-to-all.

The EP group is the mesh axes the sharding rules put on the experts' first dimension
(by default `expert` and `fsdp` together), so each device of the group holds E / n_ep
whole experts [D, F] (a slice of F with a `tensor` axis) exactly as they are stored, and
no call gathers expert weights. Inside `shard_map`, each device holds its tokens (split
over data / fsdp / expert / sequence) and runs (GShard / DeepSeek-V3 dispatch, with
MaxText's ragged exchange):

  1. sort its M = n * X routed copies by expert: by destination device, then by local
     expert; count the copies per (destination, local expert) and all-gather the counts,
     so every device knows the whole [source, destination, local expert] matrix;
  2. fit each destination's receive buffer of R rows: every source keeps min(demand, L)
     copies for it, with the largest level L that fits (max-min fair), dropping the tail
     of its sorted chunk (the overflow contributes zero);
  3. exchange: each source's kept chunk lands at its offset in its destination's buffer
     (`ragged_all_to_all`, which moves only real rows; on XLA:CPU, which lacks it, a padded
     `all_to_all` with the same result);
  4. permute the received rows to local-expert order and run the local experts as one
     grouped matmul over R rows (layers/gmm.py) with their group sizes; partial sums over
     a split F are added with psum over `tensor`;
  5. exchange back into each source's send order, unsort, and sum weight * output per token.

Every reordering is a gather by a permutation whose backward is the gather by its inverse
(`_permute`): no scatter of rows, forward or backward (a TPU scatter of bf16 rows runs on
32-bit copies of its operand). With `chunk_tokens`, a device's tokens go through steps
1-5 in chunks of that many (`lax.map`, each chunk rematerialised in the backward), so the
exchange buffers are those of one chunk: R and M below are per chunk, and the capacity
bounds each chunk's received copies.

R = ceil(c * M) for a capacity factor c (about c times the routed-copy FLOPs, which the
grouped matmul counts by its static row count); c = None sizes R for the worst case
(every copy of the group on one device, R = n_ep * M) and never drops.

Per device, in the activation dtype: the send and return buffers are M x D, the receive
buffer and the experts' output R x D, the experts' gate / up / hidden products R x F_l
each; the counts are n_ep x E int32. XLA:CPU's padded exchange sends and receives
n_ep x min(M, R) x D each way instead.

Legend: N tokens, X experts per token, D hidden, F expert hidden, M = N * X copies,
S source devices, T destination devices (both n_ep), J local experts, R receive rows.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from glmjax import sharding
from glmjax.layers.gmm import platform, swiglu_grouped

TOKEN_AXES = ("data", "fsdp", "expert", "sequence")


def _token_axes(mesh) -> tuple[str, ...]:
    return tuple(a for a in TOKEN_AXES if mesh.shape[a] > 1)


def ep_axes(num_experts: int) -> tuple[str, ...]:
    """The mesh axes the ambient rules split `num_experts` experts over (the EP group), in
    the order of their PartitionSpec; () without a mesh, or when an axis is not a token axis."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or any(a not in mesh.shape for a in sharding.AXES):
        return ()
    spec = sharding.logical_spec(("experts",), (num_experts,), mesh=mesh)[0]
    axes = () if spec is None else (spec,) if isinstance(spec, str) else tuple(spec)
    return axes if all(a in TOKEN_AXES for a in axes) else ()


def enabled(num_experts: int) -> bool:
    """Whether the ambient mesh and rules split the experts over devices that hold distinct tokens."""
    return bool(ep_axes(num_experts))


def receive_rows(copies: int, group: int, capacity_factor: float | None) -> int:
    """R, the rows each device receives and computes, for `copies` routed copies per device
    in an EP group of `group` devices: the worst case group * copies without a factor."""
    worst = group * copies
    return worst if capacity_factor is None else max(1, min(worst, math.ceil(capacity_factor * copies)))


def _exclusive_cumsum(a: jax.Array, axis: int) -> jax.Array:
    return jnp.cumsum(a, axis=axis) - a


def _fair_share(demand: jax.Array, capacity: int) -> jax.Array:
    """demand [S, T] rows each source has for each destination -> kept [S, T] <= demand with
    sum_s kept[s, t] <= capacity: kept = min(demand, L_t), L_t the largest level that fits.

    With the demands of a column sorted, d_(0) <= ... <= d_(S-1), filling every source up to
    d_(i) takes sum_{j<=i} d_(j) + (S-1-i) d_(i) rows; the last d_(i) that fits (or 0) plus
    an equal split of the remaining rows among the S-1-i sources above it is L_t."""
    s = demand.shape[0]
    levels = jnp.concatenate([jnp.zeros_like(demand[:1]), jnp.sort(demand, axis=0)])  # [S+1, T]
    above = s - jnp.arange(s + 1)[:, None]  # sources with demand above levels[i]
    filled = jnp.concatenate([jnp.zeros_like(demand[:1]), jnp.cumsum(levels[1:], axis=0)]) + above * levels
    i = jnp.sum(filled <= capacity, axis=0) - 1  # [T] the last level that fits (levels[0] = 0 always does)
    pick = lambda a: jnp.take_along_axis(a, i[None], axis=0)[0]  # noqa: E731
    spare = (capacity - pick(filled)) // jnp.maximum(pick(above), 1)
    level = pick(levels) + jnp.where(pick(above) > 0, spare, 0)
    return jnp.minimum(demand, level[None])


def _padded_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name):
    """`jax.lax.ragged_all_to_all`'s result through a padded `all_to_all`: every slice is sent
    in a chunk of min(operand rows, output rows) rows (XLA:CPU has no ragged exchange)."""
    chunk = min(operand.shape[0], output.shape[0])
    i = jnp.arange(chunk)
    rows = operand.at[input_offsets[:, None] + i].get(mode="clip")  # [T, C, D]
    send = jnp.where((i < send_sizes[:, None])[..., None], rows, 0)
    recv = jax.lax.all_to_all(send, axis_name, 0, 0)  # [S, C, D]
    at = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)  # [S] where each source's slice lands here
    dest = jnp.where(i < recv_sizes[:, None], at[:, None] + i, output.shape[0])  # out of range: not written
    return output.at[dest.reshape(-1)].set(recv.reshape(-1, recv.shape[-1]), mode="drop")


@jax.custom_vjp
def _permute(x: jax.Array, index: jax.Array, inverse: jax.Array) -> jax.Array:
    """x[index] for a permutation `index` of x's rows, `inverse` its inverse; the backward
    is g[inverse], a gather like the forward (autodiff of x[index] scatter-adds)."""
    return x.at[index].get(mode="promise_in_bounds", unique_indices=True)


def _permute_fwd(x, index, inverse):
    return _permute(x, index, inverse), inverse


def _permute_bwd(inverse, g):
    return g.at[inverse].get(mode="promise_in_bounds", unique_indices=True), None, None


_permute.defvjp(_permute_fwd, _permute_bwd)


def _inverse(index: jax.Array) -> jax.Array:
    """The inverse of a permutation [M] (an int32 scatter of M entries)."""
    return jnp.zeros_like(index).at[index].set(jnp.arange(index.shape[0], dtype=index.dtype))


def _dispatch_compute_combine(x, experts, weights, gate, up, down, *, axes, capacity_factor, ragged, split_hidden,
                              chunk_tokens):
    """Per device: x [n, D], experts / weights [n, X] (expert E marks a padding copy), local
    gate / up [J, D, F_l], down [J, F_l, D] -> (y [n, D], kept [n, X]), in chunks of at
    most `chunk_tokens` tokens (None: one)."""
    n, k = experts.shape
    chunks = 1 if chunk_tokens is None else -(-n // chunk_tokens)
    group = jax.lax.axis_size(axes)
    one = lambda x, ex, w: _exchange(x, ex, w, gate, up, down, axes=axes, ragged=ragged,  # noqa: E731
                                     rows=receive_rows(x.shape[0] * k, group, capacity_factor),
                                     split_hidden=split_hidden)
    if chunks == 1:
        return one(x, experts, weights)
    pad = -n % chunks
    if pad:  # padding copies (expert E) are never sent
        x = jnp.pad(x, ((0, pad), (0, 0)))
        experts = jnp.pad(experts, ((0, pad), (0, 0)), constant_values=gate.shape[0] * group)
        weights = jnp.pad(weights, ((0, pad), (0, 0)))
    split = lambda a: a.reshape(chunks, -1, *a.shape[1:])  # noqa: E731
    y, kept = jax.lax.map(jax.checkpoint(lambda c: one(*c), prevent_cse=False), (split(x), split(experts),
                                                                                split(weights)))
    return y.reshape(-1, y.shape[-1])[:n], kept.reshape(-1, k)[:n]


def _exchange(x, experts, weights, gate, up, down, *, axes, rows, ragged, split_hidden):
    """Steps 1-5 for one chunk: x [n, D], experts / weights [n, X] -> (y [n, D], kept [n, X])."""
    exchange = jax.lax.ragged_all_to_all if ragged else _padded_ragged_all_to_all
    n_ep, me = jax.lax.axis_size(axes), jax.lax.axis_index(axes)
    j_local = gate.shape[0]
    n, k = experts.shape
    d = x.shape[-1]
    flat = experts.reshape(-1)  # [M] global expert of each copy
    # 1. copies by (destination, local expert); padding copies (expert E) last, never sent
    order = jnp.argsort(flat, stable=True)
    inv_order = _inverse(order)
    send = _permute(jnp.repeat(x, k, axis=0), order, inv_order)  # [M, D]
    counts = jnp.zeros((n_ep * j_local,), jnp.int32).at[flat].add(1, mode="drop").reshape(n_ep, j_local)  # [T, J]
    all_counts = jax.lax.all_gather(counts, axes)  # [S, T, J]
    demand = all_counts.sum(-1)  # [S, T]
    # 2. what fits in each destination's R rows, and where it goes
    kept = _fair_share(demand, rows)  # [S, T]
    send_start = _exclusive_cumsum(demand, axis=1)  # [S, T] a chunk's offset in its source's send buffer
    recv_start = _exclusive_cumsum(kept, axis=0)  # [S, T] a chunk's offset in its destination's receive buffer
    # 3. exchange
    recv = exchange(send, jnp.zeros((rows, d), x.dtype), send_start[me], kept[me], recv_start[me], kept[:, me],
                    axis_name=axes)  # [R, D]
    # 4. received rows by local expert: the chunks arrive source-major, each sorted by local expert
    mine = all_counts[:, me]  # [S, J]
    kept_by_expert = jnp.clip(kept[:, me, None] - _exclusive_cumsum(mine, axis=1), 0, mine)  # [S, J]
    block = jnp.searchsorted(jnp.cumsum(kept_by_expert.reshape(-1)), jnp.arange(rows), side="right")  # [R]
    local = jnp.where(block < n_ep * j_local, block % j_local, j_local)  # j_local: an empty row
    perm = jnp.argsort(local, stable=True)
    inv_perm = _inverse(perm)
    y_sorted = swiglu_grouped(_permute(recv, perm, inv_perm), kept_by_expert.sum(0), gate, up, down)  # [R, D]
    if split_hidden:
        y_sorted = jax.lax.psum(y_sorted, "tensor")
    y_recv = _permute(y_sorted, inv_perm, perm)
    # 5. back to each source, at the offsets it sent from; dropped copies stay zero
    back = exchange(y_recv, jnp.zeros((n * k, d), y_recv.dtype), recv_start[:, me], kept[:, me], send_start[:, me],
                    kept[me], axis_name=axes)  # [M, D] in send order
    copies = _permute(back, inv_order, order).reshape(n, k, d)
    dest = jnp.minimum(flat[order] // j_local, n_ep - 1)
    sent = (flat[order] < n_ep * j_local) & (jnp.arange(n * k) - send_start[me][dest] < kept[me][dest])
    kept_copy = jnp.zeros((n * k,), bool).at[order].set(sent).reshape(n, k)
    return jnp.einsum("NXD,NX->ND", copies, weights.astype(copies.dtype)), kept_copy


def experts_forward(x, experts, weights, gate, up, down, *, capacity_factor=None, chunk_tokens=None):
    """x [N, D], experts / weights [N, X], gate / up [E, D, F], down [E, F, D] ->
    (y [N, D], kept [N, X]: False for a copy dropped by the capacity), computed with the
    experts split over the ambient mesh's EP group (`ep_axes`), each device's tokens in
    chunks of at most `chunk_tokens` (None: all at once).

    N need not divide over the token axes (a decode step of a few rows, a prefill of one
    sequence): the tokens are padded to a multiple with copies that are never sent."""
    mesh = jax.sharding.get_abstract_mesh()
    e = gate.shape[0]
    axes = ep_axes(e)
    if not axes:
        raise ValueError(f"expert parallelism needs a mesh whose rules split the {e} experts over token axes "
                         f"{TOKEN_AXES}; found mesh {dict(mesh.shape)} with experts split over none")
    tokens_axes = _token_axes(mesh)
    n, pad = x.shape[0], -x.shape[0] % math.prod(mesh.shape[a] for a in tokens_axes)
    if pad:
        x = jnp.pad(x, ((0, pad), (0, 0)))
        experts = jnp.pad(experts, ((0, pad), (0, 0)), constant_values=e)
        weights = jnp.pad(weights, ((0, pad), (0, 0)))
    tokens = P(tokens_axes or None, None)
    f = gate.shape[-1]
    split_hidden = mesh.shape["tensor"] > 1 and f % mesh.shape["tensor"] == 0
    hidden = "tensor" if split_hidden else None
    owner = axes[0] if len(axes) == 1 else axes
    fn = jax.shard_map(
        lambda *a: _dispatch_compute_combine(
            *a, axes=axes, capacity_factor=capacity_factor, ragged=platform() != "cpu", split_hidden=split_hidden,
            chunk_tokens=chunk_tokens),
        in_specs=(tokens, tokens, tokens, P(owner, None, hidden), P(owner, None, hidden), P(owner, hidden, None)),
        out_specs=(tokens, tokens),
        check_vma=False,
    )
    y, kept = fn(x, experts, weights, gate, up, down)
    return y[:n], kept[:n]
