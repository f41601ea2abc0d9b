"""WeightStore: the versioned parameters that the learner publishes and the engines read.

When learner and rollout engine share one parameter layout (the `nnx.State` of one
`GlmForCausalLM` in the same shardings), publishing new weights is a reference swap:
`publish` stores the new pytree and its version as one immutable `Weights` tuple, copying
and converting nothing. When the engine runs in a layout of its own (another mesh, or
other rules on the same devices), the store is given the engine's shardings and `publish`
reshards each new state into them inside XLA, never through the host:

  1. a jitted identity with `out_shardings` moves the arrays into the engine's split on
     the learner's own devices (XLA's collectives; nothing moves when the splits agree);
  2. when the engine's devices are others (a disjoint subset, as many as the learner's),
     `jax.device_put` copies each shard to the engine device of the same position, shard
     for shard, device to device.

`jax.device_put` alone would not do: a shard of the new split that no old shard equals is
assembled on the host.

Readers take `latest()` once per engine step; every token that step produces carries that
version. Reading and swapping one attribute is atomic in CPython, so readers need no
lock; the lock only orders concurrent publishers and wakes `wait_for`.

    store = WeightStore(nnx.state(model))            # version 0
    store.publish(nnx.state(model), version=1)       # O(1): no copy
    weights = store.latest()                         # Weights(state, version)

    engine_shardings = glmjax.sharding.param_shardings(state, engine_mesh)
    store = WeightStore(nnx.state(model), shardings=engine_shardings)
    store.publish(nnx.state(model))                  # resharded into engine_shardings
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding


class Weights(NamedTuple):
    """One published version: the parameter pytree and its policy version."""

    state: Any  # nnx.State (or any pytree of arrays) of the model's variables
    version: int


def has_shardings(state: Any, shardings: Any) -> bool:
    """Whether every array of `state` is laid out as `shardings` (a pytree of
    jax.sharding.Sharding matching `state`, or a prefix of it) says: same devices and the
    same split, whatever the spelling of the PartitionSpec."""
    try:
        parts = jax.tree.structure(shardings).flatten_up_to(state)
    except (TypeError, ValueError) as e:
        raise ValueError(f"WeightStore: the shardings must be a pytree matching the state, got "
                         f"{jax.tree.structure(shardings)} for {jax.tree.structure(state)}") from e
    return all(isinstance(x, jax.Array) and x.sharding.is_equivalent_to(target, x.ndim)
               for target, part in zip(jax.tree.leaves(shardings), parts) for x in jax.tree.leaves(part))


def _identity(tree):
    return tree


def _on_devices(target: NamedSharding, devices: list) -> NamedSharding:
    """`target`'s split over `devices` instead of its own: a mesh of the same shape and
    axes, the i-th device of `devices` in the place of the i-th of target's mesh."""
    mesh = target.mesh
    if set(mesh.devices.flat) == set(devices):
        return target
    if mesh.size != len(devices):
        raise ValueError(f"WeightStore: resharding onto other devices needs as many of them as the state "
                         f"is on; the target mesh {dict(mesh.shape)} has {mesh.size} devices, the state "
                         f"is on {len(devices)}")
    staged = Mesh(np.asarray(devices).reshape(mesh.devices.shape), mesh.axis_names, axis_types=mesh.axis_types)
    return NamedSharding(staged, target.spec, memory_kind=target.memory_kind)


def reshard(state: Any, shardings: Any) -> Any:
    """`state` copied into `shardings` (a pytree of NamedSharding matching it) device to
    device: steps 1 and 2 of the module docstring."""
    devices = sorted({d for x in jax.tree.leaves(state) for d in x.devices()}, key=lambda d: d.id)
    staged = jax.tree.map(lambda s: _on_devices(s, devices), shardings)
    out = jax.jit(_identity, out_shardings=staged)(state)
    return out if staged == shardings else jax.device_put(out, shardings)


class WeightStore:
    def __init__(self, state: Any, version: int = 0, *, shardings: Any = None):
        """state: version 0. shardings: the readers' layout, a pytree of NamedSharding
        matching the state (e.g. `glmjax.sharding.param_shardings(state, engine_mesh)`);
        every state stored, version 0 included, is placed in it. None: states are stored
        as given."""
        self.shardings = shardings
        self._current = Weights(self._place(state), int(version))
        self._changed = threading.Condition()

    def latest(self) -> Weights:
        """The newest (state, version); never blocks."""
        return self._current

    @property
    def version(self) -> int:
        return self._current.version

    def _place(self, state: Any) -> Any:
        """`state` itself when the store has no shardings or the state already has them;
        otherwise its copy in them."""
        if self.shardings is None or has_shardings(state, self.shardings):
            return state
        return reshard(state, self.shardings)

    def publish(self, state: Any, version: int | None = None) -> int:
        """Makes `state` the newest weights: by reference in the store's shardings (or
        without any), else resharded into them. version defaults to the current one plus 1
        and must increase. Returns the version published.

        The copy is dispatched asynchronously; readers' computations wait for it on the
        devices."""
        placed = self._place(state)
        with self._changed:
            new = self._current.version + 1 if version is None else int(version)
            if new <= self._current.version:
                raise ValueError(f"WeightStore.publish: version must increase, got {new} after "
                                 f"{self._current.version}")
            self._current = Weights(placed, new)
            self._changed.notify_all()
        return new

    def wait_for(self, version: int, timeout: float | None = None) -> Weights:
        """Blocks until a version >= `version` is published (or the timeout passes) and
        returns the newest weights."""
        with self._changed:
            self._changed.wait_for(lambda: self._current.version >= version, timeout)
            return self._current
