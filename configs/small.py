"""small: the benchmark model (~120M parameters, 32 experts, IndexShare 1-in-4), large enough
for kernel and throughput numbers to mean something, small enough for one accelerator.
The scripts in benchmarks/ measure it; it also trains:

    glmjax-train --config configs/small.py --workdir /tmp/glmjax-small
"""

import ml_collections

from glmjax import distributed
from glmjax.presets import model_config_dict


def get_config(arg=None):
    """`arg` (after `configs/small.py:`) is unused."""
    del arg
    config = ml_collections.ConfigDict()
    config.model = model_config_dict(
        model_type="glm_moe_dsa",
        vocab_size=4096,
        hidden_size=512,
        intermediate_size=1024,
        moe_intermediate_size=256,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=8,
        q_lora_rank=256,
        kv_lora_rank=128,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
        n_routed_experts=32,
        num_experts_per_tok=4,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        index_topk=128,
        index_n_heads=4,
        index_head_dim=64,
        index_topk_pattern="FSSSFSSS",
        num_nextn_predict_layers=1,
        max_position_embeddings=4096,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
    )
    # where the job runs (glmjax/distributed.py): --config.mesh.fsdp=4, --config.rules.embed=fsdp, ...
    config.mesh = distributed.mesh_section()
    config.rules = distributed.rules_section()
    config.distributed = distributed.distributed_section()
    return config
