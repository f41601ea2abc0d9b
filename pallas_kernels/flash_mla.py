"""Flash MLA prefill in the expanded (training) form, forward and backward.

Reference: `reference.mla_attention_expanded`. Training runs MLA expanded: each head has
its own key [k_nope | k_rope] (width E = K + R, the rope half shared) and value (V), so
attention is ordinary multi-head attention and FlashAttention-2 applies as is: the shared
core in `flash.py`, with n = (batch, head) and rows = tokens. Causal by position (key s is
visible to the query at q_pos when s <= q_pos), so query blocks stop at their last
visible key block and the dk / dv kernel skips query blocks that see none of its keys.

Top-k selection (DSA's sparse training stage) is applied as a bit mask: topk_idx
[B, T, P] is scattered into one bit per (query, key), [B, T, S / 32] int32 words (T * S / 8
bytes, shared by the heads), and the kernels then walk key blocks of 32 keys, one word per
row. The work stays dense (T x S per head); the O(T * P) sparse form is `sparse_mla.py`,
which runs absorbed.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import flash
from pallas_kernels._backend import pad_axis, pow2, resolve, round_up


def selection_bits(topk_idx: jax.Array, num_words: int) -> jax.Array:
    """topk_idx [B, T, P] (distinct per row, -1 = empty) -> [B, T, num_words] int32 where
    bit s % 32 of word s // 32 is set iff key s is selected."""
    word = jnp.where(topk_idx >= 0, topk_idx // flash.BITS, num_words)  # empty slots fall off the end
    bit = jnp.left_shift(jnp.uint32(1), (jnp.maximum(topk_idx, 0) % flash.BITS).astype(jnp.uint32))
    row = lambda w, b: jnp.zeros(num_words, jnp.uint32).at[w].add(b, mode="drop")  # noqa: E731  (distinct: add == or)
    return jax.lax.bitcast_convert_type(jax.vmap(jax.vmap(row))(word, bit), jnp.int32)


@functools.lru_cache(maxsize=None)
def _attention(t: int, s: int, heads: int, scale: float, layout: flash.Layout, backend: str):
    """The custom-VJP op over padded, head-major operands for one static configuration."""

    @jax.custom_vjp
    def attend(q, k, v, pos, bits):
        return _forward(q, k, v, pos, bits)[0]

    def _forward(q, k, v, pos, bits):
        o, lse = flash.forward(layout, q, None, k, None, v, pos, bits, scale=scale, splits=1,
                               out_dtype=q.dtype, backend=backend)
        return o[:, 0], lse[:, 0]

    def fwd(q, k, v, pos, bits):
        o, lse = _forward(q, k, v, pos, bits)
        return o, (q, k, v, pos, bits, o, lse)

    def bwd(res, do):
        q, k, v, pos, bits, o, lse = res
        dq, _, dk, _, dv = flash.backward(layout, q, None, k, None, v, pos, bits, o, lse, do,
                                          scale=scale, backend=backend)
        return dq, dk, dv, None, None

    attend.defvjp(fwd, bwd)
    return attend


def flash_mla_prefill(q, k, v, q_pos, topk_idx=None, *, scale: float, block_q: int = 64, block_k: int = 64,
                      backend: str | None = None):
    """Causal expanded MLA. q [B, T, H, E], k [B, S, H, E], v [B, S, H, V], q_pos [B, T];
    optional topk_idx [B, T, P] (distinct keys per row, -1 = empty). Returns [B, T, H, V].
    Differentiable in q, k and v."""
    backend = resolve(backend)
    b, t, h, e = q.shape
    s, vd = k.shape[1], v.shape[-1]
    if k.shape != (b, s, h, e) or v.shape[:3] != (b, s, h) or q_pos.shape != (b, t):
        raise ValueError(f"expected q [B, T, H, E], k [B, S, H, E], v [B, S, H, V], q_pos [B, T]; got "
                         f"{q.shape}, {k.shape}, {v.shape}, {q_pos.shape}")
    masked = topk_idx is not None
    bm = min(block_q, pow2(t, 16))
    bk = flash.BITS if masked else min(block_k, pow2(s, 16))
    tp, sp, ep, vp = round_up(t, bm), round_up(s, bk), pow2(e, 16), pow2(vd, 16)

    def heads_first(x, rows, width):  # [B, X, H, W] -> [B * H, rows, width], zero padded
        x = jnp.swapaxes(x, 1, 2).reshape(b * h, x.shape[1], x.shape[-1])
        return pad_axis(pad_axis(x, 1, rows), 2, width)

    pos = pad_axis(jnp.minimum(q_pos.astype(jnp.int32), s - 1), 1, tp, value=-1)
    pos = jnp.repeat(pos, h, axis=0)  # [B * H, tp]: row n = b * H + h
    bits = pad_axis(selection_bits(topk_idx, sp // flash.BITS), 1, tp) if masked else None
    layout = flash.Layout(block_m=bm, block_k=bk, has_q2=False, shared_kv=False, has_bits=masked, bits_group=h)
    op = _attention(t, s, h, float(scale), layout, backend)
    o = op(heads_first(q, tp, ep), heads_first(k, sp, ep), heads_first(v, sp, vp), pos, bits)
    return jnp.swapaxes(o[:, :t, :vd].reshape(b, h, t, vd), 1, 2)
