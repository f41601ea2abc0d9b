"""Sparse MLA (DSA): absorbed attention over the gathered top-k latent rows, prefill and
decode, forward and backward.

Reference: `reference.sparse_mla_attention`. Each query token t selected P keys
(topk_idx, -1 = empty); all H heads of that token attend over the same P rows, so one
program per token gathers P_blk rows of c_kv and k_rope at a time (pointer gathers in
Triton) and runs an H-row online softmax over them (FlashMLA's sparse decode layout).
Work and traffic are O(T * P * (C + R)) whatever the context length; decode is the T = 1
case, with per-sequence lengths in q_pos (a selected key must also be <= q_pos).

Backward (delta = rowsum(o * do)): the same walk recomputes p, accumulates dq in
registers and adds each selected row's gradient, ds^T q (keys) + p^T do (values, which are
c_kv again), into fp32 dc_kv / dk_rope buffers with atomic adds. Empty slots add zeros
to a spare row S past the end, so no mask is needed; atomics make repeated keys across
tokens safe (interpret mode runs programs one at a time; it needs the indices of one
row to be distinct, which top-k indices are).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from pallas_kernels._backend import (
    NEG,
    call,
    mm,
    mm_nt,
    mm_tn,
    pad_axis,
    pow2,
    resolve,
    round_up,
)


def _gathered(idx_ref, pos, j, block_p: int):
    idx = idx_ref[pl.ds(j * block_p, block_p)]
    valid = (idx >= 0) & (idx <= pos)
    return idx, valid, jnp.where(valid, idx, 0)


def _forward_kernel(qc_ref, qr_ref, c_ref, r_ref, idx_ref, pos_ref, o_ref, lse_ref, *, scale: float, block_p: int):
    qc, qr, pos = qc_ref[...], qr_ref[...], pos_ref[...]
    rows = qc.shape[0]

    def body(j, carry):
        acc, m_prev, l_prev = carry
        _, valid, safe = _gathered(idx_ref, pos, j, block_p)
        c, r = c_ref[safe, :], r_ref[safe, :]  # [P_blk, C], [P_blk, R]
        s = jnp.where(valid[None, :], (mm_nt(qc, c) + mm_nt(qr, r)) * scale, NEG)  # [H, P_blk]
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
        p = jnp.where(valid[None, :], jnp.exp(s - m_next[:, None]), 0.0)
        correction = jnp.exp(m_prev - m_next)
        return acc * correction[:, None] + mm(p.astype(c.dtype), c), m_next, l_prev * correction + p.sum(axis=1)

    init = (jnp.zeros(qc.shape, jnp.float32), jnp.full((rows,), NEG, jnp.float32), jnp.zeros((rows,), jnp.float32))
    acc, m, l = jax.lax.fori_loop(0, idx_ref.shape[0] // block_p, body, init)
    seen = l > 0
    o_ref[...] = (acc / jnp.where(seen, l, 1.0)[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), NEG)


def _backward_kernel(qc_ref, qr_ref, c_ref, r_ref, idx_ref, pos_ref, do_ref, lse_ref, delta_ref, _dc_in, _dr_in,
                     dqc_ref, dqr_ref, dc_ref, dr_ref, *, scale: float, block_p: int):
    qc, qr, pos, do, lse, delta = (x[...] for x in (qc_ref, qr_ref, pos_ref, do_ref, lse_ref, delta_ref))
    spare = c_ref.shape[0]  # the row past the end that absorbs empty slots

    def body(j, carry):
        dqc, dqr = carry
        _, valid, safe = _gathered(idx_ref, pos, j, block_p)
        c, r = c_ref[safe, :], r_ref[safe, :]
        s = (mm_nt(qc, c) + mm_nt(qr, r)) * scale
        p = jnp.where(valid[None, :], jnp.exp(s - lse[:, None]), 0.0)  # [H, P_blk]
        ds = p * (mm_nt(do, c) - delta[:, None]) * scale
        dc = mm_tn(ds.astype(qc.dtype), qc) + mm_tn(p.astype(do.dtype), do)  # [P_blk, C]
        dr = mm_tn(ds.astype(qr.dtype), qr)  # [P_blk, R]
        target = jnp.where(valid, safe, spare)[:, None]
        for ref, val in ((dc_ref, dc), (dr_ref, dr)):
            cols = jax.lax.broadcasted_iota(jnp.int32, val.shape, 1)
            pl_triton.atomic_add(ref, (jnp.broadcast_to(target, val.shape), cols), val)
        return dqc + mm(ds.astype(c.dtype), c), dqr + mm(ds.astype(r.dtype), r)

    init = (jnp.zeros(qc.shape, jnp.float32), jnp.zeros(qr.shape, jnp.float32))
    dqc, dqr = jax.lax.fori_loop(0, idx_ref.shape[0] // block_p, body, init)
    dqc_ref[...] = dqc.astype(dqc_ref.dtype)
    dqr_ref[...] = dqr.astype(dqr_ref.dtype)


def _token(x):
    """BlockSpec of one token's slice of a [B, T, ...] array on grid (b, t, ...)."""
    return pl.BlockSpec((None, None) + x.shape[2:], lambda b, t, *_: (b, t) + (0,) * (x.ndim - 2))


def _whole(x):
    """BlockSpec of one batch row of a [B, ...] array on grid (b, t, ...)."""
    return pl.BlockSpec((None,) + x.shape[1:], lambda b, *_: (b,) + (0,) * (x.ndim - 1))


def _heads(x, block_h: int):
    """BlockSpec of one token's block_h heads of a [B, T, H, ...] array on grid (b, t, h)."""
    return pl.BlockSpec((None, None, block_h) + x.shape[3:], lambda b, t, g: (b, t, g) + (0,) * (x.ndim - 3))


@functools.lru_cache(maxsize=None)
def _attention(scale: float, block_p: int, block_p_bwd: int, block_h: int, backend: str):

    def _forward(qc, qr, c, r, idx, pos):
        b, t, h, cw = qc.shape
        return call(
            functools.partial(_forward_kernel, scale=scale, block_p=block_p), backend=backend, grid=(b, t),
            in_specs=[_token(qc), _token(qr), _whole(c), _whole(r), _token(idx), _token(pos)],
            out_specs=[_token(qc), pl.BlockSpec((None, None, h), lambda i, j: (i, j, 0))],
            out_shape=[jax.ShapeDtypeStruct(qc.shape, qc.dtype), jax.ShapeDtypeStruct((b, t, h), jnp.float32)],
            name="sparse_mla_forward",
        )(qc, qr, c, r, idx, pos)

    @jax.custom_vjp
    def attend(qc, qr, c, r, idx, pos):
        return _forward(qc, qr, c, r, idx, pos)[0]

    def fwd(qc, qr, c, r, idx, pos):
        o, lse = _forward(qc, qr, c, r, idx, pos)
        return o, (qc, qr, c, r, idx, pos, o, lse)

    def bwd(res, do):
        qc, qr, c, r, idx, pos, o, lse = res
        b, t, h, _ = qc.shape
        s = c.shape[1]
        delta = jnp.einsum("BTHC,BTHC->BTH", o.astype(jnp.float32), do.astype(jnp.float32))
        dc0 = jnp.zeros((b, s + 1, c.shape[-1]), jnp.float32)
        dr0 = jnp.zeros((b, s + 1, r.shape[-1]), jnp.float32)
        # grid (b, t, head block): a program holds block_h heads' q, do and dq, so a wide
        # latent (GLM-5's C = 512 at 64 heads) stays inside shared memory and registers.
        row = pl.BlockSpec((None, None, block_h), lambda i, j, g: (i, j, g))
        dqc, dqr, dc, dr = call(
            functools.partial(_backward_kernel, scale=scale, block_p=block_p_bwd), backend=backend,
            grid=(b, t, h // block_h),
            in_specs=[_heads(qc, block_h), _heads(qr, block_h), _whole(c), _whole(r), _token(idx), _token(pos),
                      _heads(do, block_h), row, row, _whole(dc0), _whole(dr0)],
            out_specs=[_heads(qc, block_h), _heads(qr, block_h), _whole(dc0), _whole(dr0)],
            out_shape=[jax.ShapeDtypeStruct(qc.shape, qc.dtype), jax.ShapeDtypeStruct(qr.shape, qr.dtype),
                       jax.ShapeDtypeStruct(dc0.shape, dc0.dtype), jax.ShapeDtypeStruct(dr0.shape, dr0.dtype)],
            input_output_aliases={9: 2, 10: 3},
            name="sparse_mla_backward",
        )(qc, qr, c, r, idx, pos, do.astype(qc.dtype), lse, delta, dc0, dr0)
        return dqc, dqr, dc[:, :s].astype(c.dtype), dr[:, :s].astype(r.dtype), None, None

    attend.defvjp(fwd, bwd)
    return attend


def sparse_mla_attention(q_c, q_r, c_kv, k_r, q_pos, topk_idx, *, scale: float, block_p: int | None = None,
                         block_h: int | None = None, backend: str | None = None):
    """Absorbed MLA over each query's selected keys (the signature of
    `reference.sparse_mla_attention`).

    q_c [B, T, H, C], q_r [B, T, H, R], c_kv [B, S, C], k_r [B, S, R], q_pos [B, T],
    topk_idx [B, T, P] key positions (-1 = empty; a key also has to be <= q_pos).
    Returns o_c [B, T, H, C]. Differentiable in q_c, q_r, c_kv and k_r.
    block_p: selected rows gathered per step (None: 64; the backward then gathers 16 for
    latents wider than 256). block_h: heads per backward program (None: as many as keep
    block_h * C <= 16384). The defaults for GLM-5's C = 512 at 64 heads are the fastest that
    fit an H200's shared memory (results/gpu_kernels.json, "sweep").
    """
    backend = resolve(backend)
    b, t, h, c = q_c.shape
    s, r, p = c_kv.shape[1], k_r.shape[-1], topk_idx.shape[-1]
    if (q_r.shape[:3] != (b, t, h) or c_kv.shape != (b, s, c) or k_r.shape != (b, s, r)
            or q_pos.shape != (b, t) or topk_idx.shape[:2] != (b, t)):
        raise ValueError(f"expected q_c [B, T, H, C], q_r [B, T, H, R], c_kv [B, S, C], k_r [B, S, R], q_pos [B, T], "
                         f"topk_idx [B, T, P]; got {q_c.shape}, {q_r.shape}, {c_kv.shape}, {k_r.shape}, "
                         f"{q_pos.shape}, {topk_idx.shape}")
    bp = min(block_p or 64, pow2(p, 16))
    bp_bwd = min(bp, 16) if block_p is None and c > 256 else bp
    hp, cp, rp = pow2(h, 16), pow2(c, 16), pow2(r, 16)
    heads = lambda x, w: pad_axis(pad_axis(x, 2, hp), 3, w)  # noqa: E731
    idx = pad_axis(topk_idx.astype(jnp.int32), 2, round_up(p, bp), value=-1)
    bh = min(hp, pow2(block_h or max(16, 16384 // cp), 16))
    op = _attention(float(scale), bp, bp_bwd, bh, backend)
    o = op(heads(q_c, cp), heads(q_r, rp), pad_axis(c_kv, 2, cp), pad_axis(k_r, 2, rp), idx, q_pos.astype(jnp.int32))
    return o[:, :, :h, :c]
