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


def get_config(arg=None):
    del arg
    config = ml_collections.ConfigDict()
    config.model = load_config(os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny.py")).model
    config.model.max_position_embeddings = 64
    config.seed = 0
    config.checkpoint_every = 10
    config.task = ml_collections.ConfigDict(dict(
        family="sorting", difficulty=2, seed=0, train_tasks=4000, eval_tasks=200, max_len=28,
        max_new_tokens=10,
        # adversarial copies of training tasks (envs/augment.py): "", "distractor", "reorder"
        augment="", augment_fraction=0.5))
    config.base = ml_collections.ConfigDict(dict(
        demonstrations=3000, steps=90, batch_size=64, seq_len=28, learning_rate=3e-3, warmup=20, mtp_weight=0.3,
        seed=0))
    config.rl = ml_collections.ConfigDict(dict(
        algorithm="sao", steps=300, batch_size=64, group_size=1, slots=64, eta=2, tau=4, temperature=0.5,
        eps_low=0.2, eps_high=4.0, alpha=1.5, gamma=1.0, actor_lr=1e-4, critic_lr=1e-3, critic_steps=2,
        critic_warmup=10, freeze_critic_attention=False, grad_clip=1.0,
        # actor updates over which actor_lr ramps up linearly from 0 (0: the full rate from the first)
        actor_warmup=0,
        # beta of a KL(policy || base) term in the actor's loss (rl/sao.py: reference_kl; 0: off)
        kl_coef=0.0,
        # generation pauses while a complete next batch waits: the engine and the learner share the machine
        generation_yields=True,
        num_draft=0, mtp_lr=0.0,
        # compile every prefill and decode shape before the loop (off: each compiles when first used)
        warmup_compile=True,
        # reward by task complexity (envs/reward.py): "none", "difficulty" or "pass_rate"
        reward_shaping="none", reward_alpha=0.5,
        # every N steps, greedy and sampled pass rates on tasks neither trained on nor held out (0: off)
        validate_every=0, validate_tasks=64,
        # with config.mesh: the engine in the learner's layout ("learner": publishing is a
        # reference swap) or the serving one ("decode": publishing reshards inside XLA)
        engine_rules="learner",
        # the engine on devices of its own, after the learner's: their axis sizes, e.g.
        # "expert=2,tensor=2" beside --config.mesh.fsdp=4 (publishing copies shard to shard);
        # "": on the learner's devices
        engine_mesh=""))
    # Prioritized replay (rl/replay.py: BatchReplay): `rows` stored rows beside each batch's fresh ones
    config.rl.replay = ml_collections.ConfigDict(dict(enabled=False, capacity=1024, rows=16, alpha=0.6, beta=0.4))
    # Trajectories longer than the window: summarise and continue (rl/compaction.py);
    # configs/compaction_tiny.py turns it on for answers that outgrow the context.
    config.rl.compaction = ml_collections.ConfigDict(dict(enabled=False, summary_tokens=6, max_segments=4))
    # where the job runs (glmjax/distributed.py): --config.mesh.fsdp=4, --config.rules.embed=fsdp, ...
    config.mesh = distributed.mesh_section()
    config.rules = distributed.rules_section()
    config.distributed = distributed.distributed_section()
    return config
