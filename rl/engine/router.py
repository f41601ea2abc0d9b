"""Joint scheduling of requests across engine replicas (in-process Drivers, gRPC servers).

    router = Router([Driver(engine_a).start(), Driver(engine_b).start()])
    handle = router.submit(Request(prompt, 64, session_id="rollout-7"))

The router holds the queue; a replica is given a request only when it has a free slot,
so work waits in one place and goes to whichever replica frees capacity first (the
done-callback of every request triggers dispatch). Among replicas with room the least
loaded (in flight / capacity) wins. The queue's order is `order`: "fifo" (arrival), or
"longest_budget": the largest max_new_tokens first, Graham's longest-processing-time rule
for the makespan of a batch of rollouts. When the budgets are the lengths it keeps the
longest requests from starting last and running alone while every other slot idles;
when all budgets are equal it is FIFO. Session affinity: a session's next turn goes back to
the replica that served its last one, where its prefix is cached, and waits for that
replica rather than recomputing the prefix elsewhere; requests behind it are not held up.
(slime does the same with SGLang's router: least-loaded data-parallel choice plus
consistent hashing by session.)

A replica is anything with `capacity` and `submit(request, handle)` (and `running` and
`stop` where the router is served): `Driver`, or `GrpcReplica` for a glmjax-serve /
JetStream server. The JetStream protocol carries no sampling settings, log-probs or
versions: a GrpcReplica's results have log_probs NaN and versions -1, and the server's own
sampling settings apply. A GrpcReplica whose server is down or refuses a request finishes
that request at once with finish_reason "error" and the server's status in `error`.

The router offers the Driver's serving interface (`submit`, `queued`, `active`,
`capacity`, `running`, `stop`), so `glmjax-serve --route` serves it as it serves a Driver.
"""

from __future__ import annotations

import bisect
import collections
import math
import threading
from collections.abc import Sequence

from rl.engine.driver import Handle, Request, Result

ORDERS = ("fifo", "longest_budget")


class Router:
    def __init__(self, replicas: Sequence, *, order: str = "fifo", max_sessions: int = 65536):
        if not replicas:
            raise ValueError("Router needs at least one replica")
        if order not in ORDERS:
            raise ValueError(f"order={order!r} is invalid: expected one of {ORDERS}")
        self.order = order
        self.replicas = list(replicas)
        self.in_flight = [0] * len(self.replicas)
        self.dispatched = [0] * len(self.replicas)
        self._queue: list[Handle] = []
        self._keys: list[tuple[int, int]] = []  # the queue's sort keys, in queue order
        self._arrivals = 0
        self._sessions: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._max_sessions = max_sessions
        self._lock = threading.RLock()

    def submit(self, request: Request) -> Handle:
        validate = getattr(self.replicas[0], "validate", None)
        if validate is not None:
            validate(request)  # ValueError now rather than an error result later
        handle = Handle(request)
        handle.on_cancel = self._dispatch
        with self._lock:
            self._arrivals += 1
            key = (-request.max_new_tokens if self.order == "longest_budget" else 0, self._arrivals)
            i = bisect.bisect(self._keys, key)
            self._keys.insert(i, key)
            self._queue.insert(i, handle)
        self._dispatch()
        return handle

    def _remove(self, handle: Handle) -> None:
        i = self._queue.index(handle)
        del self._queue[i], self._keys[i]

    @property
    def queued(self) -> int:
        """Requests waiting in the router for a replica's slot."""
        return len(self._queue)

    @property
    def active(self) -> int:
        """Requests given to replicas and not yet finished."""
        return sum(self.in_flight)

    @property
    def capacity(self) -> int:
        """Slots over all replicas."""
        return sum(r.capacity for r in self.replicas)

    @property
    def running(self) -> bool:
        """Whether any replica can serve (a Driver's thread runs, a GrpcReplica's server
        answers HealthCheck)."""
        return any(r.running for r in self.replicas)

    def stop(self) -> None:
        """Stops every replica: Drivers' threads end, GrpcReplicas' channels close (their
        calls in flight finish "cancelled")."""
        for replica in self.replicas:
            replica.stop()

    def _choose(self, request: Request) -> int | None:
        room = [i for i, r in enumerate(self.replicas) if self.in_flight[i] < r.capacity]
        home = self._sessions.get(request.session_id) if request.session_id is not None else None
        if home is not None:
            return home if home in room else None
        if not room:
            return None
        return min(room, key=lambda i: (self.in_flight[i] / self.replicas[i].capacity, self.in_flight[i]))

    def _dispatch(self) -> None:
        with self._lock:
            for handle in list(self._queue):
                if handle.cancelled:
                    self._remove(handle)
                    handle._finish(Result([], [], [], "cancelled", len(handle.request.prompt)))
                    continue
                i = self._choose(handle.request)
                if i is None:
                    if all(n >= r.capacity for n, r in zip(self.in_flight, self.replicas)):
                        break
                    continue  # waits for its own replica; later requests may go elsewhere
                self._remove(handle)
                self.in_flight[i] += 1
                self.dispatched[i] += 1
                sid = handle.request.session_id
                if sid is not None:
                    self._sessions[sid] = i
                    self._sessions.move_to_end(sid)
                    if len(self._sessions) > self._max_sessions:
                        self._sessions.popitem(last=False)
                handle.add_done_callback(lambda _, i=i: self._finished(i))
                try:
                    self.replicas[i].submit(handle.request, handle=handle)
                except ValueError as err:
                    handle._finish(Result([], [], [], "error", len(handle.request.prompt), error=str(err)))

    def _finished(self, i: int) -> None:
        with self._lock:
            self.in_flight[i] -= 1
        self._dispatch()


class GrpcReplica:
    """A glmjax-serve (or any JetStream Orchestrator) server at `target` ("host:port") as a
    router replica taking `capacity` requests at a time (the server's --slots); ``token``:
    the server's ``--auth-token``, sent with every request. A call that fails ends its
    request with finish_reason "error" and `error` "<gRPC status>: replica <target>:
    <details>", e.g. "UNAVAILABLE: replica 10.0.0.2:9000: failed to connect to all
    addresses" when the server is down (gRPC fails such calls at once)."""

    def __init__(self, target: str, capacity: int, token: str | None = None):
        from rl.engine.serve import Client

        self.target, self.capacity = target, capacity
        self.client = Client(target, token=token)

    @property
    def running(self) -> bool:
        """Whether the server answers HealthCheck as live within 5 s."""
        import grpc

        try:
            return self.client.health(timeout=5.0)
        except grpc.RpcError:
            return False

    def stop(self) -> None:
        """Closes the channel; calls in flight finish "cancelled"."""
        self.client.close()

    def submit(self, request: Request, handle: Handle | None = None) -> Handle:
        handle = handle or Handle(request)
        call = self.client.decode(request.prompt, request.max_new_tokens, request.session_id)
        handle.on_cancel = call.cancel
        threading.Thread(target=self._read, args=(call, handle), daemon=True).start()
        return handle

    def _read(self, call, handle: Handle) -> None:
        import grpc

        out = Result([], [], [], "length", len(handle.request.prompt))
        try:
            for response in call:
                ids = [int(t) for s in response.stream_content.samples for t in s.token_ids]
                out.tokens.extend(ids)
                handle._emit(ids)
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.CANCELLED:
                out.finish_reason = "cancelled"
            else:
                out.finish_reason, out.error = "error", f"{err.code().name}: replica {self.target}: {err.details()}"
        else:
            if out.tokens and out.tokens[-1] in handle.request.stop_ids:
                out.finish_reason = "stop"
        out.log_probs = [math.nan] * len(out.tokens)
        out.versions = [-1] * len(out.tokens)
        handle._finish(out)
