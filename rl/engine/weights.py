"""WeightStore: the versioned parameters that the learner publishes and the engines read.

When learner and rollout engine share one parameter layout (the `nnx.State` of one
`GlmForCausalLM` in the same shardings), publishing new weights is a reference swap:
`publish` stores the new pytree and its version as one immutable `Weights` tuple, copying
and converting nothing. When the engine runs in a layout of its own (another mesh, or
other rules on the same devices), the store is given the engine's shardings and `publish`
reshards each new state into them inside XLA, never through the host:

  1. a jitted copy (`reshard_program`) moves the arrays into the engine's split on the
     learner's own devices: through a split that gives each device a distinct piece of its
     target block (an all-to-all), then all-gathers of the rest of the block, one mesh axis
     at a time, because XLA's direct reshard between unrelated splits gathers whole tensors
     and slices them;
  2. when the engine's devices are others (a disjoint subset, as many as the learner's),
     `jax.device_put` copies each shard to the engine device of the same position, shard
     for shard, device to device;
  3. when the learner spans several processes and each process runs an engine on its own
     devices (rl/trainer.py), one jitted identity reshards the state into a layout that
     repeats the engine's split in every process's block of devices, and each process
     keeps the shards on its own devices as the engine's arrays
     (`jax.make_array_from_single_device_arrays`: no copy). Every process publishes.
  4. engine groups (rl/engine/groups.py) that split the learner's devices into blocks, one
     engine per block: the same as 3, with the groups for the processes
     (`reshard_to_groups`), so that one jitted identity gives every group its weights and
     each device receives only the shards its group's engine holds there.

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

import itertools
import math
import threading
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec


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


def _repeated(blocks: list[Mesh], target: NamedSharding, order: list | None = None) -> NamedSharding:
    """`target`'s split repeated over every block: a mesh with a "group" axis, replicated
    along it, so that each block's devices hold what `target` gives the same position of
    its own mesh. `order`: the devices of the arrays to reshard, in their order, which a
    jitted program's outputs must keep; the axes are arranged to give it."""
    devices = np.stack([b.devices for b in blocks])
    names = ("group",) + tuple(target.mesh.axis_names)
    if order is not None:
        ids = [d.id for d in order]
        for perm in itertools.permutations(range(devices.ndim)):
            if [d.id for d in np.transpose(devices, perm).flat] == ids:
                devices, names = np.transpose(devices, perm), tuple(names[i] for i in perm)
                break
    return NamedSharding(Mesh(devices, names), target.spec, memory_kind=target.memory_kind)


def _refined(view: NamedSharding, source: jax.Array) -> list[NamedSharding]:
    """The splits from `source`'s to `view` (a group-repeated split): first `view` with
    every mesh axis it leaves replicated ("group" first) added to a dimension it divides,
    the one `source` is split along most first, so that each device holds a distinct piece
    of its own target block. Reaching it from the learner's split is an all-to-all; XLA's
    direct reshard would gather whole tensors and slice them. Then those axes dropped one
    at a time, the last added first: each an all-gather over one mesh axis. (XLA:TPU turns
    one gather over a group of every chip of a v5p slice into an all-reduce of a
    zero-padded buffer, which moves twice the bytes; over one axis of 64 chips it stays an
    all-gather.)"""
    mesh, shape = view.mesh, source.shape
    spec = [() if s is None else (s,) if isinstance(s, str) else tuple(s)
            for s in list(view.spec) + [None] * (len(shape) - len(view.spec))]
    held = source.sharding.shard_shape(shape)
    order = sorted(range(len(shape)), key=lambda i: held[i] / max(shape[i], 1))  # most split first
    used, added = {a for s in spec for a in s}, []
    for axis in [a for a in mesh.axis_names if a not in used and mesh.shape[a] > 1]:
        for i in order:
            if shape[i] % (math.prod(mesh.shape[a] for a in spec[i]) * mesh.shape[axis]) == 0:
                spec[i] = spec[i] + (axis,)
                added.append(i)
                break
    splits = []
    for i in [None] + added[::-1]:
        if i is not None:
            spec[i] = spec[i][:-1]  # the dimension's minor-most axis: a plain all-gather
        splits.append(NamedSharding(mesh, PartitionSpec(*[s or None for s in spec]), memory_kind=view.memory_kind))
    return splits[:-1]  # the last is `view` itself: the program's output


_PROGRAMS: dict = {}  # reshard_program's, by the state's structure and layout and the target's


def reshard_program(state: Any, views: Any, donate: bool = False):
    """The jitted copy of `state` (arrays, or ShapeDtypeStructs with shardings) into `views`
    (a pytree of NamedSharding on the same devices, a prefix of the state's), through each
    leaf's `_refined` splits: an all-to-all, then all-gathers of the rest of each block,
    one mesh axis at a time.
    Built once per layout: every publish runs the same compiled program. With `donate` it
    takes a second argument, the readers' previous state in `views`, whose buffers it
    reuses for its output: the old and the new copy are never both held."""
    key = (jax.tree.structure(state), tuple((x.shape, x.dtype, x.sharding) for x in jax.tree.leaves(state)),
           jax.tree.structure(views), tuple(jax.tree.leaves(views)), donate)
    if key not in _PROGRAMS:
        _PROGRAMS[key] = _build_program(state, views, donate)
    return _PROGRAMS[key]


def _build_program(state: Any, views: Any, donate: bool = False):
    treedef = jax.tree.structure(views)  # a prefix of the state's: a Variable holds each array
    chains = [_refined(v, x) for v, part in zip(jax.tree.leaves(views), treedef.flatten_up_to(state))
              for x in jax.tree.leaves(part)]  # in the order of the state's leaves

    def move(tree):
        leaves, structure = jax.tree.flatten(tree)
        for k, chain in enumerate(chains):
            for split in chain:
                leaves[k] = jax.lax.with_sharding_constraint(leaves[k], split)
        return structure.unflatten(leaves)

    if donate:
        return jax.jit(lambda tree, previous: move(tree), out_shardings=views, donate_argnums=(1,),
                       keep_unused=True)
    return jax.jit(move, out_shardings=views)


def _group_views(state: Any, shardings: list[Any]):
    """(the jitted reshard of step 4, its output shardings), built once per layout."""
    key = (jax.tree.structure(state), tuple((x.shape, x.dtype, x.sharding) for x in jax.tree.leaves(state)),
           tuple(tuple(jax.tree.leaves(group)) for group in shardings))
    if key not in _PROGRAMS:
        _PROGRAMS[key] = _build_group_views(state, shardings)
    return _PROGRAMS[key]


def _build_group_views(state: Any, shardings: list[Any]):
    meshes = [next(s.mesh for s in jax.tree.leaves(group)) for group in shardings]
    if len({m.devices.shape for m in meshes}) != 1:
        raise ValueError(f"engine groups must have meshes of one shape, got {[dict(m.shape) for m in meshes]}")
    held = {d for x in jax.tree.leaves(state) for d in x.sharding.device_set}
    grouped = [d for m in meshes for d in m.devices.flat]
    if set(grouped) != held or len(grouped) != len(held):
        raise ValueError(f"the engine groups' devices ({len(grouped)}) must be the learner's ({len(held)}), each "
                         "in one group")
    order = next(list(x.sharding.mesh.devices.flat) for x in jax.tree.leaves(state)
                 if isinstance(x.sharding, NamedSharding))
    views = jax.tree.map(lambda s: _repeated(meshes, s, order), shardings[0])
    return reshard_program(state, views), views


def reshard_to_groups(state: Any, shardings: list[Any]) -> list[Any]:
    """`state` (on the devices that the groups' meshes partition) copied into every group's
    shardings (one pytree of NamedSharding per group, on meshes of one shape), inside one
    XLA program: step 4 of the module docstring. Returns one state per group."""
    program, views = _group_views(state, shardings)
    out = program(state)
    treedef = jax.tree.structure(views)  # a prefix of the state's: a Variable holds each array
    parts = treedef.flatten_up_to(out)
    placed = []
    for group in shardings:
        def own(x, s):  # the shards on this group's devices (this process's of them), as an array of its mesh
            mine = {shard.device: shard.data for shard in x.addressable_shards}
            return jax.make_array_from_single_device_arrays(x.shape, s, [mine[d] for d in s.mesh.devices.flat
                                                                         if d in mine])
        placed.append(treedef.unflatten([jax.tree.map(lambda x, s=s: own(x, s), part)
                                         for s, part in zip(jax.tree.leaves(group), parts)]))
    return placed


def groups_publish_hlo(state: Any, shardings: list[Any]) -> str:
    """The compiled HLO of `reshard_to_groups(state, shardings)`'s program (for its bytes:
    rl/hlo_collectives.py)."""
    program, _ = _group_views(state, shardings)
    return program.lower(state).compile().as_text()


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


def reshard(state: Any, shardings: Any, previous: Any = None) -> Any:
    """`state` copied into `shardings` (a pytree of NamedSharding matching it) device to
    device: steps 1 to 3 of the module docstring. `previous`: a state in `shardings` whose
    buffers the copy may take (it is deleted) when it is made on the same devices."""
    if (jax.process_count() > 1 and all(s.is_fully_addressable for s in jax.tree.leaves(shardings))
            and not all(x.is_fully_addressable for x in jax.tree.leaves(state))):
        return _to_process_local(state, shardings)
    devices = sorted({d for x in jax.tree.leaves(state) for d in x.devices()}, key=lambda d: d.id)
    staged = jax.tree.map(lambda s: _on_devices(s, devices), shardings)
    same_devices = jax.tree.leaves(staged) == jax.tree.leaves(shardings)
    if previous is not None and same_devices:
        return reshard_program(state, staged, donate=True)(state, previous)
    out = reshard_program(state, staged)(state)
    return out if same_devices else jax.device_put(out, shardings)


class WeightStore:
    def __init__(self, state: Any, version: int = 0, *, shardings: Any = None, donate_previous: bool = False):
        """state: version 0. shardings: the readers' layout, a pytree of NamedSharding
        matching the state (e.g. `glmjax.sharding.param_shardings(state, engine_mesh)`);
        every state stored, version 0 included, is placed in it. None: states are stored
        as given. donate_previous: a publish that copies reuses the previous copy's buffers
        (which are deleted), so that a device never holds both: only where no reader can be
        in the middle of a step with them (an engine stepped from the publisher's own
        thread, rl/engine/lockstep.py)."""
        self.shardings, self.donate_previous = shardings, donate_previous
        self._current = Weights(self._place(state), int(version))
        self._changed = threading.Condition()

    def latest(self) -> Weights:
        """The newest (state, version); never blocks."""
        return self._current

    @property
    def version(self) -> int:
        return self._current.version

    def _place(self, state: Any, previous: Any = None) -> Any:
        """`state` itself when the store has no shardings or the state already has them;
        otherwise its copy in them (into `previous`'s buffers, when given)."""
        return reshard(state, self.shardings, previous) if self.copies(state) else state

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
        previous = self._current.state if self.donate_previous and self.copies(state) else None
        placed = self._place(state, previous)
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
