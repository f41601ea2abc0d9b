"""Adversarial augmentation: perturbations that keep the verified answer.

    distractor(task, rng)        text: an irrelevant assignment before the prompt
                                 ("k=4;12+7="); sandboxed: an unrelated file /app/NOTES.txt
                                 named in the instruction as unrelated
    rename(task, mapping)        identifiers renamed consistently (word boundaries) in every
                                 text of the task: instruction, files, solution, tests, partials
    reorder(task, rng)           facts in another order: operands of + and *, the list to sort,
                                 the example points of a program task
    noisy_output(p)              an observation filter for ``ShellEnv(noise=...)``: warnings,
                                 progress bars and colour codes mixed into tool output

An augmented task gets a new id (``<id>-aug<hash>``) and ``metadata["augmentations"]``.
A perturbation can still break a verifier in ways nobody foresaw, so augmented tasks go
through the three checks again before training (``envs/harbor/validate.py``); ``augment``
refuses, with ``ValueError``, a text task whose oracle stops scoring full.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
import re
from typing import Callable, Mapping, Sequence

from envs.base import Task, TextTask, is_full
from envs.harbor.task import HarborTask

_NOISE = ("warning: setlocale: LC_ALL: cannot change locale", "\x1b[33mnote:\x1b[0m cache refreshed",
          "[#####     ] 50%", "DeprecationWarning: this flag will be removed", "Reading package lists... Done")


def _renew(task: Task, kind: str, **changes) -> Task:
    meta = dict(changes.pop("metadata", task.metadata))
    meta["augmentations"] = list(meta.get("augmentations", [])) + [kind]
    meta.setdefault("original_id", task.id)
    fresh = dataclasses.replace(task, metadata=meta, **changes)
    digest = hashlib.sha256(repr((fresh.instruction, kind, sorted(getattr(fresh, "files", {}).items()))).encode())
    fresh = dataclasses.replace(fresh, id=f"{meta['original_id']}-aug{digest.hexdigest()[:6]}")
    if isinstance(fresh, TextTask) and not is_full(fresh.verify(fresh.oracle())):
        raise ValueError(f"{kind} changed the verified answer of {task.id}")
    return fresh


def distractor(task: Task, rng: random.Random) -> Task:
    if isinstance(task, TextTask):
        fact = f"{rng.choice('kmnpqrstuvwz')}={rng.randint(0, 99)};"
        return _renew(task, "distractor", instruction=fact + task.instruction)
    if isinstance(task, HarborTask):
        files = dict(task.files)
        files["NOTES.txt"] = f"meeting moved to {rng.randint(1, 12)}pm; ticket {rng.randint(1000, 9999)}\n"
        text = task.instruction.rstrip("\n") + "\n(/app/NOTES.txt is unrelated to this task: leave it alone.)\n"
        return _renew(task, "distractor", instruction=text, files=files)
    raise TypeError(f"cannot add a distractor to {type(task).__name__}")


def _sub(text, pattern):
    if isinstance(text, bytes):
        try:
            return _sub(text.decode(), pattern).encode()
        except UnicodeDecodeError:
            return text
    return pattern(text)


def rename(task: Task, mapping: Mapping[str, str]) -> Task:
    regex = re.compile(r"\b(" + "|".join(map(re.escape, sorted(mapping, key=len, reverse=True))) + r")\b")
    sub = lambda text: _sub(text, lambda t: regex.sub(lambda m: mapping[m.group(1)], t))  # noqa: E731
    if isinstance(task, TextTask):
        return _renew(task, "rename", instruction=sub(task.instruction))
    if isinstance(task, HarborTask):
        return _renew(task, "rename", instruction=sub(task.instruction),
                      files={sub(k): sub(v) for k, v in task.files.items()},
                      solution=None if task.solution is None else sub(task.solution),
                      tests={k: sub(v) for k, v in task.tests.items()}, partials=tuple(sub(p) for p in task.partials),
                      metadata={k: sub(v) if isinstance(v, str) else v for k, v in task.metadata.items()})
    raise TypeError(f"cannot rename identifiers in {type(task).__name__}")


def reorder(task: TextTask, rng: random.Random) -> TextTask:
    family = task.metadata.get("family")
    head, _, prompt = task.instruction.rpartition(";")  # keep a distractor prefix in front
    head = head + ";" if head else ""
    if family == "arithmetic":
        found = re.fullmatch(r"(-?\d+)([+*])(-?\d+)=", prompt)
        if not found:
            raise ValueError(f"{prompt!r}: only + and * have their operands swapped")
        prompt = f"{found.group(3)}{found.group(2)}{found.group(1)}="
    elif family == "sorting":
        values = prompt[len("sort "):-1].split()
        rng.shuffle(values)
        prompt = "sort " + " ".join(values) + "="
    elif family == "program":
        points = prompt[:-len(" f=")].split()
        rng.shuffle(points)
        prompt = " ".join(points) + " f="
    else:
        raise ValueError(f"no fact order to change in a {family} task")
    return _renew(task, "reorder", instruction=head + prompt)


def noisy_output(p: float = 0.5) -> Callable[[str, random.Random], str]:
    """Insert a noise line after each line of an observation with probability ``p``."""
    def noise(observation: str, rng: random.Random) -> str:
        out = []
        for line in observation.split("\n"):
            out.append(line)
            if rng.random() < p:
                out.append(rng.choice(_NOISE))
        return "\n".join(out)
    return noise


def augment(task: Task, kinds: Sequence[str], rng: random.Random, mapping: Mapping[str, str] | None = None) -> Task:
    """Apply ``kinds`` ("distractor", "rename", "reorder") in order."""
    for kind in kinds:
        if kind == "distractor":
            task = distractor(task, rng)
        elif kind == "rename":
            task = rename(task, mapping or {})
        elif kind == "reorder":
            task = reorder(task, rng)
        else:
            raise ValueError(f"unknown augmentation {kind!r}: distractor, rename or reorder")
    return task
