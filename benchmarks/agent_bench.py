"""Agentic rollouts: asynchronous against synchronous collection of multi-turn episodes.

    python benchmarks/agent_bench.py --out results/agent_bench.json

Episodes are `lookup` tasks at difficulty 2 (envs/families/lookup.py) in real sandboxed
shells (envs/shell.py), three model turns each (`--turns`), `--turn-tokens` sampled
tokens per turn (stop tokens ignored, so every episode does the same work), played by
the tiny agentic model (configs/sao_agent_tiny.py's shape, random weights). Each
environment step also waits a log-normal delay (median `--delay-ms`, sigma `--sigma`):
the latency of a real command, a build or a test run.

Each arm plays `--episodes` episodes, `--slots` at a time:
- Synchronous: batches of `--slots` episodes, turn by turn in lockstep, as a loop without
  an environment pool does it: every episode's model turn is generated, then every
  episode's environment step runs (all at once, in the pool), and the engine waits for
  the slowest before the next turn; the next batch starts when the whole batch is done.
- Asynchronous (rl/collector.py: `drive` with `max_active`): an episode's next turn is
  queued as soon as its own environment step returns, a new episode starts as soon as
  one ends, and the engine keeps decoding the others meanwhile.

Figures, the median over `--repeats` repeats run in alternation (sync, async, sync, ...),
each arm's CPU time over wall time recorded: episodes per second of each arm and
`agent_async_vs_sync`; `env_share_of_sync_step` (the share of a synchronous turn spent
waiting for environments); `engine_busy_fraction` (the share of the asynchronous arm's
wall time the engine spent in steps while environments ran); and
`history_tokens_reused_fraction`: of the history tokens that turns 2 and later submit,
the share taken from the session's cached prefix rather than prefilled again.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import pathlib
import random
import statistics
import sys
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import glmjax  # noqa: E402
from envs import families  # noqa: E402
from envs.shell import ShellEnv  # noqa: E402
from glmjax import presets  # noqa: E402
from glmjax.chat import ByteChat  # noqa: E402
from glmjax.presets import load_config  # noqa: E402
from rl.cli import use_compile_cache  # noqa: E402
from rl.collector import drive  # noqa: E402
from rl.engine.driver import Driver, Request  # noqa: E402
from rl.engine.engine import GlmEngine  # noqa: E402
from rl.episode import Episode  # noqa: E402


class DelayedEnv(ShellEnv):
    """A shell whose every step first waits a log-normal delay (command latency)."""

    def __init__(self, rng: random.Random, median_s: float, sigma: float, **kw):
        super().__init__(**kw)
        self.delay_rng, self.median_s, self.sigma = rng, median_s, sigma

    def step(self, action):
        time.sleep(self.delay_rng.lognormvariate(0.0, self.sigma) * self.median_s)
        return super().step(action)


class NoStop(ByteChat):
    """Turns run to their token budget, so both arms do the same work."""

    stop_ids = ()


class Reuse(Episode):
    """An episode that records, per model turn, (prompt tokens reused, history tokens): the
    history of turn k is turn k-1's prompt and sampled tokens."""

    def receive(self, result):
        self.reuse = getattr(self, "reuse", []) + [(result.reused_tokens, getattr(self, "_history", 0))]
        self._history = result.prompt_tokens + len(result.tokens)
        super().receive(result)


def episodes(args, tasks, seed: int) -> list[Episode]:
    rng = random.Random(seed)
    return [Reuse(t, DelayedEnv(rng, args.delay_ms / 1e3, args.sigma, show_help=False, max_turns=args.turns),
                    NoStop(), turn_tokens=args.turn_tokens, window=args.max_len - 1, temperature=1.0, seed=seed + i,
                    session_id=f"{seed}-{i}") for i, t in enumerate(tasks)]


def synchronous(driver: Driver, eps: list[Episode], pool) -> dict:
    """Lockstep turns (module docstring); returns the time spent waiting on environments."""
    env_wait = 0.0
    live = list(eps)
    while live:
        works = [(e, e.next()) for e in live]
        env = [(e, w) for e, w in works if w is not None and not isinstance(w, Request)]
        t0 = time.perf_counter()
        for f in [pool.submit(w) for _, w in env]:
            f.result()
        env_wait += time.perf_counter() - t0
        handles = [(e, driver.submit(w)) for e, w in works if isinstance(w, Request)]
        driver.run_until_idle()
        for e, h in handles:
            e.receive(h.result())
        live = [e for e, w in works if w is not None]
    for e in eps:
        e.close()
    return {"env_wait_s": env_wait}


def asynchronous(driver: Driver, eps: list[Episode], pool_size: int, slots: int) -> dict:
    drive(driver, eps, workers=pool_size, max_active=slots)
    return {}


def arm(name: str, driver: Driver, eps: list[Episode], workers: int, slots: int) -> dict:
    driver.trace = []
    driver.stats.clear()
    wall, cpu = time.perf_counter(), time.process_time()
    if name == "sync":
        extra = {"env_wait_s": 0.0}
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            for i in range(0, len(eps), slots):
                extra["env_wait_s"] += synchronous(driver, eps[i:i + slots], pool)["env_wait_s"]
    else:
        extra = asynchronous(driver, eps, workers, slots)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    busy = sum(end - start for start, end, _ in driver.trace)
    turns = [e.turns for e in eps]
    later = [(h_reused, h_len) for e in eps for h_reused, h_len in e.reuse[1:]]
    return {"episodes_per_s": len(eps) / wall, "wall_s": wall, "cpu_over_wall": cpu / wall,
            "engine_busy_fraction": busy / wall, "turns_mean": statistics.mean(turns),
            "history_tokens_reused_fraction": sum(r for r, _ in later) / max(sum(n for _, n in later), 1),
            "prefill_tokens": driver.stats["prefill_tokens"], "reused_tokens": driver.stats["reused_tokens"],
            **({"env_share_of_step": extra["env_wait_s"] / wall} if "env_wait_s" in extra else {})}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(REPO / "results" / "agent_bench.json"))
    p.add_argument("--episodes", type=int, default=64)
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--turn-tokens", type=int, default=16)
    p.add_argument("--max-len", type=int, default=384)
    p.add_argument("--delay-ms", type=float, default=150.0)
    p.add_argument("--sigma", type=float, default=1.0)
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    use_compile_cache()
    cfg = load_config(str(REPO / "configs" / "sao_agent_tiny.py"))
    cfg.model.max_position_embeddings = args.max_len  # room for three turns of unparsed output
    cfg.model.index_topk = args.max_len
    model = glmjax.init_model(presets.model_config_from(cfg), seed=0)
    engine = GlmEngine(model, max_concurrent_decodes=args.slots, max_len=args.max_len)
    engine.warmup()
    driver = Driver(engine, record_trace=True)
    tasks = families.make_tasks("lookup", args.episodes, seed=0, difficulty=2)
    runs = {"sync": [], "async": []}
    arm("async", driver, episodes(args, tasks, seed=999), args.workers, args.slots)  # warm-up: shapes compiled
    for r in range(args.repeats):
        for name in ("sync", "async"):
            runs[name].append(arm(name, driver, episodes(args, tasks, seed=r), args.workers, args.slots))
            print(name, {k: round(v, 3) for k, v in runs[name][-1].items()}, flush=True)
    med = {name: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for name, rs in runs.items()}
    out = {
        "command": "python benchmarks/agent_bench.py " + " ".join(argv or sys.argv[1:]),
        "config": vars(args),
        "agent_async_vs_sync": med["async"]["episodes_per_s"] / med["sync"]["episodes_per_s"],
        "env_share_of_sync_step": med["sync"]["env_share_of_step"],
        "engine_busy_fraction": med["async"]["engine_busy_fraction"],
        "history_tokens_reused_fraction": med["async"]["history_tokens_reused_fraction"],
        "median": med, "runs": runs, "cpus": os.cpu_count(),
    }
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    import results_io  # benchmarks/results_io.py: keeps the file's findings

    results_io.write(args.out, out)
    print(json.dumps({k: v for k, v in out.items() if k not in ("median", "runs", "config")}, indent=2))
    return out


if __name__ == "__main__":
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    import floor

    floor.main_with_profile(main, "agent_bench")  # --profile DIR: a JAX profiler trace of the run
