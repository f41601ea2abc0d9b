"""Absorbed MLA attention over the latent cache: prefill and decode, forward and backward.

Reference: `reference.mla_attention`. With W_UK absorbed into the query, every head
attends to the same (C + R)-wide key [c_kv | k_rope] and reads the value c_kv itself
(one 576-wide KV head for GLM-5), so the (token, head) pairs of a sequence are the rows of
one matrix: a decode step of 64 heads is a 64-row matmul against each key block, and the
latent block loaded for the scores is reused as the value (`flash.Layout.shared_kv`).

Each row carries its token's position, so per-sequence lengths (ragged decode batches,
several speculative tokens per sequence) come from q_pos alone: a row sees keys <= its
position and its program stops at the last key block any of its rows can see. Decode has
few rows per sequence, so the keys are split across programs (flash decoding) and the
partial results merged by log-sum-exp; prefill has rows to spare and uses one split.
Top-k restricted attention is `sparse_mla.py`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import flash
from pallas_kernels._backend import pad_axis, pow2, resolve, round_up

TARGET_PROGRAMS = 128  # about one program per streaming multiprocessor when splitting keys


@functools.lru_cache(maxsize=None)
def _attention(scale: float, layout: flash.Layout, splits: int, backend: str):
    """The custom-VJP op over padded row-major operands for one static configuration."""

    def _forward(q_c, q_r, c_kv, k_r, pos):
        out_dtype = q_c.dtype if splits == 1 else jnp.float32
        o, lse = flash.forward(layout, q_c, q_r, c_kv, k_r, None, pos, None, scale=scale, splits=splits,
                               out_dtype=out_dtype, backend=backend)
        o, lse = flash.merge_splits(o, lse)
        return o.astype(q_c.dtype), lse

    @jax.custom_vjp
    def attend(q_c, q_r, c_kv, k_r, pos):
        return _forward(q_c, q_r, c_kv, k_r, pos)[0]

    def fwd(q_c, q_r, c_kv, k_r, pos):
        o, lse = _forward(q_c, q_r, c_kv, k_r, pos)
        return o, (q_c, q_r, c_kv, k_r, pos, o, lse)

    def bwd(res, do):
        q_c, q_r, c_kv, k_r, pos, o, lse = res
        dq_c, dq_r, dc, dk_r, _ = flash.backward(layout, q_c, q_r, c_kv, k_r, None, pos, None, o, lse, do,
                                                 scale=scale, backend=backend)
        return dq_c, dq_r, dc, dk_r, None

    attend.defvjp(fwd, bwd)
    return attend


def mla_attention(q_c, q_r, c_kv, k_r, q_pos, *, scale: float, block_m: int = 64, block_k: int | None = None,
                  splits: int | None = None, backend: str | None = None):
    """Causal absorbed-MLA attention (the signature of `reference.mla_attention`).

    q_c [B, T, H, C], q_r [B, T, H, R], c_kv [B, S, C], k_r [B, S, R], q_pos [B, T]; key s
    is visible to the query at q_pos when s <= q_pos. Returns o_c [B, T, H, C].
    block_k: keys per step (None: 64, or 32 for latents wider than 256, whose key block
    doubles as the value block and must fit Triton's shared memory twice over).
    splits: key splits per row block (None: enough to give ~TARGET_PROGRAMS programs).
    """
    backend = resolve(backend)
    b, t, h, c = q_c.shape
    s, r = c_kv.shape[1], k_r.shape[-1]
    if q_r.shape[:3] != (b, t, h) or c_kv.shape != (b, s, c) or k_r.shape != (b, s, r) or q_pos.shape != (b, t):
        raise ValueError(f"expected q_c [B, T, H, C], q_r [B, T, H, R], c_kv [B, S, C], k_r [B, S, R], q_pos [B, T]; "
                         f"got {q_c.shape}, {q_r.shape}, {c_kv.shape}, {k_r.shape}, {q_pos.shape}")
    m = t * h
    bm = min(block_m, pow2(m, 16))
    bk = min(block_k or (64 if c <= 256 else 32), pow2(s, 16))
    mp, sp, cp, rp = round_up(m, bm), round_up(s, bk), pow2(c, 16), pow2(r, 16)
    row_blocks, key_blocks = mp // bm, sp // bk
    if splits is None:
        splits = max(1, min(key_blocks, TARGET_PROGRAMS // (b * row_blocks)))
    splits = min(splits, key_blocks)

    def rows(x, width):  # [B, T, H, W] -> [B, T * H, width]: row t * H + h
        return pad_axis(pad_axis(x.reshape(b, m, x.shape[-1]), 1, mp), 2, width)

    pos = jnp.repeat(jnp.minimum(q_pos.astype(jnp.int32), s - 1), h, axis=1)
    pos = pad_axis(pos, 1, mp, value=-1)
    keys = lambda x, width: pad_axis(pad_axis(x, 1, sp), 2, width)  # noqa: E731
    layout = flash.Layout(block_m=bm, block_k=bk, has_q2=True, shared_kv=True, has_bits=False, bits_group=1)
    op = _attention(float(scale), layout, splits, backend)
    o = op(rows(q_c, cp), rows(q_r, rp), keys(c_kv, cp), keys(k_r, rp), pos)
    return o[:, :m, :c].reshape(b, t, h, c)
