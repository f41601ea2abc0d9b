"""Sparse MLA (DeepSeek-V3.2's DSA) as Mosaic kernels: absorbed attention over each query's gathered top-k
latent rows, forward and backward.

Reference: `reference.sparse_mla_attention`. Query t selected P keys (topk_idx, -1 =
empty; a selected key must also be <= q_pos[t]); its H heads attend over the same P rows
of [c_kv | k_rope], an MQA softmax in fp32:

    o[t, h] = sum_p softmax_p(scale * (q_c[t, h] . c[i_p] + q_r[t, h] . r[i_p])) c[i_p]

Gather. topk_idx and q_pos are read as scalars from SMEM; every valid selected row is one
DMA from the HBM arrays (`memory_space=pl.ANY`) into a VMEM buffer, double-buffered: the
rows of the next block of block_p slots load while the MXU works on this one. A DMA may
land in VMEM only at a tile-aligned or static row of an (8, 128) tile, which a bf16 row
(half of a packed sublane) never is, so the latents travel as 32-bit words (two bf16 columns a word, `_words`) and are unpacked in
VMEM; the kernels therefore see the even columns and the odd columns of C and R as
separate "parts", and q / o / dq are split the same way outside. Slots that are empty or
invisible issue no DMA; their scores are masked to exp = 0, and their buffer rows are
zeroed once per grid step, so a stale row is finite and contributes exactly 0.

Forward: grid (b, block of block_t queries), both parallel; each query walks its P slots
in blocks of block_p with FlashAttention's online softmax, and stores o and the
log-sum-exp for the backward.

Backward (delta = rowsum(o * do), p = exp(s - lse), ds = p * (do . c - delta) * scale):
dq_c = ds c, dq_r = ds r, and each selected row receives dc = ds^T q_c + p^T do and
dr = ds^T q_r. Several queries select the same row, so these are added into fp32
accumulators in HBM (aliased inputs) by read-modify-write DMAs: read the block's rows,
add, write back, and wait for the writes before the next block reads. The grid is
sequential ("arbitrary") for this; the slots of one query must be distinct (top-k
indices are), or two DMAs of one block race on a row.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._backend import NEG, pad_axis, round_up
from pallas_kernels.tpu._mosaic import call, estimate

SUBLANES = 8  # rows of a 32-bit VMEM tile: a DMA lands at a static row of a tile


# -- outside the kernels: 32-bit words and column parts ------------------------------------

def _parts_per_word(dtype) -> int:
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"expected float32 or bfloat16 latents, got {jnp.dtype(dtype)}")
    return 4 // jnp.dtype(dtype).itemsize


def _words(x):
    """x [B, S, D] float32 | bfloat16 -> int32 [B, S, D / n]; word w holds columns n*w .. n*w + n-1."""
    n = _parts_per_word(x.dtype)
    if n > 1:
        x = x.reshape(*x.shape[:-1], x.shape[-1] // n, n)
    return jax.lax.bitcast_convert_type(x, jnp.int32)


def _split(x, n: int):
    """[B, T, H, D] -> [B, T, n, H, D / n]: part j holds columns j, j + n, ... (a word's j-th value)."""
    b, t, h, d = x.shape
    return jnp.moveaxis(x.reshape(b, t, h, d // n, n), -1, 2)


def _merge(x):
    """Inverse of `_split` along the last two axes: [..., n, H, D / n] -> [..., H, D]."""
    x = jnp.moveaxis(x, -3, -1)
    return x.reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1])


# -- inside the kernels ----------------------------------------------------------------------

def _dot(a, b, contract_a: int, contract_b: int):
    """A 2-D matmul in fp32. The precision is explicit so that a global default (the tests'
    "highest") cannot ask the MXU for fp32 passes over bf16 operands, which Mosaic refuses."""
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else jax.lax.Precision.DEFAULT
    return jax.lax.dot_general(a, b, (((contract_a,), (contract_b,)), ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)


mm = functools.partial(_dot, contract_a=1, contract_b=0)  # [M, K] @ [K, N]
mm_nt = functools.partial(_dot, contract_a=1, contract_b=1)  # [M, K] @ [N, K]^T
mm_tn = functools.partial(_dot, contract_a=0, contract_b=0)  # [K, M]^T @ [K, N]


def _unpack(words, n: int, dtype):
    """int32 words [rows, D / n] -> n parts [rows, D / n] of dtype (part j: each word's j-th value)."""
    if n == 1:
        return [jax.lax.bitcast_convert_type(words, jnp.float32)]
    low = jax.lax.bitcast_convert_type(jnp.left_shift(words, 16), jnp.float32)  # a bf16 is an f32's high half
    high = jax.lax.bitcast_convert_type(jnp.bitwise_and(words, jnp.int32(-65536)), jnp.float32)
    return [low.astype(dtype), high.astype(dtype)]


def _for_valid_slots(idx_s, token, first: jax.Array, count: int, pos, num_keys: int, fn):
    """fn(row, group, k) for the slots first .. first + count - 1 of `token` whose key is
    valid (0 <= row <= pos); slot first + 8 * group + k lands at row k of tile `group`."""

    def group(g, carry):
        for k in range(SUBLANES):  # static: the row inside a VMEM tile must be static
            row = idx_s[token, first + g * SUBLANES + k]
            pl.when((row >= 0) & (row <= pos))(functools.partial(fn, jnp.minimum(row, num_keys - 1), g, k))
        return carry

    jax.lax.fori_loop(0, count // SUBLANES, group, 0)


def _gather(action: str, u, chunks: int, idx_s, pos_s, latents, bufs, sem):
    """Starts or waits for ("start" | "wait") the DMAs of step u's block of selected rows,
    u = token * chunks + chunk, into buffer slot u % 2: latents = (c [B, S, C/n], r [B, S, R/n])
    words in HBM, bufs = (c_buf, r_buf) [2, block_p / 8, 8, W], sem [2]."""
    token, chunk, slot = jax.lax.div(u, chunks), jax.lax.rem(u, chunks), jax.lax.rem(u, 2)
    batch, block_p = pl.program_id(0), bufs[0].shape[1] * SUBLANES

    def fn(row, g, k):
        for hbm, buf in zip(latents, bufs):
            copy = pltpu.make_async_copy(hbm.at[batch, pl.ds(row, 1)], buf.at[slot, g, pl.ds(k, 1)], sem.at[slot])
            copy.start() if action == "start" else copy.wait()

    _for_valid_slots(idx_s, token, chunk * block_p, block_p, pos_s[token, 0], latents[0].shape[1], fn)


def _rows(buf, n: int, dtype):
    """A gathered block buf [block_p / 8, 8, W] int32 -> its n column parts [block_p, W]."""
    g, s, w = buf.shape
    return _unpack(buf[...].reshape(g * s, w), n, dtype)


def _scores(qc_parts, qr_parts, c_parts, r_parts):
    """[H, block_p] fp32: q_c . c + q_r . r, summed over the column parts."""
    return sum(mm_nt(q, x) for q, x in zip(qc_parts + qr_parts, c_parts + r_parts))


def _valid(idx_v, token, chunk, pos):
    ids = idx_v[token, pl.ds(chunk, 1)]  # [1, block_p]
    return (ids >= 0) & (ids <= pos)


def _forward_kernel(idx_s, pos_s, qc_ref, qr_ref, idx_v, c_hbm, r_hbm, o_ref, lse_ref, c_buf, r_buf, sem, *,
                    scale: float, n: int):
    """idx_s [bt, P], pos_s [bt] (SMEM); qc_ref [bt, n, H, C/n], qr_ref [bt, n, H, R/n], idx_v
    [bt, P / block_p, block_p]; c_hbm [B, S, C/n], r_hbm [B, S, R/n] int32 words (HBM);
    o_ref [bt, n, H, C/n], lse_ref [bt, H, 1]; c_buf, r_buf [2, block_p / 8, 8, W] (2 slots)."""
    tokens, chunks, _ = idx_v.shape
    steps, heads, dtype = tokens * chunks, qc_ref.shape[2], qc_ref.dtype
    c_buf[...] = jnp.zeros(c_buf.shape, c_buf.dtype)
    r_buf[...] = jnp.zeros(r_buf.shape, r_buf.dtype)

    gather = lambda action, u: _gather(action, u, chunks, idx_s, pos_s, (c_hbm, r_hbm), (c_buf, r_buf), sem)  # noqa: E731

    gather("start", 0)

    def token_step(t, carry):
        qc = [qc_ref[t, j] for j in range(n)]  # n x [H, C/n]
        qr = [qr_ref[t, j] for j in range(n)]
        pos = pos_s[t, 0]

        def chunk_step(k, state):
            acc, peak, total = state
            u = t * chunks + k
            gather("wait", u)

            @pl.when(u + 1 < steps)
            def _():
                gather("start", u + 1)

            c, r = (_rows(buf.at[jax.lax.rem(u, 2)], n, dtype) for buf in (c_buf, r_buf))
            valid = _valid(idx_v, t, k, pos)  # [1, block_p]
            s = jnp.where(valid, _scores(qc, qr, c, r) * scale, NEG)  # [H, block_p]
            new_peak = jnp.maximum(peak, jnp.max(s, axis=1, keepdims=True))  # [H, 1]
            p = jnp.where(valid, jnp.exp(s - new_peak), 0.0)
            fix = jnp.exp(peak - new_peak)
            acc = tuple(a * fix + mm(p.astype(dtype), x) for a, x in zip(acc, c))
            return acc, new_peak, total * fix + jnp.sum(p, axis=1, keepdims=True)

        init = (tuple(jnp.zeros(x.shape, jnp.float32) for x in qc), jnp.full((heads, 1), NEG, jnp.float32),
                jnp.zeros((heads, 1), jnp.float32))
        acc, peak, total = jax.lax.fori_loop(0, chunks, chunk_step, init)
        seen = total > 0
        for j in range(n):
            o_ref[t, j] = (acc[j] / jnp.where(seen, total, 1.0)).astype(o_ref.dtype)
        lse_ref[t] = jnp.where(seen, peak + jnp.log(jnp.where(seen, total, 1.0)), NEG)
        return carry

    jax.lax.fori_loop(0, tokens, token_step, 0)


def _backward_kernel(idx_s, pos_s, qc_ref, qr_ref, do_ref, lse_ref, delta_ref, idx_v, c_hbm, r_hbm, _dc_in, _dr_in,
                     dqc_ref, dqr_ref, dc_hbm, dr_hbm, c_buf, r_buf, sem, dc_buf, dr_buf, acc_sem, *,
                     scale: float, n: int):
    """As the forward, plus do_ref [bt, n, H, C/n], lse_ref and delta_ref [bt, H, 1]; outputs
    dqc_ref, dqr_ref (q's blocks) and dc_hbm [B, n, S, C/n], dr_hbm [B, n, S, R/n] fp32
    accumulators in HBM (aliased to _dc_in, _dr_in); dc_buf, dr_buf [n, block_p / 8, 8, W]."""
    batch, (tokens, chunks, block_p) = pl.program_id(0), idx_v.shape
    steps, dtype, num_keys = tokens * chunks, qc_ref.dtype, dc_hbm.shape[2]
    c_buf[...] = jnp.zeros(c_buf.shape, c_buf.dtype)
    r_buf[...] = jnp.zeros(r_buf.shape, r_buf.dtype)

    gather = lambda action, u: _gather(action, u, chunks, idx_s, pos_s, (c_hbm, r_hbm), (c_buf, r_buf), sem)  # noqa: E731

    def accumulators(action, t, k):  # "read" | "write" ("start" | "wait") of the block's accumulator rows
        def fn(row, g, m):
            for hbm, buf in ((dc_hbm, dc_buf), (dr_hbm, dr_buf)):
                for j in range(n):
                    rows, tile = hbm.at[batch, j, pl.ds(row, 1)], buf.at[j, g, pl.ds(m, 1)]
                    copy = pltpu.make_async_copy(*((rows, tile) if action[0] == "read" else (tile, rows)), acc_sem)
                    copy.start() if action[1] == "start" else copy.wait()

        _for_valid_slots(idx_s, t, k * block_p, block_p, pos_s[t, 0], num_keys, fn)

    gather("start", 0)

    def token_step(t, carry):
        qc, qr, do = ([ref[t, j] for j in range(n)] for ref in (qc_ref, qr_ref, do_ref))
        lse, delta, pos = lse_ref[t], delta_ref[t], pos_s[t, 0]  # [H, 1], [H, 1], scalar

        def chunk_step(k, dq):
            u = t * chunks + k
            accumulators(("read", "start"), t, k)  # the previous block's writes are complete
            gather("wait", u)

            @pl.when(u + 1 < steps)
            def _():
                gather("start", u + 1)

            c, r = (_rows(buf.at[jax.lax.rem(u, 2)], n, dtype) for buf in (c_buf, r_buf))
            valid = _valid(idx_v, t, k, pos)
            p = jnp.where(valid, jnp.exp(_scores(qc, qr, c, r) * scale - lse), 0.0)  # [H, block_p]
            dp = sum(mm_nt(g, x) for g, x in zip(do, c))
            ds = p * (dp - delta) * scale
            ds_in, p_in = ds.astype(dtype), p.astype(dtype)
            dc = [mm_tn(ds_in, q) + mm_tn(p_in, g) for q, g in zip(qc, do)]  # n x [block_p, C/n]
            dr = [mm_tn(ds_in, q) for q in qr]
            accumulators(("read", "wait"), t, k)
            for buf, grads in ((dc_buf, dc), (dr_buf, dr)):
                for j, grad in enumerate(grads):
                    buf[j] = buf[j] + grad.reshape(buf.shape[1:])
            accumulators(("write", "start"), t, k)
            accumulators(("write", "wait"), t, k)
            return (tuple(a + mm(ds_in, x) for a, x in zip(dq[0], c)),
                    tuple(a + mm(ds_in, x) for a, x in zip(dq[1], r)))

        init = tuple(tuple(jnp.zeros(x.shape, jnp.float32) for x in xs) for xs in (qc, qr))
        dqc, dqr = jax.lax.fori_loop(0, chunks, chunk_step, init)
        for j in range(n):
            dqc_ref[t, j] = dqc[j].astype(dqc_ref.dtype)
            dqr_ref[t, j] = dqr[j].astype(dqr_ref.dtype)
        return carry

    jax.lax.fori_loop(0, tokens, token_step, 0)


@functools.lru_cache(maxsize=None)
def _attention(scale: float, block_t: int, block_p: int, backend: str):
    """The custom-VJP op on prepared operands: q parts [B, Tp, n, H, C/n] and [B, Tp, n, H, R/n],
    c_kv [B, S, C], k_r [B, S, R], idx [B, Tp, Pp] (Pp a multiple of block_p), pos [B, Tp, 1]."""

    def specs(qc, qr, idx, *per_query):
        """In-specs on grid (b, query block): idx and pos in SMEM (the DMAs' addresses), the
        per-query blocks, idx in VMEM (the score masks)."""
        tokens = lambda x: pl.BlockSpec((None, block_t) + x.shape[2:], lambda b, i: (b, i) + (0,) * (x.ndim - 2))  # noqa: E731
        smem = [pl.BlockSpec((None, block_t, idx.shape[-1]), lambda b, i: (b, i, 0), memory_space=pltpu.SMEM),
                pl.BlockSpec((None, block_t, 1), lambda b, i: (b, i, 0), memory_space=pltpu.SMEM)]
        chunks = idx.shape[-1] // block_p
        idx_v = pl.BlockSpec((None, block_t, chunks, block_p), lambda b, i: (b, i, 0, 0))
        return smem + [tokens(x) for x in (qc, qr) + per_query] + [idx_v], tokens

    def scratch(c, r):
        rows = lambda x: pltpu.VMEM((2, block_p // SUBLANES, SUBLANES, x.shape[-1]), jnp.int32)  # noqa: E731
        return [rows(c), rows(r), pltpu.SemaphoreType.DMA((2,))]

    def pairs(qc, qr, idx):
        """(query head, selected key) pairs and the widths C and R of their dot products."""
        b, tp, n, h, w = qc.shape
        return b * tp * h * idx.shape[-1], n * w, n * qr.shape[-1]

    def forward(qc, qr, c_kv, k_r, idx, pos):
        b, tp, n, h, _ = qc.shape
        c, r = _words(c_kv), _words(k_r)
        in_specs, tokens = specs(qc, qr, idx)
        lse = jax.ShapeDtypeStruct((b, tp, h, 1), jnp.float32)
        out = jax.ShapeDtypeStruct(qc.shape, qc.dtype)
        p, cw, rw = pairs(qc, qr, idx)  # each selected row gathered once per query: scores, then values
        return call(
            functools.partial(_forward_kernel, scale=scale, n=n), backend=backend,
            name="sparse_mla_forward", grid=(b, tp // block_t),
            in_specs=in_specs + [pl.BlockSpec(memory_space=pl.ANY)] * 2,
            out_specs=[tokens(qc), tokens(lse)],
            out_shape=[out, lse],
            scratch_shapes=scratch(c, r),
            dimension_semantics=("parallel", "parallel"),
            cost_estimate=estimate(2 * p * (2 * cw + rw), p, qc, qr, idx, out, lse),
        )(idx, pos, qc, qr, _chunked(idx, block_p), c, r)

    @jax.custom_vjp
    def attend(qc, qr, c_kv, k_r, idx, pos):
        return forward(qc, qr, c_kv, k_r, idx, pos)[0]

    def attend_fwd(qc, qr, c_kv, k_r, idx, pos):
        o, lse = forward(qc, qr, c_kv, k_r, idx, pos)
        return o, (qc, qr, c_kv, k_r, idx, pos, o, lse)

    def attend_bwd(res, do):
        qc, qr, c_kv, k_r, idx, pos, o, lse = res
        b, tp, n, h, _ = qc.shape
        c, r, s = _words(c_kv), _words(k_r), c_kv.shape[1]
        do = do.astype(qc.dtype)
        delta = jnp.einsum("BTnHW,BTnHW->BTH", o.astype(jnp.float32), do.astype(jnp.float32))[..., None]
        dc0 = jnp.zeros((b, n, s, c.shape[-1]), jnp.float32)
        dr0 = jnp.zeros((b, n, s, r.shape[-1]), jnp.float32)
        in_specs, tokens = specs(qc, qr, idx, do, lse, delta)
        acc = lambda x: pltpu.VMEM((n, block_p // SUBLANES, SUBLANES, x.shape[-1]), jnp.float32)  # noqa: E731
        hbm = pl.BlockSpec(memory_space=pl.ANY)
        p, cw, rw = pairs(qc, qr, idx)  # per pair: the scores again (C + R), dp (C), dc (2 C), dr (R), dq (C + R)
        # idx_s, pos_s, qc, qr, do, lse, delta, idx_v, c, r, dc0, dr0: the accumulators are inputs 10, 11.
        dqc, dqr, dc, dr = call(
            functools.partial(_backward_kernel, scale=scale, n=n), backend=backend,
            name="sparse_mla_backward", grid=(b, tp // block_t),
            in_specs=in_specs + [hbm] * 4,
            out_specs=[tokens(qc), tokens(qr), hbm, hbm],
            out_shape=[jax.ShapeDtypeStruct(qc.shape, qc.dtype), jax.ShapeDtypeStruct(qr.shape, qr.dtype),
                       jax.ShapeDtypeStruct(dc0.shape, dc0.dtype), jax.ShapeDtypeStruct(dr0.shape, dr0.dtype)],
            scratch_shapes=scratch(c, r) + [acc(c), acc(r), pltpu.SemaphoreType.DMA(())],
            input_output_aliases={10: 2, 11: 3},
            dimension_semantics=("arbitrary", "arbitrary"),
            cost_estimate=estimate(2 * p * (5 * cw + 3 * rw), p, qc, qr, do, idx, dc0, dr0, qc, qr),
        )(idx, pos, qc, qr, do, lse, delta, _chunked(idx, block_p), c, r, dc0, dr0)
        planes = lambda x, like: jnp.moveaxis(x, 1, -1).reshape(like.shape).astype(like.dtype)  # noqa: E731
        return dqc, dqr, planes(dc, c_kv), planes(dr, k_r), None, None

    attend.defvjp(attend_fwd, attend_bwd)
    return attend


def _chunked(idx, block_p: int):
    """idx [B, T, Pp] -> [B, T, Pp / block_p, block_p]: a block's slots are one row of a tile."""
    return idx.reshape(*idx.shape[:2], idx.shape[2] // block_p, block_p)


def sparse_mla_attention(q_c, q_r, c_kv, k_r, q_pos, topk_idx, *, scale: float, block_t: int = 8,
                         block_p: int = 512, backend: str = "tpu"):
    """Absorbed MLA over each query's selected keys (`reference.sparse_mla_attention`).

    q_c [B, T, H, C], q_r [B, T, H, R], c_kv [B, S, C], k_r [B, S, R] (float32 or bfloat16),
    q_pos [B, T], topk_idx [B, T, P] key positions (-1 = empty; a key also has to be
    <= q_pos). Returns o_c [B, T, H, C]. Differentiable in q_c, q_r, c_kv and k_r.
    block_t: queries per grid step; block_p: selected rows per DMA block (a multiple of 8).
    """
    b, t, h, c = q_c.shape
    s, r, p = c_kv.shape[1], k_r.shape[-1], topk_idx.shape[-1]
    if (q_r.shape[:3] != (b, t, h) or c_kv.shape != (b, s, c) or k_r.shape != (b, s, r)
            or q_pos.shape != (b, t) or topk_idx.shape[:2] != (b, t)):
        raise ValueError(f"expected q_c [B, T, H, C], q_r [B, T, H, R], c_kv [B, S, C], k_r [B, S, R], q_pos [B, T], "
                         f"topk_idx [B, T, P]; got {q_c.shape}, {q_r.shape}, {c_kv.shape}, {k_r.shape}, "
                         f"{q_pos.shape}, {topk_idx.shape}")
    n = _parts_per_word(c_kv.dtype)
    if len({q_c.dtype, q_r.dtype, c_kv.dtype, k_r.dtype}) != 1 or c % n or r % n:
        raise ValueError(f"expected one dtype for q_c, q_r, c_kv, k_r and C, R multiples of {n}; got "
                         f"{q_c.dtype}, {q_r.dtype}, {c_kv.dtype}, {k_r.dtype}, C={c}, R={r}")
    if block_p % SUBLANES or block_t % SUBLANES:
        raise ValueError(f"expected block_p and block_t multiples of {SUBLANES}, got {block_p}, {block_t}")
    bt, bp = min(block_t, t), min(block_p, round_up(p, SUBLANES))
    tp = round_up(t, bt)
    idx = pad_axis(pad_axis(topk_idx.astype(jnp.int32), 2, round_up(p, bp), value=-1), 1, tp, value=-1)
    pos = pad_axis(q_pos.astype(jnp.int32), 1, tp, value=-1)[:, :, None]  # [B, Tp, 1]
    qc, qr = (pad_axis(_split(x, n), 1, tp) for x in (q_c, q_r))
    o = _attention(float(scale), bt, bp, backend)(qc, qr, c_kv, k_r, idx, pos)
    return _merge(o)[:, :t]
