"""Routing replay in bf16: how often the learner routes a token to other experts than the
engine did, and what that does to the log-probs the algorithm compares.

    python benchmarks/routing_replay.py --out results/routing_replay.json

The agentic main job (configs/sao_agent_tiny.py, synchronous: rl.eta=0, so that every
token was sampled by the weights the learner scores it with) runs in bfloat16 twice from
one supervised base (the config's: 1000 oracle episodes, 150 steps): with `rl.routing_replay=measure` (the engine records its experts,
the learner routes by its own routers) and `=on` (the learner runs the engine's
experts). The engine decodes one token at a time over a cache, the learner runs whole
sequences: in bf16 their MoE inputs differ in the last bits, which flips near-tied
top-8 choices. Per arm, from the job's metrics.jsonl, the mean over the actor steps of
  routing_mismatch_tokens   positions whose experts differ in any MoE layer
  routing_mismatch_layers   (position, layer) pairs that differ
  routing_replayed          positions scoring an action token that ran the engine's experts
  logp_gap_mean / _max      |log pi_learner - log pi_engine| per action token
and the wall and CPU seconds of each arm's process.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from benchmarks import results_io  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parent.parent
METRICS = ("routing_mismatch_tokens", "routing_mismatch_layers", "routing_replayed", "logp_gap_mean", "logp_gap_max",
           "reward", "clip_fraction")
SIZE = ["--config.model.dtype=bfloat16", "--config.rl.eta=0", "--config.rl.steps=12", "--config.rl.batch_size=16",
        "--config.rl.slots=16", "--config.rl.critic_warmup=2", "--config.rl.validate_every=0",
        "--config.task.eval_tasks=16", "--config.eval.matrix_tasks=0", "--config.rl.warmup_compile=False"]


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_arm(config: str, workdir: pathlib.Path, replay: str, extra: list[str]) -> dict:
    command = ["glmjax-train", "--config", config, "--workdir", str(workdir), *SIZE,
               f"--config.rl.routing_replay={replay}", *extra]
    cpu, start = _cpu_seconds(), time.time()
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    wall = time.time() - start
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    actor = [r for r in rows if "logp_gap_mean" in r]  # the steps that updated the policy
    summary = json.loads((workdir / "summary.json").read_text())
    out = {"command": " ".join(command[1:]), "actor_steps": len(actor), "wall_seconds": wall,
           "cpu_seconds": _cpu_seconds() - cpu, "final_pass_rate": summary["final_pass_rate"],
           "base_pass_rate": summary["base_pass_rate"]}
    out["cpu_over_wall"] = out["cpu_seconds"] / wall
    for key in METRICS:
        values = [r[key] for r in actor if key in r]
        out[key] = float(np.mean(values)) if values else None
    out["logp_gap_max_overall"] = max(r["logp_gap_max"] for r in actor)
    out["per_step"] = {key: [r.get(key) for r in actor] for key in ("routing_mismatch_tokens", "logp_gap_mean")}
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/sao_agent_tiny.py")
    parser.add_argument("--out", default="results/routing_replay.json")
    args, extra = parser.parse_known_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        measure, on = pathlib.Path(tmp, "measure"), pathlib.Path(tmp, "on")
        arms = {"measure": run_arm(args.config, measure, "measure", extra)}
        on.mkdir()
        shutil.copytree(measure / "base", on / "base")  # one supervised base for both arms
        arms["on"] = run_arm(args.config, on, "on", extra)
    m, r = arms["measure"], arms["on"]
    report = {"about": __doc__.split("\n\n")[1].replace("\n", " "), "arms": arms,
              "logp_gap_mean_ratio_on_over_measure": r["logp_gap_mean"] / m["logp_gap_mean"],
              "gap_falls_with_replay": r["logp_gap_mean"] < m["logp_gap_mean"]}
    results_io.write(args.out, report, indent=1)
    for name, arm in arms.items():
        print(f"{name:8s} mismatch tokens {arm['routing_mismatch_tokens']:.3f} layers "
              f"{arm['routing_mismatch_layers']:.3f} replayed {arm['routing_replayed']:.3f} "
              f"gap mean {arm['logp_gap_mean']:.4f} max {arm['logp_gap_max_overall']:.3f} ({arm['wall_seconds']:.0f} s)")
    return report


if __name__ == "__main__":
    main()
