"""Sandboxed steps per second (one at a time and concurrently), episodes per second,
validation seconds per task, the cost of a command by how it enters its sandbox, and Ray
environment workers' episodes per second.

    python benchmarks/env_bench.py --out results/env_bench.json
    python benchmarks/env_bench.py --out results/env_bench.json --baseline /path/to/other/checkout

Steps: a ``ShellEnv`` step running ``echo`` (parse the action, run it in the sandbox with
every isolation this machine allows, collect the output), ``--steps`` of them in one
episode; then ``--workers`` episodes in threads at once (total steps / wall time).
Episodes: whole episodes of the agentic main job's ``lookup`` tasks, one after another:
a fresh sandbox, the task's files, the demonstrated command, ``<submit/>`` and the
verifier, the sandbox closed; ``--workers`` threads at once, as the job's environment
pool runs them. Validation: the three checks on ``--tasks`` tasks per family (oracle,
no-op and every unfinished probe, each in a fresh sandbox), mean and max seconds per task.

Ray workers (``--ray-workers 1,2,4``): episodes per second with each number of Ray
environment workers (``env.backend="ray"``, a private Ray on this machine) on lookup
episodes whose actions first sleep, so that the episodes wait rather than compute and
the workers' slots, not the cores, are the limit.

Entry (``entry``; ``--entry`` for it alone): agent commands started inside the episode's
namespaces by its anchor beside commands that make their own namespaces and root
(``GLMJAX_SANDBOX_ENTRY=episode|command``), each arm in a process of its own, the arms in
turn, ``--entry-rounds`` times: CPU per command (``true``), sandboxes per second, and
lookup episodes per second and per core-second; CPU is that of the arm's processes (the
helpers, the anchors and what they started) and of the kernel's threads, medians over the
rounds.

``--baseline DIR`` times the episodes of another checkout of glmjax (an earlier commit, in
a ``git worktree``) beside this one's: each arm runs in a process of its own, the arms in
turn, ``--rounds`` times; each run records its wall time and the machine's busy CPU time
over it (from ``/proc/stat``: the sandboxes' work happens in helper processes and the
kernel), and a run starved of the cores (``floor.starved``) is run again. Figures are
wall-clock on whatever else the machine is running; the JSON records the isolation, the
CPU count and the load average next to them. Nothing here asserts on time.
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
sys.path.insert(0, os.environ.get("GLMJAX_BENCH_REPO", str(REPO)))  # whose envs/ to time (--baseline's arm sets it)

from envs import families  # noqa: E402
from envs.harbor.task import HarborTask  # noqa: E402
from envs.harbor.validate import validate  # noqa: E402
from envs.sandbox.sandbox import probe  # noqa: E402
from envs.shell import ShellEnv  # noqa: E402

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


def episodes(n: int, workers: int = 1) -> float:
    """Seconds for ``n`` lookup episodes (reset, the demonstrated command, submit, close)
    over ``workers`` threads."""
    tasks = families.make_tasks("lookup", n, seed=0)

    def one(task) -> None:
        env = ShellEnv(max_turns=4)
        env.reset(task)
        for action in task.metadata["demonstration"]:
            if env.step(action).done:
                break
        else:
            env.finish()
        env.close()

    start = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(one, tasks))
    return time.perf_counter() - start


def _busy_seconds() -> float:
    """CPU seconds the whole machine has spent busy since boot (all but idle and iowait)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


_ARM = """import json, sys
sys.path.insert(0, {bench!r})
import env_bench
assert env_bench.families.__file__.startswith({repo!r}), env_bench.families.__file__
env_bench.episodes(8, {workers})  # warm-up: the isolation probe, the tool directory, the page cache
busy = env_bench._busy_seconds()
wall = env_bench.episodes({n}, {workers})
print(json.dumps([wall, env_bench._busy_seconds() - busy]))
"""


def _kernel_thread_seconds() -> float:
    """CPU seconds of the kernel's own threads (a network namespace is torn down by a
    kernel worker, after its command has returned)."""
    total = 0
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == "2":  # children of kthreadd
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def _process_seconds(*sandboxes) -> float:
    """CPU seconds of this process, its waited-for children (the helpers, once closed), and
    the sandboxes' anchors with the commands they started: those of ``sandboxes``, open,
    and those closed (``anchor_cpu_seconds``)."""
    import resource

    from envs.sandbox.sandbox import anchor_cpu_seconds

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    total = own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + anchor_cpu_seconds()
    return total + sum(anchor_cpu_seconds(box._anchor[0]) for box in sandboxes if box._anchor is not None)


def entry_arm(commands: int, sandboxes: int, n: int, workers: int) -> dict:
    """One arm of ``compare_entry``, in a process of its own whose ``GLMJAX_SANDBOX_ENTRY``
    picks the arm. Each part: [wall seconds, CPU seconds of this process tree and the
    kernel's threads, the machine's busy CPU seconds]."""
    from envs.sandbox import launcher
    from envs.sandbox.sandbox import Sandbox

    episodes(4, 1)  # warm-up: the isolation probe, the tool directory, the page cache

    def clocked(work, boxes=lambda: ()):
        launcher.close()
        busy, kernel, start = _busy_seconds(), _kernel_thread_seconds(), time.perf_counter()
        mine = _process_seconds(*boxes())
        work()
        wall = time.perf_counter() - start
        launcher.close()  # helpers counted once they have exited
        time.sleep(0.5)  # a namespace's teardown by the kernel's workers
        tree = _process_seconds(*boxes()) - mine + _kernel_thread_seconds() - kernel
        return [wall, tree, _busy_seconds() - busy]

    box = Sandbox()
    box.run("true")

    def run_commands() -> None:
        for _ in range(commands):
            box.run("true")

    command = clocked(run_commands, lambda: (box,))
    entry = box.isolation.entry
    box.close()

    def make_sandboxes() -> None:
        for _ in range(sandboxes):
            with Sandbox() as one:
                one.run("true")

    sandbox = clocked(make_sandboxes)
    episode = clocked(lambda: episodes(n, workers))
    return {"entry": entry, "command": command, "sandbox": sandbox, "episode": episode}


def compare_entry(commands: int, sandboxes: int, n: int, workers: int, rounds: int) -> dict:
    """Agent commands that enter the episode's namespaces against commands that make their
    own (``GLMJAX_SANDBOX_ENTRY``), each arm a process of its own, the arms in turn,
    ``rounds`` times: per arm, ``commands`` commands (``true``) in one sandbox, ``sandboxes``
    sandboxes made, used once and closed, and ``n`` lookup episodes over ``workers`` threads
    (``entry_arm``). CPU is counted for the arm's own processes and the kernel's threads,
    so that what else runs on the machine does not enter it (the machine's busy time is
    recorded beside it); medians over the rounds."""
    import subprocess

    def run(entry: str) -> dict:
        code = (f"import json, sys; sys.path.insert(0, {str(REPO / 'benchmarks')!r}); import env_bench; "
                f"print(json.dumps(env_bench.entry_arm({commands}, {sandboxes}, {n}, {workers})))")
        out = subprocess.run([sys.executable, "-c", code], cwd=str(REPO), capture_output=True, text=True, check=True,
                             env=dict(os.environ, GLMJAX_SANDBOX_ENTRY=entry))
        found = json.loads(out.stdout.splitlines()[-1])
        assert found["entry"] == entry, found
        return found

    arms = ("episode", "command")
    runs = {arm: [] for arm in arms}
    for _ in range(rounds):
        for arm in arms:
            runs[arm].append(run(arm))
    result = {"commands": commands, "sandboxes": sandboxes, "episodes": n, "workers": workers,
              "cpu": "CPU seconds of the arm's process tree (helpers, anchors, commands) and of the kernel's threads; "
                     "busy: the whole machine's, whatever else ran"}
    for arm in arms:
        parts = {}
        for name, count in (("command", commands), ("sandbox", sandboxes), ("episode", n)):
            kept = [r[name] for r in runs[arm]]
            wall, cpu = statistics.median(r[0] for r in kept), statistics.median(r[1] for r in kept)
            parts[name] = {"per_second": count / wall, "wall_ms_per": 1e3 * wall / count, "cpu_ms_per": 1e3 * cpu / count,
                           "busy_ms_per": 1e3 * statistics.median(r[2] for r in kept) / count,
                           "cpu_over_wall": statistics.median(r[1] / r[0] for r in kept), "all_runs": kept}
        parts["episode"]["episodes_per_second_per_core"] = n / statistics.median(r["episode"][1] for r in runs[arm])
        result[arm] = parts
    result["cpu_per_command_episode_over_command"] = (result["episode"]["command"]["cpu_ms_per"]
                                                      / result["command"]["command"]["cpu_ms_per"])
    return result


def compare_episodes(baseline: str, n: int, workers: int, rounds: int) -> dict:
    """This checkout's episodes against ``baseline``'s, arms interleaved (module docstring)."""
    import subprocess

    sys.path.insert(0, str(REPO / "benchmarks"))
    import floor

    arms = {"this": str(REPO), "baseline": os.path.abspath(baseline)}

    def run(repo: str) -> tuple[float, float]:
        code = _ARM.format(repo=repo, bench=str(REPO / "benchmarks"), n=n, workers=workers)
        out = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, check=True,
                             env=dict(os.environ, GLMJAX_BENCH_REPO=repo))
        return tuple(json.loads(out.stdout.splitlines()[-1]))

    runs = {name: [] for name in arms}
    for _ in range(rounds):
        for name, repo in arms.items():
            runs[name].append(run(repo))
    result = {"episodes": n, "workers": workers, "baseline": arms["baseline"]}
    for name, repo in arms.items():
        kept, extra = floor.rerun_starved(runs[name], lambda repo=repo: run(repo))
        result[name] = dict(floor.summary(kept, extra), episodes_per_second=n / statistics.median(w for w, _ in kept),
                            all_runs=kept)
    result["this_over_baseline_seconds"] = result["this"]["seconds"] / result["baseline"]["seconds"]
    return result


def validation_seconds(family: str, n: int) -> dict:
    times = []
    for task in families.make_tasks(family, n, seed=0):
        report = validate(task)
        times.append(report.seconds)
        if not report.passed:
            print(f"warning: {task.id} did not pass: {report.status}", file=sys.stderr)
    return {"tasks": n, "mean_s": statistics.mean(times), "max_s": max(times)}


def ray_workers(counts: list[int], n: int, slots: int = 2, wait: float = 0.25) -> dict:
    """Episodes per second on each of ``counts`` Ray environment workers
    (envs/workers/ray_backend.py, a private Ray on this machine): ``n`` lookup episodes whose
    every action first waits (``sleep wait``), so that the workers' calls at once (``slots``
    each), not the cores, bound the rate; the caller's side runs a thread per slot of all
    workers. Each pool is warmed up first (a worker's first episode imports the sandbox and
    probes the isolation)."""
    import ray

    from envs.workers import RayWorkers, ray_backend

    owns = ray_backend.connect("")
    tasks = families.make_tasks("lookup", n, seed=0)

    def one(pool, task) -> float:
        env = pool.env(max_turns=4, timing=False)
        env.reset(task)
        for action in task.metadata["demonstration"]:
            step = env.step(f"<bash>sleep {wait}</bash>{action}")
            if step.done:
                break
        else:
            step = env.finish()
        env.close()
        return step.reward

    result = {"episodes": n, "slots_per_worker": slots, "wait_seconds_per_action": wait}
    try:
        for count in counts:
            pool = RayWorkers(count, cpus=os.cpu_count() / max(counts), slots=slots)
            try:
                with ThreadPoolExecutor(count * slots) as threads:
                    list(threads.map(lambda t: one(pool, t), tasks[:count * slots]))
                    start = time.perf_counter()
                    rewards = list(threads.map(lambda t: one(pool, t), tasks))
                    seconds = time.perf_counter() - start
            finally:
                pool.close()
            result[f"{count}_workers"] = {"episodes_per_second": n / seconds, "seconds": seconds,
                                          "rewarded": sum(rewards) / n}
    finally:
        if owns:
            ray.shutdown()
    for count in counts[1:]:
        result[f"{count}_over_{counts[0]}_workers"] = (result[f"{count}_workers"]["episodes_per_second"]
                                                       / result[f"{counts[0]}_workers"]["episodes_per_second"])
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="where to write the JSON results")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--tasks", type=int, default=3, help="tasks per family for the validation timing")
    parser.add_argument("--families", default="arithmetic,terminal,code_repair,security,ml_infra")
    parser.add_argument("--episodes", type=int, default=64, help="lookup episodes per timed run")
    parser.add_argument("--ray-workers", default="1,2,4",
                        help="Ray environment worker counts whose episodes per second to time ('' for none)")
    parser.add_argument("--baseline", default=None, help="another glmjax checkout whose episodes to time beside these")
    parser.add_argument("--rounds", type=int, default=5, help="runs of each arm with --baseline")
    parser.add_argument("--entry", action="store_true",
                        help="only the commands that enter the episode's namespaces beside those that make their own")
    parser.add_argument("--entry-rounds", type=int, default=3, help="runs of each entry's arm (0: none)")
    parser.add_argument("--commands", type=int, default=200, help="commands per arm of the entry comparison")
    parser.add_argument("--sandboxes", type=int, default=40, help="sandboxes per arm of the entry comparison")
    args = parser.parse_args(argv)
    entry = lambda: compare_entry(args.commands, args.sandboxes, args.episodes, args.workers,  # noqa: E731
                                  args.entry_rounds)
    if args.entry:
        results = {"isolation": probe().describe(), "cpus": os.cpu_count(), "load_average": os.getloadavg(),
                   "entry": entry()}
        _write(args.out, results)
        return
    if args.baseline:  # one episode at a time, then --workers at once
        results = {"isolation": probe().describe(), "cpus": os.cpu_count(), "load_average": os.getloadavg()}
        for workers in dict.fromkeys((1, args.workers)):
            results[f"episodes_beside_baseline_{workers}_workers"] = compare_episodes(
                args.baseline, args.episodes, workers, args.rounds)
        _write(args.out, results)
        return
    steps_per_second(5)  # warm-up: the isolation probe, page cache
    results = {
        "isolation": probe().describe(), "cpus": os.cpu_count(), "load_average": os.getloadavg(),
        "python": platform.python_version(),
        "steps_per_second_sequential": steps_per_second(args.steps),
        f"steps_per_second_{args.workers}_concurrent": concurrent_steps_per_second(args.steps, args.workers),
        "episodes_per_second_sequential": args.episodes / episodes(args.episodes),
        f"episodes_per_second_{args.workers}_concurrent": args.episodes / episodes(args.episodes, args.workers),
        "validation_seconds_per_task": {f: validation_seconds(f, args.tasks) for f in args.families.split(",")},
    }
    if args.entry_rounds:
        results["entry"] = entry()
    if args.ray_workers:  # last, so that no Ray process runs beside the other timings
        results["ray_workers"] = ray_workers([int(c) for c in args.ray_workers.split(",")], args.episodes)
    _write(args.out, results)


def _write(path: str, results: dict) -> None:
    out = pathlib.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    import results_io  # benchmarks/results_io.py: keeps the file's findings

    results_io.write(out, results, indent=1)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    import floor

    floor.main_with_profile(main, "env_bench")  # --profile DIR: a JAX profiler trace of the run
