"""The RL loop's throughput and stability, in one run of the real job (rl/trainer.py).

    python benchmarks/rl_bench.py --out results/rl_bench.json

1. Asynchronous against synchronous rollouts. Every rollout's length is drawn from a
   log-normal (median `--median-len` tokens, sigma `--sigma`) and the end-of-answer token
   is ignored, so lengths are what was drawn. Synchronous (eta = 0): the learner waits for
   the batch's slowest rollout and the engine idles while it trains. Asynchronous
   (eta = 2): freed slots take new prompts at once and generation runs on while the
   learner trains, and pauses while a complete next batch already waits (the learner and
   the engine share the machine). Every shape is compiled before the loop. Figures, per
   arm: rollouts trained per second from the median interval between learner steps after
   the first two, the learner's busy share of that time, and the share of a synchronous
   step spent generating; the arms run --repeats times in alternation (sync, async, sync,
   ...) and each figure is the median over repeats. Asynchrony hides generation behind
   the learner, so its gain is at most `bound` = 1 / (1 - the synchronous generation
   share). Measured at two learner batch sizes (--batches); the first gives the headline
   `async_vs_sync_throughput` and, in async mode, `learner_busy_fraction`. On a CPU the
   tiny model's learner step (about ten forward passes' worth of work over the padded
   context) outweighs generating the batch, so the bound is low; with fewer rollouts per
   step generation weighs more, and so does their competition for the same two cores.
2. SAO against GRPO at eta = 4 on the main job's task (configs/sao_tiny.py): SAO with one
   rollout per prompt and the value model, GRPO with 8 per prompt and the same rollouts
   per step. Reward and entropy curves per step, the held-out pass rates, and whether the
   run collapsed (its last tenth's mean reward below half of its best ten-step mean).

Both parts start from the same supervised base model (trained once, cached in --workdir).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import statistics
import sys
import time

import numpy as np

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from glmjax.presets import load_config  # noqa: E402
from rl import base_model, trainer  # noqa: E402
from rl import rollout as ro  # noqa: E402
from rl.config import JobConfig  # noqa: E402
from rl.cli import use_compile_cache  # noqa: E402
from rl.compaction import Answer  # noqa: E402

CONFIG = str(REPO / "configs" / "sao_tiny.py")


def _metrics(workdir: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def _fresh(workdir: pathlib.Path, base: pathlib.Path) -> pathlib.Path:
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    shutil.copytree(base / "base", workdir / "base")
    return workdir


def throughput_arm(workdir, base, eta, batch, args) -> dict:
    cfg = load_config(CONFIG, [
        f"--config.rl.eta={eta}", f"--config.rl.steps={args.throughput_steps}", f"--config.rl.batch_size={batch}",
        f"--config.rl.slots={args.slots}", "--config.rl.critic_warmup=0", f"--config.task.max_len={args.max_len}",
        "--config.task.eval_tasks=8"])
    rng = np.random.default_rng(args.seed)
    lengths = {}

    def lognormal_rollout(task, rid):
        prompt = ro.encode(task.prompt)
        if rid not in lengths:
            room = args.max_len - 1 - len(prompt)
            lengths[rid] = int(np.clip(round(rng.lognormal(np.log(args.median_len), args.sigma)), 1, room))
        inner = Answer(prompt, lengths[rid], temperature=cfg.rl.temperature, seed=rid)  # no stop: the drawn length
        return ro.TextRollout(task, inner)

    wd = _fresh(pathlib.Path(workdir), base)
    trainer.run(cfg, str(wd), make_rollout=lognormal_rollout)
    rows = _metrics(wd)[2:]  # the first steps warm up
    step_s = statistics.median(b["time"] - a["time"] for a, b in zip(rows, rows[1:]))
    learner_s = statistics.median(r["learner_s"] for r in rows[1:])
    drawn = np.asarray(list(lengths.values()))
    return {"eta": eta, "batch": batch, "rollouts_per_s": batch / step_s, "steps_measured": len(rows) - 1,
            "seconds_per_step": step_s, "learner_seconds_per_step": learner_s,
            "learner_busy_fraction": min(1.0, learner_s / step_s), "generation_share": max(0.0, 1 - learner_s / step_s),
            "mean_len": float(drawn.mean()), "p50_len": float(np.median(drawn)), "max_len": int(drawn.max())}


def stability_arm(workdir, base, algorithm, args) -> dict:
    overrides = [f"--config.rl.algorithm={algorithm}", "--config.rl.eta=4", f"--config.rl.steps={args.steps}",
                 f"--config.task.eval_tasks={args.eval_tasks}"]
    if algorithm == "grpo":
        overrides.append("--config.rl.group_size=8")
    cfg = load_config(CONFIG, overrides)
    wd = _fresh(pathlib.Path(workdir), base)
    summary = trainer.run(cfg, str(wd))
    rows = _metrics(wd)
    reward = [r["reward"] for r in rows]
    smooth = [statistics.mean(reward[max(0, i - 9):i + 1]) for i in range(len(reward))]
    tail = statistics.mean(reward[-max(1, len(reward) // 10):])
    return {"algorithm": algorithm, "group_size": cfg.rl.group_size, "batch_size": cfg.rl.batch_size,
            "reward": reward, "entropy": [r.get("entropy") for r in rows], "best_mean10": max(smooth),
            "last_tenth_mean": tail, "collapsed": tail < 0.5 * max(smooth),
            "base_pass_rate": summary["base_pass_rate"], "final_pass_rate": summary["final_pass_rate"],
            "max_staleness": max(r["staleness_mean"] for r in rows)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--workdir", default="/tmp/glmjax-rl-bench")
    ap.add_argument("--batches", default="16,8", help="learner batch sizes of the throughput arms")
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--median-len", type=float, default=24)
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--max-len", type=int, default=64, help="the context (the base model's positions)")
    ap.add_argument("--throughput-steps", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3, help="alternating runs of each throughput arm")
    ap.add_argument("--steps", type=int, default=60, help="steps of each SAO / GRPO run")
    ap.add_argument("--eval-tasks", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    use_compile_cache()
    root = pathlib.Path(args.workdir)
    base = root / "base-model"
    if not (base / "base" / "config.json").exists():  # the SFT base, once
        cfg = JobConfig.from_config(load_config(CONFIG, ["--config.rl.steps=0"]))
        base_model.build_base(cfg, str(base))
    t0, load0 = time.time(), os.getloadavg()[0]
    results = {"config": "configs/sao_tiny.py", "load_average_start": load0}
    batches = [int(b) for b in args.batches.split(",")]
    results["throughput"] = {}
    for batch in batches:
        runs = {"sync": [], "async": []}
        for _ in range(args.repeats):  # alternating, so that a noisy minute does not hit one arm only
            runs["sync"].append(throughput_arm(root / "sync", base, 0, batch, args))
            runs["async"].append(throughput_arm(root / "async", base, 2, batch, args))
        med = lambda arm, key: statistics.median(r[key] for r in runs[arm])  # noqa: E731
        share = med("sync", "generation_share")
        results["throughput"][f"batch{batch}"] = {
            "async_vs_sync_throughput": med("async", "rollouts_per_s") / med("sync", "rollouts_per_s"),
            "bound": 1 / max(1 - share, 1e-9), "sync_generation_share": share,
            "learner_busy_fraction": med("async", "learner_busy_fraction"),
            "sync_rollouts_per_s": med("sync", "rollouts_per_s"), "async_rollouts_per_s": med("async", "rollouts_per_s"),
            "async_vs_sync_per_repeat": [a["rollouts_per_s"] / b["rollouts_per_s"]
                                         for a, b in zip(runs["async"], runs["sync"])],
            "runs": runs}
        t = results["throughput"][f"batch{batch}"]
        print(f"batch {batch}: async / sync throughput {t['async_vs_sync_throughput']:.2f}x (bound {t['bound']:.2f}x), "
              f"learner busy {t['learner_busy_fraction']:.2f}", flush=True)
    headline = results["throughput"][f"batch{batches[0]}"]
    results.update(async_vs_sync_throughput=headline["async_vs_sync_throughput"],
                   learner_busy_fraction=headline["learner_busy_fraction"],
                   sync_generation_share=headline["sync_generation_share"], headline_batch=batches[0])
    results["sao_vs_grpo_eta4"] = {a: stability_arm(root / a, base, a, args) for a in ("sao", "grpo")}
    for a, r in results["sao_vs_grpo_eta4"].items():
        print(f"{a}: reward best {r['best_mean10']:.3f} last {r['last_tenth_mean']:.3f} collapsed {r['collapsed']} "
              f"pass rate {r['base_pass_rate']:.3f} -> {r['final_pass_rate']:.3f}", flush=True)
    results.update(wall_seconds=time.time() - t0, load_average_end=os.getloadavg()[0])
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    import results_io  # benchmarks/results_io.py: keeps the file's findings

    results_io.write(out, results)
    print(f"wrote {out}")


if __name__ == "__main__":
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    import floor

    floor.main_with_profile(main, "rl_bench")  # --profile DIR: a JAX profiler trace of the run
