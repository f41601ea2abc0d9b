"""Grouped matmul for the experts: rows sorted by expert, each group times its own weights.

On GPU and TPU this is `jax.lax.ragged_dot` (megablox / Triton grouped GEMM). XLA:CPU
lowers ragged_dot as a dense product against every group, E times the work, so on a CPU
the rows are laid out in fixed-size tiles instead, each tile holding rows of one expert
only (groups padded up to a tile multiple), and the tiles run as one batched matmul
against their experts' weights. Exact, no dropped rows; padding costs at most E - 1 tiles.

Legend: M sorted rows, D in features, F out features, E groups (experts).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


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
        self.tile, self.rows = tile, rows

    def scatter(self, x: jax.Array) -> jax.Array:
        """[M, D] sorted rows -> [num_tiles, tile, D] (padding rows are zero)."""
        out = jnp.zeros((self.num_tiles * self.tile, x.shape[-1]), x.dtype).at[self.dest].set(x)
        return out.reshape(self.num_tiles, self.tile, x.shape[-1])

    def gather(self, y: jax.Array) -> jax.Array:
        """[num_tiles, tile, F] -> [M, F] in sorted-row order."""
        return y.reshape(-1, y.shape[-1])[self.dest]

    def matmul(self, x_tiles: jax.Array, w: jax.Array) -> jax.Array:
        """x_tiles [n, tile, D] times w [E, D, F] of each tile's group -> [n, tile, F]."""
        return jnp.einsum("ntD,nDF->ntF", x_tiles, w[self.tile_group])


DENSE_BELOW_ROWS_PER_EXPERT = 32


def swiglu_experts(x, experts, weights, gate, up, down):
    """sum_x weights[n, x] * down_e(silu(x_n gate_e) * (x_n up_e)) with e = experts[n, x].

    x [N, D]; experts, weights [N, X]; gate, up [E, D, F]; down [E, F, D]. Returns [N, D].
    """
    n, k = experts.shape
    e = gate.shape[0]
    if jax.default_backend() == "cpu" and e <= n * k < DENSE_BELOW_ROWS_PER_EXPERT * e:
        # A few rows per expert (batched decoding): nearly every expert's weights are read
        # anyway, and one dense pass over all of them reads each once, where gathering
        # them per tile copies them. With fewer rows than experts, gathering reads less.
        combine = jnp.zeros((n, e), x.dtype).at[jnp.arange(n)[:, None], experts].add(weights.astype(x.dtype))
        h = jax.nn.silu(jnp.einsum("ND,EDF->NEF", x, gate)) * jnp.einsum("ND,EDF->NEF", x, up)
        return jnp.einsum("NEF,EFD,NE->ND", h, down, combine)

    flat = experts.reshape(-1)  # [N*X] token copies, grouped by expert below
    order = jnp.argsort(flat, stable=True)
    xs = x[order // k]
    sizes = jnp.zeros((e,), jnp.int32).at[flat].add(1)
    if jax.default_backend() != "cpu":
        h = jax.nn.silu(jax.lax.ragged_dot(xs, gate, sizes)) * jax.lax.ragged_dot(xs, up, sizes)
        ys = jax.lax.ragged_dot(h, down, sizes)
    else:
        layout = TiledLayout(sizes, xs.shape[0], tile_size(xs.shape[0], e))
        x_tiles = layout.scatter(xs)
        h = jax.nn.silu(layout.matmul(x_tiles, gate)) * layout.matmul(x_tiles, up)
        ys = layout.gather(layout.matmul(h, down))
    y = jnp.zeros_like(ys).at[order].set(ys).reshape(n, k, -1)  # back to token order
    return jnp.einsum("NXD,NX->ND", y, weights.astype(y.dtype))
