"""GLM-5 (zai-org/GLM-5): 744B-total MoE, MLA, DeepSeek sparse attention on every layer, one MTP layer.

Every architecture field is written out, so this file is the reference for the numbers.
It is a model preset, not a job: it has only a `model` section, which job configs load
(configs/glm53.py on top of it, and configs/glm53_sao.py, the full-size SAO job, on top of
that), as do the checkpoint import / export and the full-size shape checks:

    glmjax-aot --config configs/glm53_sao.py --topology v5p:8x8x4 --json /tmp/aot.json
    python -m glmjax.plan --config configs/glm5.py --mesh fsdp=64,expert=4 --device-memory-gb 95
    python -c "from glmjax.presets import load_config, model_config_from; \
        print(model_config_from(load_config('configs/glm5.py')))"

`glmjax-train --config configs/glm5.py` stops with an error that names those job configs.
"""

import ml_collections

from glmjax.presets import model_config_dict


def get_config(arg=None):
    """`arg` (after `configs/glm5.py:`) is unused."""
    del arg
    config = ml_collections.ConfigDict()
    config.model = model_config_dict(
        model_type="glm_moe_dsa",
        vocab_size=154880,
        hidden_size=6144,
        intermediate_size=12288,
        moe_intermediate_size=2048,
        num_hidden_layers=78,
        num_attention_heads=64,
        num_key_value_heads=64,
        # MLA
        q_lora_rank=2048,
        kv_lora_rank=512,
        qk_nope_head_dim=192,
        qk_rope_head_dim=64,
        v_head_dim=256,
        attention_bias=False,
        # MoE: 3 dense layers, then 256 routed experts (top 8, no groups) + 1 shared
        n_routed_experts=256,
        num_experts_per_tok=8,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        first_k_dense_replace=3,
        hidden_act="silu",
        # DSA lightning indexer, run on every layer (no IndexShare)
        index_topk=2048,
        index_n_heads=32,
        index_head_dim=128,
        index_topk_freq=1,
        index_skip_topk_offset=2,
        num_nextn_predict_layers=1,
        max_position_embeddings=202752,
        rope_parameters={"rope_theta": 1e6, "rope_type": "default"},
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        initializer_range=0.02,
        bos_token_id=0,
        eos_token_id=1,
    )
    return config
