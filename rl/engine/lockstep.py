"""Engines over the devices of several processes: every process runs the same steps.

    driver = Lockstep([engine])                  # engine.mesh spans every process's devices
    driver = Lockstep(engines, store=store)      # engine groups (rl/engine/groups.py: build_engines)
    handle = driver.submit(request)              # from any thread of any process
    while not driver.sync(done=...):             # the main thread of every process, in step
        ...

A program over a mesh that spans processes runs only when every process launches it,
with the same inputs, in the same order. A Driver's decisions (which request takes which
slot, which prefill bucket, when a request ends) follow from its queue and from the
tokens the engine returns, which every process reads whole (GlmEngine.fetch). So every
process keeps a full copy of each engine's driver, and the copies stay equal as long as
each queues the same requests and cancellations at the same step. `sync` makes it so: the
requests and cancellations this process's threads made since the last step are exchanged
with every other process's (distributed.gather_objects) and applied in process order;
the requests wait in one queue, and each goes to a group the moment it has a free slot
(a session's next turn to the group that holds its prefix, else the least loaded); then
every group with work runs one Driver step. A process follows its own requests through
the handles `submit` returned; the others' run in its copies as mirrors whose results it
drops.

A group whose step raises has failed: at the next sync, on every process (each reports
its failures in the exchange), its requests in flight end with finish_reason "error" and
an error that starts with "UNAVAILABLE: engine group" (the RL collector drops their
rollouts as "engine_group_failed"), and a new driver over the same engine (an empty decode
state) takes its place while the others go on; `failures` counts them. A step must raise
on every process alike (a program's error does): a host that fails alone leaves the others
waiting in the program it never launched, and the job resumes from its last checkpoint.

`sync(done)` also carries one flag per process and returns True once every process passed
done=True: the way the processes agree that a batch is complete or an evaluation over.
`serve_while(fn)` runs fn in a thread while the main thread keeps in step, for work that
blocks (an HTTP client, a matrix of evaluations) on some processes only.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

from glmjax import distributed
from rl.engine.driver import Driver, Handle, Request, Result
from rl.engine.engine import GlmEngine
from rl.engine.groups import DOWN, pooled_stats, utilisation

log = logging.getLogger(__name__)


class _Mirror(Handle):
    """A driver's own handle of a request; for this process's requests it hands every
    chunk and the result on to the caller's handle. Cancelling the caller's handle reaches
    the mirror only through `sync`, at the same step on every process."""

    def __init__(self, request: Request, target: Handle | None):
        super().__init__(request)
        self.target = target

    def _emit(self, tokens: list[int], result: Result | None = None) -> None:
        super()._emit(tokens, result)
        if self.target is not None:
            self.target._emit(tokens, result)

    def _finish(self, result: Result) -> None:
        super()._finish(result)
        if self.target is not None:
            self.target._finish(result)


class Lockstep:
    """The engines' drivers, stepped by every process together (module docstring). Offers
    the Driver's interface (submit, validate, capacity, load, stats, engine, start, stop,
    pause, resume) so that the RL job's collector and evaluations take it in place of one
    driver; `sync` replaces `step`."""

    def __init__(self, engines: Sequence[GlmEngine], *, store=None, prefix_cache_size: int = 32,
                 max_sessions: int = 65536):
        self.engines = list(engines)
        self.store = store if store is not None else self.engines[0].weights
        self._cache_size = prefix_cache_size
        self.drivers = [Driver(e, prefix_cache_size=prefix_cache_size) for e in self.engines]
        self._outbox: list[tuple[str, int, Request | None]] = []  # (kind, id, request) since the last sync
        self._lock = threading.Lock()
        self._issued = 0
        self._waiting: dict[int, Handle] = {}  # this process's requests not yet exchanged, by id
        self._mirrors: dict[tuple[int, int], _Mirror] = {}  # every process's requests not yet finished
        self._queue: collections.deque[_Mirror] = collections.deque()  # exchanged, not yet given to a group
        self._homes: collections.OrderedDict[str, int] = collections.OrderedDict()  # session -> its group
        self._max_sessions = max_sessions
        self._failed_here: set[int] = set()  # groups whose step raised here since the last sync
        self.dispatched = [0] * len(self.engines)
        self.failures: collections.Counter = collections.Counter()
        self.dropped_in_flight = 0
        self._retired: collections.Counter = collections.Counter()  # stats of the drivers replaced
        self.syncs = 0

    # The Driver's interface ------------------------------------------------------------
    @property
    def engine(self) -> GlmEngine:
        return self.engines[0]

    @property
    def capacity(self) -> int:
        return sum(d.capacity for d in self.drivers)

    @property
    def queued(self) -> int:
        return len(self._queue) + sum(d.queued for d in self.drivers)

    @property
    def active(self) -> int:
        return sum(d.active for d in self.drivers)

    @property
    def load(self) -> int:
        """Requests exchanged and not finished, on every process alike."""
        return self.queued + self.active

    @property
    def running(self) -> bool:
        """Always: the main threads step the drivers (clients wait on their handles)."""
        return True

    @property
    def stats(self) -> collections.Counter:
        return pooled_stats(self._retired, self.drivers)

    def validate(self, request: Request) -> None:
        self.drivers[0].validate(request)

    def start(self) -> Lockstep:
        return self

    def stop(self) -> None:
        pass

    def pause(self) -> None:
        pass

    def resume(self) -> None:
        pass

    def step(self) -> bool:
        raise RuntimeError("a Lockstep driver steps with every process at once: call sync(done) from the main "
                           "thread of each")

    def run_until_idle(self) -> None:
        raise RuntimeError("a Lockstep driver runs until every process is done: call sync(done) from the main "
                           "thread of each")

    def submit(self, request: Request, handle: Handle | None = None) -> Handle:
        """Queues a request at the next `sync` of every process (ValueError at once if it
        cannot be served)."""
        self.validate(request)
        handle = handle or Handle(request)
        with self._lock:
            rid, self._issued = self._issued, self._issued + 1
            self._outbox.append(("submit", rid, request))
            self._waiting[rid] = handle
        handle.on_cancel = lambda: self._send(("cancel", rid, None))
        return handle

    def _send(self, message) -> None:
        with self._lock:
            self._outbox.append(message)

    # The step --------------------------------------------------------------------------
    def sync(self, done: bool = False) -> bool:
        """One exchange and one step of every group with work, on every process at once;
        True when every process passed done=True (the step still ran)."""
        with self._lock:
            outbox, self._outbox = self._outbox, []
            waiting, self._waiting = self._waiting, {}
        failed, self._failed_here = sorted(self._failed_here), set()
        inboxes = distributed.gather_objects((outbox, done, failed))
        for g in sorted({g for _, _, f in inboxes for g in f}):
            self._rebuild(g)
        me = jax.process_index()
        for process, (messages, _, _) in enumerate(inboxes):
            for kind, rid, request in messages:
                key = (process, rid)
                if kind == "cancel":
                    if key in self._mirrors:
                        self._mirrors[key].cancelled = True
                    continue
                mirror = _Mirror(request, waiting.pop(rid) if process == me else None)
                self._mirrors[key] = mirror
                mirror.add_done_callback(lambda _, key=key: self._mirrors.pop(key, None))
                self._queue.append(mirror)
        self._dispatch()
        for g, d in enumerate(self.drivers):
            if d.load:
                try:
                    d.step()
                except Exception:  # the group failed: every process rebuilds it at the next sync
                    log.exception("engine group %d: step failed", g)
                    self._failed_here.add(g)
        self.syncs += 1
        return all(flag for _, flag, _ in inboxes)

    def _dispatch(self) -> None:
        """Gives queued requests to groups with a free slot, in order; a request whose
        session's group is full waits for it, and the ones behind it go on."""
        held = collections.deque()
        while self._queue:
            mirror = self._queue.popleft()
            if mirror.cancelled:
                mirror._finish(Result([], [], [], "cancelled", len(mirror.request.prompt)))
                continue
            g = self._choose(mirror.request)
            if g is None:
                held.append(mirror)
                continue
            session = mirror.request.session_id
            if session is not None:
                self._homes[session] = g
                self._homes.move_to_end(session)
                if len(self._homes) > self._max_sessions:
                    self._homes.popitem(last=False)
            self.dispatched[g] += 1
            with self.drivers[g]._wake:
                self.drivers[g]._queue.append(mirror)
        self._queue = held

    def _choose(self, request: Request) -> int | None:
        room = [g for g, d in enumerate(self.drivers) if d.load < d.capacity]
        home = self._homes.get(request.session_id) if request.session_id is not None else None
        if home is not None:
            return home if home in room else None
        return min(room, key=lambda g: (self.drivers[g].load / self.drivers[g].capacity, g)) if room else None

    def _rebuild(self, g: int) -> None:
        """Group g failed: a new driver over its engine takes its place, and the old one's
        requests end as UNAVAILABLE (module docstring)."""
        old = self.drivers[g]
        self.drivers[g] = Driver(self.engines[g], prefix_cache_size=self._cache_size)
        pending = old.abandon()
        self._retired.update(old.stats)
        self.failures["error"] += 1
        self.dropped_in_flight += len(pending)
        self._homes = collections.OrderedDict((s, h) for s, h in self._homes.items() if h != g)
        error = f"{DOWN} {g} error: its step failed; its requests in flight are dropped and the group is rebuilt"
        for handle in pending:
            handle._finish(Result([], [], [], "error", len(handle.request.prompt), error=error))

    def utilisation(self) -> dict:
        """As EngineGroups.utilisation (rl/engine/groups.py)."""
        return utilisation(self.dispatched, self.drivers, self.failures, self.dropped_in_flight)

    def serve_while(self, fn: Callable[[], Any], idle_seconds: float = 0.002) -> Any:
        """fn() in a thread of this process while this thread keeps in step with the other
        processes, until every process's fn has returned; fn's value (its exception raised)."""
        out: dict[str, Any] = {}

        def run():
            try:
                out["value"] = fn()
            except BaseException as err:  # raised below, after every process is done
                out["error"] = err

        worker = threading.Thread(target=run, name="glmjax-lockstep-work", daemon=True)
        worker.start()
        while not self.sync(done=not worker.is_alive()):
            if not self.load:
                time.sleep(idle_seconds)
        worker.join()
        if "error" in out:
            raise out["error"]
        return out.get("value")


def driver_for(engine: GlmEngine, **kw) -> Driver | Lockstep:
    """The driver an engine needs: a Lockstep when its mesh spans processes."""
    return Lockstep([engine], **kw) if engine.mesh.is_multi_process else Driver(engine, **kw)
