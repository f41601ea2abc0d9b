"""Engine groups: G rollout engines over blocks of the learner's devices, one router in
front of them, a watchdog that notices a group that fails or stalls and rebuilds it.

    groups = EngineGroups.build(policy, learner_mesh, count=2, sizes={"expert": 2, "tensor": 2},
                                rules=sharding.DECODE_RULES, max_concurrent_decodes=64, max_len=4096)
    groups.start()
    handle = groups.submit(Request(prompt, 256))   # to the group with a free slot
    groups.store.publish(nnx.state(policy))        # every group's weights, one XLA program

Devices: the learner's N devices, in the learner mesh's order, are laid out as the grid
(first engine axis, G, the other engine axes) of the engine mesh `sizes` (which multiply
to N / G), and group g is the slice [:, g, ...]: the groups interleave along the first
engine axis. Publishing (rl/engine/weights.py: reshard_to_groups) then moves each
parameter from the learner's split to every group's with an all-to-all inside each
stretch of devices that shares an expert block and an all-gather across the groups, and
no permutation between them; each device receives less than its share of the engine's
parameters (0.79x on configs/small.py: `benchmarks/sharding_bench.py`, `publish_groups`).

Scheduling is the router's (rl/engine/router.py): the queue is one, and a group takes the
next request the moment it has a free slot (least loaded first).

Health: every `check_seconds` the watchdog looks at each group's driver. One whose thread
is no longer running ("stopped"), or that, having completed a step since it was built,
held requests for `stall_seconds` without completing another while not paused ("stalled";
before its first step it may be compiling), has failed: its requests in flight end
with finish_reason "error" and an error that starts with "UNAVAILABLE: engine group"
(the collector drops their rollouts as "engine_group_failed"), and a new driver over the
same engine (an empty decode state) takes its place; the router, which marked the group
down on those errors, gives it work again once the new driver answers its health check.
The other groups go on throughout. `failures` counts the causes.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

import numpy as np
from flax import nnx

from glmjax import sharding
from rl.engine.driver import Driver, Handle, Request, Result
from rl.engine.engine import GlmEngine
from rl.engine.router import Router
from rl.engine.weights import WeightStore, Weights, reshard_to_groups

DOWN = "UNAVAILABLE: engine group"  # how the requests of a failed group end


def group_meshes(mesh, count: int, sizes: dict[str, int]) -> list:
    """The groups' meshes over `mesh`'s devices (module docstring: interleaved along the
    first engine axis)."""
    devices = list(mesh.devices.flat)
    axes = [(a, n) for a, n in sizes.items() if n > 1] or [("tensor", 1)]
    per_group = int(np.prod([n for _, n in axes]))
    if per_group * count != len(devices):
        shown = ",".join(f"{a}={n}" for a, n in sizes.items())
        raise ValueError(f"rl.engine_groups={count} groups of rl.engine_mesh={shown!r} ({per_group} devices each) "
                         f"must cover the learner's {len(devices)} devices exactly")
    grid = np.asarray(devices, dtype=object).reshape(axes[0][1], count, *[n for _, n in axes[1:]])
    return [sharding.make_mesh(**sizes, devices=list(np.take(grid, g, axis=1).flat)) for g in range(count)]


def build_engines(policy, mesh, count: int, sizes: dict[str, int], rules,
                  **engine_kwargs) -> tuple[list[GlmEngine], GroupStore]:
    """`count` engines of `policy` (whose state is on `mesh`), each over its block
    (`group_meshes`) in `rules`, and the store that publishes to all of them;
    engine_kwargs go to every GlmEngine. Behind a Router in one process (EngineGroups), or
    stepped by every process when the blocks span processes (rl/engine/lockstep.py)."""
    state = nnx.state(policy)
    meshes = group_meshes(mesh, count, sizes)
    shardings = [sharding.param_shardings(state, m, rules) for m in meshes]
    stores = [WeightStore(part, shardings=s) for part, s in zip(reshard_to_groups(state, shardings), shardings)]
    engines = [GlmEngine(policy, weights=store, mesh=m, rules=rules, **engine_kwargs)
               for store, m in zip(stores, meshes)]
    return engines, GroupStore(stores)


class GroupStore:
    """The WeightStore interface over every group's store: `publish` reshards the learner's
    state into all groups at once (rl/engine/weights.py: reshard_to_groups)."""

    def __init__(self, stores: list[WeightStore]):
        self.stores = stores

    def latest(self) -> Weights:
        return self.stores[0].latest()

    @property
    def version(self) -> int:
        return self.stores[0].version

    def copies(self, state: Any) -> bool:
        return True  # each group holds arrays of its own

    def publish(self, state: Any, version: int | None = None) -> int:
        placed = reshard_to_groups(state, [s.shardings for s in self.stores])
        version = self.version + 1 if version is None else int(version)
        for store, part in zip(self.stores, placed):
            store.publish(part, version)
        return version


class EngineGroups:
    """G engines and their drivers behind one Router, with the watchdog of the module
    docstring. Offers the Driver's interface (submit, validate, step, start, stop, pause,
    resume, load, capacity, stats, engine) so that the RL job's collector and evaluations
    take it in place of one driver."""

    def __init__(self, engines: list[GlmEngine], store: GroupStore, *, stall_seconds: float = 120.0,
                 check_seconds: float = 0.5):
        self.engines, self.store = engines, store
        self.drivers = [Driver(e) for e in engines]
        self.router = Router(self.drivers, backoff=check_seconds)
        self.stall_seconds, self.check_seconds = stall_seconds, check_seconds
        self.failures: collections.Counter = collections.Counter()
        self.dropped_in_flight = 0
        self._retired: collections.Counter = collections.Counter()  # stats of the drivers replaced
        self._progress = [(0, time.time())] * len(engines)  # (steps, when they last changed) per group
        self._paused = False
        self._watchdog: threading.Thread | None = None
        self._stopping = threading.Event()

    @classmethod
    def build(cls, policy, mesh, count: int, sizes: dict[str, int], rules, *, stall_seconds: float = 120.0,
              **engine_kwargs) -> EngineGroups:
        """`count` engines of `policy` (whose state is on `mesh`), each over its block
        (`group_meshes`) in `rules`; engine_kwargs go to every GlmEngine."""
        engines, store = build_engines(policy, mesh, count, sizes, rules, **engine_kwargs)
        return cls(engines, store, stall_seconds=stall_seconds)

    # The Driver's interface ------------------------------------------------------------
    @property
    def engine(self) -> GlmEngine:
        return self.engines[0]

    @property
    def capacity(self) -> int:
        return self.router.capacity

    @property
    def queued(self) -> int:
        return self.router.queued

    @property
    def active(self) -> int:
        return self.router.active

    @property
    def load(self) -> int:
        return self.queued + self.active

    @property
    def running(self) -> bool:
        return self._watchdog is not None

    @property
    def stats(self) -> collections.Counter:
        return pooled_stats(self._retired, self.drivers)

    def validate(self, request: Request) -> None:
        self.drivers[0].validate(request)

    def submit(self, request: Request) -> Handle:
        return self.router.submit(request)

    def step(self) -> bool:
        """One step of every group that has work, in this thread (before `start`)."""
        for d in self.drivers:
            if d.load:
                d.step()
        return self.load > 0

    def start(self) -> EngineGroups:
        for d in self.drivers:
            d.start()
        if self._watchdog is None:
            self._stopping.clear()
            self._progress = [(d.stats["steps"], time.time()) for d in self.drivers]
            self._watchdog = threading.Thread(target=self._watch, name="glmjax-engine-groups", daemon=True)
            self._watchdog.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        if self._watchdog is not None:
            self._watchdog.join()
            self._watchdog = None
        self.router.stop()

    def pause(self) -> None:
        self._paused = True
        for d in self.drivers:
            d.pause()

    def resume(self) -> None:
        self._paused = False
        now = time.time()
        self._progress = [(steps, now) for steps, _ in self._progress]  # a pause is not a stall
        for d in self.drivers:
            d.resume()

    def utilisation(self) -> dict:
        return utilisation(self.router.dispatched, self.drivers, self.failures, self.dropped_in_flight)

    # Health ----------------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._stopping.wait(self.check_seconds):
            for g, d in enumerate(self.drivers):
                cause = self._health(g, d)
                if cause is not None:
                    self._rebuild(g, cause)

    def _health(self, g: int, d: Driver) -> str | None:
        if not d.running:
            return "stopped"
        steps, since = self._progress[g]
        now = time.time()
        # before its first step a group may be compiling (minutes at full size): not a stall
        if d.stats["steps"] != steps or self._paused or not d.load or not d.stats["steps"]:
            self._progress[g] = (d.stats["steps"], now)
            return None
        return "stalled" if now - since > self.stall_seconds else None

    def _rebuild(self, g: int, cause: str) -> None:
        """Group g failed (`cause`): a new driver over its engine takes its place, and the
        old one's requests end as UNAVAILABLE (module docstring)."""
        old = self.drivers[g]
        new = Driver(self.engines[g])
        if self._paused:
            new.pause()
        new.start()
        self.router.replace(g, new)
        self.drivers[g] = new
        pending = old.abandon()
        self._retired.update(old.stats)
        self.failures[cause] += 1
        self.dropped_in_flight += len(pending)
        self._progress[g] = (0, time.time())
        error = f"{DOWN} {g} {cause}: its requests in flight are dropped and the group is rebuilt"
        for handle in pending:
            handle._finish(Result([], [], [], "error", len(handle.request.prompt), error=error))


def pooled_stats(retired: collections.Counter, drivers: list[Driver]) -> collections.Counter:
    """The drivers' counters summed, with those of the drivers they replaced."""
    total = collections.Counter(retired)
    for d in drivers:
        total.update(d.stats)
    return total


def utilisation(dispatched: list[int], drivers: list[Driver], failures: collections.Counter,
                dropped_in_flight: int) -> dict:
    """Per group: rollout requests dispatched to it, decode steps, and the share of its
    slots busy over its steps; the failures by cause and the requests they dropped."""
    out = {"requests": list(dispatched), "steps": [], "slot_utilisation": []}
    for d in drivers:
        steps = d.stats["steps"]
        out["steps"].append(steps)
        out["slot_utilisation"].append(d.stats["busy_slot_steps"] / max(steps * d.capacity, 1))
    out.update(failures=dict(failures), dropped_in_flight=dropped_in_flight)
    return out


def describe(groups) -> str:
    """"2 engine groups of expert=2, tensor=2 (devices 0,1,4,5 | 2,3,6,7)": where the groups
    (EngineGroups, or a Lockstep over several processes) run."""
    mesh = groups.engines[0].mesh
    axes = ", ".join(f"{a}={n}" for a, n in mesh.shape.items() if n > 1) or "one device"
    blocks = " | ".join(",".join(str(d.id) for d in e.mesh.devices.flat) for e in groups.engines)
    return f"{len(groups.engines)} engine groups of {axes} (devices {blocks})"

