"""The model's own matmul FLOPs of the RL job's roles, counted from its config: what
`glmjax-aot` (rl/aot.py) sets beside the compiled programs' count (rl/hlo_flops.py).

Each einsum counts 2 x its multiply-adds (glmjax/layers/mla.py, indexer.py, moe.py); a
token's attention counts the keys it sees (causal, or the whole cache for a decode step),
at most index_topk where the indexer selects.
"""

from __future__ import annotations

import numpy as np

from glmjax.config import ModelConfig


def learner_rows(job) -> int:
    """The learner's batch rows: rl.batch_size, times the segments with compaction, plus replayed rows."""
    rl = job.rl
    return rl.batch_size * (rl.compaction.max_segments if rl.compaction.enabled else 1) + (
        rl.replay.rows if rl.replay.enabled else 0)


def layer_flops(c: ModelConfig, i: int | None, keys: float, indexed_keys: float) -> tuple[float, float]:
    """Matmul FLOPs per token of decoder layer `i` (None: the MTP block) attending to
    `keys` keys per query (the visible ones, or the top-k) while its indexer scores
    `indexed_keys` (0 when the layer attends densely): (trained path, indexer), each 2 x
    the multiply-adds of its einsums (glmjax/layers/mla.py, indexer.py, moe.py)."""
    d, h, q, kv = c.hidden_size, c.num_attention_heads, c.q_lora_rank, c.kv_lora_rank
    nope, rope, v = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
    mla = d * q + q * h * (nope + rope) + d * (kv + rope) + h * nope * kv + h * kv * v + h * v * d
    attention = keys * h * (kv + rope + kv)  # scores over [c_kv | k_rope], then the values c_kv
    moe = c.mtp_is_moe if i is None else c.is_moe(i)
    if moe:
        mlp = d * c.n_routed_experts + c.num_experts_per_tok * 3 * d * c.moe_intermediate_size
        mlp += 3 * d * c.shared_intermediate_size
    else:
        mlp = 3 * d * c.intermediate_size
    indexer = 0.0
    if i is None or c.has_indexer(i):
        g, ih = c.index_n_heads, c.index_head_dim
        indexer = d * ih + (q * g * ih + d * g + indexed_keys * g * ih if indexed_keys else 0.0)
    return 2.0 * (mla + attention + mlp), 2.0 * indexer


def forward_flops(c: ModelConfig, tokens: int, seq: int, cached: int = 0, head_tokens: int | None = None,
                  causal: bool = True) -> tuple[float, float]:
    """(trained path, indexer) matmul FLOPs of a forward over `tokens` tokens in rows of
    `seq` new tokens after `cached` cached ones: each query sees the keys up to its own
    position (causal) or every cache position (`causal=False`: a decode step reads the
    whole cache), at most index_topk of them where the indexer selects (it selects when
    index_topk is below the key count); the LM head on `head_tokens` (default all)."""
    num_keys = cached + seq
    sparse = c.index_topk < num_keys
    positions = np.arange(cached + 1, cached + seq + 1, dtype=np.float64)  # keys visible to each query
    seen = positions if causal else np.full(seq, float(num_keys))
    keys = float(np.minimum(seen, c.index_topk).sum() if sparse else seen.sum()) / seq
    indexed = float(seen.sum()) / seq if sparse else 0.0
    trained = indexer = 0.0
    for i in range(c.num_hidden_layers):
        t, x = layer_flops(c, i, keys, indexed)
        trained, indexer = trained + t, indexer + x
    head = 2.0 * c.hidden_size * c.vocab_size * (tokens if head_tokens is None else head_tokens)
    return trained * tokens + head, indexer * tokens


def analytic_flops(job, role: str, devices: int, prefill: tuple[int, int] = (1, 1)) -> float:
    """The model's own matmul FLOPs of a role, per device.

    learner_step: the actor step's forward, backward (2x) and the remat recompute of the
    forward (`model.remat` "full": one more forward; "matmuls" keeps every matmul output:
    none), the indexer forward only (no gradient reaches it); the KL reference's forward
    when rl.kl_coef > 0; rl.critic_steps critic updates (the trunk, no LM head: the value
    head reads the hidden state) with the same factors. engine_prefill: rows x bucket
    tokens, the LM head at one position per row. engine_decode: every slot's 1 + num_draft
    tokens over the whole cache."""
    c, rl, task = job.model, job.rl, job.task
    remat = 1.0 if getattr(c, "remat", "none") == "full" else 0.0
    if role == "learner_step":
        tokens, t = learner_rows(job) * task.max_len, task.max_len
        trained, indexer = forward_flops(c, tokens, t)
        head = 2.0 * c.hidden_size * c.vocab_size * tokens
        total = (3 + remat) * trained + (1 + remat) * indexer
        if rl.kl_coef > 0:
            total += trained + indexer
        if rl.uses_critic:
            total += max(rl.critic_steps, 1) * ((3 + remat) * (trained - head) + (1 + remat) * indexer)
        return total / devices
    if role == "engine_prefill":
        rows, length = prefill
        trained, indexer = forward_flops(c, rows * length, length, head_tokens=rows)
        return (trained + indexer) / devices
    if role == "engine_decode":
        fed = 1 + rl.num_draft
        trained, indexer = forward_flops(c, rl.slots * fed, fed, cached=task.max_len + rl.num_draft - fed,
                                         causal=False)
        return (trained + indexer) / devices
    raise ValueError(f"role {role!r}: expected learner_step, engine_prefill or engine_decode")
