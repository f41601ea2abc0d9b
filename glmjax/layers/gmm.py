"""Grouped matmul for the experts: rows sorted by expert, each group times its own weights.

One implementation per platform (`SWIGLU_GROUPED`), chosen by the platform of the ambient
mesh's devices (the default backend without a mesh), so a program compiled on a CPU host
for a TPU mesh gets the TPU's:

- TPU: megablox (`jax.experimental.pallas.ops.tpu.megablox`), `gmm` for the products and
  the input gradients, `tgmm` for the weight gradients. Its Pallas cost estimate is 2 M K N
  for each of the three, which XLA:TPU's cost analysis then reports; XLA's own count of a
  `ragged_dot`'s weight gradient is E times that. The rows are padded to the row tile.
- GPU: `jax.lax.ragged_dot`.
- CPU: XLA:CPU lowers ragged_dot as a dense product against every group, E times the
  work, so the rows are laid out in fixed-size tiles instead, each tile holding rows of
  one expert only (groups padded up to a tile multiple), and each tile is multiplied by
  its expert's weights. Exact, no dropped rows; padding costs at most E - 1 tiles.

On a CPU, the forward runs the tiles in a loop: each tile takes its own expert's weights
(a dynamic slice, which XLA:CPU copies before the matmul), and tiles past the last group
are skipped. The backward runs every tile at once, its weights
gathered to [tiles, D, F] and the weight gradients summed back per expert: there the loop
would rematerialise each tile under a cond, thousands of small ops, while the batched
products' gathered copies cost little beside twice the forward's FLOPs. The forward's
gate and up products are kept for it. (Batching the forward costs more than the loop at
every size measured here but one: large tiles of small experts, whose products take less
than the loop's cost per tile. Those run as one batched matmul, forward and backward.)

Legend: M sorted rows, D in features, F out features, E groups (experts), n tiles, t rows
per tile; K, N a product's in and out features.
"""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp

from pallas_kernels.reference import jit_when_eager

# megablox's kernels, gmm and tgmm: the package's name `gmm` is ops.gmm, their custom_vjp,
# whose backward would be traced outside the matmul precision that this file sets
megablox = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")

BATCHED_TILE = 32  # rows per tile from which small experts' tiles run as one batched matmul
LOOP_TILE_MACS = 1 << 22  # a tile's products from which the loop's per-tile cost is small beside them
MEGABLOX_ROWS = 512  # rows per megablox tile at most
MEGABLOX_FEATURES = 1024  # in and out features per megablox tile at most


def tile_size(rows: int, groups: int) -> int:
    """Rows per tile: about the mean group size, a power of two in [1, 128]."""
    mean = max(rows // max(groups, 1), 1)
    return int(min(128, 1 << (mean.bit_length() - 1)))


def platform() -> str:
    """The platform the ambient mesh's devices run on ("cpu", "gpu", "tpu"); the default
    backend without a mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else mesh.abstract_device
    return jax.default_backend() if device is None else device.platform


class TiledLayout:
    """Where each sorted row goes in the tiled layout, computed once per routing and shared
    by the three expert matmuls. Rows past sum(group_sizes) belong to no group: they get no
    tile and read back as zeros."""

    def __init__(self, group_sizes: jax.Array, rows: int, tile: int):
        groups = group_sizes.shape[0]
        padded = (group_sizes + tile - 1) // tile * tile
        start = jnp.cumsum(group_sizes) - group_sizes  # first sorted row of each group
        pad_end = jnp.cumsum(padded)
        pad_start = pad_end - padded
        group_of_row = jnp.repeat(jnp.arange(groups), group_sizes, total_repeat_length=rows)
        self.num_tiles = -(-(rows + groups * (tile - 1)) // tile)  # static upper bound
        dest = pad_start[group_of_row] + jnp.arange(rows) - start[group_of_row]
        in_group = jnp.arange(rows) < jnp.sum(group_sizes)
        self.dest = jnp.where(in_group, dest, self.num_tiles * tile).astype(jnp.int32)  # out of range: no tile
        tile_starts = jnp.arange(self.num_tiles) * tile
        self.tile_group = jnp.minimum(jnp.searchsorted(pad_end, tile_starts, side="right"), groups - 1)
        self.tile_used = tile_starts < pad_end[-1]  # [n] False for the tiles past the last group
        self.tile, self.rows = tile, rows

    def scatter(self, x: jax.Array) -> jax.Array:
        """[M, D] sorted rows -> [num_tiles, tile, D] (padding rows are zero)."""
        out = jnp.zeros((self.num_tiles * self.tile, x.shape[-1]), x.dtype).at[self.dest].set(x, mode="drop")
        return out.reshape(self.num_tiles, self.tile, x.shape[-1])

    def gather(self, y: jax.Array) -> jax.Array:
        """[num_tiles, tile, F] -> [M, F] in sorted-row order (zeros for rows in no group)."""
        return y.reshape(-1, y.shape[-1]).at[self.dest].get(mode="fill", fill_value=0)


def _expert_products(x, gate, up, down):
    """One tile x [t, D] through one expert's weights (converted to x's dtype here, so
    stored bf16 or quantized weights are read at their own size): y [t, D] and the gate
    and up products g, u [t, F]."""
    w = lambda p: p.astype(x.dtype)  # noqa: E731
    g, u = jnp.einsum("tD,DF->tF", x, w(gate)), jnp.einsum("tD,DF->tF", x, w(up))
    return jnp.einsum("tF,FD->tD", jax.nn.silu(g) * u, w(down)), g, u


def _tile_loop(per_tile, x_tiles, tile_group, tile_used, gate, up, down):
    """per_tile(x [t, D], gate_e, up_e, down_e) for each tile i with e = tile_group[i], one
    tile at a time, its expert's weights sliced out there; zeros for the skipped tiles."""

    def one(x, e, used):
        run = lambda x: per_tile(x, gate[e], up[e], down[e])  # noqa: E731
        skip = lambda x: jax.tree.map(jnp.zeros_like, jax.eval_shape(run, x))  # noqa: E731
        return jax.lax.cond(used, run, skip, x)

    _, out = jax.lax.scan(lambda _, xs: (None, one(*xs)), None, (x_tiles, tile_group, tile_used))
    return out


def _outputs(x, gate, up, down):
    return _expert_products(x, gate, up, down)[0]


def _swiglu_batched(x_tiles, tile_group, gate, up, down):
    """x_tiles [n, t, D] -> [n, t, D]: every tile at once, each against its expert's
    weights gathered to [n, D, F] (padding tiles hold zeros and give zeros)."""
    w = lambda p: p[tile_group].astype(x_tiles.dtype)  # noqa: E731
    h = jax.nn.silu(jnp.einsum("ntD,nDF->ntF", x_tiles, w(gate))) * jnp.einsum("ntD,nDF->ntF", x_tiles, w(up))
    return jnp.einsum("ntF,nFD->ntD", h, w(down))


@jax.custom_vjp
def _swiglu_tiles(x_tiles, tile_group, tile_used, gate, up, down):
    """x_tiles [n, t, D] -> [n, t, D]: the tile loop forward, the batched backward."""
    return _tile_loop(_outputs, x_tiles, tile_group, tile_used, gate, up, down)


def _swiglu_tiles_fwd(x_tiles, tile_group, tile_used, gate, up, down):
    y, g, u = _tile_loop(_expert_products, x_tiles, tile_group, tile_used, gate, up, down)
    return y, (x_tiles, tile_group, g, u, gate, up, down)


def _swiglu_tiles_bwd(res, dy):
    """y = h down_e, h = silu(g) u, g = x gate_e, u = x up_e, per tile with e = its expert:
    dh = dy down_e^T, du = dh silu(g), dg = dh u silu'(g), dx = dg gate_e^T + du up_e^T;
    each tile's weight gradient (x^T dg, x^T du, h^T dy) is added into its expert's."""
    x, tile_group, g, u, gate, up, down = res
    w = lambda p: p[tile_group].astype(x.dtype)  # noqa: E731
    sig = jax.nn.sigmoid(g)
    silu = g * sig
    dh = jnp.einsum("ntD,nFD->ntF", dy, w(down))
    du = dh * silu
    dg = dh * u * sig * (1 + g * (1 - sig))
    dx = jnp.einsum("ntF,nDF->ntD", dg, w(gate)) + jnp.einsum("ntF,nDF->ntD", du, w(up))
    per_expert = lambda d, p: jnp.zeros(p.shape, d.dtype).at[tile_group].add(d).astype(p.dtype)  # noqa: E731
    return (dx, None, None, per_expert(jnp.einsum("ntD,ntF->nDF", x, dg), gate),
            per_expert(jnp.einsum("ntD,ntF->nDF", x, du), up),
            per_expert(jnp.einsum("ntF,ntD->nFD", silu * u, dy), down))


_swiglu_tiles.defvjp(_swiglu_tiles_fwd, _swiglu_tiles_bwd)


def _swiglu_tiled(xs, group_sizes, gate, up, down):
    layout = TiledLayout(group_sizes, xs.shape[0], tile_size(xs.shape[0], group_sizes.shape[0]))
    args = (layout.scatter(xs), layout.tile_group, layout.tile_used, gate, up, down)
    arrays = all(isinstance(w, jax.Array) for w in (gate, up, down))
    if not arrays:  # quantized weights (inference only): the loop, dequantizing one expert at a time
        y_tiles = _tile_loop(_outputs, *args)
    elif layout.tile >= BATCHED_TILE and layout.tile * gate.shape[1] * gate.shape[2] < LOOP_TILE_MACS:
        y_tiles = _swiglu_batched(args[0], layout.tile_group, gate, up, down)  # small experts, many rows
    else:
        y_tiles = _swiglu_tiles(*args)
    return layout.gather(y_tiles)


def _swiglu_ragged(xs, group_sizes, gate, up, down):
    gate, up, down = (w.astype(xs.dtype) for w in (gate, up, down))
    h = jax.nn.silu(jax.lax.ragged_dot(xs, gate, group_sizes)) * jax.lax.ragged_dot(xs, up, group_sizes)
    return _in_groups(jax.lax.ragged_dot(h, down, group_sizes), group_sizes)


def _in_groups(y, group_sizes):
    """y [M, N] with its rows past sum(group_sizes) set to zero."""
    return jnp.where((jnp.arange(y.shape[0]) < jnp.sum(group_sizes))[:, None], y, 0)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def megablox_rows(rows: int) -> int:
    """The rows megablox takes for `rows` sorted rows: up to MEGABLOX_ROWS, one row tile of
    whole bf16 sublane tiles (16 rows); above, a multiple of the largest row tile of 512,
    256, 128 that pads by at most an eighth. The kernels skip the padding (no group holds
    it), but the cost analysis counts it, as it counts every one of the R rows."""
    if rows <= MEGABLOX_ROWS:
        return _round_up(rows, 16)
    padded = (_round_up(rows, t) for t in (MEGABLOX_ROWS, MEGABLOX_ROWS // 2, MEGABLOX_ROWS // 4))
    return next((p for p in padded if p - rows <= rows // 8), _round_up(rows, MEGABLOX_ROWS // 4))


def megablox_tiling(m: int, k: int, n: int) -> tuple[int, int, int]:
    """Tile sizes (rows, in, out features) of a megablox product [m, k] x [k, n], m from
    `megablox_rows`. Mosaic takes a block whose last two dimensions are whole (16, 128)
    tiles or the array's own: rows in one tile up to MEGABLOX_ROWS, else the largest of
    512, 256, 128 dividing m; features the largest power-of-two multiple of 128 up to
    MEGABLOX_FEATURES dividing the dimension, else the whole dimension."""
    def largest(dim, limit):
        return next((t for t in (limit >> i for i in range(limit.bit_length())) if t >= 128 and dim % t == 0), dim)

    rows = m if m <= MEGABLOX_ROWS else largest(m, MEGABLOX_ROWS)
    return rows, largest(k, MEGABLOX_FEATURES), largest(n, MEGABLOX_FEATURES)


def _precision(dtype):
    """bf16 in one MXU pass (Mosaic has no fp32 passes over bf16 operands, whatever
    jax_default_matmul_precision says), fp32 exactly."""
    return "highest" if dtype == jnp.float32 else "default"


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _megablox_dot(x, w, group_sizes, interpret):
    """x [M, K] rows sorted by group, w [E, K, N] -> [M, N] (zeros past sum(group_sizes)),
    M a multiple of the row tile."""
    with jax.default_matmul_precision(_precision(x.dtype)):
        return _in_groups(megablox.gmm(x, w, group_sizes, x.dtype, megablox_tiling, interpret=interpret), group_sizes)


def _megablox_dot_fwd(x, w, group_sizes, interpret):
    return _megablox_dot(x, w, group_sizes, interpret), (x, w, group_sizes)


def _megablox_dot_bwd(interpret, res, dy):
    """dx = dy w_e^T per row of group e (gmm against the transposed weights); dw_e = x_e^T dy_e
    (tgmm, which gives zeros to the empty groups)."""
    x, w, group_sizes = res
    with jax.default_matmul_precision(_precision(x.dtype)):
        dx = megablox.gmm(dy, w, group_sizes, x.dtype, megablox_tiling, transpose_rhs=True, interpret=interpret)
        dw = megablox.tgmm(x.swapaxes(0, 1), dy, group_sizes, w.dtype, megablox_tiling,
                           num_actual_groups=w.shape[0], interpret=interpret)
    return _in_groups(dx, group_sizes), dw, None


_megablox_dot.defvjp(_megablox_dot_fwd, _megablox_dot_bwd)


def swiglu_megablox(xs, group_sizes, gate, up, down, *, interpret=False):
    """`swiglu_grouped` through megablox's kernels, the rows padded to `megablox_rows`.
    `interpret` is megablox's: True, or a `pltpu.InterpretParams`, runs them on a CPU."""
    m = xs.shape[0]
    if m == 0:
        return xs
    xs = jnp.pad(xs, ((0, megablox_rows(m) - m), (0, 0)))
    group_sizes = group_sizes.astype(jnp.int32)
    gate, up, down = (w.astype(xs.dtype) for w in (gate, up, down))
    dot = lambda x, w: _megablox_dot(x, w, group_sizes, interpret)  # noqa: E731
    return dot(jax.nn.silu(dot(xs, gate)) * dot(xs, up), down)[:m]


SWIGLU_GROUPED = {"cpu": _swiglu_tiled, "gpu": _swiglu_ragged, "tpu": swiglu_megablox}


def swiglu_grouped(xs, group_sizes, gate, up, down):
    """Rows sorted by expert through their expert: row r of group e -> down_e(silu(x_r gate_e) * (x_r up_e)).

    xs [M, D]; group_sizes [E] int32 with sum <= M (rows past the sum give zeros); gate,
    up [E, D, F]; down [E, F, D], in any stored dtype (or anything with `[e]` and `.astype`,
    such as rl/engine/quant.py's Quantized); the products run in xs's dtype. Returns [M, D].
    Platforms without an entry in SWIGLU_GROUPED use ragged_dot.
    """
    return SWIGLU_GROUPED.get(platform(), _swiglu_ragged)(xs, group_sizes, gate, up, down)


@jit_when_eager  # an eager call compiles the tile scan once per shape, not at every call
def swiglu_experts(x, experts, weights, gate, up, down):
    """sum_x weights[n, x] * down_e(silu(x_n gate_e) * (x_n up_e)) with e = experts[n, x].

    x [N, D]; experts, weights [N, X]; gate, up [E, D, F]; down [E, F, D], as in
    `swiglu_grouped`. Returns [N, D].
    """
    n, k = experts.shape
    e = gate.shape[0]
    flat = experts.reshape(-1)  # [N*X] token copies, grouped by expert below
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.zeros((e,), jnp.int32).at[flat].add(1)
    ys = swiglu_grouped(x[order // k], sizes, gate, up, down)
    y = jnp.zeros_like(ys).at[order].set(ys).reshape(n, k, -1)  # back to token order
    return jnp.einsum("NXD,NX->ND", y, weights.astype(y.dtype))
