"""tiny: every GLM-5 mechanism (MLA, DSA + IndexShare, MoE + shared expert, MTP) at a size
that trains in seconds on a laptop CPU. The model for tests, examples and the quickstart:

    glmjax-train --config configs/tiny.py --workdir /tmp/glmjax-tiny
    glmjax-train --config configs/tiny.py --workdir /tmp/glmjax-tiny \
        --config.model.num_hidden_layers=2 --config.model.index_topk_pattern=FS --config.train.steps=100

`index_topk_pattern` names each layer's indexer (F full, S shared), so it changes with
`num_hidden_layers`.
"""

import ml_collections

from glmjax import distributed
from glmjax.presets import model_config_dict


def get_config(arg=None):
    """`arg` (after `configs/tiny.py:`) is unused."""
    del arg
    config = ml_collections.ConfigDict()
    config.model = model_config_dict(
        model_type="glm_moe_dsa",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        index_topk=16,
        index_n_heads=4,
        index_head_dim=16,
        index_topk_pattern="FSFS",
        num_nextn_predict_layers=1,
        max_position_embeddings=512,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
    )
    config.train = ml_collections.ConfigDict(dict(
        seq_len=64,
        batch_size=16,
        steps=300,
        learning_rate=3e-3,
        warmup=20,
        mtp_loss_weight=0.3,
        seed=0,
    ))
    # where the job runs (glmjax/distributed.py): --config.mesh.fsdp=4, --config.rules.embed=fsdp, ...
    config.mesh = distributed.mesh_section()
    config.rules = distributed.rules_section()
    config.distributed = distributed.distributed_section()
    return config
