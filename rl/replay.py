"""Prioritized experience replay of trajectories, stored in mixed precision (host numpy).

Prioritized replay (Schaul et al. 2016, "Prioritized Experience Replay"), proportional form:

    P(i) = p_i^alpha / sum_k p_k^alpha,      p_i = |priority_i| + eps
    w_i  = (N P(i))^-beta / max_k (N P(k))^-beta      N = entries stored

The buffer holds a fixed number of rows (trajectories or segments) padded to one length.
The fields are whatever the first `add` passes (a mapping or a NamedTuple such as
`rl.sao.Batch`, plus e.g. advantages and returns), each with a leading row axis:
per-token floating fields ([n, T, ...]) are stored as bfloat16 (half the bytes; about 3
significant digits, so a stored log-prob of -5 is off by up to ~0.01), per-row floating
fields ([n], e.g. rewards) as float32, integers as int32, booleans as bool. `sample`
returns float32 copies.

How it differs from the paper's buffer:
  * new rows enter at the largest priority seen so far, so each is likely drawn soon;
  * when full, the oldest rows are evicted (a ring), whatever their priority;
  * sampling is with replacement, by inverse CDF over a cumulative sum: O(capacity) per
    draw of a whole batch, which at RL batch sizes costs less than a sum tree's upkeep;
  * rows are addressed by insertion index (0, 1, 2, ... over the buffer's life), so a
    priority update for a row that was evicted in the meantime is ignored, not applied
    to the row that replaced it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax.numpy as jnp
import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)


class Sample(NamedTuple):
    data: dict[str, np.ndarray]  # field -> [batch, ...] (floating fields as float32)
    indices: np.ndarray  # [batch] int64 insertion indices, for update_priorities
    weights: np.ndarray  # [batch] float32 importance weights, max over the buffer = 1


def _storage_dtype(name: str, value: np.ndarray) -> np.dtype:
    if value.dtype == np.bool_:
        return np.dtype(np.bool_)
    if np.issubdtype(value.dtype, np.integer):
        return np.dtype(np.int32)
    if np.issubdtype(value.dtype, np.floating) or value.dtype == BF16:
        return BF16 if value.ndim >= 2 else np.dtype(np.float32)
    raise TypeError(f"replay field {name!r} has dtype {value.dtype}: expected bool, integer or floating")


def mean_abs_priority(advantages: np.ndarray, action_mask: np.ndarray) -> np.ndarray:
    """A row's priority: mean |advantage| over its action tokens. [n, T] -> [n]."""
    m = np.asarray(action_mask, bool)
    a = np.abs(np.asarray(advantages, np.float32))
    return np.where(m, a, 0.0).sum(1) / np.maximum(m.sum(1), 1)


class ReplayBuffer:
    """Fixed-capacity prioritized replay. `alpha` shapes the sampling (0 = uniform),
    `beta` the importance correction (1 = full); anneal `beta` by setting the attribute.
    Not thread-safe: a buffer shared by rollout and learner threads needs a lock."""

    def __init__(self, capacity: int, *, alpha: float = 0.6, beta: float = 0.4, eps: float = 1e-6, seed: int = 0):
        if capacity <= 0:
            raise ValueError(f"ReplayBuffer capacity={capacity}: expected a positive number of rows")
        self.capacity, self.alpha, self.beta, self.eps = int(capacity), float(alpha), float(beta), float(eps)
        self._rng = np.random.default_rng(seed)
        self._data: dict[str, np.ndarray] = {}
        self._priority = np.zeros(self.capacity, np.float64)
        self._max_priority = 1.0
        self._added = 0  # rows ever added; row k lives in slot k % capacity while k >= added - size

    def __len__(self) -> int:
        return min(self._added, self.capacity)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self._data.values()) + self._priority.nbytes

    def add(self, rows: Mapping[str, Any] | tuple, priorities: np.ndarray | None = None) -> np.ndarray:
        """Stores n rows (every field [n, ...]); returns their insertion indices [n].
        priorities [n] default to the largest seen so far. Evicts the oldest when full."""
        rows = rows._asdict() if hasattr(rows, "_asdict") else dict(rows)
        rows = {k: np.asarray(v) for k, v in rows.items()}
        n = self._check(rows)
        if priorities is None:
            prio = np.full(n, self._max_priority)
        else:
            prio = np.abs(np.asarray(priorities, np.float64)).reshape(-1)
            if prio.shape != (n,):
                raise ValueError(f"replay priorities have shape {prio.shape}, expected ({n},)")
        indices = np.arange(self._added, self._added + n, dtype=np.int64)
        keep = slice(max(n - self.capacity, 0), n)  # rows that would be evicted at once are not written
        slots = indices[keep] % self.capacity
        for name, value in rows.items():
            self._data[name][slots] = value[keep].astype(self._data[name].dtype)
        self._priority[slots] = prio[keep]
        if n:
            self._max_priority = max(self._max_priority, float(prio.max()))
        self._added += n
        return indices

    def _check(self, rows: dict[str, np.ndarray]) -> int:
        if not rows:
            raise ValueError("replay add got no fields")
        sizes = {name: (v.shape[0] if v.ndim else None) for name, v in rows.items()}
        n = next(iter(sizes.values()))
        if n is None or any(s != n for s in sizes.values()):
            raise ValueError(f"replay fields need one leading row axis of equal size, got {sizes}")
        if not self._data:
            for name, value in rows.items():
                self._data[name] = np.zeros((self.capacity,) + value.shape[1:], _storage_dtype(name, value))
        if set(rows) != set(self._data):
            raise ValueError(f"replay fields {sorted(rows)} differ from the stored {sorted(self._data)}")
        for name, value in rows.items():
            if self._data[name].dtype == np.int32 and value.size and (value.min() < -2**31 or value.max() >= 2**31):
                raise ValueError(f"replay field {name!r} holds integers outside int32 [{value.min()}, {value.max()}]")
            want = self._data[name].shape[1:]
            if value.shape[1:] != want:
                raise ValueError(f"replay field {name!r} has shape {value.shape}, expected (n,) + {want}")
        return n

    def _probabilities(self) -> np.ndarray:
        p = (self._priority[: len(self)] + self.eps) ** self.alpha
        return p / p.sum()

    def _slot(self, indices: np.ndarray) -> np.ndarray:
        return np.asarray(indices, np.int64) % self.capacity

    def sample(self, batch_size: int, *, beta: float | None = None) -> Sample:
        """Draws batch_size rows with replacement, with probability P(i)."""
        size = len(self)
        if size == 0:
            raise ValueError("replay sample from an empty buffer")
        probs = self._probabilities()
        slots = np.minimum(np.searchsorted(np.cumsum(probs), self._rng.random(batch_size), side="right"), size - 1)
        beta = self.beta if beta is None else beta
        weights = (size * probs[slots]) ** -beta / (size * probs.min()) ** -beta
        # Slot s holds the row whose insertion index is the newest one congruent to s.
        newest = self._added - 1
        indices = newest - (newest - slots) % self.capacity
        data = {k: (v[slots].astype(np.float32) if v.dtype == BF16 else v[slots].copy()) for k, v in self._data.items()}
        return Sample(data, indices.astype(np.int64), weights.astype(np.float32))

    def update_priorities(self, indices: np.ndarray, priorities: np.ndarray) -> None:
        """Sets |priorities| [n] of the rows with insertion indices [n]; rows evicted since
        they were sampled are skipped."""
        indices = np.asarray(indices, np.int64).reshape(-1)
        prio = np.abs(np.asarray(priorities, np.float64)).reshape(-1)
        if prio.shape != indices.shape:
            raise ValueError(f"update_priorities got {indices.shape[0]} indices and {prio.shape[0]} priorities")
        if np.any((indices < 0) | (indices >= self._added)):
            raise ValueError(f"update_priorities: indices must lie in [0, {self._added}), got {indices}")
        live = indices >= self._added - len(self)
        self._priority[self._slot(indices[live])] = prio[live]
        if live.any():
            self._max_priority = max(self._max_priority, float(prio[live].max()))

    # Checkpointing: plain numpy arrays (bfloat16 as its uint16 bits, which np.savez and
    # orbax keep) and a JSON-serialisable dict.
    def state_dict(self) -> dict[str, Any]:
        arrays = {f"data/{k}": (v.view(np.uint16) if v.dtype == BF16 else v).copy() for k, v in self._data.items()}
        arrays["priority"] = self._priority.copy()
        meta = {"capacity": self.capacity, "alpha": self.alpha, "beta": self.beta, "eps": self.eps,
                "added": self._added, "max_priority": self._max_priority, "rng": self._rng.bit_generator.state,
                "dtypes": {k: str(v.dtype) for k, v in self._data.items()}}
        return {"arrays": arrays, "meta": meta}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        arrays, meta = state["arrays"], state["meta"]
        if int(meta["capacity"]) != self.capacity:
            raise ValueError(f"replay state has capacity {meta['capacity']}, this buffer {self.capacity}")
        self.alpha, self.beta, self.eps = float(meta["alpha"]), float(meta["beta"]), float(meta["eps"])
        self._added, self._max_priority = int(meta["added"]), float(meta["max_priority"])
        self._rng = np.random.default_rng()
        self._rng.bit_generator.state = meta["rng"]
        self._priority = np.array(arrays["priority"], np.float64)
        self._data = {}
        for name, dtype in meta["dtypes"].items():
            a = np.array(arrays[f"data/{name}"])
            self._data[name] = a.view(BF16) if dtype == "bfloat16" else a.astype(dtype)


class BatchReplay:
    """Prioritized replay in the RL loop (`rl.replay`): every learner batch carries `rows`
    stored rows beside its fresh ones, in rows the batch keeps free for them (one learner
    shape, with or without a full buffer).

        batch, weights, drawn = replay.fill(batch, fresh=B)   # rows B.. from the buffer
        learner.step(batch, row_weights=weights)
        replay.update(batch, learner.last_advantages, fresh=B, drawn=drawn)

    Fresh rows enter with priority = their mean |advantage| over action tokens
    (`mean_abs_priority`); drawn rows get theirs from this step's advantages. Drawn rows
    keep their behaviour log-probs, so SAO's importance ratio and strict band are the
    off-policy correction, and the buffer's importance weights w_i scale each row's loss.
    Each drawn row is a rollout of its own (negative rollout ids): a drawn segment of a
    compacted rollout bootstraps 0 past its end. The buffer is not checkpointed; a resumed
    run starts with it empty."""

    FIELDS = ("tokens", "action_mask", "logp_rollout", "versions", "rewards")

    def __init__(self, capacity: int = 1024, rows: int = 8, alpha: float = 0.6, beta: float = 0.4, seed: int = 0):
        if rows < 1 or capacity < rows:
            raise ValueError(f"rl.replay needs rows >= 1 and capacity >= rows, got rows={rows}, capacity={capacity}")
        self.rows = rows
        self.buffer = ReplayBuffer(capacity, alpha=alpha, beta=beta, seed=seed)

    def fill(self, batch, fresh: int):
        """The batch with its rows [fresh, fresh + rows) drawn from the buffer; the row
        weights [B] (1 on fresh rows, 0 on rows left empty); the drawn insertion indices."""
        b = batch.tokens.shape[0]
        if b != fresh + self.rows:
            raise ValueError(f"the batch has {b} rows, expected {fresh} fresh + {self.rows} for replay")
        weights = np.ones(b, np.float32)
        if len(self.buffer) == 0:
            weights[fresh:] = 0.0
            return batch, weights, None
        drawn = self.buffer.sample(self.rows)
        fields = {}
        for name in self.FIELDS:
            value = np.array(getattr(batch, name))
            value[fresh:] = drawn.data[name].astype(value.dtype)
            fields[name] = value
        ids = np.array(batch.rollout_id)
        ids[fresh:] = -1 - np.arange(self.rows)
        segments = np.array(batch.segment_index)
        segments[fresh:] = 0
        weights[fresh:] = drawn.weights
        batch = batch._replace(**{k: jnp.asarray(v) for k, v in fields.items()}, rollout_id=jnp.asarray(ids),
                               segment_index=jnp.asarray(segments))
        return batch, weights, drawn.indices

    def update(self, batch, advantages, fresh: int, drawn) -> None:
        prio = mean_abs_priority(np.asarray(advantages), np.asarray(batch.action_mask))
        live = np.asarray(batch.action_mask)[:fresh].sum(axis=1) > 0  # not the empty padding rows
        rows = {name: np.asarray(getattr(batch, name))[:fresh][live] for name in self.FIELDS}
        self.buffer.add(rows, prio[:fresh][live])
        if drawn is not None:
            self.buffer.update_priorities(drawn, prio[fresh:])
