"""opd_tiny: multi-teacher on-policy distillation of the tiny model, on a CPU.

    glmjax-train --config configs/opd_tiny.py --workdir /tmp/glmjax-opd
    glmjax-train --config configs/opd_tiny.py --workdir /tmp/glmjax-opd-cold --config.opd.prefetch=False
    glmjax-train --config configs/opd_tiny.py --workdir /tmp/glmjax-opd-topk --config.opd.distribution=topk
    glmjax-train --config configs/opd_tiny.py --workdir /tmp/opd-s --config.opd.distribution=sampled --config.opd.kl_coef=1

A shared base (the tiny model after a supervised start on two task families,
"sort 9 3 7=" -> "3 7 9\\n" and "rev omp=" -> "pmo\\n") is fine-tuned on each family alone
into two specialists, the teachers of their family's domain. The student, the base itself,
is then distilled on mixed prompts: it samples (at temperature 0.5, near the greedy
decoding it is evaluated with), the teacher of each prompt's domain scores its tokens,
and at every position it visited the student is pulled toward the teacher's whole
next-token distribution (the vocabulary is 256 bytes, so the full KL is cheap; beta = 0,
the forward direction: the strings student starts near 0%, where the reverse KL's
gradient on the teacher's tokens vanishes). The teachers are orbax checkpoints in the
workdir; only the active one is on the device, the next one is prefetched while the
student samples. rl/distill/trainer.py is the job.
"""

import os

import ml_collections

from glmjax import distributed
from glmjax.presets import load_config
from rl.config import BaseConfig, DistillConfig, section


def get_config(arg=None):
    del arg
    config = ml_collections.ConfigDict()
    config.model = load_config(os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny.py")).model
    config.model.max_position_embeddings = 64
    config.seed = 0
    config.task = ml_collections.ConfigDict(dict(seed=0, train_tasks=800, eval_tasks=100, max_len=24,
                                                 max_new_tokens=10))
    config.teachers = ml_collections.ConfigDict(dict(
        sorter=dict(family="sorting", difficulty=1, steps=150),
        speller=dict(family="strings", difficulty=1, steps=250, demonstrations=3000)))
    sft = dict(demonstrations=800, steps=150, seq_len=24)  # rl/config.py: BaseConfig's defaults otherwise
    config.student = section(BaseConfig, **dict(sft, steps=400))  # the shared base: both families
    config.teacher_sft = section(BaseConfig, **dict(sft, seed=1))  # the base fine-tuned on one family
    # 80 rounds of 4 batches of 32 prompts, 3 epochs each, the full-vocabulary forward KL
    # (rl/config.py: DistillConfig, where every field is described, holds these as its defaults)
    config.opd = section(DistillConfig)
    # where the job runs (glmjax/distributed.py): --config.mesh.fsdp=4, --config.rules.embed=fsdp, ...
    config.mesh = distributed.mesh_section()
    config.rules = distributed.rules_section()
    config.distributed = distributed.distributed_section()
    return config
