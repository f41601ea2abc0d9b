"""Procedural task families: small-scale RL tasks, terminal tasks, code repair, ML infra, security.

    from envs import families
    tasks = families.make_tasks("arithmetic", n=100, seed=0)              # difficulties 1..5 in turn
    tasks = families.make_tasks("sorting", n=50, seed=1, difficulty=2)    # one difficulty
    heldout = families.make_tasks("arithmetic", n=20, seed=0, split="heldout")
    families.names()            # every family; families.TEXT / families.SANDBOX split them

``make_tasks(family, n, seed=0, difficulty=None, split="train")`` is deterministic in
``(family, seed, split, difficulty)``. Tasks are assigned to a split by a hash of their
content (1 in 10 is held out), so train and held-out sets never share a task, whatever the
seeds. ``difficulty=None`` cycles 1, 2, ..., 5.

Text families (``TextTask``, one prompt -> one short answer ending in ``"\\n"``, for a tiny
byte-level model; ``envs/families/procedural.py``): ``arithmetic`` (``"12+7="`` ->
``"19\\n"``), ``sorting``, ``strings``, ``program``, ``counting``. Score a completion with
``task.verify(completion)``; ``task.oracle()`` is the reference completion.

Sandboxed families (``HarborTask``, run by ``envs.shell.ShellEnv``): ``terminal``
(file and text work in the shell), ``lookup`` (read a value the answer depends on: for
a tiny model's agentic RL), ``code_repair`` (injected bugs with fail-to-pass and
pass-to-pass tests), ``ml_infra`` (make a slow data/training script faster, same output),
``security`` (vulnerable programs with exploit tests). Their ``Pattern`` objects
(``patterns(family)``) are what ``envs/generate.py`` builds environments from. Making
``code_repair`` tasks runs sandboxed commands (to measure which tests fail).
"""

from __future__ import annotations

import hashlib
import random

from envs.base import Task
from envs.families import code_repair, lookup, ml_infra, procedural, security, terminal
from envs.families.pattern import Pattern

TEXT = dict(procedural.FAMILIES)
SANDBOX: dict[str, list[Pattern]] = {
    "terminal": terminal.PATTERNS,
    "lookup": lookup.PATTERNS,
    "code_repair": code_repair.PATTERNS,
    "ml_infra": ml_infra.PATTERNS,
    "security": security.PATTERNS,
}
HELDOUT_FRACTION = 10  # one task in this many is held out
_MAX_ATTEMPTS = 50


def names() -> list[str]:
    return sorted(TEXT) + sorted(SANDBOX)


def patterns(family: str) -> list[Pattern]:
    if family not in SANDBOX:
        raise KeyError(f"unknown sandboxed family {family!r}; known: {sorted(SANDBOX)}")
    return SANDBOX[family]


def split_of(task: Task) -> str:
    """ "heldout" for 1 task in ``HELDOUT_FRACTION`` (by a hash of its content), else "train"."""
    blob = task.instruction + "\0" + "".join(f"{k}\0{v}" for k, v in sorted(getattr(task, "files", {}).items()))
    return "heldout" if int(hashlib.sha256(blob.encode()).hexdigest(), 16) % HELDOUT_FRACTION == 0 else "train"


def make_task(family: str, seed: int, index: int, difficulty: int, split: str = "train") -> Task:
    """Task ``index`` of ``(family, seed, split)`` at ``difficulty``."""
    if family not in TEXT and family not in SANDBOX:
        raise KeyError(f"unknown family {family!r}; known: {names()}")
    if not 1 <= difficulty <= 5:
        raise ValueError(f"difficulty must be in 1..5, got {difficulty}")
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    for attempt in range(_MAX_ATTEMPTS * (HELDOUT_FRACTION if split == "heldout" else 1)):
        rng = random.Random(f"{family}:{seed}:{index}:{difficulty}:{attempt}")
        if family in TEXT:
            task = TEXT[family](rng, difficulty, index)
        else:
            options = SANDBOX[family]
            task = options[index % len(options)].make(rng, difficulty)
        if task is not None and split_of(task) == split:
            return task
    raise RuntimeError(f"could not make a {split} {family} task (seed {seed}, index {index}, difficulty {difficulty})")


def make_tasks(family: str, n: int, seed: int = 0, difficulty: int | None = None, split: str = "train") -> list[Task]:
    """``n`` distinct tasks of ``family`` (see the module docstring)."""
    tasks, seen, index = [], set(), 0
    while len(tasks) < n:
        if index > 20 * n + 100:
            raise RuntimeError(f"{family}: only {len(tasks)} distinct tasks at difficulty {difficulty} (asked for {n})")
        task = make_task(family, seed, index, difficulty or index % 5 + 1, split)
        index += 1
        if task.id not in seen:
            seen.add(task.id)
            tasks.append(task)
    return tasks
