"""glm53_sao: SAO post-training of GLM-5.3 at full size, on a v5p slice of 256 chips (or 128 H200s).

    glmjax-aot --config configs/glm53_sao.py --topology v5p:8x8x4 --json /tmp/glm53_sao_aot.json
    python -m rl.job_plan --config configs/glm53_sao.py:h200 --device-memory-gb 141
    glmjax-train --config configs/glm53_sao.py --workdir gs://BUCKET/glm53-sao \\
        --config.base.checkpoint=/path/to/GLM-5.3 --config.task.data=/path/to/prompts.jsonl

The model is configs/glm53.py's (GLM-5 with IndexShare) in bf16, its layers scanned and
rematerialised per layer (the backward keeps each layer's input only). The job is SAO's
(rl/config.py): 256 rollouts of up to 8192 tokens per learner step (6144 of them answer),
a value model of its own, 64 concurrent decodes per engine. `get_config(arg)`:

  ""      (default) v5p:8x8x4, 256 chips over 64 hosts: mesh fsdp=64 x expert=4, a process
          per host (distributed.num_processes=-1: detected). Each device receives at most
          1.25x its tokens' expert copies (model.moe_capacity_factor), exchanged 2048 tokens
          at a time (model.moe_chunk_tokens). The engine decodes in the "decode" rules
          (rl.engine_rules: experts split over all 256 chips, every other weight whole on
          each) over the whole slice (rl.engine_span="job": every host steps the one engine
          in lockstep, rl/engine/lockstep.py): no host's 4 chips hold GLM-5.3. Its weights
          are a copy in those rules, so the learner updates the policy's in place;
  "h200"  128 H200s over 16 hosts: mesh fsdp=32 x expert=4, a process per host (8 GPUs
          each). 64 cannot hold the job: the policy, the critic and their Adam states
          alone are 140.7 GB of each GPU's 141. A GPU target cannot be compiled on a CPU:
          `python -m rl.job_plan` gives its planned bytes per device (119 GB).
`glmjax-aot` compiles the learner's step and the engine's prefill and decode for the slice
and compares them with the planner's figures (rl/job_plan.py: role_bytes).
"""

import os

from glmjax import distributed
from glmjax.presets import load_config
from rl.config import BaseConfig, RLConfig, TaskConfig, section

# arg -> (mesh axis sizes, processes)
TARGETS = {
    "": ({"fsdp": 64, "expert": 4}, -1),
    "h200": ({"fsdp": 32, "expert": 4}, -1),
}


def get_config(arg=None):
    arg = arg or ""
    if arg not in TARGETS:
        raise ValueError(f"configs/glm53_sao.py:{arg}: expected one of {sorted(TARGETS)} after the colon")
    mesh, processes = TARGETS[arg]
    config = load_config(os.path.join(os.path.dirname(os.path.abspath(__file__)), "glm53.py"))
    config.model.dtype = "bfloat16"
    config.model.param_dtype = "bfloat16"
    config.model.scan_layers = True
    config.model.remat = "full"
    # each device receives at most 1.25x its tokens' expert copies (layers/expert_parallel.py);
    # the router's bias keeps the load near even, and a copy over the bound is dropped
    config.model.moe_capacity_factor = 1.25
    # a device's 8192 tokens exchanged in 4 chunks: the backward holds one chunk's buffers
    config.model.moe_chunk_tokens = 2048
    config.model.kernel_impl = "pallas"  # on a TPU: pallas_kernels/tpu (Mosaic), each device its own rows
    config.seed = 0
    config.checkpoint_every = 20
    config.task = section(TaskConfig, max_len=8192, max_new_tokens=6144, train_tasks=100000, eval_tasks=500)
    config.base = section(BaseConfig)
    config.rl = section(RLConfig, steps=1000, batch_size=256, slots=64, temperature=1.0, actor_lr=1e-6,
                        critic_lr=5e-6, critic_warmup=20, export_every=100, engine_rules="decode",
                        engine_span="job")
    config.mesh = distributed.mesh_section(**mesh)
    config.rules = distributed.rules_section()
    config.distributed = distributed.distributed_section(num_processes=processes)
    return config
