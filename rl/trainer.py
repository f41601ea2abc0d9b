"""The SAO post-training job in one process: rollouts and learning side by side.

    glmjax-train --config configs/sao_tiny.py --workdir /tmp/sao              # one-turn answers
    glmjax-train --config configs/sao_agent_tiny.py --workdir /tmp/agent      # multi-turn episodes

  1. base model (rl/base_model.py): supervised training on demonstrations (oracle
     answers, or oracle episodes: the demonstration's commands and the observations they
     really print, the observations not in the loss), cached in workdir/base, so a second
     run starts from it;
  2. held-out evaluation of the base (greedy);
  3. SAO: the engine's driver generates in a background thread from the WeightStore's
     newest weights; the collector (rl/collector.py) admits rollouts (staleness eta),
     runs their environment work in a worker pool, scores them and drops those older
     than tau versions; each batch of B trains one learner step, published to the
     WeightStore by reference;
  4. held-out evaluation again; workdir/summary.json and a before/after table; the policy
     as a Hugging Face directory, workdir/export/final (rl/export.py), and every
     `rl.export_every` steps workdir/export/step_N.
With `base.checkpoint` (rl/config.py: BaseConfig) step 1 is that checkpoint, and the job
speaks its tokenizer and chat template (rl/tasks.py: job_chat).
Each learner step is a short sequence of named steps of `Loop` (collect, admit, learn,
publish, measure, validate, log, checkpoint); the algorithm is an entry of
rl/algorithms.py and the config is typed (rl/config.py).
The loop does not know what kind of rollout it runs (rl/rollout.py: one-turn answers,
compacted answers, episodes; rl/tasks.py makes them). Metrics go to tensorboardX
(workdir/tb), workdir/metrics.jsonl and a progress bar.

Checkpoints (workdir/checkpoints, rl/checkpoint.py) are written every
`checkpoint_every` steps; a rerun in the same workdir resumes from the newest one that
reads and prints "resumed from step N". The checkpoint carries the run's totals (rollouts,
dropped rollouts, learner, loop, warm-up and wall seconds), so a resumed run's
summary.json counts the whole run: every process's work up to its last checkpoint, and
the work after it, which the resumed run redoes, once.
"""

from __future__ import annotations

import collections
import json
import logging
import math
import os
import pickle
import time

import jax
import numpy as np
from flax import nnx

from envs import evaluate as evaluate_matrix
from envs.base import is_full
from envs.reward import RewardConfig
from envs.reward import reward as shape
from glmjax import distributed, sharding, storage
from rl import rollout as ro
from rl import sao
from rl import tasks as rl_tasks
from rl.base_model import build_base, load_checkpoint
from rl.checkpoint import LoopCheckpointer
from rl.collector import Collector
from rl.compaction import Compaction
from rl.config import JobConfig
from rl.engine.engine import GlmEngine
from rl.engine.groups import EngineGroups, build_engines
from rl.engine.groups import describe as describe_groups
from rl.engine.lockstep import Lockstep, driver_for
from rl.engine.weights import WeightStore
from rl.evaluation import evaluate_tasks, matrix
from rl.export import export
from rl.job import Totals, on_mesh, say
from rl.job_log import JobLog, QuietLog
from rl.learner import Learner, ValueModel
from rl.replay import BatchReplay

log = logging.getLogger(__name__)

# The engine's layout on the learner's mesh: the learner's own rules, or the serving ones.
ENGINE_RULES = {"learner": None, "decode": sharding.DECODE_RULES}
# What a checkpoint carries of the run's totals, so that a resumed run's summary counts the whole run.
TOTALS = ("wall_seconds", "warmup_seconds", "rl_seconds", "env_seconds", "learner_seconds")


def check_config(cfg) -> JobConfig:
    """The typed config (rl/config.py); a ValueError names the first field the job cannot
    run, so that a mistyped value stops the job before the base model trains."""
    job = JobConfig.from_config(cfg)
    rl_tasks.compaction(job)  # Compaction validates its own fields
    if job.base.checkpoint:
        check_checkpoint(job)
    if job.rl.engine_mesh:
        _engine_devices(job)
    m = job.model
    if job.rl.routing_replay != "off" and not any(m.is_moe(i) for i in range(m.num_hidden_layers)):
        raise ValueError(f"rl.routing_replay={job.rl.routing_replay!r} records MoE routing; this model has no MoE "
                         "layer: set it to 'off'")
    return job


def check_checkpoint(job: JobConfig) -> None:
    """A `base.checkpoint` the job can use, before any compute: its tokenizer and chat
    template load, the template only appends (glmjax/chat.py: check_append_only, on a
    sample conversation; the ValueError names the turn that differs), the tokenizer fits the
    model's vocabulary, and the critic's checkpoint shares it."""
    from glmjax.chat import check_append_only

    chat = rl_tasks.job_chat(job)
    where = f"base.checkpoint={job.base.checkpoint!r}"
    try:
        check_append_only(chat)
    except ValueError as err:
        raise ValueError(f"{where}: the chat template cannot train token in, token out: {err}") from None
    if chat.vocab_size > job.model.vocab_size:
        raise ValueError(f"{where}: the tokenizer has {chat.vocab_size} tokens and the model's vocab_size is "
                         f"{job.model.vocab_size}: they are not one checkpoint's")
    if job.base.critic_checkpoint:
        from glmjax.config import ModelConfig

        critic = ModelConfig.from_hf(job.base.critic_checkpoint)
        if critic.vocab_size != job.model.vocab_size:
            raise ValueError(f"base.critic_checkpoint={job.base.critic_checkpoint!r} has vocab_size "
                             f"{critic.vocab_size}, the policy {job.model.vocab_size}: the critic reads the "
                             "policy's tokens")


def run(cfg, workdir: str, make_rollout=None) -> dict:
    """The job (module docstring). `make_rollout(task, rollout_id)` -> a rollout
    (rl/rollout.py) replaces the default (rl/tasks.py: the task's prompt or episode, the
    config's sampling), e.g. for benchmarks that fix the generation lengths.

    With `config.mesh` (glmjax/distributed.py) policy and critic are created or loaded
    sharded by `config.rules`, learner batches are global arrays, and the engine decodes on
    the same devices: in the learner's layout (`rl.engine_rules="learner"`: publishing is a
    reference swap) or in the serving one ("decode": sharding.DECODE_RULES, publishing
    reshards inside XLA)."""
    job = check_config(cfg)
    return on_mesh(job.raw, workdir, lambda mesh, rules: _run(job, workdir, make_rollout, mesh))


def _run(job: JobConfig, workdir: str, make_rollout, mesh) -> dict:
    loop = Loop(job, workdir, make_rollout, mesh)
    loop.evaluate_base()
    loop.start()
    while loop.step < job.rl.steps:
        local = loop.collect()
        if local is None:
            continue
        batch = loop.admit(local)
        metrics = loop.learn(batch)
        loop.publish()
        metrics.update(loop.measure())
        metrics.update(loop.validate())
        loop.log(metrics)
        loop.checkpoint()
        loop.export()
    loop.stop()
    return loop.finish()


class Loop:
    """The RL job's state, built once (tasks, base model, learner, engine, collector,
    checkpoints, logs), and the steps of one learner update as methods."""

    def __init__(self, job: JobConfig, workdir: str, make_rollout, mesh):
        self.job, self.workdir, self.mesh = job, workdir, mesh
        self.started = time.time()
        rl = job.rl
        self.train_tasks, self.heldout, self.excluded = rl_tasks.task_sets(job, workdir)
        self.validation = rl_tasks.validation_tasks(job, self.train_tasks, self.heldout)
        self.policy = build_base(job, workdir, demo_tasks=self.train_tasks, mesh=mesh)
        self.critic = ValueModel(self._critic_trunk()) if rl.uses_critic else None
        if self.critic is not None and mesh is not None:  # its head, made on one device, joins the mesh
            self.critic = sharding.shard_model(self.critic, mesh)
        self.groups = _engine_groups(job, self.policy, mesh) if rl.engine_groups > 1 else None
        if self.groups is not None:  # the groups serve the rollouts; group 0's engine the evaluations
            self.engine, self.store, self.driver = self.groups.engine, self.groups.store, self.groups
        else:
            self.engine = _engine(job, self.policy, mesh)
            self.store = self.engine.weights
            self.driver = driver_for(self.engine)  # a Lockstep when the engine spans processes
        self.lockstep = isinstance(self.driver, Lockstep)
        self._held = None  # lockstep: this process's batch share, taken while the others complete theirs
        # an engine that decodes from copies leaves the policy's arrays to the learner alone
        self.learner = Learner(self.policy, self.critic, rl, mesh=mesh,
                               donate_policy=self.store.copies(nnx.state(self.policy)))
        _describe_placement(job, self.engine, mesh, self.groups)
        self.compaction = rl_tasks.compaction(job)
        self._warmup()
        self.processes = jax.process_count()
        self.shard = (jax.process_index(), self.processes)  # each process collects its share of every batch
        self.share = rl.batch_size // self.processes
        if self.share * self.processes != rl.batch_size or self.share % rl.group_size:
            raise ValueError(f"rl.batch_size={rl.batch_size} does not split over {self.processes} processes in "
                             "whole groups")
        self.stream = rl_tasks.TaskStream(self.train_tasks, seed=job.task.seed, shard=self.shard)
        self.admission = ro.Admission(self.share, rl.eta, rl.slots)
        self._resume()
        self.logs = JobLog(workdir, rl.steps, self.learner.steps) if distributed.is_main() else QuietLog()
        self.make = make_rollout or rl_tasks.RolloutFactory(job, job.task.max_len - 1, driver=self.driver)
        self.collector = Collector(self.driver, self.admission, self.make, self.stream, group_size=rl.group_size, tau=rl.tau,
                                   workers=job.env.workers if job.env else 2, shard=self.shard,
                                   env_timeout=job.env.episode_seconds if job.env else 600.0, score=_scorer(job),
                                   dynamic_sampling=rl.dynamic_sampling)
        self.rows = rl.batch_size * (self.compaction.max_segments if self.compaction else 1)  # one learner shape
        self.replay = BatchReplay(capacity=rl.replay.capacity, rows=rl.replay.rows, alpha=rl.replay.alpha,
                                  beta=rl.replay.beta, seed=job.seed) if rl.replay.enabled else None
        self.row_share = _row_share(mesh, self.rows + (self.replay.rows if self.replay else 0))
        self.shared = {"env_seconds": 0.0, "rollout_seconds": 0.0, "dropped": collections.Counter(), "turns": [],
                       "rerendered": []}
        self.drafted = (0, 0)  # the driver's accepted drafts and busy slot-steps at the last learner step
        self.sent_bytes = []  # per learner step: what this process sent the others of its rollouts

    # Setup --------------------------------------------------------------------------------
    def _critic_trunk(self):
        """The critic's backbone: `base.critic_checkpoint`, or the policy's starting weights."""
        path = self.job.base.critic_checkpoint
        return load_checkpoint(path, self.job.model, self.mesh) if path else nnx.clone(self.policy)

    def _warmup(self) -> None:
        """Every prefill shape compiled now, so that no rollout waits for a compile mid-run."""
        start = time.time()
        if self.job.rl.warmup_compile:
            buckets = _prefill_buckets(self.engine, self.train_tasks + self.heldout, self.compaction,
                                       rl_tasks.job_chat(self.job))
            for engine in self.groups.engines if self.groups is not None else [self.engine]:
                engine.warmup(buckets=buckets)
        self.warmup_seconds = time.time() - start

    def _resume(self) -> None:
        """The newest checkpoint that reads, if any: models, optimizers, task stream,
        admission, the published version and the run's totals so far."""
        self.ckpt = LoopCheckpointer(os.path.join(self.workdir, "checkpoints"), keep=2)
        resumed = self.ckpt.restore(policy=self.policy, critic=self.critic, learner=self.learner, stream=self.stream,
                                    admission=self.admission)
        self.resumed = resumed
        if resumed:
            say(f"resumed from step {resumed['step']} ({os.path.join(self.ckpt.directory, str(resumed['step']))})")
            if resumed["version"] > self.store.version:  # a run killed before its first update stays at 0
                self.store.publish(nnx.state(self.policy), resumed["version"])
        before = resumed or {}  # the totals of the processes before this one, up to the checkpoint
        self.totals = Totals({k: before.get(k, 0.0) for k in TOTALS})
        self.totals.clock("wall_seconds", self.started)
        self.totals.set("warmup_seconds", self.warmup_seconds)
        self.step = self.learner.steps
        self.rollouts = before.get("rollouts", 0)
        self.dropped_before = collections.Counter(before.get("dropped", {}))

    def evaluate_base(self) -> None:
        """The base's held-out pass rate (a resumed run's checkpoint has it)."""
        if self.resumed and "base_eval" in self.resumed:
            self.base = self.resumed["base_eval"]
        else:
            self.base = evaluate_tasks(self.job, self.driver, self.heldout)
        say(f"base model: held-out pass rate {self.base['pass_rate']:.1%} on {len(self.heldout)} tasks")
        if not self.resumed:
            self.logs.eval(self.base, 0)

    def start(self) -> None:
        self.driver.start()
        self.totals.clock("rl_seconds")
        self.last_step_at = time.time()

    # One learner step ---------------------------------------------------------------------
    def collect(self) -> list | None:
        """This process's next batch share, or None while it is incomplete (generation
        goes on meanwhile)."""
        self.collector.poll(self.store.version)
        if self.lockstep:  # one engine step with every process; the batch once every share is complete
            self._held = self._held or self.collector.take(self.share)
            if not self.driver.sync(done=self._held is not None):
                return None
            local, self._held = self._held, None
            return local
        local = self.collector.take(self.share)
        if local is None:
            self.driver.resume()
            time.sleep(0.002)
        return local

    def admit(self, local: list) -> list:
        """The part of the batch this process learns from: its own rollouts, in rollout
        order, which fill the rows its devices hold (`row_share`); every process's rollouts
        when the learner's layout holds a row on several processes. Every process receives
        a summary of each rollout (rl/rollout.py: Seen) for the metrics. Generation pauses
        while it trains if the next batch is complete too (rl.generation_yields)."""
        if self.job.rl.generation_yields and self.collector.ready_rollouts() >= self.share:
            self.driver.pause()
        else:
            self.driver.resume()
        whole = self.processes > 1 and self.row_share is None
        self.shared = _gathered(self.collector, local, whole)
        self.sent_bytes.append(self.shared["sent_bytes"])
        return self.shared["batch"] if whole else sorted(local, key=lambda tr: (tr.rollout_id, tr.segment_index))

    def learn(self, batch: list) -> dict:
        """One learner step on the batch (rl/learner.py): group ids for group baselines
        (padding and replayed rows are groups of their own), and `rl.replay.rows` stored rows
        beside the fresh ones when replay is on (rl/replay.py: BatchReplay)."""
        t0 = time.time()
        group, share = self.job.rl.group_size, self.row_share
        held = np.arange(self.rows + (self.replay.rows if self.replay else 0)) if share is None else share.rows
        group_ids = None
        if group > 1:  # each padding row a group of its own, named by its global row
            group_ids = np.asarray([tr.rollout_id // group for tr in batch] + [-1 - r for r in held[len(batch):]])
        arrays = ro.to_batch(batch, length=self.job.task.max_len, rows=len(held))
        if self.replay is None:
            metrics = self.learner.step(arrays, group_ids=group_ids, share=share)
        else:
            arrays, weights, drawn = self.replay.fill(arrays, fresh=self.rows)
            metrics = self.learner.step(arrays, group_ids=group_ids, row_weights=weights)
            self.replay.update(arrays, self.learner.last_advantages, fresh=self.rows, drawn=drawn)
            metrics.update(replay_size=float(len(self.replay.buffer)),
                           replay_rows=float(drawn is not None) * self.replay.rows)
        self.step += 1
        self.learn_started = t0
        return metrics

    def publish(self) -> None:
        """The new weights to the engine: a reference swap, or a reshard inside XLA."""
        self.store.publish(nnx.state(self.policy))
        self.learner_s = time.time() - self.learn_started
        self.totals.add("learner_seconds", self.learner_s)

    def measure(self) -> dict:
        """Rewards, staleness, throughput and the engine's speculation of this step, over
        every process's rollouts."""
        seen = self.shared["seen"]
        last = [tr for tr in seen if not tr.compacted]  # one row per rollout
        self.last = last
        self.rollouts += len(last)
        self.staleness = [tr.staleness(self.store.version - 1) for tr in seen]
        metrics = {}
        if self.compaction:
            metrics["segments_per_rollout"] = len(seen) / len(last)
        if self.shared["turns"]:
            metrics["turns_per_episode"] = float(np.mean(self.shared["turns"]))
        if self.shared["rerendered"]:  # agent episodes: calls whose history the agent sent otherwise
            metrics["rerendered_calls_per_episode"] = float(np.mean(self.shared["rerendered"]))
        now = time.time()
        if self.engine.num_draft:  # drafts accepted per decode step since the last learner step
            counts = self.driver.stats["accepted_drafts"], self.driver.stats["busy_slot_steps"]
            metrics["mtp_accept_len"] = (counts[0] - self.drafted[0]) / max(counts[1] - self.drafted[1], 1)
            self.drafted = counts
        metrics["tokens_per_s"] = sum(tr.completion_tokens for tr in seen) / max(now - self.last_step_at, 1e-9)
        self.last_step_at = now
        if last[0].raw_reward is not None:
            metrics["reward_raw"] = float(np.mean([tr.raw_reward for tr in last]))
        env_seconds = self.totals.earlier["env_seconds"] + self.shared["env_seconds"]
        metrics.update(reward=float(np.mean([tr.reward for tr in last])), staleness_mean=float(np.mean(self.staleness)),
                       learner_s=self.learner_s,
                       learner_busy_fraction=self.totals["learner_seconds"] / max(self.totals["rl_seconds"], 1e-9),
                       env_seconds_per_rollout=env_seconds / max(self.rollouts, 1))
        return metrics

    def validate(self) -> dict:
        """Every `rl.validate_every` steps, greedy and sampled pass rates on the validation
        tasks; the training driver waits meanwhile."""
        every = self.job.rl.validate_every
        if not (every and self.step % every == 0 and self.validation):
            return {}
        self.driver.pause()
        metrics = {}
        for name, greedy in (("greedy", True), ("sampled", False)):
            result = evaluate_tasks(self.job, driver_for(self.engine), self.validation, greedy=greedy)
            self.logs.eval({f"validation_{name}_pass_rate": result["pass_rate"]}, self.step)
            metrics[f"validation_{name}_pass_rate"] = result["pass_rate"]
        self.driver.resume()
        return metrics

    def log(self, metrics: dict) -> None:
        """The step's row: metrics.jsonl, TensorBoard and the progress bar (process 0's)."""
        row = {"version": self.store.version, "time": time.time() - self.started,
               "tasks": [tr.task_id for tr in self.last]}
        self.logs.step(self.step, row, metrics, self.staleness)

    def checkpoint(self) -> None:
        """Every `checkpoint_every` steps and at the last: models, optimizers, stream,
        admission and the run's totals."""
        if self.step % self.job.checkpoint_every and self.step != self.job.rl.steps:
            return
        self.ckpt.save(self.step, policy=self.policy, critic=self.critic, learner=self.learner, stream=self.stream,
                       admission=self.admission, version=self.store.version, base_pass_rate=self.base["pass_rate"],
                       base_eval=self.base, rollouts=self.rollouts, dropped=dict(self.dropped),
                       env_seconds=self.env_seconds, **self.totals.snapshot("learner_seconds", "rl_seconds",
                                                                            "warmup_seconds", "wall_seconds"))

    def export(self, name: str | None = None) -> str | None:
        """The policy as a Hugging Face directory (rl/export.py) every `rl.export_every` steps,
        or now as `name`."""
        every = self.job.rl.export_every
        if name is None and not (every and self.step % every == 0):
            return None
        path = os.path.join(self.workdir, "export", name or f"step_{self.step}")
        return export(self.policy, path, tokenizer_from=self.job.base.checkpoint)

    @property
    def dropped(self) -> collections.Counter:
        return self.dropped_before + self.shared["dropped"]

    @property
    def env_seconds(self) -> float:
        return self.totals.earlier["env_seconds"] + self.shared["env_seconds"]

    # The end ------------------------------------------------------------------------------
    def stop(self) -> None:
        self.rl_seconds = max(self.totals["rl_seconds"], 1e-9)
        self.collector.close()
        if isinstance(self.make, rl_tasks.RolloutFactory):
            self.make.close()
        self.driver.stop()
        self.ckpt.wait()

    def finish(self) -> dict:
        """Held-out evaluation of the final weights (the training engine, compiled once,
        serves the store's newest), summary.json, and for an agentic job the blind ablation
        and the evaluation matrix."""
        job, base = self.job, self.base
        final = evaluate_tasks(job, driver_for(self.engine), self.heldout)
        self.logs.eval(final, self.step)
        summary = {"base_pass_rate": base["pass_rate"], "final_pass_rate": final["pass_rate"], "steps": self.step,
                   "rollouts": self.rollouts, "algorithm": job.rl.algorithm, "eta": job.rl.eta,
                   "dropped": dict(self.dropped),
                   "heldout_tasks": len(self.heldout), "train_tasks": len(self.train_tasks),
                   "excluded_tasks": self.excluded, "wall_seconds": self.totals["wall_seconds"],
                   "warmup_seconds": self.totals["warmup_seconds"], "rl_seconds": self.rl_seconds,
                   "learner_busy_fraction": self.totals["learner_seconds"] / self.rl_seconds,
                   "relative_gain": (final["pass_rate"] - base["pass_rate"]) / max(base["pass_rate"], 1e-9),
                   "resumed_from_step": self.resumed["step"] if self.resumed else None, "processes": self.processes,
                   # the learner's rows each process filled from its own rollouts (None: every process had them all)
                   "learner_rows_per_process": None if self.row_share is None else len(self.row_share.rows),
                   "learner_rows": self.row_share.total if self.row_share is not None else None,
                   # bytes of its rollouts (their summaries, or themselves) process 0 sent the others per step
                   "rollout_bytes_sent_per_step": float(np.mean(self.sent_bytes)) if self.sent_bytes else 0.0}
        if self.groups is not None:  # how the router spread the rollouts, and what failed
            summary["engine_groups"] = self.groups.utilisation()
        if self.engine.num_draft:  # over this process's training rollouts
            stats = self.driver.stats
            summary.update(num_draft=self.engine.num_draft,
                           mtp_accept_len=stats["accepted_drafts"] / max(stats["busy_slot_steps"], 1))
        if job.agentic:  # the same policy with every command's output hidden: what reading is worth
            blind = evaluate_tasks(job, driver_for(self.engine), self.heldout, blank_observations=True)
            summary.update(final_pass_rate_blind=blind["pass_rate"], base_turns_per_episode=base["turns"],
                           final_turns_per_episode=final["turns"], env_seconds=self.env_seconds,
                           env_time_fraction=self.shared["env_seconds"] / max(self.shared["rollout_seconds"], 1e-9))
        summary["export"] = self.export("final")
        if distributed.is_main():
            storage.write_text(os.path.join(self.workdir, "summary.json"), json.dumps(summary, indent=2))
        if job.agentic and job.eval.matrix_tasks:  # process 0's; an engine over all processes serves it in step
            if self.lockstep:
                work = (lambda d: matrix(job, self.engine, self.heldout, self.workdir, d)) if distributed.is_main() \
                    else (lambda d: None)
                driver = Lockstep([self.engine])
                report = driver.serve_while(lambda: work(driver))
            else:
                report = matrix(job, self.engine, self.heldout, self.workdir) if distributed.is_main() else None
            if report is not None:
                print(evaluate_matrix.table(report), flush=True)
        self.logs.close()
        say(format_table(summary))
        return summary


# Parts ----------------------------------------------------------------------------------
def _prefill_buckets(engine: GlmEngine, tasks, compaction: Compaction | None, chat) -> tuple[int, ...]:
    """The prefill lengths a job uses: up to its longest prompt's bucket; with compaction
    or episodes every bucket (a continuation holds a summary or a history of any length)."""
    if compaction or not all(hasattr(t, "prompt") for t in tasks):
        return engine.buckets
    longest = engine.bucket(max(len(rl_tasks.prompt_tokens(chat, t)) for t in tasks))
    return tuple(b for b in engine.buckets if b <= longest)


def _scorer(job: JobConfig):
    """The reward the learner sees: the verifier's, shaped by task complexity
    (`rl.reward_shaping`: envs/reward.py; "pass_rate" tracks each difficulty level's running
    pass rate over this run's rollouts), plus DAPO's overlong penalty on answers within
    `rl.overlong_buffer` tokens of the budget `task.max_new_tokens` (rl/sao.py)."""
    rl = job.rl
    if rl.reward_shaping == "none" and not rl.overlong_buffer:
        return None
    config = RewardConfig(shaping=rl.reward_shaping, alpha=rl.reward_alpha)
    seen = collections.defaultdict(lambda: [0, 0])  # difficulty -> [full rewards, rollouts]

    def score(task, r):
        reward = r.reward
        if rl.reward_shaping != "none":
            passed, n = seen[task.difficulty]
            reward = shape(r.reward, task, config, pass_rate=passed / n if n else 0.5)
            seen[task.difficulty][0] += is_full(r.reward)
            seen[task.difficulty][1] += 1
        if rl.overlong_buffer:
            length = sum(len(tr.completion) - sum(tr.observation_mask or ()) for tr in r.trajectories(-1))
            reward += sao.dapo_overlong_penalty(length, job.task.max_new_tokens, rl.overlong_buffer)
        return reward

    return score


def _engine(job: JobConfig, policy, mesh) -> GlmEngine:
    """The rollout engine and its WeightStore, in the layout `rl.engine_rules` names: on the
    learner's devices (this process's share of them), or with `rl.engine_mesh` on as many
    devices of their own."""
    rl = job.rl
    drafts = rl.num_draft  # MTP speculation: drafts per step from the policy's own MTP layer
    # a step verifies `drafts` tokens past the last one kept: the cache has room for them
    max_len = job.task.max_len + drafts
    own = engine_mesh(job, mesh)
    record = rl.routing_replay != "off"  # the experts of every position, for the learner (rl/learner.py)
    if mesh is None and own is None:
        return GlmEngine(policy, weights=WeightStore(nnx.state(policy)), max_concurrent_decodes=rl.slots,
                         max_len=max_len, num_draft=drafts, record_routes=record)
    rules = ENGINE_RULES[rl.engine_rules] or sharding.current_rules()
    # several processes: each its own devices, or (rl.engine_span="job") every device of the job
    where = own if own is not None else mesh if rl.engine_span == "job" else distributed.local_mesh(mesh)
    state = nnx.state(policy)
    # an engine over several processes is stepped by the publisher's own thread (rl/engine/lockstep.py):
    # each publish may take the previous copy's buffers
    store = WeightStore(state, shardings=sharding.param_shardings(state, where, rules),
                        donate_previous=where.is_multi_process)
    return GlmEngine(policy, weights=store, max_concurrent_decodes=rl.slots, max_len=max_len, mesh=where,
                     rules=rules, num_draft=drafts, record_routes=record)


def _engine_groups(job: JobConfig, policy, mesh) -> EngineGroups | Lockstep:
    """`rl.engine_groups` engines over blocks of the learner's devices (rl/engine/groups.py),
    in the layout `rl.engine_rules` names, each over `rl.engine_mesh`: behind a Router with a
    watchdog in one process, stepped by every process together when the blocks span
    processes (rl/engine/lockstep.py)."""
    rl = job.rl
    if mesh is None:
        raise ValueError(f"rl.engine_groups={rl.engine_groups} splits the learner's devices: give config.mesh")
    rules = ENGINE_RULES[rl.engine_rules] or sharding.current_rules()
    engines, store = build_engines(policy, mesh, rl.engine_groups, sharding.parse_axes(rl.engine_mesh), rules,
                                   max_concurrent_decodes=rl.slots, max_len=job.task.max_len + rl.num_draft,
                                   num_draft=rl.num_draft, record_routes=rl.routing_replay != "off")
    if any(e.mesh.is_multi_process for e in engines):
        return Lockstep(engines, store=store)
    return EngineGroups(engines, store, stall_seconds=rl.engine_stall_seconds)


def engine_mesh(job: JobConfig, mesh):
    """The engine's own mesh when `rl.engine_mesh` gives one ("expert=2,tensor=2"), None
    when it decodes on the learner's devices: the devices that follow the learner's (devices
    4-7 after a learner on 0-3), as many as the learner has, so that publishing copies each
    parameter shard device to device (rl/engine/weights.py)."""
    if not job.rl.engine_mesh or job.rl.engine_groups > 1:
        return None
    learner = mesh.size if mesh is not None else 1
    return sharding.make_mesh(**_engine_devices(job), devices=jax.devices()[learner:2 * learner])


def _engine_devices(job: JobConfig) -> dict[str, int]:
    """`rl.engine_mesh`'s axis sizes; a ValueError when they do not fit beside the learner's."""
    text = job.rl.engine_mesh
    sizes = sharding.parse_axes(text)
    learner, wanted = distributed.mesh_devices(job.raw), math.prod(sizes.values())
    groups = job.rl.engine_groups
    if groups > 1:
        if wanted * groups != learner:
            raise ValueError(f"rl.engine_groups={groups} groups of rl.engine_mesh={text!r} span {wanted * groups} "
                             f"devices and config.mesh {learner}: the groups split the learner's devices")
        return sizes
    if wanted != learner:
        raise ValueError(f"rl.engine_mesh={text!r} spans {wanted} devices and config.mesh {learner}: give the "
                         f"engine as many devices as the learner (axis sizes that multiply to {learner})")
    if 2 * learner > len(jax.devices()):
        raise ValueError(f"rl.engine_mesh={text!r} needs {wanted} devices after the learner's {learner}; "
                         f"{len(jax.devices())} are available: shrink config.mesh and rl.engine_mesh together")
    return sizes


def _describe_placement(job: JobConfig, engine: GlmEngine, mesh, groups=None) -> None:
    """Where policy, critic and engine run, when that is more than one device."""
    if groups is not None:
        where, how = distributed.describe(mesh), ""
        if jax.process_count() > 1:
            where = f"{where} over {jax.process_count()} processes"
            how = ", every process stepping them in lockstep" if isinstance(groups, Lockstep) else ""
        say(f"policy and critic on {where}; {describe_groups(groups)}{how} in the {job.rl.engine_rules} layout")
        return
    disjoint = bool(job.rl.engine_mesh)
    if mesh is None and not disjoint:
        return
    where = distributed.describe(mesh) if mesh is not None else "one device"
    engines = "the engine"
    if disjoint:
        ids = [d.id for d in engine.mesh.devices.flat]
        engines = f"the engine on devices {ids[0]}-{ids[-1]} ({distributed.describe(engine.mesh)})"
    elif jax.process_count() > 1:
        where = f"{where} over {jax.process_count()} processes"
        engines = f"one engine per process on its {engine.mesh.size} devices"
        if engine.mesh.is_multi_process:
            engines = f"one engine over all {engine.mesh.size} devices, every process stepping it in lockstep"
    say(f"policy and critic on {where}; {engines} in the {job.rl.engine_rules} layout")


def _row_share(mesh, rows: int) -> distributed.RowShare | None:
    """The learner batch's rows this process fills with its own rollouts; None without a
    mesh, or when the learner's layout holds a row on several processes (each then needs
    every process's rollouts: `_gathered(whole=True)`)."""
    if mesh is None:
        return None
    share = distributed.RowShare.of(mesh, rows)
    return share if share.disjoint else None


def _gathered(collector: Collector, local: list, whole: bool = False) -> dict:
    """What every process needs of this step's shares: a summary of each trajectory in
    rollout order (rl/rollout.py: Seen; with `whole`, the trajectories too, as "batch"), the
    turns of the episodes finished since the last step, and the collectors' environment and
    rollout seconds and dropped rollouts so far."""
    done = [r for _, r in collector.drain_finished() if hasattr(r, "turns")]
    finished = [(r.turns, r.info.get("rerendered")) for r in done]
    sent = local if whole else [ro.Seen.of(tr) for tr in local]
    sent_bytes = len(pickle.dumps(sent)) if jax.process_count() > 1 else 0
    parts = distributed.gather_objects((sent, finished, collector.env_seconds, collector.rollout_seconds,
                                        dict(collector.dropped)))
    order = sorted((tr for p in parts for tr in p[0]), key=lambda tr: (tr.rollout_id, tr.segment_index))
    return {"seen": [ro.Seen.of(tr) for tr in order] if whole else order, "batch": order if whole else None,
            "sent_bytes": sent_bytes,
            "turns": [t for p in parts for t, _ in p[1]],
            "rerendered": [n for p in parts for _, n in p[1] if n is not None], "env_seconds": sum(p[2] for p in parts),
            "rollout_seconds": sum(p[3] for p in parts),
            "dropped": sum((collections.Counter(p[4]) for p in parts), collections.Counter())}


def format_table(s: dict) -> str:
    rows = [("held-out pass rate", f"{s['base_pass_rate']:.1%}", f"{s['final_pass_rate']:.1%}"),
            ("change", "", f"{100 * (s['final_pass_rate'] - s['base_pass_rate']):+.1f} points "
                           f"({s['relative_gain']:+.0%})")]
    width = max(len(r[0]) for r in rows)
    lines = [f"{'':{width}}  {'base':>10}  {'after ' + s['algorithm'].upper():>12}"]
    lines += [f"{a:{width}}  {b:>10}  {c:>12}" for a, b, c in rows]
    lines.append(f"{s['steps']} steps, {s['rollouts']} rollouts, {s['wall_seconds']:.0f} s")
    return "\n".join(lines)
