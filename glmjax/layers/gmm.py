"""Grouped matmul for the experts: rows sorted by expert, each group times its own weights.

On GPU and TPU this is `jax.lax.ragged_dot` (megablox / Triton grouped GEMM). XLA:CPU
lowers ragged_dot as a dense product against every group, E times the work, so on a CPU
the rows are laid out in fixed-size tiles instead, each tile holding rows of one expert
only (groups padded up to a tile multiple), and each tile is multiplied by its expert's
weights. Exact, no dropped rows; padding costs at most E - 1 tiles, and tiles past the
last group are skipped (the loop) or give zeros (the batched matmul).

Small tiles run in a loop, large ones in one batched matmul. Batching the tiles needs
their weights gathered into [tiles, D, F] first, a copy of D * F per tile beside its
t * D * F products: it costs more than the products themselves when a group holds few
rows (decoding), and little once tiles hold BATCHED_TILE rows or more (prefill, training),
where the loop's thousands of small ops (a cond and a rematerialised body per tile in the
backward pass) cost more instead. A dense pass over all experts reads each weight once
but does E / X times the work. In the loop each tile reads its expert's weights once,
straight from the parameter.

Legend: M sorted rows, D in features, F out features, E groups (experts), n tiles, t rows
per tile.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.reference import jit_when_eager


BATCHED_TILE = 32  # rows per tile from which the tiles run as one batched matmul


def tile_size(rows: int, groups: int) -> int:
    """Rows per tile: about the mean group size, a power of two in [1, 128]."""
    mean = max(rows // max(groups, 1), 1)
    return int(min(128, 1 << (mean.bit_length() - 1)))


class TiledLayout:
    """Where each sorted row goes in the tiled layout, computed once per routing and shared
    by the three expert matmuls."""

    def __init__(self, group_sizes: jax.Array, rows: int, tile: int):
        groups = group_sizes.shape[0]
        padded = (group_sizes + tile - 1) // tile * tile
        start = jnp.cumsum(group_sizes) - group_sizes  # first sorted row of each group
        pad_end = jnp.cumsum(padded)
        pad_start = pad_end - padded
        group_of_row = jnp.repeat(jnp.arange(groups), group_sizes, total_repeat_length=rows)
        self.dest = (pad_start[group_of_row] + jnp.arange(rows) - start[group_of_row]).astype(jnp.int32)
        self.num_tiles = -(-(rows + groups * (tile - 1)) // tile)  # static upper bound
        tile_starts = jnp.arange(self.num_tiles) * tile
        self.tile_group = jnp.minimum(jnp.searchsorted(pad_end, tile_starts, side="right"), groups - 1)
        self.tile_used = tile_starts < pad_end[-1]  # [n] False for the tiles past the last group
        self.tile, self.rows = tile, rows

    def scatter(self, x: jax.Array) -> jax.Array:
        """[M, D] sorted rows -> [num_tiles, tile, D] (padding rows are zero)."""
        out = jnp.zeros((self.num_tiles * self.tile, x.shape[-1]), x.dtype).at[self.dest].set(x)
        return out.reshape(self.num_tiles, self.tile, x.shape[-1])

    def gather(self, y: jax.Array) -> jax.Array:
        """[num_tiles, tile, F] -> [M, F] in sorted-row order."""
        return y.reshape(-1, y.shape[-1])[self.dest]


def _swiglu_tiles(layout: TiledLayout, x_tiles, gate, up, down):
    """x_tiles [n, t, D] -> [n, t, D]: tile i through expert tile_group[i], one tile at a
    time, its weights converted to x's dtype there (so stored bf16 or quantized weights
    are read at their own size). Each step is rematerialised in the backward pass, so
    nothing per tile is kept but its input; the weight gradients accumulate in place."""

    @jax.checkpoint
    def one(x, e, used):  # x [t, D]
        def run(x):
            w = lambda p: p[e].astype(x.dtype)  # noqa: E731
            h = jax.nn.silu(jnp.einsum("tD,DF->tF", x, w(gate))) * jnp.einsum("tD,DF->tF", x, w(up))
            return jnp.einsum("tF,FD->tD", h, w(down))

        return jax.lax.cond(used, run, jnp.zeros_like, x)

    _, y = jax.lax.scan(lambda _, xs: (None, one(*xs)), None, (x_tiles, layout.tile_group, layout.tile_used))
    return y


def _swiglu_batched(layout: TiledLayout, x_tiles, gate, up, down):
    """x_tiles [n, t, D] -> [n, t, D]: every tile at once, each against its expert's
    weights gathered to [n, D, F] (padding tiles hold zeros and give zeros)."""
    w = lambda p: p[layout.tile_group].astype(x_tiles.dtype)  # noqa: E731
    h = jax.nn.silu(jnp.einsum("ntD,nDF->ntF", x_tiles, w(gate))) * jnp.einsum("ntD,nDF->ntF", x_tiles, w(up))
    return jnp.einsum("ntF,nFD->ntD", h, w(down))


@jit_when_eager  # an eager call compiles the tile scan once per shape, not at every call
def swiglu_experts(x, experts, weights, gate, up, down):
    """sum_x weights[n, x] * down_e(silu(x_n gate_e) * (x_n up_e)) with e = experts[n, x].

    x [N, D]; experts, weights [N, X]; gate, up [E, D, F]; down [E, F, D], in any stored
    dtype (or anything with `[e]` and `.astype`, such as rl/quant.py's Quantized); the
    products run in x's dtype. Returns [N, D].
    """
    n, k = experts.shape
    e = gate.shape[0]
    flat = experts.reshape(-1)  # [N*X] token copies, grouped by expert below
    order = jnp.argsort(flat, stable=True)
    xs = x[order // k]
    sizes = jnp.zeros((e,), jnp.int32).at[flat].add(1)
    if jax.default_backend() != "cpu":
        gate, up, down = (w.astype(x.dtype) for w in (gate, up, down))
        h = jax.nn.silu(jax.lax.ragged_dot(xs, gate, sizes)) * jax.lax.ragged_dot(xs, up, sizes)
        ys = jax.lax.ragged_dot(h, down, sizes)
    else:
        tile = tile_size(xs.shape[0], e)
        batched = tile >= BATCHED_TILE and all(isinstance(w, jax.Array) for w in (gate, up, down))
        run = _swiglu_batched if batched else _swiglu_tiles
        layout = TiledLayout(sizes, xs.shape[0], tile)
        ys = layout.gather(run(layout, layout.scatter(xs), gate, up, down))
    y = jnp.zeros_like(ys).at[order].set(ys).reshape(n, k, -1)  # back to token order
    return jnp.einsum("NXD,NX->ND", y, weights.astype(y.dtype))
