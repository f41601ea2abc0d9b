"""A main job run once per seed, each in a fresh workdir: is its gain a property of the
method or of one lucky run?

    python benchmarks/main_job_seeds.py --config configs/sao_tiny.py --out results/main_job_seeds.json
    python benchmarks/main_job_seeds.py --config configs/sao_agent_tiny.py \
        --out results/agent_main_job_seeds.json

Each seed runs `glmjax-train --config CONFIG --workdir W --config.seed=N` as a user would,
one after another (the compile cache is shared, so only the first run compiles from
scratch). The supervised base depends on `base.seed`, not `seed`: every run starts from
the same base model, trained again in each fresh workdir. Per run: base and final
held-out pass rates, the points and relative gain, whether the run meets the job's goals
(+50% relative and +15 points), wall and CPU seconds, the sampled training reward over
the first and last tenth of the steps, and the diagnostics of a collapse (the critic's
explained variance, entropy, KL between the behaviour and the current policy, clipped
fractions on each side of the band). Then the mean and range of the final pass rate.

`--workdirs DIR` keeps the runs' workdirs under DIR; a workdir that already holds a
summary.json of the same command is read rather than run again (`--reuse`).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import resource
import shutil
import subprocess
import tempfile
import time

import numpy as np

REPO = pathlib.Path(__file__).resolve().parent.parent
DIAGNOSTICS = ("explained_variance", "entropy", "kl_rollout", "clip_low_fraction", "clip_high_fraction",
               "value_loss", "ratio_mean")


def _command(config: str, workdir: pathlib.Path, seed: int, extra: list[str]) -> list[str]:
    return ["glmjax-train", "--config", config, "--workdir", str(workdir), f"--config.seed={seed}", *extra]


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _tenth(rows: list[dict], key: str, last: bool) -> float | None:
    values = [r[key] for r in rows if key in r]
    if not values:
        return None
    n = max(1, len(values) // 10)
    return float(np.mean(values[-n:] if last else values[:n]))


def run_seed(config: str, workdir: pathlib.Path, seed: int, extra: list[str], reuse: bool) -> dict:
    command = _command(config, workdir, seed, extra)
    stamp = workdir / "command.json"
    measured = {}
    if not (reuse and (workdir / "summary.json").exists() and stamp.exists()
            and json.loads(stamp.read_text())["command"] == command):
        shutil.rmtree(workdir, ignore_errors=True)
        workdir.mkdir(parents=True)
        start, cpu = time.time(), _cpu_seconds()
        with open(workdir / "job.log", "w") as log:
            subprocess.run(command, check=True, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        measured = {"process_wall_seconds": time.time() - start, "process_cpu_seconds": _cpu_seconds() - cpu}
        stamp.write_text(json.dumps({"command": command, **measured}))
    else:
        measured = {k: v for k, v in json.loads(stamp.read_text()).items() if k != "command"}
    summary = json.loads((workdir / "summary.json").read_text())
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    base, final = summary["base_pass_rate"], summary["final_pass_rate"]
    points = 100 * (final - base)
    out = {"seed": seed, "command": " ".join(command[:4] + ["W"] + command[5:]),
           "base_pass_rate": base, "final_pass_rate": final, "points": points,
           "relative_gain": summary["relative_gain"],
           "meets_plus_50_percent_and_15_points": bool(summary["relative_gain"] >= 0.5 - 1e-9 and points >= 15 - 1e-9),
           "wall_seconds": summary["wall_seconds"], **measured,
           "reward_first_tenth": _tenth(rows, "reward", last=False),
           "reward_last_tenth": _tenth(rows, "reward", last=True)}
    out["cpu_over_wall"] = out.get("process_cpu_seconds", 0.0) / max(out.get("process_wall_seconds", 0.0), 1e-9)
    for key in DIAGNOSTICS:
        out[f"{key}_last_tenth"] = _tenth(rows, key, last=True)
    for key in ("final_pass_rate_blind", "final_turns_per_episode", "env_time_fraction", "dropped"):
        if key in summary:
            out[key] = summary[key]
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/sao_tiny.py")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--out", required=True)
    parser.add_argument("--workdirs", default="", help="keep the runs' workdirs here (default: a temporary dir)")
    parser.add_argument("--reuse", action="store_true", help="read a workdir that already ran the same command")
    parser.add_argument("overrides", nargs="*", help="--config.X=Y flags passed to every run")
    args = parser.parse_args(argv)
    root = pathlib.Path(args.workdirs or tempfile.mkdtemp(prefix="glmjax-seeds-"))
    runs = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        runs.append(run_seed(args.config, root / f"seed{seed}", seed, args.overrides, args.reuse))
        r = runs[-1]
        print(f"seed {seed}: {r['base_pass_rate']:.1%} -> {r['final_pass_rate']:.1%} ({r['points']:+.1f} points, "
              f"{r['relative_gain']:+.0%}), {r['wall_seconds']:.0f} s", flush=True)
    finals = [r["final_pass_rate"] for r in runs]
    report = {"config": args.config, "overrides": args.overrides, "runs": runs,
              "final_pass_rate_mean": float(np.mean(finals)), "final_pass_rate_range": [min(finals), max(finals)],
              "points_mean": float(np.mean([r["points"] for r in runs])),
              "all_meet_plus_50_percent_and_15_points": all(r["meets_plus_50_percent_and_15_points"] for r in runs),
              "notes": "fresh workdirs, one after another on one machine, the compile cache shared",
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform()}}
    import results_io  # benchmarks/results_io.py: keeps the file's findings

    results_io.write(args.out, report, indent=1)
    if not args.workdirs:
        shutil.rmtree(root, ignore_errors=True)
    return report


if __name__ == "__main__":
    main()
