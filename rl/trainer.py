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
"""

from __future__ import annotations

import collections
import json
import logging
import os
import time

import jax
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

import glmjax
from envs import families
from glmjax import train as lm_train
from rl import rollout as ro
from rl.checkpoint import LoopCheckpointer
from rl.driver import Driver, Request
from rl.engine import GlmEngine
from rl.learner import Learner, ValueModel
from rl.weights import WeightStore

log = logging.getLogger(__name__)
STOP = ro.encode("\n")


def demonstrations(tasks, seq_len: int):
    """SFT arrays: prompt + oracle answer, loss on the answer tokens only."""
    ids = np.zeros((len(tasks), seq_len), np.int32)
    mask = np.zeros((len(tasks), seq_len), np.float32)
    for i, task in enumerate(tasks):
        p, a = ro.encode(task.prompt), ro.encode(task.oracle())
        ids[i, :len(p) + len(a)] = p + a
        mask[i, len(p):len(p) + len(a)] = 1
    return ids, mask


def build_base(cfg, workdir: str) -> glmjax.GlmForCausalLM:
    """The supervised starting point, trained once and cached in workdir/base."""
    path = os.path.join(workdir, "base")
    if os.path.exists(os.path.join(path, "config.json")):
        log.info("loading the cached base model from %s", path)
        return glmjax.from_pretrained(path)
    model_cfg = glmjax.presets.model_config_from(cfg)
    model = glmjax.init_model(model_cfg, seed=cfg.base.seed)
    tasks = families.make_tasks(cfg.task.family, cfg.base.demonstrations, seed=cfg.base.seed,
                                difficulty=cfg.task.difficulty)
    ids, mask = demonstrations(tasks, cfg.base.seq_len)
    opt = lm_train.make_optimizer(dict(cfg.base), model)
    rng = np.random.default_rng(cfg.base.seed)
    for _ in tqdm(range(cfg.base.steps), desc="base model (SFT)", mininterval=1.0):
        idx = rng.integers(0, len(ids), cfg.base.batch_size)
        lm_train.train_step(model, opt, {"input_ids": ids[idx], "loss_mask": mask[idx]},
                            mtp_weight=cfg.base.mtp_weight)
    glmjax.save_pretrained(model, path)
    return model


def evaluate(driver: Driver, tasks, max_new_tokens: int) -> float:
    """Greedy pass rate over tasks."""
    handles = [driver.submit(Request(ro.encode(t.prompt), max_new_tokens, temperature=0.0, stop_ids=STOP))
               for t in tasks]
    driver.run_until_idle()
    return float(np.mean([t.verify(ro.decode(h.result().tokens)) for t, h in zip(tasks, handles)]))


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


def run(cfg, workdir: str) -> dict:
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
    stream = TaskStream(train_tasks, seed=cfg.task.seed)
    admission = ro.Admission(rl.batch_size, rl.eta, rl.slots)
    ckpt = LoopCheckpointer(os.path.join(workdir, "checkpoints"), keep=2)
    resumed = ckpt.restore(policy=policy, critic=critic, learner=learner, stream=stream, admission=admission)
    if resumed and resumed["version"] > store.version:  # a run killed before its first update stays at 0
        store.publish(nnx.state(policy), resumed["version"])
    writer = _writer(workdir)
    history = open(os.path.join(workdir, "metrics.jsonl"), "a")

    base_rate = resumed["base_pass_rate"] if resumed else evaluate(driver, heldout, cfg.task.max_new_tokens)
    print(f"base model: held-out pass rate {base_rate:.1%} on {len(heldout)} tasks", flush=True)

    driver.start()
    pending, ready, dropped = {}, [], collections.Counter()
    step, rollouts, rng_seed = learner.steps, 0, cfg.seed * 1_000_003
    bar = tqdm(total=rl.steps, initial=step, desc="SAO", mininterval=1.0)
    busy = 0.0
    while step < rl.steps:
        group = rl.get("group_size", 1)  # GRPO-style baselines sample G rollouts per prompt
        while admission.capacity(store.version) >= group:
            task = next(stream)
            prompt = ro.encode(task.prompt)
            for _ in range(group):
                rid = admission.accepted + admission.running
                h = driver.submit(Request(prompt, cfg.task.max_new_tokens, temperature=rl.temperature,
                                          seed=rng_seed + rid, stop_ids=STOP))
                pending[h] = (task, prompt, rid)
                admission.started()
        for h in [h for h in pending if h.done()]:
            task, prompt, rid = pending.pop(h)
            res = h.result()
            if res.finish_reason == "error":
                admission.finished(False)
                dropped["error"] += 1
                continue
            tr = ro.Trajectory(prompt, res.tokens, res.log_probs, res.versions, task.verify(ro.decode(res.tokens)),
                               rollout_id=rid, task_id=task.id, difficulty=task.difficulty)
            keep = tr.staleness(store.version) <= rl.tau
            admission.finished(keep)
            dropped["stale"] += not keep
            if keep:
                ready.append(tr)
        if len(ready) < rl.batch_size:
            time.sleep(0.002)
            continue
        ready.sort(key=lambda tr: tr.rollout_id)  # admission order, not finishing order: replayable
        batch, ready = ready[:rl.batch_size], ready[rl.batch_size:]
        t0 = time.time()
        groups = np.unique([tr.task_id for tr in batch], return_inverse=True)[1] if group > 1 else None
        metrics = learner.step(ro.to_batch(batch, length=cfg.task.max_len), group_ids=groups)
        store.publish(nnx.state(policy))
        busy += time.time() - t0
        step, rollouts = step + 1, rollouts + len(batch)
        staleness = [tr.staleness(store.version - 1) for tr in batch]
        metrics.update(reward=float(np.mean([tr.reward for tr in batch])), staleness_mean=float(np.mean(staleness)),
                       learner_busy_fraction=busy / max(time.time() - start, 1e-9))
        for k, v in metrics.items():
            writer.add_scalar(f"train/{k}", v, step)
        history.write(json.dumps({"step": step, "version": store.version, "time": time.time() - start,
                                  "tasks": [tr.task_id for tr in batch], **metrics}) + "\n")
        history.flush()
        writer.add_histogram("train/staleness", np.asarray(staleness), step)
        bar.update(1)
        bar.set_postfix(reward=f"{metrics['reward']:.2f}", vloss=f"{metrics.get('value_loss', 0):.3f}")
        if step % cfg.checkpoint_every == 0 or step == rl.steps:
            ckpt.save(step, policy=policy, critic=critic, learner=learner, stream=stream, admission=admission,
                      version=store.version, base_pass_rate=base_rate)
    bar.close()
    for h in pending:
        h.cancel()
    driver.stop()
    ckpt.wait()

    final_rate = evaluate(Driver(GlmEngine(policy, max_concurrent_decodes=rl.slots, max_len=cfg.task.max_len)),
                          heldout, cfg.task.max_new_tokens)
    summary = {"base_pass_rate": base_rate, "final_pass_rate": final_rate, "steps": step, "rollouts": rollouts,
               "algorithm": rl.algorithm, "eta": rl.eta, "dropped": dict(dropped), "heldout_tasks": len(heldout),
               "wall_seconds": time.time() - start, "learner_busy_fraction": busy / (time.time() - start),
               "relative_gain": (final_rate - base_rate) / max(base_rate, 1e-9)}
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
