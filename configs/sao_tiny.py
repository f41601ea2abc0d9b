"""sao_tiny: the main job. SAO post-training of the tiny model on sorting, on a CPU.

    glmjax-train --config configs/sao_tiny.py --workdir /tmp/glmjax-sao
    glmjax-train --config configs/sao_tiny.py --workdir /tmp/glmjax-grpo \
        --config.rl.algorithm=grpo --config.rl.group_size=8
    glmjax-train --config configs/sao_tiny.py --workdir /tmp/glmjax-sync --config.rl.eta=0

A base model is first trained briefly on demonstrations ("sort 4 2 9 1=" -> "1 2 4 9\\n"),
so that it solves some held-out problems but not most; SAO then trains it on its own sampled
answers, one rollout per prompt, with rewards from the exact-answer verifier. The model
is configs/tiny.py's with a context of 64 bytes.

Rollouts sample at temperature 0.5: at 0.7 the base's samples are right a tenth of the
time against a fifth at greedy, and few positives reach the learner; at 0.5 a sample is
right more often while 70% of the held-out tasks still have a right answer within 16
samples, so exploration remains.

MTP speculation in the rollouts: `--config.rl.num_draft=3` drafts that many tokens per
decode step with the policy's own MTP layer (the summary gives `mtp_accept_len`), and
`--config.rl.mtp_lr=1e-3` keeps that layer trained on the rollouts (rl/learner.py, step 5).
Off here: on the tiny model a draft step costs about what it saves
(`mtp_speedup_main_job` in results/engine_bench.json).
"""

import os

import ml_collections

from glmjax import distributed
from glmjax.presets import load_config
from rl.config import BaseConfig, RLConfig, TaskConfig, section


def get_config(arg=None):
    del arg
    config = ml_collections.ConfigDict()
    config.model = load_config(os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny.py")).model
    config.model.max_position_embeddings = 64
    config.seed = 0
    config.checkpoint_every = 10
    # Each section is its class's defaults (rl/config.py, where every field is described);
    # this job's values are those defaults: sorting at difficulty 2, 4000 training and 200
    # held-out tasks, answers of at most 10 bytes in a 28-byte window; a 90-step supervised
    # base on 3000 demonstrations; 300 SAO steps of 64 rollouts, eta 2, tau 4, temperature
    # 0.5, the band (0.8, 5.0), a value model at 1e-3 warmed up for 10 steps.
    config.task = section(TaskConfig)
    config.base = section(BaseConfig)
    config.rl = section(RLConfig)
    # where the job runs (glmjax/distributed.py): --config.mesh.fsdp=4, --config.rules.embed=fsdp, ...
    config.mesh = distributed.mesh_section()
    config.rules = distributed.rules_section()
    config.distributed = distributed.distributed_section()
    return config
