"""Pure-jnp definitions of the attention ops. Every kernel is tested against these, and on
a CPU the model runs them directly (`kernel_impl="xla"`).

MLA is computed in its absorbed form throughout: the per-head nope query is projected
into the latent space (`q_c = q_nope @ W_UK`), so attention is MQA against one shared
key/value head of width C + R (the cached `c_kv | k_rope`), and the output stays in the
latent space until `W_UV`. A selected key set (DSA's top-k) is applied by gathering those
P latent rows per query, never by masking a dense T x S matrix, and queries are processed
in blocks so memory is O(block * S) rather than O(T * S).

Legend: B batch, T queries, S keys, H heads, C kv latent, R rope dim, P selected keys,
G indexer heads, I indexer head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = float("-inf")
QUERY_BLOCK = 256


def map_query_blocks(fn, block: int, *args):
    """Applies fn to blocks of `block` queries along axis 1 of every arg, with lax.map.

    Bounds the live memory of fn's intermediates to one block; T need not divide block.
    """
    t = args[0].shape[1]
    if t <= block:
        return fn(*args)
    n = -(-t // block)
    pad = n * block - t

    def split(a):
        a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        return jnp.moveaxis(a.reshape(a.shape[0], n, block, *a.shape[2:]), 1, 0)

    out = jax.lax.map(lambda xs: fn(*xs), tuple(split(a) for a in args))

    def merge(o):
        o = jnp.moveaxis(o, 0, 1)
        return o.reshape(o.shape[0], n * block, *o.shape[3:])[:, :t]

    return jax.tree.map(merge, out)


def _softmax_rows(scores: jax.Array, valid: jax.Array) -> jax.Array:
    """Softmax over the last axis in fp32; rows with no valid entry give zeros."""
    scores = jnp.where(valid, scores.astype(jnp.float32), NEG_INF)
    peak = jnp.max(scores, axis=-1, keepdims=True)
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
    e = jnp.where(valid, jnp.exp(scores - peak), 0.0)
    return e / jnp.maximum(jnp.sum(e, axis=-1, keepdims=True), 1e-30)


def mla_attention(q_c, q_r, c_kv, k_r, q_pos, *, scale: float, block: int = QUERY_BLOCK):
    """Causal absorbed-MLA attention over every visible key.

    q_c [B, T, H, C], q_r [B, T, H, R], c_kv [B, S, C], k_r [B, S, R]; key s is at
    position s and visible to the query at q_pos [B, T] when s <= q_pos.
    Returns o_c [B, T, H, C] (fp32 softmax, output in q_c's dtype).
    """

    def attend(qc, qr, pos):
        scores = jnp.einsum("BTHC,BSC->BTHS", qc, c_kv) + jnp.einsum("BTHR,BSR->BTHS", qr, k_r)
        valid = jnp.arange(c_kv.shape[1])[None, None, None, :] <= pos[:, :, None, None]
        probs = _softmax_rows(scores * scale, valid)
        return jnp.einsum("BTHS,BSC->BTHC", probs.astype(c_kv.dtype), c_kv)

    return map_query_blocks(attend, block, q_c, q_r, q_pos)


def gather_rows(x: jax.Array, idx: jax.Array) -> jax.Array:
    """x [B, S, ...] at idx [B, T, P] -> [B, T, P, ...]; negative indices read row 0."""
    return jax.vmap(lambda xb, ib: xb[jnp.maximum(ib, 0)])(x, idx)


def sparse_mla_attention(q_c, q_r, c_kv, k_r, q_pos, topk_idx, *, scale: float, block: int = QUERY_BLOCK):
    """Absorbed-MLA attention restricted to the selected keys (DSA).

    topk_idx [B, T, P] holds key positions, -1 for empty slots; a selected key also has to
    be visible (<= q_pos). Cost O(T * P * H * (C + R)): only the P gathered rows are read.
    """

    def attend(qc, qr, pos, idx):
        c_sel, r_sel = gather_rows(c_kv, idx), gather_rows(k_r, idx)  # [B, t, P, C], [B, t, P, R]
        scores = jnp.einsum("BTHC,BTPC->BTHP", qc, c_sel) + jnp.einsum("BTHR,BTPR->BTHP", qr, r_sel)
        valid = ((idx >= 0) & (idx <= pos[..., None]))[:, :, None, :]
        probs = _softmax_rows(scores * scale, valid)
        return jnp.einsum("BTHP,BTPC->BTHC", probs.astype(c_sel.dtype), c_sel)

    return map_query_blocks(attend, block, q_c, q_r, q_pos, topk_idx)


def indexer_scores(q, w, k, q_pos, *, block: int = QUERY_BLOCK):
    """Lightning-indexer scores (DeepSeek-V3.2, DSA):

        I[t, s] = sum_g w[t, g] * relu(q[t, g] . k[s] * I^-0.5),   -inf where s > q_pos[t]

    q [B, T, G, I], w [B, T, G] (already times G^-0.5), k [B, S, I]. Returns [B, T, S] fp32.
    The [T, S, G] product exists one query block at a time.
    """
    scale = q.shape[-1] ** -0.5

    def score(qb, wb, pos):
        logits = jnp.einsum("BTGI,BSI->BTSG", qb.astype(jnp.float32), k.astype(jnp.float32)) * scale
        s = jnp.einsum("BTSG,BTG->BTS", jax.nn.relu(logits), wb.astype(jnp.float32))
        visible = jnp.arange(k.shape[1])[None, None, :] <= pos[:, :, None]
        return jnp.where(visible, s, NEG_INF)

    return map_query_blocks(score, block, q, w, q_pos)


def select_topk(scores: jax.Array, topk: int) -> jax.Array:
    """Top-k key positions [B, T, P] of scores [B, T, S], -1 where fewer than k are visible."""
    values, idx = jax.lax.top_k(scores, min(topk, scores.shape[-1]))
    return jnp.where(jnp.isfinite(values), idx, -1).astype(jnp.int32)


def indexer_topk(q, w, k, q_pos, *, topk: int, block: int = QUERY_BLOCK):
    """`select_topk(indexer_scores(...))` fused per query block: O(block * S) memory."""

    def one_block(qb, wb, pos):
        return select_topk(indexer_scores(qb, wb, k, pos, block=qb.shape[1]), topk)

    return map_query_blocks(one_block, block, q, w, q_pos)


def mla_attention_probs(q_c, q_r, c_kv, k_r, q_pos, *, scale: float):
    """Head-summed, L1-normalised attention distribution [B, T, S] (the indexer's KL target)."""
    scores = jnp.einsum("BTHC,BSC->BTHS", q_c, c_kv) + jnp.einsum("BTHR,BSR->BTHS", q_r, k_r)
    valid = jnp.arange(c_kv.shape[1])[None, None, None, :] <= q_pos[:, :, None, None]
    probs = _softmax_rows(scores * scale, valid).sum(axis=2)
    return probs / jnp.maximum(probs.sum(-1, keepdims=True), 1e-30)
