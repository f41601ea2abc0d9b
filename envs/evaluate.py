"""The evaluation matrix: a model over held-out task sets, per category and sub-metric.

    category   task sets (held-out split)      sub-metrics (per sample, averaged)
    terminal   terminal                        command_parsing: share of the model's actions that
                                               parse (well-formed tags, every command accepted by
                                               ``bash -n``); multi_step_completion: full reward
    code       code_repair, program            syntax_correctness: every .py in /app parses at the
                                               end (for ``program``: the answer is a Python
                                               expression); logical_completeness: full reward
    security   security                        vulnerability_detection: the submitted name is the
                                               vulnerable function; repair: full reward (exploits
                                               blocked, behaviour kept)

Each task is run ``samples`` times; pass@k (the unbiased estimator
``1 - C(n-c, k) / C(n, k)`` per task, averaged) is computed on the category's completion
metric. Confidence intervals are 95% percentile bootstraps over tasks (seeded, 1000
resamples), so a handful of tasks shows a wide interval rather than a false precision.
``evaluate`` returns the JSON-able report; ``table`` renders it.
"""

from __future__ import annotations

import ast
import logging
import math
import random
import subprocess
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

from envs import families
from envs.base import TextTask, is_full, parse_action
from envs.models import ModelClient, ModelError
from envs.sandbox import tree
from envs.sandbox.sandbox import Limits
from envs.shell import ShellEnv

CATEGORIES = {
    "terminal": (("terminal",), ("command_parsing", "multi_step_completion")),
    "code": (("code_repair", "program"), ("syntax_correctness", "logical_completeness")),
    "security": (("security",), ("vulnerability_detection", "repair")),
}


log = logging.getLogger(__name__)


def heldout(category: str, n: int, seed: int = 0) -> list:
    """``n`` held-out tasks per family of ``category``."""
    names, _ = CATEGORIES[category]
    return [t for name in names for t in families.make_tasks(name, n, seed=seed, split="heldout")]


def _bash_ok(command: str) -> bool:
    return subprocess.run(["/bin/bash", "-n"], input=command.encode(), capture_output=True).returncode == 0


def _python_files_parse(env: ShellEnv) -> bool:
    """Every .py file under /app parses (any depth: ``envs/sandbox/tree.py``)."""
    for entry in tree.files(env.sandbox.host_path("/app")):
        if entry.name.endswith(".py"):
            try:
                ast.parse(entry.read(1 << 20))
            except (SyntaxError, ValueError):
                return False
    return True


def run_sample(client: ModelClient, task, category: str, *, max_turns: int = 8, max_tokens: int = 512,
               temperature: float = 0.0, limits: Limits = Limits(wall_seconds=20.0), show_help: bool = True,
               timing: bool = True, action_format: str = "bash") -> dict:
    """One episode of ``task``; returns ``{"reward", sub-metric: value}``. A client with an
    ``act(transcript, max_tokens=, temperature=)`` method (a chat model: ``rl/env_client.py``)
    is given the episode's turns; any other gets their text rendering to complete."""
    names = CATEGORIES[category][1]
    try:
        if isinstance(task, TextTask):
            completion = client.complete(task.prompt, max_tokens=max_tokens, temperature=temperature,
                                         stop=[task.terminator])
            reward = task.verify(completion)
            try:
                ast.parse(task.extract(completion), mode="eval")
                syntax = 1.0
            except (SyntaxError, ValueError):
                syntax = 0.0
            return {"reward": reward, names[0]: syntax, names[1]: float(is_full(reward))}
        env = ShellEnv(limits=limits, max_turns=max_turns, show_help=show_help, timing=timing,
                       action_format=action_format)
        act = getattr(client, "act", None)  # a chat model reads the turns, not their rendering
        try:
            env.reset(task)
            actions, good, done, info, reward = 0, 0, False, {}, 0.0
            while not done:
                if act is not None:
                    text = act(env.transcript, max_tokens=max_tokens, temperature=temperature)
                else:
                    text = client.complete(env.transcript.render(), max_tokens=max_tokens, temperature=temperature)
                parsed = parse_action(text)
                actions += 1
                good += parsed.parsed and all(_bash_ok(c) for c in parsed.commands)
                _, reward, done, info = env.step(text)
            metrics = {"reward": reward}
            if category == "terminal":
                metrics.update(command_parsing=good / actions, multi_step_completion=float(is_full(reward)))
            elif category == "code":
                metrics.update(syntax_correctness=float(_python_files_parse(env)),
                               logical_completeness=float(is_full(reward)))
            else:
                answer = (info.get("answer") or "").strip().strip("`")
                metrics.update(vulnerability_detection=float(answer == task.metadata.get("vulnerable_function")),
                               repair=float(is_full(reward)))
            return metrics
        finally:
            env.close()
    except (ModelError, OSError, ValueError, RuntimeError) as err:
        # a failed request or a crashed environment is a failed sample (counted in errors), not a dead evaluation
        log.warning("sample of %s failed: %s: %s", task.id, type(err).__name__, err)
        return {"reward": 0.0, **{n: 0.0 for n in names}, "error": f"{type(err).__name__}: {err}"}


def pass_at_k(n: int, c: int, k: int) -> float:
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _bootstrap(values: Sequence[float], seed: int = 0, resamples: int = 1000) -> list[float]:
    if not values:
        return [0.0, 0.0]
    rng = random.Random(seed)
    means = sorted(sum(rng.choices(values, k=len(values))) / len(values) for _ in range(resamples))
    return [means[int(0.025 * resamples)], means[int(0.975 * resamples) - 1]]


def evaluate(client: ModelClient, *, categories: Sequence[str] = tuple(CATEGORIES), tasks: dict | None = None,
             n_tasks: int = 4, samples: int = 1, ks: Sequence[int] = (1,), seed: int = 0, model: str = "model",
             workers: int = 1, **episode) -> dict:
    """The matrix for ``client``. ``tasks``: {category: [task, ...]} (default: held-out sets).
    ``workers``: episodes run at once (a client that batches concurrent requests, such as
    the engine's, then serves them together)."""
    report = {"model": model, "samples": samples, "categories": {}}
    for category in categories:
        chosen = (tasks or {}).get(category) or heldout(category, n_tasks, seed)
        names = CATEGORIES[category][1]
        jobs = [task for task in chosen for _ in range(samples)]
        with ThreadPoolExecutor(max(1, workers)) as pool:
            runs = list(pool.map(lambda task: run_sample(client, task, category, **episode), jobs))
        per_task = [runs[i * samples:(i + 1) * samples] for i in range(len(chosen))]
        metrics = {}
        for name in names:
            values = [sum(s[name] for s in runs) / len(runs) for runs in per_task]
            metrics[name] = {"mean": sum(values) / len(values), "ci95": _bootstrap(values, seed)}
        completion = names[1]
        passes = {}
        for k in ks:
            if k > samples:
                continue
            values = [pass_at_k(samples, sum(s[completion] >= 1.0 for s in runs), k) for runs in per_task]
            passes[f"pass@{k}"] = {"value": sum(values) / len(values), "ci95": _bootstrap(values, seed)}
        errors = sum("error" in s for runs in per_task for s in runs)
        report["categories"][category] = {"tasks": len(chosen), "metrics": metrics, "pass_at_k": passes,
                                          "errors": errors, "task_ids": [t.id for t in chosen]}
    return report


def table(report: dict) -> str:
    lines = [f"model: {report['model']}   samples per task: {report['samples']}",
             f"{'category':<10} {'metric':<24} {'value':>6}   95% CI"]
    for category, entry in report["categories"].items():
        rows = [(n, m["mean"], m["ci95"]) for n, m in entry["metrics"].items()]
        rows += [(n, m["value"], m["ci95"]) for n, m in entry["pass_at_k"].items()]
        for name, value, (lo, hi) in rows:
            lines.append(f"{category:<10} {name:<24} {value:6.3f}   [{lo:.3f}, {hi:.3f}]")
        lines.append(f"{category:<10} {'tasks':<24} {entry['tasks']:6d}   errors: {entry['errors']}")
    return "\n".join(lines)
