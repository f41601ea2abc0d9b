"""sao_hf: SAO post-training of your own Hugging Face checkpoint on a JSONL prompt dataset.

    python -m glmjax.tiny_checkpoint /tmp/my-model          # or any GLM-5 / DeepSeek-V3.2 directory
    glmjax-train --config configs/sao_hf.py:/tmp/my-model --workdir /tmp/my-run \\
        --config.task.data=examples/data/arith.jsonl
    glmjax-serve --checkpoint /tmp/my-run/export/final --http-port 8000

The argument after the colon is `base.checkpoint`: its config.json is the model, its
tokenizer and chat template the job's format (prompts are user turns, answers end at the
template's stop tokens), and its weights the policy, the critic's trunk and the engine's
model. The run writes the trained policy as a Hugging Face directory to
workdir/export/final (and every `rl.export_every` steps to workdir/export/step_N).

The defaults fit the small checkpoint `glmjax.tiny_checkpoint` makes, on a CPU, in a few
minutes: a model with random weights that learns little in that time; the run shows the
path, not a gain. For a real checkpoint raise `task.max_len`, `task.max_new_tokens`,
`rl.steps`, `rl.batch_size` and give the job a mesh (`--config.mesh.fsdp=...`).
"""

import ml_collections

from glmjax import distributed
from rl.config import BaseConfig, RLConfig, TaskConfig, section


def get_config(arg=None):
    config = ml_collections.ConfigDict()
    config.model = ml_collections.ConfigDict({"dtype": "float32", "param_dtype": "float32"})
    config.seed = 0
    config.checkpoint_every = 10
    config.task = section(TaskConfig, data="", max_len=96, max_new_tokens=16, train_tasks=4000, eval_tasks=32)
    config.base = section(BaseConfig, checkpoint=arg or "")
    config.rl = section(RLConfig, steps=4, batch_size=8, slots=8, critic_warmup=1, eta=1, temperature=1.0,
                        export_every=2)
    config.mesh = distributed.mesh_section()
    config.rules = distributed.rules_section()
    config.distributed = distributed.distributed_section()
    return config
