"""Held-out evaluation of a policy through its engine: pass rates, and the evaluation matrix.

    evaluate_tasks(job, driver, heldout)              # greedy: pass_rate, reward, turns, seconds
    evaluate(driver, text_tasks, max_new_tokens)      # a one-turn job's greedy pass rate
    matrix(job, engine, heldout, workdir)             # pass@k with intervals, eval_matrix.json

A rollout without a reward (its environment failed) counts as a fail.
"""

from __future__ import annotations

import json
import os
import time

import jax
import numpy as np

from envs import evaluate as evaluate_matrix
from envs.base import is_full
from glmjax import distributed, storage
from glmjax.chat import ByteChat
from rl import rollout as ro
from rl import tasks as rl_tasks
from rl.collector import drive
from rl.compaction import Answer, Compaction
from rl.engine.driver import Driver
from rl.engine.engine import GlmEngine
from rl.env_client import EngineClient


def evaluate_rollouts(driver: Driver, rollouts, workers: int = 4) -> dict:
    """Runs rollouts to the end (rl/collector.py: drive) and returns the pass rate (full
    reward; a rollout without one fails), turns per episode and the seconds spent."""
    start = time.time()
    drive(driver, rollouts, workers=workers)
    rewards = [r.reward if r.reward is not None else 0.0 for r in rollouts]
    turns = [r.turns for r in rollouts if hasattr(r, "turns")]
    return {"pass_rate": float(np.mean([is_full(x) for x in rewards])), "reward": float(np.mean(rewards)),
            "turns": float(np.mean(turns)) if turns else 1.0, "seconds": time.time() - start,
            "failed": sum(r.reward is None for r in rollouts)}


def serving_window(engine: GlmEngine) -> int:
    """Tokens the engine serves per request: its context less the drafts' room and the
    step's own write."""
    return engine.max_len - engine.num_draft - 1


def evaluate(driver: Driver, tasks, max_new_tokens: int, compaction: Compaction | None = None, chat=None) -> float:
    """Greedy pass rate of one-turn tasks (compacting, as in training, when configured), in
    the byte vocabulary or `chat`'s format (rl/tasks.py: chat_for)."""
    window = serving_window(driver.engine)
    chat = chat or ByteChat()
    rollouts = []
    for i, t in enumerate(tasks):
        prompt = rl_tasks.prompt_tokens(chat, t)
        inner = Answer(prompt, rl_tasks.budget(prompt, max_new_tokens, window, compaction), compaction=compaction,
                       stop_ids=rl_tasks.answer_stops(chat), session_id=f"eval-{i}" if compaction else None,
                       decode=chat.decode)
        rollouts.append(ro.TextRollout(t, inner))
    return evaluate_rollouts(driver, rollouts)["pass_rate"]


def evaluate_tasks(job, driver: Driver, tasks, greedy: bool = True, **kw) -> dict:
    """evaluate_rollouts over `tasks` as the job makes their rollouts; with several
    processes each runs every count-th task on its own engine and the results are pooled."""
    make = rl_tasks.RolloutFactory(job, serving_window(driver.engine), greedy=greedy, driver=driver, **kw)
    index, count = jax.process_index(), jax.process_count()
    mine = [make(t, i, session="eval") for i, t in enumerate(tasks) if i % count == index]
    try:
        result = evaluate_rollouts(driver, mine, workers=job.env.workers if job.env else 4)
    finally:
        make.close()
    if count == 1:
        return result
    parts = distributed.gather_objects((len(mine), result))
    n = max(sum(k for k, _ in parts), 1)
    pooled = {key: sum(k * r[key] for k, r in parts) / n for key in ("pass_rate", "reward", "turns")}
    return dict(pooled, seconds=max(r["seconds"] for _, r in parts), failed=sum(r["failed"] for _, r in parts))


def matrix(job, engine: GlmEngine, heldout, workdir: str, driver: Driver | None = None) -> dict:
    """The evaluation matrix (envs/evaluate.py, as `glmjax-envs eval` runs it) on the final
    weights through the engine client, the held-out tasks as its terminal category:
    pass@k with bootstrap intervals, sampled at the RL temperature. Written to
    workdir/eval_matrix.json. `driver`: one already served (a Lockstep's `serve_while`),
    else a Driver of the engine's in a thread of its own."""
    e, m = job.env, job.eval
    own = driver is None
    driver = Driver(engine).start() if own else driver
    try:
        report = evaluate_matrix.evaluate(
            EngineClient(driver, chat=rl_tasks.job_chat(job)), categories=["terminal"],
            tasks={"terminal": heldout[:m.matrix_tasks]},
            samples=m.samples, ks=m.k_values, model=os.path.join(workdir, "checkpoints"),
            workers=engine.max_concurrent_decodes, max_turns=e.max_turns, max_tokens=e.turn_tokens,
            temperature=job.rl.temperature, show_help=e.show_help, timing=e.timing,
            limits=rl_tasks.sandbox_limits(job), action_format=rl_tasks.action_format(job))
    finally:
        if own:
            driver.stop()
    storage.write_text(os.path.join(workdir, "eval_matrix.json"), json.dumps(report, indent=2))
    return report
