"""The SAO post-training job in one process: rollouts and learning side by side.

    glmjax-train --config configs/sao_tiny.py --workdir /tmp/sao

  1. base model: supervised training on demonstrations of the task family (cached in
     workdir/base, so a second run starts from it);
  2. held-out evaluation of the base (greedy, exact-answer verifier);
  3. SAO: the engine's driver generates in a background thread from the WeightStore's
     newest weights while this thread admits rollouts (staleness eta), scores them,
     drops those older than tau versions, and trains on each batch of B;
     every update is published to the WeightStore by reference;
  4. held-out evaluation again; workdir/summary.json and a before/after table.
Metrics go to tensorboardX (workdir/tb) and a progress bar.

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
import os
import time

import numpy as np
from flax import nnx
from safetensors import SafetensorError
from tqdm.auto import tqdm

import glmjax
from envs import families
from glmjax import presets
from glmjax import train as lm_train
from rl import rollout as ro
from rl.checkpoint import LoopCheckpointer, set_aside
from rl.compaction import Compaction, Rollout, oracle_segments
from rl.driver import Driver
from rl.engine import GlmEngine
from rl.learner import ALGORITHMS, Learner, ValueModel
from rl.weights import WeightStore

log = logging.getLogger(__name__)
STOP = ro.encode("\n")


def demonstrations(tasks, seq_len: int, compaction: Compaction | None = None):
    """SFT arrays: prompt + oracle answer, loss on the answer tokens only; with compaction,
    one row per segment of the oracle's compacted rollout (summaries included)."""
    rows = [seg for task in tasks
            for seg in oracle_segments(ro.encode(task.prompt), ro.encode(task.oracle()), compaction)]
    ids = np.zeros((len(rows), seq_len), np.int32)
    mask = np.zeros((len(rows), seq_len), np.float32)
    for i, seg in enumerate(rows):
        p, n = len(seg.prompt), len(seg.completion)
        if p + n > seq_len:
            raise ValueError(f"a demonstration of {p + n} tokens ({ro.decode(seg.prompt + seg.completion)!r}) is "
                             f"longer than base.seq_len={seq_len}: raise it, or enable rl.compaction")
        ids[i, :p + n] = seg.prompt + seg.completion
        mask[i, p:p + n] = 1 - np.asarray(seg.observation_mask, np.float32)
    return ids, mask


def build_base(cfg, workdir: str) -> glmjax.GlmForCausalLM:
    """The supervised starting point, trained once and cached in workdir/base. A cache
    that does not read (a truncated weight file) is moved aside to base.corrupt, with a
    warning, and the base is trained again: it is the same model for the same config."""
    path = os.path.join(workdir, "base")
    if os.path.exists(os.path.join(path, "config.json")):
        log.info("loading the cached base model from %s", path)
        try:
            return glmjax.from_pretrained(path)
        except (OSError, ValueError, SafetensorError) as err:
            aside = set_aside(path)
            log.warning("the cached base model in %s does not read (%s: %s); it is moved to %s and trained again",
                        path, type(err).__name__, " ".join(str(err).split())[:300], aside)
    model_cfg = presets.model_config_from(cfg)
    model = glmjax.init_model(model_cfg, seed=cfg.base.seed)
    tasks = families.make_tasks(cfg.task.family, cfg.base.demonstrations, seed=cfg.base.seed,
                                difficulty=cfg.task.difficulty)
    ids, mask = demonstrations(tasks, cfg.base.seq_len, _compaction(cfg))
    opt = lm_train.make_optimizer(dict(cfg.base), model)
    rng = np.random.default_rng(cfg.base.seed)
    for _ in tqdm(range(cfg.base.steps), desc="base model (SFT)", mininterval=1.0):
        idx = rng.integers(0, len(ids), cfg.base.batch_size)
        lm_train.train_step(model, opt, {"input_ids": ids[idx], "loss_mask": mask[idx]},
                            mtp_weight=cfg.base.mtp_weight)
    glmjax.save_pretrained(model, path)
    return model


def _compaction(cfg) -> Compaction | None:
    # the engine serves max_len - 1 tokens: it keeps one cache entry for the step's write
    return Compaction.from_config(cfg.rl.get("compaction"), window=cfg.task.max_len - 1)


def _budget(prompt, max_new_tokens: int, window: int, compaction: Compaction | None) -> int:
    """Answer tokens a rollout may write: without compaction, what the window leaves."""
    return max_new_tokens if compaction else max(1, min(max_new_tokens, window - len(prompt)))


def _prefill_buckets(engine: GlmEngine, tasks, compaction: Compaction | None) -> tuple[int, ...]:
    """The prefill lengths a job uses: up to its longest prompt's bucket; with compaction
    every bucket (a continuation prompt holds a summary and can have any length)."""
    if compaction:
        return engine.buckets
    longest = engine.bucket(max(len(ro.encode(t.prompt)) for t in tasks))
    return tuple(b for b in engine.buckets if b <= longest)


def evaluate(driver: Driver, tasks, max_new_tokens: int, compaction: Compaction | None = None) -> float:
    """Greedy pass rate over tasks (compacting, as in training, when configured)."""
    window = driver.engine.max_len - driver.engine.num_draft - 1  # what the engine serves per request
    rollouts = []
    for i, t in enumerate(tasks):
        prompt = ro.encode(t.prompt)
        rollouts.append(Rollout(prompt, _budget(prompt, max_new_tokens, window, compaction), compaction=compaction,
                                stop_ids=STOP, session_id=f"eval-{i}" if compaction else None))
    while not all(r.done for r in rollouts):
        handles = [(r, driver.submit(r.request())) for r in rollouts if not r.done]
        driver.run_until_idle()
        for r, h in handles:
            r.receive(h.result())
    return float(np.mean([t.verify(r.text) for t, r in zip(tasks, rollouts)]))


class TaskStream:
    """Training tasks in a seeded, shuffled, repeating order (grain), checkpointable."""

    def __init__(self, tasks, seed: int):
        import grain

        self.tasks = tasks
        self._ds = grain.MapDataset.range(len(tasks)).shuffle(seed=seed).repeat()
        self._it = iter(self._ds.to_iter_dataset())

    def __next__(self):
        return self.tasks[next(self._it)]

    def get_state(self):
        return self._it.get_state()

    def set_state(self, state):
        self._it.set_state(state)


def check_config(cfg) -> None:
    """Raises ValueError naming the first field of an RL config that the job cannot run, so
    that a mistyped value stops the job before the base model trains rather than after."""
    rl, task = cfg.rl, cfg.task
    if task.family not in families.TEXT:
        raise ValueError(f"task.family={task.family!r} is not a text task family: expected one of "
                         f"{sorted(families.TEXT)}")
    if task.difficulty is not None and not 1 <= task.difficulty <= 5:
        raise ValueError(f"task.difficulty={task.difficulty!r} is invalid: expected 1..5, or None for all")
    if task.max_len > cfg.model.max_position_embeddings:
        raise ValueError(f"task.max_len={task.max_len} exceeds model.max_position_embeddings="
                         f"{cfg.model.max_position_embeddings}")
    if rl.algorithm not in ALGORITHMS:
        raise ValueError(f"rl.algorithm={rl.algorithm!r} is invalid: expected one of {ALGORITHMS}")
    group = rl.get("group_size", 1)
    if group < 1 or rl.batch_size < 1 or rl.batch_size % group:
        raise ValueError(f"rl.batch_size={rl.batch_size} must be a positive multiple of rl.group_size={group}")
    if group == 1 and rl.algorithm in ("grpo", "dapo", "gspo"):
        raise ValueError(f"rl.algorithm={rl.algorithm!r} compares rollouts of one prompt: set rl.group_size >= 2")
    if rl.eta < 0:
        raise ValueError(f"rl.eta={rl.eta} is invalid: expected >= 0 (0 = synchronous)")
    if rl.slots < 1:
        raise ValueError(f"rl.slots={rl.slots} is invalid: expected >= 1")
    _compaction(cfg)  # Compaction validates its own fields


def run(cfg, workdir: str, make_rollout=None) -> dict:
    """The job (module docstring). `make_rollout(task, rollout_id, compaction)` -> Rollout
    replaces the default (the task's prompt, the config's sampling), e.g. for benchmarks
    that fix the generation lengths."""
    check_config(cfg)
    os.makedirs(workdir, exist_ok=True)
    start = time.time()
    rl = cfg.rl
    policy = build_base(cfg, workdir)
    heldout = families.make_tasks(cfg.task.family, cfg.task.eval_tasks, seed=cfg.task.seed + 1, split="heldout",
                                  difficulty=cfg.task.difficulty)
    train_tasks = families.make_tasks(cfg.task.family, cfg.task.train_tasks, seed=cfg.task.seed,
                                      difficulty=cfg.task.difficulty)
    critic = ValueModel(nnx.clone(policy)) if rl.algorithm in ("sao", "ppo") else None
    learner = Learner(policy, critic, dict(rl))
    store = WeightStore(nnx.state(policy))
    engine = GlmEngine(policy, weights=store, max_concurrent_decodes=rl.slots, max_len=cfg.task.max_len)
    driver = Driver(engine)
    compaction = _compaction(cfg)
    warmup_start = time.time()  # every prefill shape now, so that no rollout waits for a compile mid-run
    if rl.get("warmup_compile", True):
        engine.warmup(buckets=_prefill_buckets(engine, train_tasks + heldout, compaction))
    warmup_seconds = time.time() - warmup_start
    stream = TaskStream(train_tasks, seed=cfg.task.seed)
    admission = ro.Admission(rl.batch_size, rl.eta, rl.slots)
    ckpt = LoopCheckpointer(os.path.join(workdir, "checkpoints"), keep=2)
    resumed = ckpt.restore(policy=policy, critic=critic, learner=learner, stream=stream, admission=admission)
    if resumed:
        print(f"resumed from step {resumed['step']} ({os.path.join(ckpt.directory, str(resumed['step']))})",
              flush=True)
        if resumed["version"] > store.version:  # a run killed before its first update stays at 0
            store.publish(nnx.state(policy), resumed["version"])
    before = resumed or {}  # the totals of the processes before this one, up to the checkpoint
    earlier = {k: before.get(k, 0.0) for k in ("wall_seconds", "warmup_seconds", "rl_seconds")}
    writer = _writer(workdir)
    history = open(os.path.join(workdir, "metrics.jsonl"), "a")

    base_rate = resumed["base_pass_rate"] if resumed else evaluate(driver, heldout, cfg.task.max_new_tokens,
                                                                   compaction)
    print(f"base model: held-out pass rate {base_rate:.1%} on {len(heldout)} tasks", flush=True)
    if not resumed:
        writer.add_scalar("eval/pass_rate", base_rate, 0)

    def default_rollout(task, rid, compaction):
        prompt = ro.encode(task.prompt)
        return Rollout(prompt, _budget(prompt, cfg.task.max_new_tokens, cfg.task.max_len - 1, compaction),
                       compaction=compaction, stop_ids=STOP, temperature=rl.temperature, seed=rng_seed + rid,
                       session_id=f"rollout-{rid}" if compaction else None)

    make_rollout = make_rollout or default_rollout
    driver.start()
    loop_start = time.time()
    pending, dropped = {}, collections.Counter(before.get("dropped", {}))
    groups = collections.defaultdict(list)  # group id -> its finished rollouts (None where dropped)
    ready = []  # complete groups, each a list of rollouts, each a list of segments
    step, rollouts, rng_seed = learner.steps, before.get("rollouts", 0), cfg.seed * 1_000_003
    group = rl.get("group_size", 1)  # GRPO-style baselines sample G rollouts per prompt
    yields = rl.get("generation_yields", True)
    rows = rl.batch_size * (compaction.max_segments if compaction else 1)  # one learner shape
    bar = tqdm(total=rl.steps, initial=step, desc="SAO", mininterval=1.0)
    busy, last_step_at = before.get("learner_seconds", 0.0), time.time()
    while step < rl.steps:
        while admission.capacity(store.version) >= group:
            task = next(stream)
            for _ in range(group):  # a group's ids are consecutive: rid // group names it
                rid = admission.issued
                r = make_rollout(task, rid, compaction)
                pending[driver.submit(r.request())] = (task, r, rid)
                admission.started()
        for h in [h for h in pending if h.done()]:
            task, r, rid = pending.pop(h)
            r.receive(h.result())
            if not r.done:  # compaction: the summary, or the next segment
                pending[driver.submit(r.request())] = (task, r, rid)
                continue
            segments = None
            if r.finish_reason == "error":
                dropped["error"] += 1
            else:
                segments = r.trajectories(task.verify(r.text), rid, task_id=task.id, difficulty=task.difficulty)
                if max(tr.staleness(store.version) for tr in segments) > rl.tau:
                    segments, dropped["stale"] = None, dropped["stale"] + 1
            admission.finished(segments is not None)
            members = groups[rid // group]
            members.append(segments)
            if len(members) == group:  # the group is complete: its kept rollouts go to the learner
                kept = sorted((m for m in members if m is not None), key=lambda m: m[0].rollout_id)
                if kept:
                    ready.append(kept)
                del groups[rid // group]
        if sum(map(len, ready)) < rl.batch_size:
            driver.resume()
            time.sleep(0.002)
            continue
        ready.sort(key=lambda g: g[0][0].rollout_id)  # admission order, not finishing order: replayable
        take, n = 0, 0
        while take < len(ready) and n + len(ready[take]) <= rl.batch_size:
            n, take = n + len(ready[take]), take + 1
        batch = [tr for g in ready[:take] for rollout in g for tr in rollout]
        ready = ready[take:]
        if yields and sum(map(len, ready)) >= rl.batch_size:
            driver.pause()  # the next batch is complete too: generation waits while this one trains
        else:
            driver.resume()
        t0 = time.time()
        group_ids = None
        if group > 1:  # padding rows are groups of their own
            names = [tr.rollout_id // group for tr in batch] + [-1 - i for i in range(rows - len(batch))]
            group_ids = np.unique(names, return_inverse=True)[1]
        metrics = learner.step(ro.to_batch(batch, length=cfg.task.max_len, rows=rows), group_ids=group_ids)
        store.publish(nnx.state(policy))
        learner_s = time.time() - t0
        busy += learner_s
        last = [tr for tr in batch if tr.finish_reason != "compacted"]  # one row per rollout
        step, rollouts = step + 1, rollouts + len(last)
        staleness = [tr.staleness(store.version - 1) for tr in batch]
        if compaction:
            metrics["segments_per_rollout"] = len(batch) / len(last)
        now = time.time()
        metrics["tokens_per_s"] = sum(len(tr.completion) for tr in batch) / max(now - last_step_at, 1e-9)
        last_step_at = now
        metrics.update(reward=float(np.mean([tr.reward for tr in last])), staleness_mean=float(np.mean(staleness)),
                       learner_s=learner_s,
                       learner_busy_fraction=busy / max(earlier["rl_seconds"] + time.time() - loop_start, 1e-9))
        for k, v in metrics.items():
            writer.add_scalar(f"train/{k}", v, step)
        history.write(json.dumps({"step": step, "version": store.version, "time": time.time() - start,
                                  "tasks": [tr.task_id for tr in last], **metrics}) + "\n")
        history.flush()
        writer.add_histogram("train/staleness", np.asarray(staleness), step)
        bar.update(1)
        bar.set_postfix(reward=f"{metrics['reward']:.2f}", vloss=f"{metrics.get('value_loss', 0):.3f}")
        if step % cfg.checkpoint_every == 0 or step == rl.steps:
            now = time.time()
            ckpt.save(step, policy=policy, critic=critic, learner=learner, stream=stream, admission=admission,
                      version=store.version, base_pass_rate=base_rate, rollouts=rollouts, dropped=dict(dropped),
                      learner_seconds=busy, rl_seconds=earlier["rl_seconds"] + now - loop_start,
                      warmup_seconds=earlier["warmup_seconds"] + warmup_seconds,
                      wall_seconds=earlier["wall_seconds"] + now - start)
    bar.close()
    rl_seconds = max(earlier["rl_seconds"] + time.time() - loop_start, 1e-9)
    for h in pending:
        h.cancel()
    driver.stop()
    ckpt.wait()

    # the training engine (compiled once) serves the final weights, the store's newest
    final_rate = evaluate(Driver(engine), heldout, cfg.task.max_new_tokens, compaction)
    writer.add_scalar("eval/pass_rate", final_rate, step)
    summary = {"base_pass_rate": base_rate, "final_pass_rate": final_rate, "steps": step, "rollouts": rollouts,
               "algorithm": rl.algorithm, "eta": rl.eta, "dropped": dict(dropped), "heldout_tasks": len(heldout),
               "wall_seconds": earlier["wall_seconds"] + time.time() - start,
               "warmup_seconds": earlier["warmup_seconds"] + warmup_seconds, "rl_seconds": rl_seconds,
               "learner_busy_fraction": busy / rl_seconds,
               "relative_gain": (final_rate - base_rate) / max(base_rate, 1e-9),
               "resumed_from_step": resumed["step"] if resumed else None}
    with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    writer.close()
    history.close()
    print(format_table(summary), flush=True)
    return summary


def format_table(s: dict) -> str:
    rows = [("held-out pass rate", f"{s['base_pass_rate']:.1%}", f"{s['final_pass_rate']:.1%}"),
            ("change", "", f"{100 * (s['final_pass_rate'] - s['base_pass_rate']):+.1f} points "
                           f"({s['relative_gain']:+.0%})")]
    width = max(len(r[0]) for r in rows)
    lines = [f"{'':{width}}  {'base':>10}  {'after ' + s['algorithm'].upper():>12}"]
    lines += [f"{a:{width}}  {b:>10}  {c:>12}" for a, b, c in rows]
    lines.append(f"{s['steps']} steps, {s['rollouts']} rollouts, {s['wall_seconds']:.0f} s")
    return "\n".join(lines)


def _writer(workdir):
    from tensorboardX import SummaryWriter

    return SummaryWriter(os.path.join(workdir, "tb"))
