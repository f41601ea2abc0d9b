"""The starting point of the RL and distillation jobs: a Hugging Face checkpoint, or
demonstrations and the SFT steps on them.

    ids, mask = demonstrations(tasks, seq_len)        # prompt + oracle answer, loss on the answer
    ids, mask = episode_demonstrations(cfg, tasks)    # oracle episodes, observations out of the loss
    supervised(model, ids, mask, cfg.base)            # DSA's sparse stage by default
    policy = build_base(cfg, workdir)                 # all of it, cached in workdir/base

With `base.checkpoint` the policy is that checkpoint, loaded in the mesh's shardings; with
`base.finetune` too, it is first fine-tuned on the task's demonstrations in the
checkpoint's chat format (cached in workdir/base like a base trained from scratch).

An agentic base learns from oracle episodes run in the environment pool (the
demonstration's commands with the observations they really print), a one-turn base from
the oracle answers (with compaction, one row per segment of the oracle's compacted
rollout).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os

import numpy as np
from safetensors import SafetensorError
from tqdm.auto import tqdm

import glmjax
from envs import families
from glmjax import distributed, storage
from glmjax import train as lm_train
from rl import rollout as ro
from rl import tasks as rl_tasks
from rl.compaction import Compaction, oracle_segments
from rl.config import BaseConfig

log = logging.getLogger(__name__)


def demonstrations(tasks, seq_len: int, compaction: Compaction | None = None, chat=None):
    """SFT arrays: prompt + oracle answer, loss on the answer tokens only; with compaction,
    one row per segment of the oracle's compacted rollout (summaries included). With a
    chat template (`chat`, an HFChat), the prompt is a user turn and the answer an assistant
    turn that ends with the tokenizer's end token."""
    if chat is not None and hasattr(chat, "assistant"):
        end = [chat.end_id]
        rows = [(rl_tasks.prompt_tokens(chat, t), chat.assistant(t.oracle().removesuffix("\n")) + end, None)
                for t in tasks]
        return _sft_arrays([(p, c, [0] * len(c)) for p, c, _ in rows], seq_len)
    rows = [seg for task in tasks
            for seg in oracle_segments(ro.encode(task.prompt), ro.encode(task.oracle()), compaction)]
    return _sft_arrays([(s.prompt, s.completion, s.observation_mask) for s in rows], seq_len)


def episode_demonstrations(cfg, tasks):
    """SFT arrays from oracle episodes (rl/tasks.py: oracle_episode), run in the env pool:
    loss on the model's tokens, not on the observations."""
    window, chat, style = cfg.task.max_len - 1, rl_tasks.job_chat(cfg), rl_tasks.action_format(cfg)

    def one(task):
        episode = rl_tasks.oracle_episode(task, rl_tasks.make_env(cfg), chat, window, style)
        return [(tr.prompt, tr.completion, tr.observation_mask or [0] * len(tr.completion))
                for tr in episode.trajectories(0)]

    with concurrent.futures.ThreadPoolExecutor(cfg.env.workers) as pool:
        rows = [row for rows in tqdm(pool.map(one, tasks), total=len(tasks), desc="oracle episodes", mininterval=1.0,
                                              disable=not distributed.is_main())
                for row in rows]
    return _sft_arrays(rows, cfg.base.seq_len)


def _sft_arrays(rows, seq_len: int):
    ids = np.zeros((len(rows), seq_len), np.int32)
    mask = np.zeros((len(rows), seq_len), np.float32)
    for i, (prompt, completion, observation) in enumerate(rows):
        p, n = len(prompt), len(completion)
        if p + n > seq_len:
            raise ValueError(f"a demonstration of {p + n} tokens (row {i}) is "
                             f"longer than base.seq_len={seq_len}: raise it, or enable rl.compaction")
        ids[i, :p + n] = list(prompt) + list(completion)
        mask[i, p:p + n] = 1 - np.asarray(observation, np.float32)
    return ids, mask


def build_base(cfg, workdir: str, demo_tasks=(), mesh=None) -> glmjax.GlmForCausalLM:
    """The supervised starting point, trained once and cached in workdir/base. A cache
    that does not read (a truncated weight file) is moved aside to base.corrupt, with a
    warning, and the base is trained again: it is the same model for the same config.
    With several processes, process 0 says whether the cache exists and a read that fails
    on any host makes every host train again.
    An agentic base learns from oracle episodes of generated tasks (`base.demonstrations`
    of them, seed `base.seed`), or of `demo_tasks` (the training tasks) from a Harbor dir;
    a demonstration that its verifier does not reward stops the job, naming the task.
    With a mesh the model is created (or loaded) sharded by the ambient rules. With
    `base.checkpoint`, module docstring."""
    b = cfg.base
    if b.checkpoint and not b.finetune:
        log.info("the base model is %s", b.checkpoint)
        return load_checkpoint(b.checkpoint, cfg.model, mesh)
    path = os.path.join(workdir, "base")  # a local directory, or gs://... (glmjax/storage.py)
    if distributed.broadcast_object(storage.exists(os.path.join(path, "config.json"))):  # process 0's view
        log.info("loading the cached base model from %s", path)
        try:
            with storage.reading(path) as local:
                model, reason = glmjax.from_pretrained(local, mesh=mesh), None
        except (OSError, ValueError, SafetensorError) as err:
            model, reason = None, f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"
        failures = distributed.failures(reason)  # every host loads the cache, or every host trains again
        if not failures:
            return model
        aside = storage.set_aside(path) if distributed.is_main() else path + ".corrupt"
        log.warning("the cached base model in %s does not read (%s); it is moved to %s and trained again", path,
                    distributed.describe_failures(failures), aside)
    if b.checkpoint:
        model = load_checkpoint(b.checkpoint, cfg.model, mesh)
    else:
        model = glmjax.init_model(cfg.model, seed=cfg.base.seed, mesh=mesh)
    if rl_tasks.agentic(cfg):
        if cfg.task.harbor_dir:  # a directory's tasks are what there is to demonstrate
            demo_tasks = list(demo_tasks)[:cfg.base.demonstrations]
        else:
            demo_tasks = families.make_tasks(cfg.task.family, cfg.base.demonstrations, seed=cfg.base.seed,
                                             difficulty=cfg.task.difficulty)
        ids, mask = episode_demonstrations(cfg, demo_tasks)
    else:
        if cfg.task.data:
            tasks = list(demo_tasks)[:cfg.base.demonstrations]
        else:
            tasks = families.make_tasks(cfg.task.family, cfg.base.demonstrations, seed=cfg.base.seed,
                                        difficulty=cfg.task.difficulty)
        ids, mask = demonstrations(tasks, cfg.base.seq_len, rl_tasks.compaction(cfg),
                                   chat=rl_tasks.job_chat(cfg) if b.checkpoint else None)
    supervised(model, ids, mask, cfg.base, desc="base model (SFT)", mesh=mesh)
    with storage.writing(path) as local:
        glmjax.save_pretrained(model, local)
    return model


def load_checkpoint(path: str, model_config, mesh=None) -> glmjax.GlmForCausalLM:
    """A Hugging Face checkpoint as the job's model, in `model_config`'s dtype and kernels
    (the job's config was read from its config.json), sharded by the ambient rules with a mesh."""
    return glmjax.from_pretrained(path, dtype=model_config.dtype, mesh=mesh, kernel_impl=model_config.kernel_impl,
                                  scan_layers=model_config.scan_layers, remat=model_config.remat,
                                  moe_capacity_factor=model_config.moe_capacity_factor,
                                  moe_chunk_tokens=model_config.moe_chunk_tokens)


def supervised(model: glmjax.GlmForCausalLM, ids, mask, sft: BaseConfig, desc: str = "SFT",
               mesh=None) -> glmjax.GlmForCausalLM:
    """`sft.steps` supervised steps on demonstration arrays (ids, loss mask [n, T]), batches
    drawn with `sft.seed`. DSA's sparse stage (glmjax/train.py) by default: the lightning
    indexer learns, from the attention it serves, which keys to keep; a model whose top-k
    is smaller than its context and whose indexer stayed at its init would attend to an
    arbitrary subset of keys. `sft.indexer_stage` None trains the LM losses only. With a
    mesh each batch is a global array split over the batch axes. A model without an MTP layer
    (a checkpoint written by transformers) trains without the MTP loss."""
    stage = sft.indexer_stage
    mtp_weight = sft.mtp_weight if model.config.num_nextn_predict_layers else 0.0
    opt = lm_train.make_optimizer(sft.optimizer(), model, trainable=lm_train.TRAINABLE[stage])
    rng = np.random.default_rng(sft.seed)
    for _ in tqdm(range(sft.steps), desc=desc, mininterval=1.0, disable=not distributed.is_main()):
        idx = rng.integers(0, len(ids), sft.batch_size)
        batch = distributed.global_batch({"input_ids": ids[idx], "loss_mask": mask[idx]}, mesh)
        lm_train.train_step(model, opt, batch, mtp_weight=mtp_weight, indexer_stage=stage)
    return model
