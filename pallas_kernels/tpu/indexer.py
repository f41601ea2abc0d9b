"""The DSA lightning indexer (DeepSeek-V3.2) as a Mosaic kernel: blockwise causal scores,
then top-k per chunk of queries.

Reference: `reference.indexer_scores` / `reference.indexer_topk`:

    I[t, s] = sum_g w[t, g] * relu(q[t, g] . k[s] * I^-0.5),   -inf where s > q_pos[t]

Grid (b, query block, key block), every axis parallel. A step scores block_q queries
against block_k keys one head at a time (one [block_q, I] x [I, block_k] MXU matmul per
head, weighted into one fp32 [block_q, block_k] tile), so the [T, S, G] product never
exists. The key block index is clamped to the query block's last visible key block
(scalar-prefetched), so the invisible blocks of a causal prefill are neither read from
HBM nor computed: they are written as -inf.

Selection: `jax.lax.top_k` over the scores of `chunk` queries at a time, so the score
buffer is [chunk, S], never [T, S]. An exact top-k inside Mosaic would be k passes of
arg-max over the row (O(k * S) vector work, ruinous at GLM-5's k = 2048) or a
compaction of the selected positions, which needs a scatter Mosaic does not have; XLA's
TopK on a TPU is a tuned sort. Like the reference, the chunk ranks only the keys up to a
band (`reference.key_bands`) that holds its last visible key, and it breaks ties and
fills the slots of invisible keys (-1) by `reference.select_topk`, so the selections are
the reference's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import reference
from pallas_kernels._backend import pad_axis, round_up
from pallas_kernels.tpu._mosaic import call, causal_pairs, estimate


def _mm_nt(a, b):
    """a [M, K] @ b [N, K]^T in fp32; an explicit precision, so that a global default of
    "highest" cannot ask the MXU for fp32 passes over bf16 operands (Mosaic refuses them)."""
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else jax.lax.Precision.DEFAULT
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32)


def _scores_kernel(last_ref, q_ref, w_ref, k_ref, pos_ref, o_ref, *, scale: float, query_blocks: int):
    """One [block_q, block_k] tile of scores. last_ref [B * nq] (SMEM): each query block's
    last visible key block; q_ref [G, block_q, I], w_ref [block_q, G], k_ref [block_k, I],
    pos_ref [block_q, 1], o_ref [block_q, block_k]."""
    b, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    visible = j <= last_ref[b * query_blocks + i]
    block_q, block_k = o_ref.shape

    @pl.when(visible)
    def _():
        k = k_ref[...]
        w = w_ref[...].astype(jnp.float32)
        tile = jnp.zeros((block_q, block_k), jnp.float32)
        for g in range(q_ref.shape[0]):  # static: w's column g is a static lane slice
            tile += w[:, g:g + 1] * jnp.maximum(_mm_nt(q_ref[g], k) * scale, 0.0)
        key_pos = j * block_k + jax.lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
        o_ref[...] = jnp.where(key_pos <= pos_ref[...], tile, -jnp.inf)

    @pl.when(jnp.logical_not(visible))
    def _():
        o_ref[...] = jnp.full((block_q, block_k), -jnp.inf, jnp.float32)


def indexer_scores(q, w, k, q_pos, *, block_q: int = 128, block_k: int = 512, backend: str = "tpu"):
    """q [B, T, G, I], w [B, T, G], k [B, S, I], q_pos [B, T] -> scores [B, T, S] fp32,
    -inf where s > q_pos (`reference.indexer_scores`)."""
    b, t, g, i = q.shape
    s = k.shape[1]
    if w.shape != (b, t, g) or k.shape != (b, s, i) or q_pos.shape != (b, t):
        raise ValueError(f"expected q [B, T, G, I], w [B, T, G], k [B, S, I], q_pos [B, T]; got "
                         f"{q.shape}, {w.shape}, {k.shape}, {q_pos.shape}")
    if block_q % 8 or block_k % 128:
        raise ValueError(f"expected block_q a multiple of 8 and block_k of 128 (a TPU tile); "
                         f"got block_q={block_q}, block_k={block_k}")
    bq, bk = min(block_q, round_up(t, 8)), min(block_k, round_up(s, 128))
    tp, sp = round_up(t, bq), round_up(s, bk)
    nq = tp // bq
    # Padded queries see nothing; positions past the last key see exactly the real keys.
    pos = pad_axis(jnp.minimum(q_pos.astype(jnp.int32), s - 1), 1, tp, value=-1)  # [B, Tp]
    last = (jnp.max(pos.reshape(b, nq, bq), axis=-1) // bk).reshape(b * nq)  # [B * nq]; -1: sees nothing
    qg = pad_axis(jnp.swapaxes(q, 1, 2), 2, tp)  # [B, G, Tp, I]: one head is a [block_q, I] block
    key_block = lambda n, r, c, last: (n, jnp.minimum(c, jnp.maximum(last[n * nq + r], 0)), 0)  # noqa: E731
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(b, nq, sp // bk),
        in_specs=[
            pl.BlockSpec((None, g, bq, i), lambda n, r, c, last: (n, 0, r, 0)),
            pl.BlockSpec((None, bq, g), lambda n, r, c, last: (n, r, 0)),
            pl.BlockSpec((None, bk, i), key_block),
            pl.BlockSpec((None, bq, 1), lambda n, r, c, last: (n, r, 0)),
        ],
        out_specs=pl.BlockSpec((None, bq, bk), lambda n, r, c, last: (n, r, c)),
    )
    out = jax.ShapeDtypeStruct((b, tp, sp), jnp.float32)
    pairs = causal_pairs(b, t, s)  # the key blocks past a query block's last visible one are skipped
    scores = call(
        functools.partial(_scores_kernel, scale=i ** -0.5, query_blocks=nq), backend=backend,
        name="lightning_indexer_scores", grid_spec=grid_spec, out_shape=out,
        dimension_semantics=("parallel", "parallel", "parallel"),
        cost_estimate=estimate(2 * pairs * g * (i + 1), 0, q, w, k, out),
    )(last, qg, pad_axis(w.astype(jnp.float32), 1, tp), pad_axis(k, 1, sp), pos[:, :, None])
    return scores[:, :t, :s]


def indexer_topk(q, w, k, q_pos, *, topk: int, chunk: int = reference.QUERY_BLOCK, block_q: int = 128,
                 block_k: int = 512, backend: str = "tpu"):
    """Top-k key positions [B, T, min(topk, S)] int32 of the indexer's scores, -1 where
    fewer than topk keys are visible (`reference.indexer_topk`). A selection: no gradient
    flows through it."""
    q, w, k = (jax.lax.stop_gradient(x) for x in (q, w, k))
    width = min(topk, k.shape[1])
    bands = reference.key_bands(k.shape[1])

    def over(length):
        def select(scores):  # [B, chunk, S] -> [B, chunk, width]
            idx = reference.select_topk(scores[:, :, :length], topk)
            return jnp.pad(idx, [(0, 0), (0, 0), (0, width - idx.shape[-1])], constant_values=-1)
        return select

    def one_chunk(qb, wb, pos):
        scores = indexer_scores(qb, wb, k, pos, block_q=block_q, block_k=block_k, backend=backend)
        if len(bands) == 1:
            return over(bands[0])(scores)
        band = jnp.clip(jnp.max(pos) // bands[0], 0, len(bands) - 1)  # the band holding the last visible key
        return jax.lax.switch(band, [over(n) for n in bands], scores)

    return reference.map_query_blocks(one_chunk, chunk, q, w, q_pos)
