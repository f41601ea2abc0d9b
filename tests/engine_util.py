"""Shared by the rollout-engine tests: a tiny model and the reference continuations."""

import numpy as np

import glmjax

# Every mechanism (MLA, DSA with top-6 < context, IndexShare, MoE, MTP); decisive logits.
TINY = glmjax.ModelConfig(
    vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=24,
    qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=1,
    index_topk=6, index_n_heads=8, index_head_dim=32, index_topk_pattern="FSSF", initializer_range=0.1,
    max_position_embeddings=256, num_nextn_predict_layers=1,
)


def prompts(lengths, seed=0, vocab=TINY.vocab_size):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, vocab, n)] for n in lengths]


def greedy_reference(model, prompt, n):
    """glmjax.generate's greedy continuation: the ground truth for the engine."""
    out = glmjax.generate(model, np.asarray(prompt, np.int32)[None], n)
    return [int(t) for t in np.asarray(out)[0, len(prompt):]]
