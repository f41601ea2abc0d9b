"""Where the RL job's step metrics go: tensorboardX (workdir/tb), workdir/metrics.jsonl
and a progress bar; in a job of several processes only process 0 keeps them (the others
get a QuietLog). A remote workdir (gs://...) gets both files through glmjax/storage.py:
the metrics uploaded at every step, the event files every SYNC_EVERY steps and at the end."""

from __future__ import annotations

import json

import numpy as np
from tqdm.auto import tqdm

from glmjax import storage

SYNC_EVERY = 10  # steps between uploads of a remote workdir's TensorBoard event files


class JobLog:
    """Where a step's metrics go: tensorboard, workdir/metrics.jsonl, the progress bar."""

    def __init__(self, workdir: str, steps: int, initial: int):
        from tensorboardX import SummaryWriter

        self.tb = storage.MirroredDir(storage.path(workdir) / "tb")
        self.writer = SummaryWriter(self.tb.local)
        self.history = storage.AppendLog(storage.path(workdir) / "metrics.jsonl")
        self.bar = tqdm(total=steps, initial=initial, desc="SAO", mininterval=1.0)

    def step(self, step: int, row: dict, metrics: dict, staleness) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(f"train/{k}", v, step)
        self.history.write(json.dumps({"step": step, **row, **metrics}) + "\n")
        self.history.flush()
        self.writer.add_histogram("train/staleness", np.asarray(staleness), step)
        if step % SYNC_EVERY == 0:
            self.writer.flush()
            self.tb.sync()
        self.bar.update(1)
        self.bar.set_postfix(reward=f"{metrics['reward']:.2f}", vloss=f"{metrics.get('value_loss', 0):.3f}")

    def eval(self, metrics: dict, step: int) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(f"eval/{k}", v, step)

    def close(self) -> None:
        self.bar.close()
        self.writer.close()
        self.tb.close()
        self.history.close()


class QuietLog:
    """The log of a process other than the first: it writes nothing."""

    def step(self, *args) -> None:
        pass

    eval = close = step
