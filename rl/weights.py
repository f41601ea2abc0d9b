"""WeightStore: the versioned parameters that the learner publishes and the engines read.

Learner and rollout engine share one parameter layout (the `nnx.State` of one
`GlmForCausalLM`), so publishing new weights is a reference swap: `publish` stores the
new pytree and its version as one immutable `Weights` tuple, copying and converting
nothing. Readers take `latest()` once per engine step; every token that step produces
carries that version. Reading and swapping one attribute is atomic in CPython, so readers
need no lock; the lock only orders concurrent publishers and wakes `wait_for`.

    store = WeightStore(nnx.state(model))            # version 0
    store.publish(nnx.state(model), version=1)       # O(1): no copy
    weights = store.latest()                         # Weights(state, version)
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple


class Weights(NamedTuple):
    """One published version: the parameter pytree and its policy version."""

    state: Any  # nnx.State (or any pytree of arrays) of the model's variables
    version: int


class WeightStore:
    def __init__(self, state: Any, version: int = 0):
        self._current = Weights(state, int(version))
        self._changed = threading.Condition()

    def latest(self) -> Weights:
        """The newest (state, version); never blocks."""
        return self._current

    @property
    def version(self) -> int:
        return self._current.version

    def publish(self, state: Any, version: int | None = None) -> int:
        """Makes `state` the newest weights, by reference. version defaults to the current
        one plus 1 and must increase. Returns the version published."""
        with self._changed:
            new = self._current.version + 1 if version is None else int(version)
            if new <= self._current.version:
                raise ValueError(f"WeightStore.publish: version must increase, got {new} after "
                                 f"{self._current.version}")
            self._current = Weights(state, new)
            self._changed.notify_all()
        return new

    def wait_for(self, version: int, timeout: float | None = None) -> Weights:
        """Blocks until a version >= `version` is published (or the timeout passes) and
        returns the newest weights."""
        with self._changed:
            self._changed.wait_for(lambda: self._current.version >= version, timeout)
            return self._current
