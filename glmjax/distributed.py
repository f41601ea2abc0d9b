"""Multi-host runs through JAX's own distributed runtime.

Every process calls `initialize` once, before anything touches a device, then builds the
same mesh over `jax.devices()` (all processes' devices) and runs the same program:

    glmjax.distributed.initialize("10.0.0.1:1234", num_processes=16, process_id=rank)
    mesh = glmjax.make_mesh(fsdp=16, expert=8, tensor=4)

On TPU pods and GPU clusters with a scheduler (SLURM, GKE, Cloud TPU), the arguments can
be omitted: jax.distributed detects them. On CPUs, collectives go through gloo.
"""

from __future__ import annotations

import dataclasses
import math
import pickle

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, local_device_ids=None) -> None:
    if jax.config.jax_platforms in ("cpu",) or (jax.config.jax_platforms or "").startswith("cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id, local_device_ids=local_device_ids)


def global_array(host_data: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    """A global array from data every process holds in full (e.g. a seeded batch): each
    process places only the shards its devices own."""
    return jax.make_array_from_callback(host_data.shape, sharding, lambda index: host_data[index])


# A job's devices, from its config ----------------------------------------------------
# Every job config (configs/*.py) has three sections, overridable from the command line:
#   config.mesh         axis sizes, e.g. --config.mesh.fsdp=4 --config.mesh.expert=2 (all 1: one device)
#   config.rules        a mesh-axis target per logical axis, e.g. --config.rules.embed=fsdp
#                       ("a,b" for several axes, "" for replicated)
#   config.distributed  coordinator, num_processes, process_id (a multi-process run; on TPU
#                       pods and SLURM, num_processes=-1 lets jax.distributed detect them)


def mesh_section(**sizes: int):
    """`config.mesh`: every axis of glmjax.sharding.AXES, size 1 unless given."""
    import ml_collections

    from glmjax import sharding

    unknown = set(sizes) - set(sharding.AXES)
    if unknown:
        raise ValueError(f"mesh axes {sorted(unknown)} are unknown; axes are {sharding.AXES}")
    return ml_collections.ConfigDict({axis: int(sizes.get(axis, 1)) for axis in sharding.AXES})


def rules_section(rules=None):
    """`config.rules`: every logical axis of `rules` (default DEFAULT_RULES) as a string."""
    import ml_collections

    from glmjax import sharding

    spell = lambda t: "" if t is None else t if isinstance(t, str) else ",".join(t)  # noqa: E731
    return ml_collections.ConfigDict({name: spell(t) for name, t in (rules or sharding.DEFAULT_RULES)})


def distributed_section(coordinator: str = "", num_processes: int = 1, process_id: int = 0):
    """`config.distributed`: one process by default."""
    import ml_collections

    return ml_collections.ConfigDict(dict(coordinator=coordinator, num_processes=num_processes,
                                          process_id=process_id))


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """`config.distributed`: the processes of a multi-process run (one by default; -1 lets
    jax.distributed detect them on TPU pods and SLURM)."""

    coordinator: str = ""
    num_processes: int = 1
    process_id: int = 0

    def __post_init__(self):
        if self.num_processes == 0 or self.num_processes < -1:
            raise ValueError(f"distributed.num_processes={self.num_processes} is invalid: expected >= 1, or -1 "
                             "(detected)")
        if self.num_processes > 0 and not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"distributed.process_id={self.process_id} is invalid: expected 0.."
                             f"{self.num_processes - 1}")

    @classmethod
    def of(cls, cfg) -> DistributedConfig:
        """A job config's `distributed` section (the defaults without one)."""
        section = cfg["distributed"] if "distributed" in cfg else None
        if section is None:
            return cls()
        values = dict(section)
        unknown = sorted(set(values) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"config.distributed has unknown field(s) {unknown}; valid fields: coordinator, "
                             "num_processes, process_id")
        return cls(**values)


def job_rules(cfg):
    """The rules of a job config: DEFAULT_RULES with `config.rules`' values."""
    from glmjax import sharding

    given = dict(cfg.get("rules") or {})
    unknown = set(given) - {name for name, _ in sharding.DEFAULT_RULES}
    if unknown:
        raise ValueError(f"config.rules names {sorted(unknown)}, which are no logical axes; they are "
                         f"{[name for name, _ in sharding.DEFAULT_RULES]}")
    parse = lambda text: None if not text else tuple(a.strip() for a in text.split(","))  # noqa: E731
    return sharding.rules_from((name, parse(given[name]) if name in given else target)
                               for name, target in sharding.DEFAULT_RULES)


def _sizes(cfg) -> dict[str, int]:
    """`config.mesh` as {axis: size} over every axis ({} without a mesh section)."""
    from glmjax import sharding

    return {a: int(cfg.mesh.get(a, 1)) for a in sharding.AXES} if "mesh" in cfg else {}


def mesh_devices(cfg) -> int:
    """How many devices `config.mesh` spans (1 without a mesh section)."""
    return math.prod(_sizes(cfg).values())


def check_job(cfg) -> None:
    """Raises ValueError naming a `config.rules` entry or a `config.mesh` size that the job
    cannot use, before any work (in one process, where the devices are known already)."""
    job_rules(cfg)
    if "mesh" not in cfg:
        return
    sizes = _sizes(cfg)
    bad = [f"mesh.{a}={n}" for a, n in sizes.items() if n < 1]
    if bad:
        raise ValueError(f"config {', '.join(bad)}: mesh sizes must be >= 1")
    needed = mesh_devices(cfg)
    if DistributedConfig.of(cfg).num_processes == 1 and needed > len(jax.devices()):
        shown = ",".join(f"{a}={n}" for a, n in sizes.items() if n > 1)
        raise ValueError(f"config.mesh ({shown}) needs {needed} devices; {len(jax.devices())} are available")


def job_mesh(cfg):
    """(mesh, rules) of a job config, after starting the distributed runtime when
    `config.distributed` asks for several processes. The mesh spans every device of every
    process, or, in one process, the first devices it needs; None when every size is 1
    (one device, no sharding)."""
    from glmjax import sharding

    d = DistributedConfig.of(cfg)
    if d.num_processes != 1 and not jax.distributed.is_initialized():
        n = d.num_processes
        initialize(d.coordinator or None, None if n < 0 else n, None if n < 0 else d.process_id)
    rules = job_rules(cfg)
    sizes = _sizes(cfg)
    needed = mesh_devices(cfg)
    if needed == 1 and jax.process_count() == 1:
        return None, rules
    devices = jax.devices()
    if needed > len(devices) or (jax.process_count() > 1 and needed != len(devices)):
        shown = ",".join(f"{a}={n}" for a, n in sizes.items() if n > 1) or "1 device"
        want = f"to {len(devices)}" if jax.process_count() > 1 else f"to at most {len(devices)}"
        raise ValueError(f"config.mesh ({shown}) needs {needed} devices; {len(devices)} are available over "
                         f"{jax.process_count()} process(es): set the --config.mesh.<axis> sizes to multiply {want}")
    return sharding.make_mesh(**sizes, devices=devices[:needed]), rules


def describe(mesh) -> str:
    """"mesh fsdp=4, expert=2 of 8 cpu devices": what a job prints of where it runs."""
    axes = ", ".join(f"{a}={n}" for a, n in mesh.shape.items() if n > 1)
    if not axes:
        return f"one {mesh.devices.flat[0].platform} device"
    return f"mesh {axes} of {mesh.size} {mesh.devices.flat[0].platform} devices"


def batch_sharding(mesh, shape, rules=None) -> jax.sharding.NamedSharding:
    """Rows over the batch axes (the "batch" rule), every other dimension whole."""
    from glmjax import sharding

    names = ("batch",) + (None,) * (len(shape) - 1)
    return jax.sharding.NamedSharding(mesh, sharding.logical_spec(names, shape, mesh=mesh, rules=rules))


def global_batch(tree, mesh, rules=None, share: RowShare | None = None):
    """Host arrays as global arrays split by rows over the batch axes; `tree` itself without
    a mesh. Every process holds the whole batch, or with `share` only the rows its devices
    hold (RowShare.rows, in that order)."""
    if mesh is None:
        return tree
    if share is not None:
        return jax.tree.map(lambda x: share.place(np.asarray(x), mesh, rules), tree)
    return jax.tree.map(lambda x: global_array(np.asarray(x), batch_sharding(mesh, np.shape(x), rules)), tree)


@dataclasses.dataclass(frozen=True)
class RowShare:
    """The rows of a global batch of `total` rows that this process's devices hold under the
    batch axes: a process that fills exactly these rows with data it has (its own rollouts)
    builds its part of the global batch without any exchange.

        share = RowShare.of(mesh, total=256)
        global_batch(local_tree, mesh, share=share)       # local_tree: [len(share.rows), ...]
    """

    total: int
    rows: np.ndarray  # [R] the global row of each local row, increasing

    @classmethod
    def of(cls, mesh: Mesh, total: int, rules=None) -> RowShare:
        index = batch_sharding(mesh, (total,), rules).addressable_devices_indices_map((total,))
        held = sorted({r for idx in index.values() for r in range(*idx[0].indices(total))})
        return cls(total, np.asarray(held, np.int64))

    @property
    def disjoint(self) -> bool:
        """Whether the processes' rows partition the batch (the batch axes split rows across
        processes, evenly); otherwise a row is held by several processes, which must then
        hold the same data for it."""
        return len(self.rows) * jax.process_count() == self.total

    def place(self, local: np.ndarray, mesh: Mesh, rules=None) -> jax.Array:
        """local [len(rows), ...] -> the global array [total, ...]: each device of this
        process takes its rows from `local`."""
        if local.shape[0] != len(self.rows):
            raise ValueError(f"RowShare.place: {local.shape[0]} rows given, this process holds {len(self.rows)}")
        shape = (self.total,) + local.shape[1:]

        def piece(index):
            rows = np.arange(self.total)[index[0]]
            return local[(np.searchsorted(self.rows, rows),) + tuple(index[1:])]

        return jax.make_array_from_callback(shape, batch_sharding(mesh, shape, rules), piece)


# Several processes in one job ---------------------------------------------------------
# The RL job runs a rollout engine per process on that process's own devices (its
# generation then issues no collective and runs in a background thread), or one engine over
# every process's devices that all step in lockstep from their main threads
# (rl/engine/lockstep.py). Everything the processes must agree on (the metrics, the
# checkpoint step, a lockstep step's requests) goes through `gather_objects` at the same
# point of every process's loop; the learner's batch does not: each process fills the rows
# its devices hold with its own rollouts (RowShare).


def is_main() -> bool:
    """Whether this process writes the job's logs, metrics and summary (process 0)."""
    return jax.process_index() == 0


def gather_objects(obj) -> list:
    """Every process's `obj` (any picklable value), in process order, on every process. A
    collective: every process calls it at the same point of its program."""
    if jax.process_count() == 1:
        return [obj]
    data = np.frombuffer(pickle.dumps(obj), np.uint8)
    # one exchange of the size and the first _INLINE bytes; a second only for what is longer
    head = np.zeros(8 + _INLINE, np.uint8)
    head[:8] = np.frombuffer(np.int64(data.size).tobytes(), np.uint8)
    head[8:8 + min(data.size, _INLINE)] = data[:_INLINE]
    heads = multihost_utils.process_allgather(head)
    sizes = [int(np.frombuffer(h[:8].tobytes(), np.int64)[0]) for h in heads]
    rows = heads[:, 8:]
    if max(sizes) > _INLINE:
        rest = np.zeros(max(sizes) - _INLINE, np.uint8)
        rest[:max(data.size - _INLINE, 0)] = data[_INLINE:]
        rows = np.concatenate([rows, multihost_utils.process_allgather(rest)], axis=1)
    return [pickle.loads(rows[i, :n].tobytes()) for i, n in enumerate(sizes)]


_INLINE = 2048  # bytes of each process's value sent with its size (a lockstep step's requests, usually)


def broadcast_object(obj):
    """Process 0's `obj` on every process: what they must decide alike (which checkpoint
    step to read, whether a cache exists) decided once. A collective, as `gather_objects`."""
    return gather_objects(obj if is_main() else None)[0]


def failures(reason: str | None) -> list[tuple[int, str]]:
    """Every process's outcome of a host-local attempt (reading a checkpoint, a cache), so
    that all act on one answer: `reason` is None where this process succeeded, else why it
    failed; returns [(process, reason)] of the processes that failed, [] when none did. A
    collective, as `gather_objects`: a failure on one host becomes every host's decision
    instead of a host that goes its own way while the others wait for it."""
    return [(i, r) for i, r in enumerate(gather_objects(reason)) if r is not None]


def describe_failures(failures: list[tuple[int, str]]) -> str:
    """`failures`' reasons on one line, each named by its process when there are several."""
    return "; ".join(why if jax.process_count() == 1 else f"process {i}: {why}" for i, why in failures)


def process_meshes(mesh: Mesh) -> list[Mesh]:
    """Each process's devices in `mesh` as a mesh of the same axes: the block of the device
    grid they form, its sizes those of `mesh` divided where the processes split an axis
    (fsdp=4 over 2 processes of 4 devices: fsdp=2 each). `[mesh]` in one process. Raises
    when a process's devices are no block (a mesh built on another device order)."""
    owner = np.vectorize(lambda d: d.process_index, otypes=[int])(mesh.devices)
    blocks = []
    for p in range(jax.process_count()):
        mine = owner == p
        index = np.ix_(*[np.flatnonzero(mine.any(axis=tuple(b for b in range(mine.ndim) if b != a)))
                         for a in range(mine.ndim)])
        if not mine[index].all() or mine[index].sum() != mine.sum():
            raise ValueError(f"{describe(mesh)}: the devices of process {p} are not one block of the mesh; build it "
                             "with glmjax.make_mesh over jax.devices(), whose order is process by process")
        blocks.append(Mesh(mesh.devices[index], mesh.axis_names, axis_types=mesh.axis_types))
    return blocks


def local_mesh(mesh: Mesh) -> Mesh:
    """This process's block of `mesh` (`process_meshes`); `mesh` itself in one process."""
    return process_meshes(mesh)[jax.process_index()]
