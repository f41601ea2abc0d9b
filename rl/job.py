"""What every post-training job shares: its workdir, its devices, its output, and the
totals a resumed run carries over.

    def run(cfg, workdir):
        job = JobConfig.from_config(cfg)
        return on_mesh(job.raw, workdir, lambda mesh, rules: _run(job, workdir, mesh, rules))

The RL job (rl/trainer.py) and the distillation job (rl/distill/trainer.py) are each a
body run by `on_mesh` and print through `say`; a job that resumes from checkpoints (the RL
job) counts its seconds across processes with `Totals`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from typing import Any

from glmjax import distributed, sharding, storage


def on_mesh(raw_cfg, workdir: str, body: Callable[[Any, Any], dict]) -> dict:
    """Creates `workdir`, starts the distributed runtime and builds the mesh that the config's
    `mesh`, `rules` and `distributed` sections ask for (glmjax/distributed.py), and runs
    `body(mesh, rules)` inside it (mesh None: one device, no sharding)."""
    storage.makedirs(workdir)  # a local directory, or gs://... (glmjax/storage.py)
    mesh, rules = distributed.job_mesh(raw_cfg)
    if mesh is None:
        return body(None, rules)
    with sharding.use_mesh(mesh, rules):
        return body(mesh, rules)


def say(text: str) -> None:
    """A line of the job's output (process 0's)."""
    if distributed.is_main():
        print(text, flush=True)


class Totals:
    """Seconds and counts of a run that may be several processes in turn: each resumed one
    starts from the totals its checkpoint carries, up to that checkpoint, and adds its own
    since it started (the work after the checkpoint, which it redoes, once).

        totals = Totals(resumed)               # the checkpoint's dict, or None
        totals.clock("wall_seconds")           # this process's time counts from now
        totals["wall_seconds"]                 # earlier processes' + this one's so far
        totals.add("env_seconds", 1.5)         # this process's own count
    """

    def __init__(self, resumed: Mapping[str, Any] | None = None):
        self.earlier = dict(resumed or {})
        self._since: dict[str, float] = {}
        self._own: dict[str, float] = {}

    def clock(self, key: str, started: float | None = None) -> None:
        self._since[key] = time.time() if started is None else started

    def set(self, key: str, value: float) -> None:
        """This process's own `key` so far (replacing what it said before)."""
        self._own[key] = value

    def add(self, key: str, value: float) -> None:
        self._own[key] = self._own.get(key, 0.0) + value

    def __getitem__(self, key: str) -> float:
        now = time.time() - self._since[key] if key in self._since else 0.0
        return float(self.earlier.get(key, 0.0)) + self._own.get(key, 0.0) + now

    def snapshot(self, *keys: str) -> dict[str, float]:
        return {k: self[k] for k in keys}
