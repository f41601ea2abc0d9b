"""Tiny random transformers models for parity tests, built so the comparison is decisive.

Weights are drawn at std 0.1 (not HF's 0.02) so routing and the indexer's ranking have
clear margins, and the correction biases are non-zero. `selection_margins` measures the
gaps that decide the indexer's top-k and the routers' top-X, so a test can assert that no
near-tie makes the reference and glmjax pick different sets.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch

from glmjax.layers.mla import LATENT_NORM_EPS
from glmjax.layers.moe import MoE
from glmjax.layers.norms import rms_norm
from glmjax.layers.rope import rope_tables
from pallas_kernels import reference

COMMON = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
    kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, v_head_dim=32, qk_nope_head_dim=24, index_topk=8,
    index_head_dim=32, index_n_heads=16, first_k_dense_replace=1, pad_token_id=None,
)
YARN = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "original_max_position_embeddings": 64,
        "mscale": 1.0, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}


def _randomise(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            elif p.ndim == 1 and "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
        for mod in model.modules():
            if hasattr(mod, "e_score_correction_bias"):
                mod.e_score_correction_bias.copy_(torch.randn(mod.e_score_correction_bias.shape, generator=g) * 0.1)
    return model.eval()


def glm_model(seed: int = 0, **overrides):
    """GlmMoeDsa with IndexShare (layers F S F S), one dense layer then MoE."""
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    torch.manual_seed(seed)
    cfg = GlmMoeDsaConfig(**{**COMMON, "index_topk_freq": 2, "index_skip_topk_offset": 1, **overrides})
    return _randomise(GlmMoeDsaForCausalLM(cfg), seed)


def deepseek_model(seed: int = 0, **overrides):
    """DeepseekV32 with grouped routing (4 groups, keep 2) and YaRN RoPE."""
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM

    torch.manual_seed(seed)
    cfg = DeepseekV32Config(**{**COMMON, "n_group": 4, "topk_group": 2, "rope_parameters": dict(YARN),
                               "max_position_embeddings": 256, **overrides})
    return _randomise(DeepseekV32ForCausalLM(cfg), seed)


def selection_margins(model, input_ids) -> dict[str, float]:
    """Smallest relative gap between the k-th and (k+1)-th candidate, over every query of
    every full-indexer layer (only queries that see more than index_topk keys) and every
    token of every router. A gap near 0 would be a tie that implementations may break
    differently."""
    c = model.config
    ids = jnp.asarray(input_ids)
    pos = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
    cos, sin = rope_tables(c, pos)
    x = model.embed(ids)
    topk, index_gap, route_gap = None, np.inf, np.inf
    for layer in model.layers:
        attn = layer.attn
        if attn.indexer is not None:
            h = layer.input_norm(x)
            qr = rms_norm(h @ attn.q_a[...], attn.q_a_norm[...], LATENT_NORM_EPS)
            q, w = attn.indexer.queries(qr, h, cos, sin)
            scores = np.asarray(reference.indexer_scores(q, w, attn.indexer.keys(h, cos, sin), pos))
            k = c.index_topk
            for t in range(k, ids.shape[1]):  # query t sees t + 1 > k keys
                s = np.sort(scores[:, t, : t + 1], axis=-1)[:, ::-1]
                gap = (s[:, k - 1] - s[:, k]) / (np.abs(s[:, k - 1]) + 1e-6)
                index_gap = min(index_gap, float(gap.min()))
        if isinstance(layer.mlp, MoE):
            h = layer.post_attn_norm(x + attn(layer.input_norm(x), cos, sin, pos, shared_topk=topk).out)
            router = layer.mlp.router
            flat = np.asarray(h.reshape(-1, h.shape[-1]), np.float32)
            biased = 1 / (1 + np.exp(-flat @ np.asarray(router.weight[...]))) + np.asarray(
                router.e_score_correction_bias[...])
            if c.n_group == 1:
                s = np.sort(biased, axis=-1)[:, ::-1]
                route_gap = min(route_gap, float((s[:, c.num_experts_per_tok - 1] - s[:, c.num_experts_per_tok]).min()))
        out = layer(x, cos, sin, pos, shared_topk=topk)
        x, topk = out.x, out.topk
    return {"indexer": index_gap, "router": route_gap}
