"""What SAO's value model can learn on the main job's task, against what there is to learn.

    python benchmarks/critic_probe.py --out results/critic_probe.json

On rollouts the main job's base model samples (configs/sao_tiny.py, temperature as in
training; `--rollouts` for fitting, a quarter as many, from other tasks, for testing), the
explained variance of the returns (the outcome reward at every action token, gamma = 1,
lambda_critic = 1) on the test rollouts, over all action tokens and at the first one
(the prompt's value), for:

  * the value model as the job trains it (rl/learner.py: `Learner.step` in critic
    warm-up, `--steps` batches of `rl.batch_size` rollouts, `rl.critic_steps` updates
    each, at `rl.critic_lr` and at a tenth of it);
  * a linear probe: least squares on the base's final normed hidden state (the value
    head's input), the best a head on frozen features can do;
  * a lookup on what the value depends on: the mean return of the fitting rollouts at
    the same answer position whose answer so far is (or is not) a prefix of the right
    one. No critic sees the right answer; this says how much of the variance there is
    to explain once the policy's sampling noise is set aside.

A critic near 0 while the lookup is well above it has features to find and does not
find them within the job's budget; a critic near 0 with the lookup near 0 has nothing
to find.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import platform
import sys
import tempfile
import time

import numpy as np
from flax import nnx

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from glmjax.presets import load_config  # noqa: E402
from rl import base_model  # noqa: E402
from rl import rollout as ro  # noqa: E402
from rl import tasks as rl_tasks  # noqa: E402
from rl.config import JobConfig  # noqa: E402
from rl.cli import use_compile_cache  # noqa: E402
from rl.collector import drive  # noqa: E402
from rl.engine.driver import Driver  # noqa: E402
from rl.engine.engine import GlmEngine  # noqa: E402
from rl.engine.weights import WeightStore  # noqa: E402
from rl.learner import Learner, ValueModel  # noqa: E402


def _sample(engine, cfg, tasks, first_id: int):
    make = rl_tasks.RolloutFactory(cfg, cfg.task.max_len - 1)
    rollouts = [make(t, first_id + i) for i, t in enumerate(tasks)]
    drive(Driver(engine), rollouts, workers=2)
    return [tr for i, r in enumerate(rollouts) for tr in r.trajectories(first_id + i)]


def _returns(batch) -> np.ndarray:
    return np.asarray(batch.rewards)[:, None] * np.asarray(batch.action_mask)


def explained_variance(pred: np.ndarray, target: np.ndarray) -> float:
    return float(1.0 - np.var(pred - target) / max(np.var(target), 1e-12))


def _critic_ev(values, batch) -> dict:
    mask = np.asarray(batch.action_mask) > 0
    r = _returns(batch)
    first = mask.argmax(1)
    rows = np.arange(len(r))
    return {"all_tokens": explained_variance(values[mask], r[mask]),
            "first_token": explained_variance(values[rows, first], r[rows, first])}


def _prefix_features(trajectories, oracles):
    """(answer position, answer-so-far-is-right, return) for every action token."""
    out = []
    for tr, oracle in zip(trajectories, oracles):
        right, good = ro.encode(oracle), True
        for k, token in enumerate(tr.completion):
            out.append((k, good, tr.reward))
            good = good and k < len(right) and token == right[k]
    return out


def prefix_lookup_ev(fit, fit_oracles, test, test_oracles) -> float:
    table: dict = {}
    for k, good, r in _prefix_features(fit, fit_oracles):
        table.setdefault((k, good), []).append(r)
    mean = np.mean([r for rs in table.values() for r in rs])
    feats = _prefix_features(test, test_oracles)
    pred = np.array([np.mean(table.get((k, good), [mean])) for k, good, _ in feats])
    return explained_variance(pred, np.array([r for *_, r in feats]))


def linear_probe_ev(model, fit_batch, test_batch) -> float:
    def features(batch):
        h = np.asarray(model.norm(model(batch.tokens).hidden), np.float64)
        h = np.pad(h[:, :-1], ((0, 0), (1, 0), (0, 0)))  # values[t] reads position t - 1
        mask = np.asarray(batch.action_mask) > 0
        return np.c_[h[mask], np.ones(mask.sum())], _returns(batch)[mask]

    x, y = features(fit_batch)
    w = np.linalg.solve(x.T @ x + 1e-2 * np.eye(x.shape[1]), x.T @ y)
    xt, yt = features(test_batch)
    return explained_variance(xt @ w, yt)


def train_critic(base, cfg, fit, test_batch, lr: float, steps: int, seed: int) -> dict:
    """The job's learner with the actor held back (critic warm-up throughout): only its
    critic phase runs, as in the job's first `rl.critic_warmup` steps."""
    learner = Learner(nnx.clone(base), ValueModel(nnx.clone(base)), dataclasses.replace(cfg.rl, critic_lr=lr, critic_warmup=10 ** 9))
    rng = np.random.default_rng(seed)
    curve, start = [], time.time()
    for step in range(steps):
        idx = rng.choice(len(fit), cfg.rl.batch_size, replace=False)
        learner.step(ro.to_batch([fit[i] for i in idx], length=cfg.task.max_len))
        if (step + 1) % max(1, steps // 4) == 0:
            curve.append({"step": step + 1, **_critic_ev(np.asarray(learner.critic(test_batch.tokens)), test_batch)})
    return {"critic_lr": lr, "steps": steps, "ev_all_tokens": curve[-1]["all_tokens"],
            "ev_first_token": curve[-1]["first_token"], "curve": curve, "seconds": time.time() - start}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "sao_tiny.py"))
    parser.add_argument("--rollouts", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--workdir", default="")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    use_compile_cache()
    cfg = JobConfig.from_config(load_config(args.config))
    workdir = args.workdir or tempfile.mkdtemp(prefix="glmjax-critic-")
    train, _, _ = rl_tasks.task_sets(cfg, workdir)
    n_test = args.rollouts // 4
    if args.rollouts + n_test > len(train):
        raise SystemExit(f"--rollouts={args.rollouts} needs {args.rollouts + n_test} training tasks; "
                         f"the config has task.train_tasks={len(train)}")
    base = base_model.build_base(cfg, workdir)
    engine = GlmEngine(base, weights=WeightStore(nnx.state(base)), max_concurrent_decodes=cfg.rl.slots,
                       max_len=cfg.task.max_len)
    fit_tasks, test_tasks = train[:args.rollouts], train[args.rollouts:args.rollouts + n_test]
    fit, test = _sample(engine, cfg, fit_tasks, 0), _sample(engine, cfg, test_tasks, 10 ** 6)
    test_batch = ro.to_batch(test, length=cfg.task.max_len)
    fit_oracles, test_oracles = [t.oracle() for t in fit_tasks], [t.oracle() for t in test_tasks]
    report = {
        "config": os.path.relpath(args.config, REPO), "rollouts_fit": len(fit), "rollouts_test": len(test),
        "reward_fit": float(np.mean([t.reward for t in fit])), "reward_test": float(np.mean([t.reward for t in test])),
        "prefix_lookup_ev": prefix_lookup_ev(fit, fit_oracles, test, test_oracles),
        "linear_probe_ev": linear_probe_ev(base, ro.to_batch(fit, length=cfg.task.max_len), test_batch),
        "critic": [train_critic(base, cfg, fit, test_batch, lr, args.steps, seed=0)
                   for lr in (cfg.rl.critic_lr, cfg.rl.critic_lr / 10)],
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()}}
    import results_io  # benchmarks/results_io.py: keeps the file's findings

    results_io.write(args.out, report, indent=1)
    print(json.dumps({k: v for k, v in report.items() if k != "critic"}, indent=1))
    for c in report["critic"]:
        print(f"critic_lr {c['critic_lr']:g}: explained variance {c['ev_all_tokens']:.3f} "
              f"(first token {c['ev_first_token']:.3f})")
    return report


if __name__ == "__main__":
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    import floor

    floor.main_with_profile(main, "critic_probe")  # --profile DIR: a JAX profiler trace of the run
