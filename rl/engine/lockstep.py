"""One engine over the devices of several processes: every process runs the same steps.

    driver = LockstepDriver(engine)             # engine.mesh spans every process's devices
    handle = driver.submit(request)              # from any thread of any process
    while not driver.sync(done=...):             # the main thread of every process, in step
        ...

A program over a mesh that spans processes runs only when every process launches it,
with the same inputs, in the same order. A Driver's decisions (which request takes which
slot, which prefill bucket, when a request ends) follow from its queue and from the
tokens the engine returns, which every process reads whole (GlmEngine.fetch). So every
process keeps a full copy of the driver, and the copies stay equal as long as each queues
the same requests and cancellations at the same step. `sync` makes it so: the requests and
cancellations this process's threads made since the last step are exchanged with every
other process's (distributed.gather_objects), applied in process order, and one Driver
step runs. A process follows its own requests through the handles `submit` returned; the
others' requests run in its copy as mirrors whose results it drops.

`sync(done)` also carries one flag per process and returns True once every process passed
done=True: the way the processes agree that a batch is complete or an evaluation over.
`serve_while(fn)` runs fn in a thread while the main thread keeps in step, for work that
blocks (an HTTP client, a matrix of evaluations) on some processes only.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import jax

from glmjax import distributed
from rl.engine.driver import Driver, Handle, Request, Result
from rl.engine.engine import GlmEngine


class _Mirror(Handle):
    """The driver's own handle of a request; for this process's requests it hands every
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


class LockstepDriver(Driver):
    def __init__(self, engine: GlmEngine, **kw):
        super().__init__(engine, **kw)
        self._outbox: list[tuple[str, int, Request | None]] = []  # (kind, id, request) since the last sync
        self._lock = threading.Lock()
        self._issued = 0
        self._waiting: dict[int, Handle] = {}  # this process's requests not yet exchanged, by id
        self._mirrors: dict[tuple[int, int], _Mirror] = {}  # every process's requests in flight
        self.syncs = 0

    @property
    def running(self) -> bool:
        """Always: the main threads step the driver (clients wait on their handles)."""
        return True

    def start(self) -> "LockstepDriver":
        return self

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

    def sync(self, done: bool = False) -> bool:
        """One exchange and one engine step, on every process at once; True when every
        process passed done=True (the step still ran)."""
        with self._lock:
            outbox, self._outbox = self._outbox, []
            waiting, self._waiting = self._waiting, {}
        inboxes = distributed.gather_objects((outbox, done))
        me = jax.process_index()
        for process, (messages, _) in enumerate(inboxes):
            for kind, rid, request in messages:
                key = (process, rid)
                if kind == "cancel":
                    if key in self._mirrors:
                        self._mirrors[key].cancelled = True
                    continue
                mirror = _Mirror(request, waiting.pop(rid) if process == me else None)
                self._mirrors[key] = mirror
                mirror.add_done_callback(lambda _, key=key: self._mirrors.pop(key, None))
                with self._wake:
                    self._queue.append(mirror)
        self.syncs += 1
        super().step()
        return all(flag for _, flag in inboxes)

    def step(self) -> bool:
        raise RuntimeError("a LockstepDriver steps with every process at once: call sync(done) from the main "
                           "thread of each")

    def run_until_idle(self) -> None:
        raise RuntimeError("a LockstepDriver runs until every process is done: call sync(done) from the main "
                           "thread of each")

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


def spans_processes(engine: GlmEngine) -> bool:
    """Whether the engine's mesh holds devices of several processes (it needs a LockstepDriver)."""
    return engine.mesh.is_multi_process


def driver_for(engine: GlmEngine, **kw) -> Driver:
    """The driver an engine needs: a LockstepDriver when its mesh spans processes."""
    return LockstepDriver(engine, **kw) if spans_processes(engine) else Driver(engine, **kw)
