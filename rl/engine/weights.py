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
     for shard, device to device;
  3. when the learner spans several processes and each process runs an engine on its own
     devices (rl/trainer.py), one jitted identity reshards the state into a layout that
     repeats the engine's split in every process's block of devices, and each process
     keeps the shards on its own devices as the engine's arrays
     (`jax.make_array_from_single_device_arrays`: no copy). Every process publishes.

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


def _repeated_per_process(state_mesh: Mesh, target: NamedSharding) -> NamedSharding:
    """`target` (on this process's devices) repeated over every process's block of
    `state_mesh`: a mesh with a leading "process" axis, replicated along it."""
    from glmjax.distributed import process_meshes

    blocks = process_meshes(state_mesh)
    mine = blocks[jax.process_index()]
    if mine.devices.shape != target.mesh.devices.shape or (mine.devices != target.mesh.devices).any():
        raise ValueError(f"WeightStore: the readers' mesh {dict(target.mesh.shape)} is not this process's block "
                         f"{dict(mine.shape)} of the learner's mesh; build it with glmjax.distributed.local_mesh")
    mesh = Mesh(np.stack([b.devices for b in blocks]), ("process",) + tuple(target.mesh.axis_names))
    return NamedSharding(mesh, target.spec, memory_kind=target.memory_kind)


def _to_process_local(state: Any, shardings: Any) -> Any:
    """Step 3 of the module docstring."""
    leaves = jax.tree.leaves(state)
    state_mesh = next(x.sharding.mesh for x in leaves if isinstance(x.sharding, NamedSharding))
    views = jax.tree.map(lambda s: _repeated_per_process(state_mesh, s), shardings)
    out = jax.jit(_identity, out_shardings=views)(state)
    treedef = jax.tree.structure(shardings)  # a prefix of the state's: a Variable holds each array
    own = lambda x, s: jax.make_array_from_single_device_arrays(  # noqa: E731
        x.shape, s, [shard.data for shard in x.addressable_shards])
    return treedef.unflatten([jax.tree.map(lambda x, s=s: own(x, s), part)
                              for s, part in zip(jax.tree.leaves(shardings), treedef.flatten_up_to(out))])


def reshard(state: Any, shardings: Any) -> Any:
    """`state` copied into `shardings` (a pytree of NamedSharding matching it) device to
    device: steps 1 to 3 of the module docstring."""
    if (jax.process_count() > 1 and all(s.is_fully_addressable for s in jax.tree.leaves(shardings))
            and not all(x.is_fully_addressable for x in jax.tree.leaves(state))):
        return _to_process_local(state, shardings)
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
        return reshard(state, self.shardings) if self.copies(state) else state

    def copies(self, state: Any) -> bool:
        """Whether publishing `state` stores a copy of it (resharded), not its arrays: then
        the publisher may update those arrays in place (rl/learner.py: donate_policy)."""
        return self.shardings is not None and not has_shardings(state, self.shardings)

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
