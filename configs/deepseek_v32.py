"""DeepSeek-V3.2 (deepseek-ai/DeepSeek-V3.2): 671B-total MoE with grouped routing, MLA, DSA, YaRN RoPE.

The same glmjax model functions run it; what differs from GLM-5 is data (sizes, 8 expert
groups with the top 4 kept, 64 indexer heads, YaRN x40 over a 4K base) plus the indexer's
RoPE layout, which ModelConfig derives from `model_type`.

    glmjax-train --config configs/deepseek_v32.py --workdir /path/to/workdir
"""

import ml_collections

from glmjax.presets import model_config_dict


def get_config(arg=None):
    """`arg` (after `configs/deepseek_v32.py:`) is unused."""
    del arg
    config = ml_collections.ConfigDict()
    config.model = model_config_dict(
        model_type="deepseek_v32",
        vocab_size=129280,
        hidden_size=7168,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        num_hidden_layers=61,
        num_attention_heads=128,
        num_key_value_heads=128,
        # MLA
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        attention_bias=False,
        # MoE: 3 dense layers, then 256 routed experts in 8 groups (top 4 groups, top 8 experts) + 1 shared
        n_routed_experts=256,
        num_experts_per_tok=8,
        n_shared_experts=1,
        n_group=8,
        topk_group=4,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        first_k_dense_replace=3,
        hidden_act="silu",
        # DSA lightning indexer on every layer
        index_topk=2048,
        index_n_heads=64,
        index_head_dim=128,
        index_topk_freq=1,
        index_skip_topk_offset=2,
        num_nextn_predict_layers=1,
        max_position_embeddings=163840,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        initializer_range=0.02,
        bos_token_id=0,
        eos_token_id=1,
    )
    return config
