"""The DSA lightning indexer (DeepSeek-V3.2): blockwise causal scoring, then top-k.

Reference: `reference.indexer_scores` / `reference.indexer_topk`:

    I[t, s] = sum_g w[t, g] * relu(q[t, g] . k[s] * I^-0.5),   -inf where s > q_pos[t]

One program scores a block of queries against every key block it can see, one head at
a time, so the live state is one [T_blk, S_blk] fp32 tile and the [T, S, G] product never
exists; key blocks past the block's last visible key are written as -inf without being
computed. The top-k then runs in XLA over query chunks (`chunk` queries at a time), so the
score buffer is [chunk, S], never [T, S].

FP8 (the deployed DeepSeek-V3.2 indexer): q and k are quantised to e4m3 with one fp32
scale per 128 values (`reference.fp8_e4m3_blockwise`), the kernel reads the 1-byte values
and multiplies the scales into each 128-wide partial dot product: relu(sum_j qs_j ks_j
(q8_j . k8_j)). e4m3 values are exact in bf16, so the matmuls run in bf16 with fp32
accumulation: the same numbers as an fp8 tensor-core matmul.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import reference
from pallas_kernels._backend import (
    blocks_to,
    call,
    mm_nt,
    pad_axis,
    pow2,
    resolve,
    round_up,
)

FP8_BLOCK = 128


def _kernel(*refs, scale: float, block_k: int, groups: int, fp8: bool):
    if fp8:
        q_ref, qs_ref, w_ref, k_ref, ks_ref, pos_ref, o_ref = refs
    else:
        (q_ref, w_ref, k_ref, pos_ref, o_ref), qs_ref, ks_ref = refs, None, None
    pos = pos_ref[...]
    heads, block_q, width = q_ref.shape
    part = width // groups
    num_blocks = k_ref.shape[0] // block_k
    visible_blocks = jnp.minimum(blocks_to(jnp.max(pos) + 1, block_k), num_blocks)

    def score_block(j, carry):
        keys = pl.ds(j * block_k, block_k)

        def head(g, tile):
            if not fp8:
                logits = mm_nt(q_ref[g], k_ref[keys, :])
            else:  # one partial product per 128-value block, scaled by both blocks' scales
                logits = jnp.zeros((block_q, block_k), jnp.float32)
                for b in range(groups):
                    cols = pl.ds(b * part, part)
                    qb = q_ref[g, :, cols].astype(jnp.bfloat16)
                    kb = k_ref[keys, cols].astype(jnp.bfloat16)
                    logits += mm_nt(qb, kb) * qs_ref[g, :, b][:, None] * ks_ref[keys, b][None, :]
            return tile + w_ref[g][:, None] * jnp.maximum(logits * scale, 0.0)

        tile = jax.lax.fori_loop(0, heads, head, jnp.zeros((block_q, block_k), jnp.float32))
        key_pos = j * block_k + jax.lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
        o_ref[:, keys] = jnp.where(key_pos <= pos[:, None], tile, -jnp.inf)
        return carry

    def hide_block(j, carry):
        o_ref[:, pl.ds(j * block_k, block_k)] = jnp.full((block_q, block_k), -jnp.inf, jnp.float32)
        return carry

    # The loops carry nothing; a traced zero keeps Triton's scf.for happy.
    done = jax.lax.fori_loop(0, visible_blocks, score_block, jnp.int32(0))
    jax.lax.fori_loop(visible_blocks, num_blocks, hide_block, done)


def indexer_scores(q, w, k, q_pos, *, fp8: bool = False, block_q: int = 32, block_k: int = 64,
                   backend: str | None = None):
    """q [B, T, G, I], w [B, T, G], k [B, S, I], q_pos [B, T] -> scores [B, T, S] fp32,
    -inf where s > q_pos. fp8: score e4m3-quantised q and k (one scale per 128 values)."""
    backend = resolve(backend)
    b, t, g, i = q.shape
    s = k.shape[1]
    if w.shape != (b, t, g) or k.shape != (b, s, i) or q_pos.shape != (b, t):
        raise ValueError(f"expected q [B, T, G, I], w [B, T, G], k [B, S, I], q_pos [B, T]; got "
                         f"{q.shape}, {w.shape}, {k.shape}, {q_pos.shape}")
    bq, bk = min(block_q, pow2(t, 16)), min(block_k, pow2(s, 16))
    tp, sp = round_up(t, bq), round_up(s, bk)
    groups = max(1, i // FP8_BLOCK) if fp8 else 1
    ip = groups * pow2(i // groups, 16)  # pad each scale block to a power of two

    def features(x):  # pads each 128-value block separately so the blocks stay aligned
        x = x.reshape(*x.shape[:-1], groups, i // groups)
        return pad_axis(x, x.ndim - 1, ip // groups).reshape(*x.shape[:-2], ip)

    qh = jnp.swapaxes(q, 1, 2)  # [B, G, T, I]: one head is a contiguous [T_blk, I] block
    pos = pad_axis(jnp.minimum(q_pos.astype(jnp.int32), s - 1), 1, tp, value=-1)
    wh = pad_axis(jnp.swapaxes(w.astype(jnp.float32), 1, 2), 2, tp)
    if fp8:
        qv, qs = reference.fp8_e4m3_blockwise(qh, FP8_BLOCK)
        kv, ks = reference.fp8_e4m3_blockwise(k, FP8_BLOCK)
        qv, kv = pad_axis(features(qv), 2, tp), pad_axis(features(kv), 1, sp)
        qs, ks = pad_axis(qs, 2, tp), pad_axis(ks, 1, sp)
        args = (qv, qs, wh, kv, ks, pos)
    else:
        args = (pad_axis(features(qh), 2, tp), wh, pad_axis(features(k), 1, sp), pos)
    rows = lambda x: pl.BlockSpec((None, g, bq) + x.shape[3:], lambda n, j: (n, 0, j) + (0,) * (x.ndim - 3))  # noqa: E731
    keys = lambda x: pl.BlockSpec((None,) + x.shape[1:], lambda n, j: (n, 0, 0))  # noqa: E731
    if fp8:
        specs = [rows(qv), rows(qs), rows(wh), keys(kv), keys(ks)]
    else:
        specs = [rows(args[0]), rows(wh), keys(args[2])]
    specs.append(pl.BlockSpec((None, bq), lambda n, j: (n, j)))
    scores = call(
        functools.partial(_kernel, scale=i ** -0.5, block_k=bk, groups=groups, fp8=fp8),
        backend=backend, grid=(b, tp // bq), in_specs=specs,
        out_specs=pl.BlockSpec((None, bq, sp), lambda n, j: (n, j, 0)),
        out_shape=jax.ShapeDtypeStruct((b, tp, sp), jnp.float32), name="lightning_indexer",
    )(*args)
    return scores[:, :t, :s]


def indexer_topk(q, w, k, q_pos, *, topk: int, fp8: bool = False, chunk: int = reference.QUERY_BLOCK,
                 backend: str | None = None):
    """Top-k key positions [B, T, min(topk, S)] int32 of the indexer's scores, -1 where
    fewer than topk keys are visible (the signature of `reference.indexer_topk`). A
    selection: no gradient flows through it (the scoring kernel has no VJP to call)."""
    q, w, k = (jax.lax.stop_gradient(x) for x in (q, w, k))

    def one_chunk(qb, wb, pos):
        return reference.select_topk(indexer_scores(qb, wb, k, pos, fp8=fp8, backend=backend), topk)

    return reference.map_query_blocks(one_chunk, chunk, q, w, q_pos)
