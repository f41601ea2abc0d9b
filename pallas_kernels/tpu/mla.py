"""Absorbed MLA attention as Mosaic (TPU) kernels: prefill and decode, forward and backward.

Reference: `reference.mla_attention`; the row layout of the Triton `absorbed_mla.py`. With
W_UK absorbed into the query every head attends to one shared key [c_kv | k_rope] whose
value is c_kv itself, so the (token, head) pairs of a sequence are the M = T * H rows of
one matrix (row m = t * H + h), each carrying its token's position.

FlashAttention-2 (Dao 2023). Forward, Algorithm 1, for a block of rows over key blocks j:

    s_j = scale * (q_c c_j^T + q_r r_j^T),   masked to keys <= pos
    m_j = max(m_{j-1}, rowmax(s_j)),   p_j = exp(s_j - m_j)
    l_j = exp(m_{j-1} - m_j) l_{j-1} + rowsum(p_j)
    acc_j = exp(m_{j-1} - m_j) acc_{j-1} + p_j c_j,     o = acc / l,   lse = m + log l

Backward, Algorithm 2, from the saved lse and delta = rowsum(o * do):

    p = exp(s - lse),   ds = scale * p * (do c^T - delta)
    dq_c = ds c,   dq_r = ds r,   dk_r = ds^T q_r,   dc_kv = ds^T q_c + p^T do

(c_kv is both key and value, so its gradient has both terms). As in the TPU flash kernels of
JAX, dq and dk / dv are separate kernels: dq walks key blocks for a row block, dk walks row
blocks for a key block, each accumulating in fp32 VMEM scratch over the "arbitrary" last
grid axis. Blocks that no row can see are skipped with `pl.when`, and their index maps
repeat an earlier block so that the skipped steps start no copy from HBM; blocks that every
row sees whole (most of a causal prefill) skip the mask.

Decode (T of 1..8 against a long cache) has a few row blocks only, so the forward also
splits the keys among programs on a "parallel" grid axis (flash decoding) and merges the
partial results by their log-sum-exp; a prefill's row blocks already fill the cores.

Operands are padded to whole blocks: rows to block_m (padding rows have position -1 and
see nothing), keys to block_k, and the widths C and R to 128 lanes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._backend import MOSAIC, NEG, pad_axis, resolve, round_up
from pallas_kernels.tpu import _mosaic

LANES = 128  # feature widths are padded to whole lanes
ROW_TILE = 16  # rows of a bf16 (16, 128) tile: row and key blocks are multiples of it
CORES = 2  # TensorCores per chip (v4, v5p): "parallel" grid axes are shared among them


def _dot(a, b, contract: int):
    """a [M, K] . b, contracting b's axis `contract` (0: b [K, N], 1: b [N, K]), in fp32.

    The precision follows the operands, whatever jax_default_matmul_precision says: bf16
    in one MXU pass (Mosaic has no fp32 passes over bf16 operands), fp32 exactly."""
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else jax.lax.Precision.DEFAULT
    return jax.lax.dot_general(a, b, (((1,), (contract,)), ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)


def mm(a, b):
    return _dot(a, b, 0)


def mm_nt(a, b):
    return _dot(a, b, 1)


def _visible(pos, key_start: int, shape, key_axis: int = 1):
    """The mask of a [rows, keys] tile (key_axis 1, pos [rows, 1]) or of a [keys, rows] one
    (key_axis 0, pos [1, rows]): key key_start + k is visible to the row at pos."""
    return key_start + jax.lax.broadcasted_iota(jnp.int32, shape, key_axis) <= pos


def _when_visible(step, j, last, full):
    """step(masked) for key block j of a row block whose blocks < full are seen whole by every
    row and whose blocks > last by none."""
    pl.when(j < full)(lambda: step(masked=False))
    pl.when((j >= full) & (j <= last))(lambda: step(masked=True))


def _scores(qc, qr, c, r, scale: float):
    return (mm_nt(qc, c) + mm_nt(qr, r)) * scale  # [bm, bk]


# -- forward ---------------------------------------------------------------------------

def _forward_kernel(last_ref, full_ref, qc_ref, qr_ref, c_ref, r_ref, pos_ref, o_ref, lse_ref, acc_ref, m_ref, l_ref, *,
                    scale: float, row_blocks: int, per_split: int, block_k: int):
    b, i, split, k = (pl.program_id(a) for a in range(4))
    j = split * per_split + k  # the key block of this step

    @pl.when(k == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)
        m_ref[...] = jnp.full_like(m_ref, NEG)
        l_ref[...] = jnp.zeros_like(l_ref)

    def step(masked: bool):
        c = c_ref[...]
        s = _scores(qc_ref[...], qr_ref[...], c, r_ref[...], scale)
        if masked:
            visible = _visible(pos_ref[...], j * block_k, s.shape)
            s = jnp.where(visible, s, NEG)
        m_prev = m_ref[...]
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))  # [bm, 1]
        p = jnp.exp(s - m_next)
        if masked:  # a row that has seen nothing yet has m_next = NEG = s
            p = jnp.where(visible, p, 0.0)
        fix = jnp.exp(m_prev - m_next)
        l_ref[...] = l_ref[...] * fix + jnp.sum(p, axis=1, keepdims=True)
        acc_ref[...] = acc_ref[...] * fix + mm(p.astype(c.dtype), c)
        m_ref[...] = m_next

    _when_visible(step, j, last_ref[b * row_blocks + i], full_ref[b * row_blocks + i])

    @pl.when(k == per_split - 1)
    def _finish():
        total = l_ref[...]
        seen = total > 0
        safe = jnp.where(seen, total, 1.0)
        o_ref[...] = (acc_ref[...] / safe).astype(o_ref.dtype)
        lse_ref[...] = jnp.where(seen, m_ref[...] + jnp.log(safe), NEG)


def _forward(qc, qr, c, r, pos, last, full, *, scale: float, block_m: int, block_k: int, splits: int, backend: str,
             pairs: float):
    """Per-split o [B, splits, M, C] (fp32 when splits > 1) and lse [B, splits, M, 1]. pairs:
    the (row, key) pairs the causal mask leaves, for the cost estimate."""
    b, m, cp = qc.shape
    rp = qr.shape[-1]
    row_blocks, key_blocks = m // block_m, c.shape[1] // block_k
    per_split = -(-key_blocks // splits)

    def key_map(bi, i, split, k, last_ref, full_ref):  # past the last visible block: hold the last one (no new copy)
        return bi, jnp.minimum(split * per_split + k, jnp.maximum(last_ref[bi * row_blocks + i], 0)), 0

    def rows(width):
        return pl.BlockSpec((None, block_m, width), lambda bi, i, split, k, *_: (bi, i, 0))

    def keys(width):
        return pl.BlockSpec((None, block_k, width), key_map)

    def out(width):
        return pl.BlockSpec((None, None, block_m, width), lambda bi, i, split, k, *_: (bi, split, i, 0))

    out_dtype = qc.dtype if splits == 1 else jnp.float32
    kernel = functools.partial(_forward_kernel, scale=scale, row_blocks=row_blocks, per_split=per_split,
                               block_k=block_k)
    return _mosaic.call(
        kernel,
        backend=backend,
        name="mla_flash_forward",
        dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(b, row_blocks, splits, per_split),
            in_specs=[rows(cp), rows(rp), keys(cp), keys(rp), rows(1)],
            out_specs=[out(cp), out(1)],
            scratch_shapes=[pltpu.VMEM((block_m, cp), jnp.float32), pltpu.VMEM((block_m, 1), jnp.float32),
                            pltpu.VMEM((block_m, 1), jnp.float32)],
        ),
        out_shape=[jax.ShapeDtypeStruct((b, splits, m, cp), out_dtype),
                   jax.ShapeDtypeStruct((b, splits, m, 1), jnp.float32)],
        cost_estimate=_mosaic.estimate(2 * pairs * (2 * cp + rp), pairs, qc, qr, c, r, qc),
    )(last, full, qc, qr, c, r, pos)


def merge_splits(o, lse):
    """The partial results of key splits o [B, P, M, C], lse [B, P, M, 1] -> [B, M, C], [B, M, 1]:

        lse = log sum_p exp(lse_p),   o = sum_p exp(lse_p - lse) o_p
    """
    if o.shape[1] == 1:
        return o[:, 0], lse[:, 0]
    top = jnp.max(lse, axis=1, keepdims=True)
    weight = jnp.exp(lse - top)  # [B, P, M, 1]
    total = jnp.sum(weight, axis=1)
    out = jnp.einsum("BPMO,BPMC->BMC", weight, o.astype(jnp.float32)) / total
    return out, top[:, 0] + jnp.log(total)


# -- backward --------------------------------------------------------------------------

def _dq_kernel(last_ref, full_ref, qc_ref, qr_ref, c_ref, r_ref, pos_ref, do_ref, lse_ref, delta_ref, dqc_ref, dqr_ref,
               acc_c_ref, acc_r_ref, *, scale: float, row_blocks: int, block_k: int):
    b, i, j = (pl.program_id(a) for a in range(3))

    @pl.when(j == 0)
    def _init():
        acc_c_ref[...] = jnp.zeros_like(acc_c_ref)
        acc_r_ref[...] = jnp.zeros_like(acc_r_ref)

    def step(masked: bool):
        c, r = c_ref[...], r_ref[...]
        s = _scores(qc_ref[...], qr_ref[...], c, r, scale)
        p = jnp.exp(s - lse_ref[...])
        if masked:
            p = jnp.where(_visible(pos_ref[...], j * block_k, s.shape), p, 0.0)
        ds = (p * (mm_nt(do_ref[...], c) - delta_ref[...]) * scale).astype(c.dtype)  # [bm, bk]
        acc_c_ref[...] += mm(ds, c)
        acc_r_ref[...] += mm(ds, r)

    _when_visible(step, j, last_ref[b * row_blocks + i], full_ref[b * row_blocks + i])

    @pl.when(j == pl.num_programs(2) - 1)
    def _finish():
        dqc_ref[...] = acc_c_ref[...].astype(dqc_ref.dtype)
        dqr_ref[...] = acc_r_ref[...].astype(dqr_ref.dtype)


def _dkv_kernel(last_ref, full_ref, first_ref, qc_ref, qr_ref, c_ref, r_ref, pos_ref, do_ref, lse_ref, delta_ref,
                dc_ref, dr_ref, acc_c_ref, acc_r_ref, *, scale: float, row_blocks: int, block_k: int):
    """Works on the transposed tile [bk, bm] (keys on sublanes), as the row vectors pos, lse
    and delta arrive lane-dense [1, bm]: p^T and ds^T come out of the matmuls unrotated."""
    b, j, i = (pl.program_id(a) for a in range(3))

    @pl.when(i == 0)
    def _init():
        acc_c_ref[...] = jnp.zeros_like(acc_c_ref)
        acc_r_ref[...] = jnp.zeros_like(acc_r_ref)

    def step(masked: bool):
        qc, qr, c, do = qc_ref[...], qr_ref[...], c_ref[...], do_ref[...]
        s_t = _scores(c, r_ref[...], qc, qr, scale)  # [bk, bm]
        p_t = jnp.exp(s_t - lse_ref[...])
        if masked:
            p_t = jnp.where(_visible(pos_ref[...], j * block_k, s_t.shape, key_axis=0), p_t, 0.0)
        ds_t = (p_t * (mm_nt(c, do) - delta_ref[...]) * scale).astype(qc.dtype)
        acc_c_ref[...] += mm(ds_t, qc) + mm(p_t.astype(do.dtype), do)
        acc_r_ref[...] += mm(ds_t, qr)

    _when_visible(step, j, last_ref[b * row_blocks + i], full_ref[b * row_blocks + i])

    @pl.when(i == row_blocks - 1)
    def _finish():
        dc_ref[...] = acc_c_ref[...].astype(dc_ref.dtype)
        dr_ref[...] = acc_r_ref[...].astype(dr_ref.dtype)


def _backward(qc, qr, c, r, pos, last, full, first, o, lse, do, *, scale: float, block_m: int, block_k: int,
              backend: str, pairs: float):
    """dq_c, dq_r (one kernel over grid (B, row blocks, key blocks)) and dc_kv, dk_r (one over
    (B, key blocks, row blocks)). pos, lse and delta are [B, M, 1] for the first and
    lane-dense [B, 1, M] for the second."""
    b, m, cp = qc.shape
    rp = qr.shape[-1]
    row_blocks, key_blocks = m // block_m, c.shape[1] // block_k
    delta = jnp.einsum("BMC,BMC->BM", o.astype(jnp.float32), do.astype(jnp.float32))[..., None]  # [B, M, 1]
    blocks = dict(scale=scale, row_blocks=row_blocks, block_k=block_k)

    def row_spec(width):
        return pl.BlockSpec((None, block_m, width), lambda bi, i, j, *_: (bi, i, 0))

    def key_spec(width):  # past the last visible block: hold the last one
        def key_map(bi, i, j, last_ref, full_ref):
            return bi, jnp.minimum(j, jnp.maximum(last_ref[bi * row_blocks + i], 0)), 0
        return pl.BlockSpec((None, block_k, width), key_map)

    dq_c, dq_r = _mosaic.call(
        functools.partial(_dq_kernel, **blocks),
        backend=backend,
        name="mla_flash_dq",
        dimension_semantics=("parallel", "parallel", "arbitrary"),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(b, row_blocks, key_blocks),
            in_specs=[row_spec(cp), row_spec(rp), key_spec(cp), key_spec(rp), row_spec(1), row_spec(cp),
                      row_spec(1), row_spec(1)],
            out_specs=[row_spec(cp), row_spec(rp)],
            scratch_shapes=[pltpu.VMEM((block_m, cp), jnp.float32), pltpu.VMEM((block_m, rp), jnp.float32)],
        ),
        out_shape=[jax.ShapeDtypeStruct(qc.shape, qc.dtype), jax.ShapeDtypeStruct(qr.shape, qr.dtype)],
        # per pair: the scores again (C + R), dp (C), dq (C + R)
        cost_estimate=_mosaic.estimate(2 * pairs * (3 * cp + 2 * rp), pairs, qc, qr, c, r, do, qc, qr),
    )(last, full, qc, qr, c, r, pos, do, lse, delta)

    def held_row(bi, j, i, last_ref, full_ref, first_ref):  # blind to key block j: hold the first that sees it
        return jnp.where(last_ref[bi * row_blocks + i] >= j, i, first_ref[bi * key_blocks + j])

    def rows_of(width):
        return pl.BlockSpec((None, block_m, width), lambda bi, j, i, *refs: (bi, held_row(bi, j, i, *refs), 0))

    def lanes_of():
        return pl.BlockSpec((None, 1, block_m), lambda bi, j, i, *refs: (bi, 0, held_row(bi, j, i, *refs)))

    def keys_of(width):
        return pl.BlockSpec((None, block_k, width), lambda bi, j, i, *_: (bi, j, 0))

    def dense(x):  # [B, M, 1] -> [B, 1, M]
        return x.reshape(b, 1, m)

    dc, dr = _mosaic.call(
        functools.partial(_dkv_kernel, **blocks),
        backend=backend,
        name="mla_flash_dkv",
        dimension_semantics=("parallel", "parallel", "arbitrary"),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(b, key_blocks, row_blocks),
            in_specs=[rows_of(cp), rows_of(rp), keys_of(cp), keys_of(rp), lanes_of(), rows_of(cp), lanes_of(),
                      lanes_of()],
            out_specs=[keys_of(cp), keys_of(rp)],
            scratch_shapes=[pltpu.VMEM((block_k, cp), jnp.float32), pltpu.VMEM((block_k, rp), jnp.float32)],
        ),
        out_shape=[jax.ShapeDtypeStruct(c.shape, c.dtype), jax.ShapeDtypeStruct(r.shape, r.dtype)],
        # per pair: the scores again (C + R), dp (C), dc (2 C), dr (R)
        cost_estimate=_mosaic.estimate(2 * pairs * (4 * cp + 2 * rp), pairs, qc, qr, c, r, do, c, r),
    )(last, full, first, qc, qr, c, r, dense(pos), do, dense(lse), dense(delta))
    return dq_c, dq_r, dc, dr


# -- the op ----------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _attention(scale: float, block_m: int, block_k: int, splits: int, backend: str, pairs: float):
    """The custom-VJP op over padded row-major operands for one static configuration."""
    blocks = dict(scale=scale, block_m=block_m, block_k=block_k, pairs=pairs)

    def forward(qc, qr, c, r, pos, last, full):
        o, lse = merge_splits(*_forward(qc, qr, c, r, pos, last, full, splits=splits, backend=backend, **blocks))
        return o.astype(qc.dtype), lse

    @jax.custom_vjp
    def attend(qc, qr, c, r, pos, last, full, first):
        return forward(qc, qr, c, r, pos, last, full)[0]

    def fwd(qc, qr, c, r, pos, last, full, first):
        o, lse = forward(qc, qr, c, r, pos, last, full)
        return o, (qc, qr, c, r, pos, last, full, first, o, lse)

    def bwd(res, do):
        return (*_backward(*res, do, backend=backend, **blocks), None, None, None, None)

    attend.defvjp(fwd, bwd)
    return attend


def _block_tables(pos, block_m: int, block_k: int, key_blocks: int):
    """The visibility of blocks, from the row positions pos [B, M, 1], flattened for scalar
    prefetch (SMEM): per row block, last [B * row_blocks], the last key block some row sees
    (-1: none), and full, how many key blocks every row sees whole; per key block, first
    [B * key_blocks], the first row block that sees it (0: none)."""
    b, m, _ = pos.shape
    blocked = pos.reshape(b, m // block_m, block_m)
    last = jnp.max(blocked, axis=-1) // block_k  # floor: -1 // bk = -1
    full = (jnp.min(blocked, axis=-1) + 1) // block_k
    sees = last[:, None, :] >= jnp.arange(key_blocks)[None, :, None]  # [B, key_blocks, row_blocks]
    first = jnp.argmax(sees, axis=-1)
    return tuple(x.reshape(-1).astype(jnp.int32) for x in (last, full, first))


def mla_attention(q_c, q_r, c_kv, k_r, q_pos, *, scale: float, block_m: int = 256, block_k: int = 512,
                  splits: int | None = None, backend: str | None = None):
    """Causal absorbed-MLA attention (the signature of `reference.mla_attention`).

    q_c [B, T, H, C], q_r [B, T, H, R], c_kv [B, S, C], k_r [B, S, R], q_pos [B, T]; key s
    is visible to the query at q_pos when s <= q_pos. Returns o_c [B, T, H, C] in q_c's dtype.
    block_m rows (token, head pairs) and block_k keys per block, both multiples of 16 and cut
    down to what the operands need; on a TPU block_m is a multiple of 128 unless one block
    holds every row (the TPU interpreter takes smaller blocks, which the tests use).
    splits: key splits of the forward (None: enough to give every TensorCore a program, 1
    when the row blocks already do, as in a prefill).
    """
    backend = resolve(backend)
    if backend not in MOSAIC:
        raise ValueError(f"backend={backend!r}: expected one of {MOSAIC} "
                         "(the Triton version of this op is pallas_kernels.absorbed_mla)")
    b, t, h, c = q_c.shape
    s, r = c_kv.shape[1], k_r.shape[-1]
    if q_r.shape[:3] != (b, t, h) or c_kv.shape != (b, s, c) or k_r.shape != (b, s, r) or q_pos.shape != (b, t):
        raise ValueError(f"expected q_c [B, T, H, C], q_r [B, T, H, R], c_kv [B, S, C], k_r [B, S, R], q_pos [B, T]; "
                         f"got {q_c.shape}, {q_r.shape}, {c_kv.shape}, {k_r.shape}, {q_pos.shape}")
    if block_m % ROW_TILE or block_k % ROW_TILE:
        raise ValueError(f"block_m and block_k must be multiples of {ROW_TILE}, got {block_m} and {block_k}")
    m = t * h
    bm = min(block_m, round_up(m, ROW_TILE))
    bk = min(block_k, round_up(s, LANES))
    mp, sp, cp, rp = round_up(m, bm), round_up(s, bk), round_up(c, LANES), round_up(r, LANES)
    row_blocks, key_blocks = mp // bm, sp // bk
    if backend == "tpu" and row_blocks > 1 and bm % LANES:
        raise ValueError(f"block_m={bm} with {mp} rows: on a TPU a row block is the lanes of the backward's lse "
                         f"and delta, so expected a multiple of {LANES} or every row (T * H = {m}) in one block")
    if splits is None:
        splits = -(-CORES // (b * row_blocks))
    per_split = -(-key_blocks // max(1, min(splits, key_blocks)))
    splits = -(-key_blocks // per_split)  # no split left without keys

    def rows(x, width):  # [B, T, H, W] -> [B, Mp, width]: row t * H + h
        return pad_axis(pad_axis(x.reshape(b, m, x.shape[-1]), 1, mp), 2, width)

    def keys(x, width):
        return pad_axis(pad_axis(x, 1, sp), 2, width)

    pos = jnp.repeat(jnp.minimum(q_pos.astype(jnp.int32), s - 1), h, axis=1)  # [B, M]
    pos = pad_axis(pos, 1, mp, value=-1)[..., None]  # [B, Mp, 1]
    op = _attention(float(scale), bm, bk, splits, backend, _mosaic.causal_pairs(b, t, s) * h)
    o = op(rows(q_c, cp), rows(q_r, rp), keys(c_kv, cp), keys(k_r, rp), pos, *_block_tables(pos, bm, bk, key_blocks))
    return o[:, :m, :c].reshape(b, t, h, c)
