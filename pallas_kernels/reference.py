"""Pure-jnp definitions of the attention ops. Every kernel is tested against these, and on
a CPU the model runs them directly (`kernel_impl="xla"`).

MLA is computed in its absorbed form throughout: the per-head nope query is projected
into the latent space (`q_c = q_nope @ W_UK`), so attention is MQA against one shared
key/value head of width C + R (the cached `c_kv | k_rope`), and the output stays in the
latent space until `W_UV`. A selected key set (DSA's top-k) is applied by gathering those
P latent rows per query, never by masking a dense T x S matrix, and queries are processed
in blocks so memory is O(block * S) rather than O(T * S).

Costs follow the attention pattern: a query block walks the key blocks only up to its
last visible key (causal prefill does half the square; a decode step reads only the
filled part of its cache). The walk has a static length and skips blocks with
`lax.cond`, so reverse mode goes through it; query blocks are rematerialised in the
backward pass, so training memory stays O(block * S) too.

The ops with loops are wrapped in ``jit_when_eager``: an eager call (a notebook's
``model(ids)``) runs them compiled, once per shape, where an unjitted ``lax.fori_loop`` or
``lax.map`` traces and compiles its body again at every call; inside a traced caller they
are plain functions, optimised together with the rest of the caller's program.

Legend: B batch, T queries, S keys, H heads, C kv latent, R rope dim, P selected keys,
G indexer heads, I indexer head dim, E expanded query/key width (nope + rope), V value dim.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

NEG_INF = float("-inf")
_NEG = -1e30  # finite "minus infinity" of the online softmax: _NEG - _NEG is 0, not nan
QUERY_BLOCK = 256
KEY_BLOCK = 1024  # keys per step of the walk (decode included: measured best on CPU)
SPARSE_QUERY_BLOCK = 16  # the gathered rows of a block, [16, P, C + R], stay in cache
TOPK_BANDS = 8  # key bands the indexer's selection chooses among (indexer_topk)


def jit_when_eager(fn=None, *, static_argnames: tuple[str, ...] = ()):
    """fn itself when any argument is a tracer (it is then inlined into the caller's
    program), ``jax.jit(fn)`` when every argument is concrete."""
    if fn is None:
        return functools.partial(jit_when_eager, static_argnames=static_argnames)
    jitted = jax.jit(fn, static_argnames=static_argnames)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        traced = any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((args, kwargs)))
        return (fn if traced else jitted)(*args, **kwargs)

    return call


def map_query_blocks(fn, block: int, *args):
    """Applies fn to blocks of `block` queries along axis 1 of every arg, with lax.map.

    Bounds the live memory of fn's intermediates to one block, in the backward pass as
    well (each block is recomputed there); T need not divide block.
    """
    t = args[0].shape[1]
    if t <= block:
        return fn(*args)
    n = -(-t // block)
    pad = n * block - t

    def split(a):
        a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        return jnp.moveaxis(a.reshape(a.shape[0], n, block, *a.shape[2:]), 1, 0)

    out = jax.lax.map(jax.checkpoint(lambda xs: fn(*xs)), tuple(split(a) for a in args))

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


def _walk_keys(step, carry, pos, num_keys: int, size: int):
    """carry = step(j, start, fresh, carry) for the key blocks j that hold a key visible
    at some position in pos. Block j covers keys [start, start + size); the last block is
    shifted back to end at num_keys, and `fresh` [size] marks its keys not seen before."""
    visible_blocks = jnp.minimum(jnp.max(pos), num_keys - 1) // size + 1

    def body(j, carry):
        start = jnp.minimum(j * size, num_keys - size)
        fresh = start + jnp.arange(size) >= j * size
        return jax.lax.cond(j < visible_blocks, lambda c: step(j, start, fresh, c), lambda c: c, carry)

    return jax.lax.fori_loop(0, -(-num_keys // size), body, carry)


@jit_when_eager(static_argnames=("scale", "block", "key_block"))
def mla_attention(q_c, q_r, c_kv, k_r, q_pos, *, scale: float, block: int = QUERY_BLOCK,
                  key_block: int = KEY_BLOCK):
    """Causal absorbed-MLA attention over every visible key.

    q_c [B, T, H, C], q_r [B, T, H, R], c_kv [B, S, C], k_r [B, S, R]; key s is at
    position s and visible to the query at q_pos [B, T] when s <= q_pos.
    Returns o_c [B, T, H, C] (fp32 softmax, output in q_c's dtype).

    The online softmax of FlashAttention over blocks of key_block keys; the (token, head)
    pairs of a query block are the rows of one matmul against the shared latent key.
    """
    num_keys = c_kv.shape[1]

    def attend(qc, qr, pos):
        b, t, h, _ = qc.shape
        rows = lambda x: x.reshape(b, t * h, x.shape[-1])  # noqa: E731  [B, M, .], row m = t * H + h
        row_pos = jnp.repeat(pos, h, axis=1)[:, :, None]  # [B, M, 1]
        size = min(key_block, num_keys)

        def step(j, start, fresh, carry):
            acc, peak, total = carry
            c_j, r_j = (jax.lax.dynamic_slice_in_dim(x, start, size, 1) for x in (c_kv, k_r))
            scores = jnp.einsum("BMC,BSC->BMS", rows(qc), c_j) + jnp.einsum("BMR,BSR->BMS", rows(qr), r_j)
            valid = fresh & (start + jnp.arange(size) <= row_pos)
            scores = jnp.where(valid, scores.astype(jnp.float32) * scale, _NEG)
            new_peak = jnp.maximum(peak, scores.max(-1))
            p = jnp.where(valid, jnp.exp(scores - new_peak[..., None]), 0.0)
            fix = jnp.exp(peak - new_peak)
            acc = acc * fix[..., None] + jnp.einsum("BMS,BSC->BMC", p.astype(c_j.dtype), c_j)
            return acc, new_peak, total * fix + p.sum(-1)

        init = (jnp.zeros((b, t * h, c_kv.shape[-1]), jnp.float32), jnp.full((b, t * h), _NEG), jnp.zeros((b, t * h)))
        acc, _, total = _walk_keys(step, init, pos, num_keys, size)
        return (acc / jnp.maximum(total, 1e-30)[..., None]).reshape(qc.shape).astype(qc.dtype)

    return map_query_blocks(attend, block, q_c, q_r, q_pos)


def gather_rows(x: jax.Array, idx: jax.Array) -> jax.Array:
    """x [B, S, ...] at idx [B, T, P] -> [B, T, P, ...]; negative indices read row 0."""
    return jax.vmap(lambda xb, ib: xb[jnp.maximum(ib, 0)])(x, idx)


@jit_when_eager(static_argnames=("scale", "block"))
def sparse_mla_attention(q_c, q_r, c_kv, k_r, q_pos, topk_idx, *, scale: float,
                         block: int = SPARSE_QUERY_BLOCK):
    """Absorbed-MLA attention restricted to the selected keys (DSA).

    topk_idx [B, T, P] holds key positions, -1 for empty slots; a selected key also has to
    be visible (<= q_pos). Cost O(T * P * H * (C + R)): only the P gathered rows are read,
    a few queries at a time so that they are still in cache when the einsums read them.
    """

    def attend(qc, qr, pos, idx):
        c_sel, r_sel = gather_rows(c_kv, idx), gather_rows(k_r, idx)  # [B, t, P, C], [B, t, P, R]
        scores = jnp.einsum("BTHC,BTPC->BTHP", qc, c_sel) + jnp.einsum("BTHR,BTPR->BTHP", qr, r_sel)
        valid = ((idx >= 0) & (idx <= pos[..., None]))[:, :, None, :]
        probs = _softmax_rows(scores * scale, valid)
        return jnp.einsum("BTHP,BTPC->BTHC", probs.astype(c_sel.dtype), c_sel)

    return map_query_blocks(attend, block, q_c, q_r, q_pos, topk_idx)


@jit_when_eager(static_argnames=("block", "key_block"))
def indexer_scores(q, w, k, q_pos, *, block: int = QUERY_BLOCK, key_block: int = KEY_BLOCK):
    """Lightning-indexer scores (DeepSeek-V3.2, DSA):

        I[t, s] = sum_g w[t, g] * relu(q[t, g] . k[s] * I^-0.5),   -inf where s > q_pos[t]

    q [B, T, G, I], w [B, T, G] (already times G^-0.5), k [B, S, I]. Returns [B, T, S] fp32.
    A query block accumulates one head at a time into its [block, key_block] score tile,
    so the [T, S, G] product never exists; key blocks past its last visible key stay -inf.
    """
    k = k.astype(jnp.float32)
    return map_query_blocks(lambda qb, wb, pos: _score_block(qb, wb, pos, k, key_block), block, q, w, q_pos)


def _score_block(q, w, pos, k, key_block: int):
    """indexer_scores of one query block q [B, t, G, I] against all keys k [B, S, I]."""
    num_keys, scale = k.shape[1], q.shape[-1] ** -0.5
    q, w = q.astype(jnp.float32), w.astype(jnp.float32)
    size = min(key_block, num_keys)

    def step(j, start, fresh, out):  # an overlapping last block rewrites equal scores
        k_j = jax.lax.dynamic_slice_in_dim(k, start, size, 1)
        s = sum(w[:, :, g, None] * jax.nn.relu(jnp.einsum("BTI,BSI->BTS", q[:, :, g], k_j) * scale)
                for g in range(q.shape[2]))
        return jax.lax.dynamic_update_slice_in_dim(out, s, start, 2)

    out = _walk_keys(step, jnp.zeros(q.shape[:2] + (num_keys,), jnp.float32), pos, num_keys, size)
    visible = jnp.arange(num_keys)[None, None, :] <= pos[:, :, None]
    return jnp.where(visible, out, NEG_INF)


def select_topk(scores: jax.Array, topk: int) -> jax.Array:
    """Top-k key positions [B, T, P] of scores [B, T, S], -1 where fewer than k are visible."""
    values, idx = jax.lax.top_k(scores, min(topk, scores.shape[-1]))
    return jnp.where(jnp.isfinite(values), idx, -1).astype(jnp.int32)


def key_bands(num_keys: int) -> list[int]:
    """The key counts a query block's selection may scan: num_keys cut into at most
    TOPK_BANDS equal bands of whole KEY_BLOCKs, as [band, 2 * band, ..., num_keys]."""
    band = -(-num_keys // TOPK_BANDS // KEY_BLOCK) * KEY_BLOCK
    return [min(j * band, num_keys) for j in range(1, -(-num_keys // band) + 1)]


@jit_when_eager(static_argnames=("topk", "block"))
def indexer_topk(q, w, k, q_pos, *, topk: int, block: int = QUERY_BLOCK):
    """`select_topk(indexer_scores(...))` fused per query block: O(block * S) memory.

    A block scores and ranks only the keys up to its last visible one, rounded up to a
    band of `key_bands` (a `lax.switch` over the bands): `top_k`'s cost grows with the keys
    it scans, and causally the first half of the blocks sees under half of them. The
    keys left out are invisible to the whole block, so the selection is the same.
    """

    k = k.astype(jnp.float32)
    width = min(topk, k.shape[1])

    def over(length):
        def select(qb, wb, pos):
            idx = select_topk(_score_block(qb, wb, pos, k[:, :length], KEY_BLOCK), topk)
            return jnp.pad(idx, [(0, 0), (0, 0), (0, width - idx.shape[-1])], constant_values=-1)
        return select

    bands = key_bands(k.shape[1])

    def one_block(qb, wb, pos):
        if len(bands) == 1:
            return over(bands[0])(qb, wb, pos)
        band = jnp.clip(jnp.max(pos) // bands[0], 0, len(bands) - 1)  # the band holding the last visible key
        return jax.lax.switch(band, [over(n) for n in bands], qb, wb, pos)

    return map_query_blocks(one_block, block, q, w, q_pos)


def mla_attention_probs(q_c, q_r, c_kv, k_r, q_pos, *, scale: float):
    """Head-summed, L1-normalised attention distribution [B, T, S] (the indexer's KL target)."""
    scores = jnp.einsum("BTHC,BSC->BTHS", q_c, c_kv) + jnp.einsum("BTHR,BSR->BTHS", q_r, k_r)
    valid = jnp.arange(c_kv.shape[1])[None, None, None, :] <= q_pos[:, :, None, None]
    probs = _softmax_rows(scores * scale, valid).sum(axis=2)
    return probs / jnp.maximum(probs.sum(-1, keepdims=True), 1e-30)


def selected_keys(topk_idx: jax.Array, num_keys: int) -> jax.Array:
    """topk_idx [B, T, P] (-1 = empty) -> [B, T, S] bool: which keys each query selected."""
    mark = lambda idx: jnp.zeros(num_keys, bool).at[jnp.where(idx >= 0, idx, num_keys)].set(True, mode="drop")  # noqa: E731
    return jax.vmap(jax.vmap(mark))(topk_idx)


@jit_when_eager(static_argnames=("scale", "block"))
def mla_attention_expanded(q, k, v, q_pos, topk_idx=None, *, scale: float, block: int = QUERY_BLOCK):
    """MLA in its expanded (training) form: per-head keys and values.

    q [B, T, H, E], k [B, S, H, E] (E = nope + rope dims, concatenated), v [B, S, H, V];
    key s is visible to the query at q_pos [B, T] when s <= q_pos and, if topk_idx
    [B, T, P] is given, s is among its selected keys. Returns [B, T, H, V].
    """

    def attend(qb, pos, *idx):
        scores = jnp.einsum("BTHE,BSHE->BTHS", qb, k) * scale
        valid = jnp.arange(k.shape[1])[None, None, :] <= pos[:, :, None]
        if idx:
            valid &= selected_keys(idx[0], k.shape[1])
        probs = _softmax_rows(scores, valid[:, :, None, :])
        return jnp.einsum("BTHS,BSHV->BTHV", probs.astype(v.dtype), v)

    extra = () if topk_idx is None else (topk_idx,)
    return map_query_blocks(attend, block, q, q_pos, *extra)


FP8_E4M3_MAX = 448.0


def fp8_e4m3_blockwise(x: jax.Array, block: int = 128):
    """FP8 e4m3 with one fp32 scale per `block` consecutive values of the last axis (the
    DeepSeek-V3.2 indexer's `act_quant`): x ~ values * scale, scale = amax / 448.

    x [..., I] with I <= block or I % block == 0. Returns (values [..., I] float8_e4m3fn,
    scales [..., ceil(I / block)] fp32).
    """
    width = x.shape[-1]
    if width > block and width % block:
        raise ValueError(f"fp8 blocks of {block}: the last axis must be <= {block} or a multiple of it, got {width}")
    groups = max(1, width // block)
    xg = x.astype(jnp.float32).reshape(*x.shape[:-1], groups, width // groups)
    amax = jnp.max(jnp.abs(xg), axis=-1, keepdims=True)
    scale = jnp.where(amax > 0, amax / FP8_E4M3_MAX, 1.0)
    values = (xg / scale).astype(jnp.float8_e4m3fn).reshape(x.shape)
    return values, scale[..., 0]


def fp8_dequantize(values: jax.Array, scales: jax.Array) -> jax.Array:
    """Inverse of `fp8_e4m3_blockwise`: [..., I] fp32."""
    groups = scales.shape[-1]
    v = values.astype(jnp.float32).reshape(*values.shape[:-1], groups, values.shape[-1] // groups)
    return (v * scales[..., None]).reshape(values.shape)
