"""Sandboxed steps per second (one at a time and concurrently) and validation seconds per task.

    python benchmarks/env_bench.py --out results/env_bench.json

Steps: a ``ShellEnv`` step running ``echo`` (parse the action, run it in the sandbox with
every isolation this machine allows, collect the output), ``--steps`` of them in one
episode; then ``--workers`` episodes in threads at once (total steps / wall time).
Validation: the three checks on ``--tasks`` tasks per family (oracle, no-op and every
unfinished probe, each in a fresh sandbox), mean and max seconds per task. Figures are
wall-clock on whatever else the machine is running; the JSON records the isolation,
the CPU count and the load average next to them. Nothing here asserts on time.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from envs import families  # noqa: E402
from envs.harbor import HarborTask  # noqa: E402
from envs.sandbox import probe  # noqa: E402
from envs.shell import ShellEnv  # noqa: E402
from envs.validate import validate  # noqa: E402

_TASK = HarborTask(id="bench", instruction="Print hello.\n", domain="terminal", solution="echo hello\n",
                   tests={"test.sh": "exit 0\n"}, agent_timeout=3600.0)


def steps_per_second(steps: int) -> float:
    env = ShellEnv(max_turns=steps + 1)
    env.reset(_TASK)
    start = time.perf_counter()
    for i in range(steps):
        env.step(f"<bash>echo step {i}</bash>")
    seconds = time.perf_counter() - start
    env.close()
    return steps / seconds


def concurrent_steps_per_second(steps: int, workers: int) -> float:
    start = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(lambda _: steps_per_second(steps), range(workers)))
    return steps * workers / (time.perf_counter() - start)


def validation_seconds(family: str, n: int) -> dict:
    times = []
    for task in families.make_tasks(family, n, seed=0):
        report = validate(task)
        times.append(report.seconds)
        if not report.passed:
            print(f"warning: {task.id} did not pass: {report.status}", file=sys.stderr)
    return {"tasks": n, "mean_s": statistics.mean(times), "max_s": max(times)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="where to write the JSON results")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--tasks", type=int, default=3, help="tasks per family for the validation timing")
    parser.add_argument("--families", default="arithmetic,terminal,code_repair,security,ml_infra")
    args = parser.parse_args(argv)
    steps_per_second(5)  # warm-up: the isolation probe, page cache
    results = {
        "isolation": probe().describe(), "cpus": os.cpu_count(), "load_average": os.getloadavg(),
        "python": platform.python_version(),
        "steps_per_second_sequential": steps_per_second(args.steps),
        f"steps_per_second_{args.workers}_concurrent": concurrent_steps_per_second(args.steps, args.workers),
        "validation_seconds_per_task": {f: validation_seconds(f, args.tasks) for f in args.families.split(",")},
    }
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    import floor

    floor.main_with_profile(main, "env_bench")  # --profile DIR: a JAX profiler trace of the run
