"""Environment generation: task pattern -> concrete environments -> judge -> verifier -> checks -> registry.

The blog's agent-first pipeline, with every agent pluggable:

1. Instantiate: ``pattern.instantiate(rng, difficulty)`` turns a pattern (a workflow:
   "count log lines by level", "fix an injected bug") into a concrete ``Spec``: the
   instruction, the starting files and the facts the instruction implies.
2. Solve: the research agent writes the reference ``solve.sh``. Deterministic path:
   ``pattern.solve(spec)``; with a model: ``author`` is asked for a ```bash block.
3. Judge: the solution must run within the sandbox limits (exit 0, not killed, inside the
   agent time) and change the working directory; with a ``judge`` model, the model must
   also answer "yes" to whether the instruction alone is enough to do the task.
4. Verifier: written from the spec without the solution. Deterministic path:
   ``pattern.verify(spec)``; with a model: ``verifier`` sees the instruction and
   ``spec.facts`` (never solve.sh nor ``spec.private``) and writes the body of
   ``test_outputs.py`` in a ```python block.
5. The three checks (``envs/harbor/validate.py``) with the pattern's partial solutions.
6. Registry: accepted tasks are exported as Harbor directories under ``out/tasks/`` and
   listed, with their reports, in ``out/registry.json``; rejected ones are listed with
   the stage and the reason. Text families skip 2-4 (their verifier is the family's) and
   are recorded in the registry by prompt and answer.

``generate(...)`` is deterministic for a given seed when no model is used.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
from concurrent.futures import ThreadPoolExecutor

from envs import families
from envs.base import TextTask
from envs.families.pattern import Pattern, Spec, python_tests
from envs.harbor.dirs import export_task, load_task
from envs.harbor.task import HarborTask, UnsupportedTask, prepare, run_script
from envs.harbor.validate import validate
from envs.models import ModelClient
from envs.sandbox.sandbox import Limits, Sandbox

_DRAWS = 8  # a pattern may reject a draw (code repair: a mutant with no failing test)
_BLOCK = re.compile(r"```(\w*)\n(.*?)```", re.DOTALL)


def _block(text: str, language: str) -> str | None:
    for lang, body in _BLOCK.findall(text):
        if lang in (language, ""):
            return body
    return None


def write_solution(pattern: Pattern, spec: Spec, author: ModelClient | None = None) -> str | None:
    if author is None:
        return pattern.solve(spec)
    listing = "\n".join(f"- /app/{p} ({len(c)} bytes)" for p, c in spec.files.items())
    reply = author.complete(f"Task for a Linux shell, working directory /app:\n{spec.instruction}\nFiles:\n{listing}\n"
                            "Write a bash script that does the task, in one ```bash block.\n", max_tokens=1024)
    return _block(reply, "bash")


def write_verifier(pattern: Pattern, spec: Spec, verifier: ModelClient | None = None) -> dict[str, str] | None:
    """tests/ for ``spec``; the reference solution is never an input."""
    if verifier is None:
        return pattern.verify(spec)
    reply = verifier.complete(
        f"Write a strict Python test for this task. It must fail unless the task is completely done.\n"
        f"Task:\n{spec.instruction}\nFACTS (a dict available to your code) = {json.dumps(spec.facts)[:4000]}\n"
        "Reply with the test body in one ```python block: assertions over the files in /app.\n", max_tokens=1024)
    body = _block(reply, "python")
    return None if body is None else python_tests(spec.facts, body)


def judge(task: HarborTask, *, limits: Limits, judge_client: ModelClient | None = None) -> str | None:
    """None when the task looks solvable, else the reason it does not."""
    if judge_client is not None:
        answer = judge_client.complete(f"Can this task be done from its instruction alone? Answer yes or no.\n"
                                       f"{task.instruction}\nAnswer:", max_tokens=4)
        if not answer.strip().lower().startswith("yes"):
            return f"the judge model answered {answer.strip()[:40]!r}"
    with Sandbox(limits=limits) as box:
        try:
            prepare(box, task)
        except UnsupportedTask as err:
            return f"unsupported: {err}"
        before = box.snapshot("/app")
        result = run_script(box, task, task.solution)
        if not result.ok:
            return f"the solution failed within the limits {result.summary()}: {result.output[-300:]}"
        if box.snapshot("/app") == before:
            return "the solution leaves /app unchanged"
    return None


@dataclasses.dataclass
class Registry:
    """``root/registry.json`` plus the accepted tasks as Harbor directories in ``root/tasks``."""

    root: str
    accepted: list[dict] = dataclasses.field(default_factory=list)
    rejected: list[dict] = dataclasses.field(default_factory=list)

    @classmethod
    def load(cls, root: str) -> "Registry":
        with open(os.path.join(root, "registry.json")) as f:
            data = json.load(f)
        return cls(root, data["accepted"], data["rejected"])

    def save(self) -> str:
        os.makedirs(self.root, exist_ok=True)
        path = os.path.join(self.root, "registry.json")
        with open(path, "w") as f:
            json.dump({"accepted": self.accepted, "rejected": self.rejected}, f, indent=1, default=str)
        return path

    def add(self, task, family: str, report: dict) -> None:
        if any(e["id"] == task.id for e in self.accepted):
            return  # the same environment drawn twice
        entry = {"id": task.id, "family": family, "difficulty": task.difficulty, "report": report}
        if isinstance(task, TextTask):
            entry.update(prompt=task.prompt, answer=task.answer)
        else:
            entry["path"] = os.path.relpath(export_task(task, os.path.join(self.root, "tasks")), self.root)
        self.accepted.append(entry)

    def reject(self, task_id: str, family: str, stage: str, reason: str, report: dict | None = None) -> None:
        self.rejected.append({"id": task_id, "family": family, "stage": stage, "reason": reason, "report": report})

    def tasks(self) -> list[HarborTask]:
        """The accepted sandboxed tasks, loaded back from their Harbor directories."""
        return [load_task(os.path.join(self.root, e["path"])) for e in self.accepted if "path" in e]

    def counts(self) -> dict[str, dict[str, int]]:
        out = {}
        for entries, key in ((self.accepted, "accepted"), (self.rejected, "rejected")):
            for e in entries:
                out.setdefault(e["family"], {"accepted": 0, "rejected": 0})[key] += 1
        return out


def _candidate(pattern: Pattern, seed: int, index: int, difficulty: int, author, verifier_client, judge_client,
               limits: Limits, cuts: int):
    """(task or None, stage it stopped at, reason, report)."""
    for attempt in range(_DRAWS):
        rng = random.Random(f"generate:{pattern.name}:{seed}:{index}:{difficulty}:{attempt}")
        spec = pattern.instantiate(rng, difficulty)
        if spec is not None:
            break
    else:
        return None, "instantiate", f"the pattern drew no valid instance in {_DRAWS} tries", None
    solution = write_solution(pattern, spec, author)
    if solution is None:
        return None, "solve", "the author model wrote no ```bash block", None
    draft = pattern.build(spec, solution=solution, tests={"test.sh": "exit 1\n"}, partials=[])
    reason = judge(draft, limits=limits, judge_client=judge_client)
    if reason is not None:
        return draft, "judge", reason, None
    tests = write_verifier(pattern, spec, verifier_client)
    if tests is None:
        return draft, "verifier", "the verifier model wrote no ```python block", None
    task = pattern.build(spec, solution=solution, tests=tests)
    report = validate(task, cuts=cuts, limits=limits)
    return task, "checks", _why(report), report.to_dict()


def _why(report) -> str | None:
    if report.passed:
        return None
    failed = [c.name for c in report.checks if not c.passed]
    return f"{report.status}: " + (report.reason or "failed " + ", ".join(failed))


def generate(out_dir: str, *, families_n: dict[str, int], seed: int = 0, author: ModelClient | None = None,
             verifier: ModelClient | None = None, judge_client: ModelClient | None = None,
             limits: Limits = Limits(wall_seconds=60.0), cuts: int = 3, workers: int = 1) -> Registry:
    """Run the pipeline for ``{family: how many}`` and write the registry to ``out_dir``."""
    registry = Registry(out_dir)
    jobs = []
    for family, n in families_n.items():
        for index in range(n):
            difficulty = index % 5 + 1
            if family in families.TEXT:
                jobs.append((family, None, index, difficulty))
            else:
                options = families.patterns(family)
                jobs.append((family, options[index % len(options)], index // len(options), difficulty))

    def run(job):
        family, pattern, index, difficulty = job
        if pattern is None:
            task = families.make_task(family, seed, index, difficulty)
            report = validate(task)
            return family, task, "checks", _why(report), report.to_dict()
        return (family, *_candidate(pattern, seed, index, difficulty, author, verifier, judge_client, limits, cuts))

    with ThreadPoolExecutor(max(workers, 1)) as pool:
        results = list(pool.map(run, jobs))
    for (family, pattern, index, _), (_, task, stage, reason, report) in zip(jobs, results):
        task_id = task.id if task is not None else f"{pattern.name if pattern else family}-{index}"
        if reason is None and task is not None:
            registry.add(task, family, report)
        else:
            registry.reject(task_id, family, stage, reason or "failed", report)
    registry.save()
    return registry
