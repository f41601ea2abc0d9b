"""Rollouts: the protocol the collector drives, trajectories, staleness-aware admission,
and learner batches.

A rollout is a state machine over two kinds of work (`Rollout.next()`): a model turn for
the engine (a `Request`, answered by `receive(result)`) or blocking environment work (a
callable: a shell command, a verifier) that the collector runs in a worker pool, off the
thread that drives generation. `None` means done: `reward` is set (or `finish_reason`
says why there is none) and `trajectories` gives the learner rows. One-turn tasks
(`TextRollout`), compacted answers (`rl/compaction.py`) and multi-turn episodes
(`rl/episode.py`) implement it; the trainer's loop does not know which it runs.

Admission control (AReaL, arXiv 2505.24298) decides how many new rollouts may start, so
that no accepted sample is more than `eta` policy versions behind without discarding
work (discard-and-requeue biases training toward short rollouts):

    capacity = min(max_concurrent - running, (eta + version + 1) * B - (accepted + running))

eta = 0 is synchronous RL: B rollouts per version, all from that version. A finished
sample whose oldest token is more than `tau` versions behind the current policy is still
dropped (GLM-5), as is one whose environment crashed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Protocol, Union

import jax.numpy as jnp
import numpy as np

from rl import sao
from rl.engine.driver import Request, Result

EnvWork = Callable[[], None]


@dataclasses.dataclass
class Trajectory:
    """One segment of a rollout: its tokens and what the learner needs of each."""

    prompt: list[int]
    completion: list[int]
    log_probs: list[float]  # behaviour-policy log-prob of each completion token
    versions: list[int]  # weight version that produced each completion token
    reward: float
    rollout_id: int
    segment_index: int = 0
    task_id: str = ""
    difficulty: float = 0.0
    finish_reason: str = "stop"
    observation_mask: list[int] | None = None  # 1 on completion tokens that are tool output, not actions
    raw_reward: float | None = None  # the verifier's, when `reward` is shaped (envs/reward.py)
    # the engine's experts at each position of prompt + completion [length, L_moe, X] int16,
    # -1 where it ran none (RouteLog); None from an engine that does not record routes
    routes: np.ndarray | None = None

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.completion)

    def staleness(self, version: int) -> int:
        return version - min(self.versions) if self.versions else 0


@dataclasses.dataclass(frozen=True)
class Seen:
    """What the job's metrics read of a trajectory: small enough to send to every process,
    where the trajectory itself stays with the process that learns from it."""

    rollout_id: int
    segment_index: int
    task_id: str
    reward: float
    raw_reward: float | None
    first_version: int | None  # the oldest weight version among its tokens
    completion_tokens: int
    compacted: bool  # a segment that a later one continues (rl/compaction.py)

    @classmethod
    def of(cls, tr: Trajectory) -> Seen:
        return cls(tr.rollout_id, tr.segment_index, tr.task_id, tr.reward, tr.raw_reward,
                   min(tr.versions) if tr.versions else None, len(tr.completion), tr.finish_reason == "compacted")

    def staleness(self, version: int) -> int:
        return version - self.first_version if self.first_version is not None else 0


class RouteLog:
    """The experts the engine chose at each position of one token sequence (a segment:
    prompt + completion), merged from the Results of the requests that ran its positions:
    each request's context is a prefix of the segment, so its Result.routes row p is
    position p (a turn's reused prefix is -1 there, and the turn before ran it)."""

    def __init__(self):
        self.rows: np.ndarray | None = None  # [positions so far, L_moe, X]

    def add(self, result: Result) -> None:
        new = result.routes
        if new is None:
            return
        if self.rows is None or len(self.rows) < len(new):
            grown = np.full((len(new), *new.shape[1:]), -1, np.int16)
            if self.rows is not None:
                grown[:len(self.rows)] = self.rows
            self.rows = grown
        known = new[:, 0, 0] >= 0
        self.rows[:len(new)][known] = new[known]

    def take(self, length: int) -> np.ndarray | None:
        """[length, L_moe, X]: the known positions, -1 past them; None if nothing was recorded."""
        if self.rows is None:
            return None
        out = np.full((length, *self.rows.shape[1:]), -1, np.int16)
        n = min(length, len(self.rows))
        out[:n] = self.rows[:n]
        return out


class Rollout(Protocol):
    """What the collector drives (module docstring)."""

    reward: float | None
    finish_reason: str | None  # set once done: "stop" | "length" | "error" | ...

    def next(self) -> Union[Request, EnvWork, None]: ...

    def receive(self, result: Result) -> None: ...

    def trajectories(self, rollout_id: int, **meta) -> list[Trajectory]: ...

    def close(self) -> None: ...


class TextRollout:
    """A one-turn task: the engine writes the answer (compacting when configured: `inner` is
    an `rl.compaction.Answer`), then the task's verifier scores the transcript."""

    def __init__(self, task, inner):
        self.task, self.inner = task, inner
        self.reward: float | None = None
        self.finish_reason: str | None = None

    def next(self):
        if not self.inner.done:
            return self.inner.request()
        if self.inner.finish_reason in ("error", "cancelled"):
            self.finish_reason = self.inner.finish_reason
            return None
        if self.reward is None:
            return self._verify
        return None

    def _verify(self) -> None:
        self.reward = float(self.task.verify(self.inner.text))
        self.finish_reason = self.inner.finish_reason

    def receive(self, result: Result) -> None:
        self.inner.receive(result)

    @property
    def text(self) -> str:
        return self.inner.text

    def trajectories(self, rollout_id: int, **meta) -> list[Trajectory]:
        return self.inner.trajectories(self.reward, rollout_id, **meta)

    def close(self) -> None:
        pass


class Admission:
    """The staleness budget of asynchronous generation (formula in the module docstring)."""

    def __init__(self, batch_size: int, eta: int, max_concurrent: int):
        if eta < 0:
            raise ValueError(f"rl.eta={eta} is invalid: expected >= 0 (0 = synchronous)")
        self.batch_size, self.eta, self.max_concurrent = batch_size, eta, max_concurrent
        self.accepted = 0  # finished rollouts kept for training (whether trained on yet or not)
        self.dropped = 0  # finished rollouts not kept (stale, crashed, in a uniform group)
        self.running = 0

    @property
    def issued(self) -> int:
        """Rollouts started so far: the next rollout's id. A resumed run reissues the ids
        that were in flight at the checkpoint, so it replays them."""
        return self.accepted + self.dropped + self.running

    def capacity(self, version: int) -> int:
        by_staleness = (self.eta + version + 1) * self.batch_size - (self.accepted + self.running)
        return max(0, min(self.max_concurrent - self.running, by_staleness))

    def started(self, n: int = 1) -> None:
        self.running += n

    def finished(self, accepted: bool) -> None:
        self.running -= 1
        self.accepted += int(accepted)
        self.dropped += int(not accepted)

    def rejected(self, n: int) -> None:
        """`n` finished rollouts counted as accepted are not kept after all (a group that
        DAPO's dynamic sampling drops once its last member ends): they count as dropped, so
        their budget goes to new rollouts and `issued` stays the same."""
        if not 0 <= n <= self.accepted:
            raise ValueError(f"cannot reject {n} rollouts: expected 0 to the {self.accepted} accepted")
        self.accepted -= n
        self.dropped += n

    def state_dict(self) -> dict:
        return {"accepted": self.accepted, "dropped": self.dropped}

    def load_state_dict(self, state: dict) -> None:
        self.accepted, self.dropped, self.running = int(state["accepted"]), int(state.get("dropped", 0)), 0


def to_batch(trajectories: Sequence[Trajectory], length: int | None = None, pad_id: int = 0,
             rows: int | None = None) -> sao.Batch:
    """Right-padded learner arrays [B, T]; T is the longest row (or `length`), B the number
    of trajectories (or `rows`: the extra rows are empty, each its own rollout, so a
    varying number of compacted segments keeps one shape). With routes recorded, the
    engine's experts [B, T, L_moe, X] (-1 where unknown) for routing replay."""
    t = length or max(tr.length for tr in trajectories)
    b = rows or len(trajectories)
    if b < len(trajectories):
        raise ValueError(f"{len(trajectories)} trajectories do not fit in rows={rows}")
    tokens = np.full((b, t), pad_id, np.int32)
    shape = next((tr.routes.shape[1:] for tr in trajectories if tr.routes is not None), None)
    routes = None if shape is None else np.full((b, t, *shape), -1, np.int16)
    mask = np.zeros((b, t), np.float32)
    logp = np.zeros((b, t), np.float32)
    versions = np.zeros((b, t), np.int32)
    for i, tr in enumerate(trajectories):
        if tr.length > t:
            raise ValueError(f"trajectory {tr.task_id or i} has {tr.length} tokens, more than the batch length {t}")
        p, n = len(tr.prompt), len(tr.completion)
        tokens[i, :p + n] = tr.prompt + tr.completion
        action = np.ones(n, np.float32)
        if tr.observation_mask is not None:
            action -= np.asarray(tr.observation_mask, np.float32)
        mask[i, p:p + n] = action
        logp[i, p:p + n] = tr.log_probs
        versions[i, p:p + n] = tr.versions
        if routes is not None and tr.routes is not None:
            routes[i, :len(tr.routes)] = tr.routes
    pad = b - len(trajectories)
    rewards = [tr.reward for tr in trajectories] + [0.0] * pad
    first_free = max([tr.rollout_id for tr in trajectories], default=-1) + 1
    rollout_ids = [tr.rollout_id for tr in trajectories] + list(range(first_free, first_free + pad))
    segments = [tr.segment_index for tr in trajectories] + [0] * pad
    return sao.Batch(
        tokens=jnp.asarray(tokens), action_mask=jnp.asarray(mask), logp_rollout=jnp.asarray(logp),
        versions=jnp.asarray(versions), rewards=jnp.asarray(rewards, jnp.float32),
        values=jnp.zeros((b, t), jnp.float32), rollout_id=jnp.asarray(rollout_ids),
        segment_index=jnp.asarray(segments, jnp.int32), routes=None if routes is None else jnp.asarray(routes))


def encode(text: str) -> list[int]:
    """Byte-level tokens (the tiny models' vocabulary is the 256 byte values)."""
    return list(text.encode("utf-8"))


def decode(tokens: Sequence[int]) -> str:
    return bytes(int(t) for t in tokens if 0 <= int(t) < 256).decode("utf-8", errors="replace")
