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

Replicas that are down: a request that a replica ends with an "UNAVAILABLE: ..." error (a
GrpcReplica whose server does not answer) marks that replica down. A down replica is given
no new work, although with nothing in flight it looks least loaded, and a session whose
home it is moves to a replica that is up, where its prefix is recomputed (correct output
over cache reuse). Every `backoff` seconds (5) a timer thread asks the down replica's
`running` (a GrpcReplica: HealthCheck); once it answers, it gets work again. The request
that found it down keeps its error (its caller may retry), as do those already given to it.
When every replica is down, a request fails at once with an UNAVAILABLE error naming them
rather than waiting. Drivers do not end requests with UNAVAILABLE, so they are never down.

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
    """Requests over `replicas` (module docstring); `backoff`: seconds between the health
    checks of a replica that is down."""

    def __init__(self, replicas: Sequence, *, order: str = "fifo", max_sessions: int = 65536,
                 backoff: float = 5.0):
        if not replicas:
            raise ValueError("Router needs at least one replica")
        if order not in ORDERS:
            raise ValueError(f"order={order!r} is invalid: expected one of {ORDERS}")
        if not backoff > 0:
            raise ValueError(f"backoff={backoff!r} must be > 0 seconds")
        self.order, self.backoff = order, backoff
        self.replicas = list(replicas)
        self.in_flight = [0] * len(self.replicas)
        self.dispatched = [0] * len(self.replicas)
        self._queue: list[Handle] = []
        self._keys: list[tuple[int, int]] = []  # the queue's sort keys, in queue order
        self._arrivals = 0
        self._sessions: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._max_sessions = max_sessions
        self.down: set[int] = set()  # replicas given no work until they answer a health check
        self._stopped = False
        self._lock = threading.RLock()
        self._dispatching = self._again = False  # a dispatch re-entered from its own callbacks

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
        calls in flight finish "cancelled"); down replicas are no longer checked."""
        self._stopped = True
        for replica in self.replicas:
            replica.stop()

    def replace(self, i: int, replica) -> None:
        """`replica` in place of replica i (a rebuilt engine group, rl/engine/groups.py): the
        requests given to the old one still count in `in_flight` until they finish."""
        with self._lock:
            self.replicas[i] = replica

    def _choose(self, request: Request) -> int | None:
        room = [i for i, r in enumerate(self.replicas) if self.in_flight[i] < r.capacity and i not in self.down]
        home = self._sessions.get(request.session_id) if request.session_id is not None else None
        if home is not None and home not in self.down:
            return home if home in room else None
        if not room:
            return None
        return min(room, key=lambda i: (self.in_flight[i] / self.replicas[i].capacity, self.in_flight[i]))

    def _dispatch(self) -> None:
        """Hands queued requests to replicas with room. A request that finishes while being
        dispatched (refused at submit) calls back into here from inside the loop: that call
        only asks for another pass, so that the loop never walks a queue another pass changed."""
        with self._lock:
            if self._dispatching:
                self._again = True
                return
            self._dispatching = True
            try:
                self._again = True
                while self._again:
                    self._again = False
                    self._dispatch_pass()
            finally:
                self._dispatching = False

    def _dispatch_pass(self) -> None:
        with self._lock:
            for handle in list(self._queue):
                if handle.cancelled:
                    self._remove(handle)
                    handle._finish(Result([], [], [], "cancelled", len(handle.request.prompt)))
                    continue
                if len(self.down) == len(self.replicas):
                    self._remove(handle)
                    handle._finish(Result([], [], [], "error", len(handle.request.prompt), error=self._all_down()))
                    continue
                i = self._choose(handle.request)
                if i is None:
                    if all(self.in_flight[j] >= r.capacity for j, r in enumerate(self.replicas) if j not in self.down):
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
                handle.add_done_callback(lambda h, i=i: self._finished(i, h))
                try:
                    self.replicas[i].submit(handle.request, handle=handle)
                except ValueError as err:
                    handle._finish(Result([], [], [], "error", len(handle.request.prompt), error=str(err)))

    def _finished(self, i: int, handle: Handle) -> None:
        error = handle.result().error or ""
        with self._lock:
            self.in_flight[i] -= 1
            if error.startswith("UNAVAILABLE:") and i not in self.down:
                self.down.add(i)
                self._check_later(i)
        self._dispatch()

    def _check_later(self, i: int) -> None:
        timer = threading.Timer(self.backoff, self._check, args=(i,))
        timer.daemon = True
        timer.start()

    def _check(self, i: int) -> None:
        """The health check of down replica `i`: once it answers, it gets work again;
        until then it is asked again every `backoff` seconds."""
        if self._stopped:
            return
        up = self.replicas[i].running  # outside the lock: a GrpcReplica may wait 5 s for its answer
        with self._lock:
            if not up:
                self._check_later(i)
                return
            self.down.discard(i)
        self._dispatch()

    def _all_down(self) -> str:
        names = ", ".join(str(getattr(r, "target", f"#{i}")) for i, r in enumerate(self.replicas))
        return (f"UNAVAILABLE: every replica is down: {names} (each failed with UNAVAILABLE and gets work again "
                f"once it answers a health check, asked every {self.backoff:g} s)")


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
        """Whether the server answers HealthCheck as live within 5 s (False once stopped)."""
        import grpc

        try:
            return self.client.health(timeout=5.0)
        except (grpc.RpcError, ValueError):  # ValueError: the channel is closed
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
