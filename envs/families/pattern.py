"""Task patterns: how a sandboxed family turns a seed into a ``HarborTask``.

A ``Pattern`` is the recipe for one kind of task, split the way environment generation
(``envs/generate.py``) needs it:

    spec     = pattern.instantiate(rng, difficulty)   # instruction, starting files, facts
    solution = pattern.solve(spec)                    # reference solve.sh (the oracle)
    tests    = pattern.verify(spec)                   # tests/ files, from the spec alone
    partials = pattern.partials(spec)                 # half-done solutions (each must score 0)

``verify`` never receives the solution: the verifier is written from the specification
(the instruction and the facts it states), as the blog's pipeline prescribes. The oracle
check is then what proves solution and verifier agree.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
from typing import Any, Callable, Mapping

from envs.harbor.task import HarborTask

TEST_SH = """#!/bin/bash
# Written from the task's specification, without the reference solution.
mkdir -p /logs/verifier
if python3 /tests/test_outputs.py > /logs/verifier/test-output.txt 2>&1; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
"""


@dataclasses.dataclass(frozen=True)
class Spec:
    """One concrete task before it has a solution or tests. ``facts``: JSON-able data the
    instruction implies (expected outputs, inputs), all a verifier may use; ``private``:
    what only the solution side may use (the lines a bug fix restores, a fixed program)."""

    pattern: str
    instruction: str
    files: Mapping[str, str]
    facts: Mapping[str, Any]
    difficulty: int
    private: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def key(self) -> str:
        blob = [self.pattern, self.instruction, dict(self.files), self.facts, self.private]
        blob = json.dumps(blob, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()


def python_tests(facts: Mapping[str, Any], body: str) -> dict[str, str]:
    """tests/: ``test.sh`` (reward 1 iff test_outputs.py exits 0) and ``test_outputs.py``
    (``FACTS`` = the spec's facts, then ``body``: asserts)."""
    header = "import json, os, sys\nFACTS = json.loads(" + repr(json.dumps(facts, sort_keys=True)) + ")\n"
    return {"test.sh": TEST_SH, "test_outputs.py": header + body.lstrip("\n")}


@dataclasses.dataclass(frozen=True)
class Pattern:
    name: str
    family: str
    domain: str
    description: str
    instantiate: Callable[[random.Random, int], Spec | None]
    solve: Callable[[Spec], str]
    verify: Callable[[Spec], dict[str, str]]
    partials: Callable[[Spec], list[str]] = lambda spec: []
    # the agent's actions on a task, one model turn each (metadata["demonstration"]), if known
    demonstrate: Callable[[Spec], list[str]] | None = None
    agent_timeout: float = 60.0
    verifier_timeout: float = 60.0

    def build(self, spec: Spec, *, solution: str | None = None, tests: Mapping[str, str] | None = None,
              partials: list[str] | None = None) -> HarborTask:
        """The task for ``spec`` (solution/tests/partials default to this pattern's own)."""
        return HarborTask(
            id=f"{self.name}-d{spec.difficulty}-{spec.key()[:10]}", instruction=spec.instruction,
            domain=self.domain, difficulty=spec.difficulty, files=dict(spec.files),
            solution=self.solve(spec) if solution is None else solution,
            tests=dict(self.verify(spec) if tests is None else tests),
            partials=tuple(self.partials(spec) if partials is None else partials),
            agent_timeout=self.agent_timeout, verifier_timeout=self.verifier_timeout,
            metadata={"family": self.family, "pattern": self.name, **spec.facts.get("metadata", {}),
                      **({"demonstration": self.demonstrate(spec)} if self.demonstrate else {})})

    def make(self, rng: random.Random, difficulty: int) -> HarborTask | None:
        spec = self.instantiate(rng, difficulty)
        return None if spec is None else self.build(spec)
