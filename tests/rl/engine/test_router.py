"""rl/engine/router.py: dispatch when capacity frees, least loaded first, session affinity,
no work for a replica that is down until it answers a health check."""

import threading
import time

import glmjax
from rl.engine.driver import Driver, Handle, Request, Result
from rl.engine.engine import GlmEngine
from rl.engine.router import Router
from tests.engine_util import TINY, greedy_reference, prompts


class FakeReplica:
    """Holds what it is given until the test finishes or fails it; `running` (its health
    check) answers `up`."""

    def __init__(self, capacity, target="fake"):
        self.capacity, self.target, self.held, self.up = capacity, target, [], True

    @property
    def running(self):
        return self.up

    def submit(self, request, handle=None):
        handle = handle or Handle(request)
        self.held.append(handle)
        return handle

    def finish(self, index=0):
        handle = self.held.pop(index)
        handle._finish(Result([7], [0.0], [0], "length", len(handle.request.prompt)))
        return handle

    def stop(self):
        pass

    def fail(self, index=0):
        """Ends a request as a GrpcReplica whose server went down does."""
        handle = self.held.pop(index)
        handle._finish(Result([], [], [], "error", len(handle.request.prompt),
                              error=f"UNAVAILABLE: replica {self.target}: failed to connect to all addresses"))
        return handle


def _req(session=None):
    return Request([1, 2, 3], 4, session_id=session)


def test_least_loaded_first_and_dispatch_when_capacity_frees():
    small, big = FakeReplica(2), FakeReplica(4)
    router = Router([small, big])
    for _ in range(6):
        router.submit(_req())
    # by load ratio: small 0/2, big 0/4 -> small; then big (0 < .5), big (.25 < .5), small/big ...
    assert (len(small.held), len(big.held)) == (2, 4) and router.queued == 0
    waiting = router.submit(_req())
    assert router.queued == 1  # every slot is taken: it waits in the router, not in a replica
    big.finish()
    assert router.queued == 0 and waiting in big.held  # dispatched the moment a slot freed
    assert router.in_flight == [2, 4] and (router.active, router.capacity) == (6, 6)


def test_longest_budget_order_dispatches_the_largest_budget_first():
    replica = FakeReplica(1)
    router = Router([replica], order="longest_budget")
    router.submit(Request([1], 2))  # takes the only slot
    for n in (3, 9, 5, 9):
        router.submit(Request([n], n))
    order = []
    while replica.held:
        order.append(replica.finish().request.max_new_tokens)
    assert order == [2, 9, 9, 5, 3]  # equal budgets keep their arrival order
    replica = FakeReplica(1)
    fifo = Router([replica])
    for n in (2, 3, 9, 5):
        fifo.submit(Request([n], n))
    assert [replica.finish().request.max_new_tokens for _ in range(4)] == [2, 3, 9, 5]


def test_least_loaded_prefers_the_emptier_replica():
    a, b = FakeReplica(4), FakeReplica(4)
    router = Router([a, b])
    for _ in range(3):
        router.submit(_req())
    assert (len(a.held), len(b.held)) == (2, 1)
    a.finish()
    a.finish()
    router.submit(_req())
    assert (len(a.held), len(b.held)) == (1, 1)


def test_session_affinity_returns_to_the_replica_with_the_prefix():
    a, b = FakeReplica(2), FakeReplica(2)
    router = Router([a, b])
    first = router.submit(_req("s"))
    assert first in a.held
    a.finish()
    router.submit(_req())  # a and b tie: a
    turn2 = router.submit(_req("s"))
    assert turn2 in a.held  # b is emptier, but the session goes home
    blocked = router.submit(_req("s"))
    assert router.queued == 1  # its replica is full: it waits rather than recompute its prefix on b
    other = router.submit(_req())
    assert other in b.held and router.queued == 1  # the request behind it is not held up
    a.finish()
    assert blocked in a.held and router.queued == 0


def test_cancel_while_queued_in_the_router():
    a = FakeReplica(1)
    router = Router([a])
    router.submit(_req())
    queued = router.submit(_req())
    queued.cancel()
    assert queued.result(timeout=0).finish_reason == "cancelled" and router.queued == 0
    a.finish()
    assert a.held == []


def _wait_until(condition, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_a_replica_down_gets_no_work_until_its_health_check_answers():
    """The replica that fails with UNAVAILABLE gets nothing more, although it is the emptier
    one; its session moves; once its health check answers, the queued request goes to it."""
    a, b = FakeReplica(2, "a"), FakeReplica(2, "b")
    router = Router([a, b], backoff=0.05)
    failed = router.submit(_req("s"))  # a and b tie: a
    a.up = False
    a.fail()
    assert failed.result(timeout=0).error.startswith("UNAVAILABLE: replica a: ") and router.down == {0}
    moved = router.submit(_req("s"))
    fresh = router.submit(_req("t"))
    assert moved in b.held and fresh in b.held and router._sessions["s"] == 1  # its prefix is recomputed on b
    waiting = router.submit(_req())
    time.sleep(0.3)  # several back-offs: each health check finds a still down
    assert router.queued == 1 and a.held == [] and router.down == {0} and router.dispatched == [1, 2]
    a.up = True
    assert _wait_until(lambda: a.held == [waiting])  # the check's own dispatch gives it the queued request
    assert not router.down and router.queued == 0 and router.dispatched == [2, 2]


def test_when_every_replica_is_down_requests_fail_at_once_naming_them():
    a, b = FakeReplica(1, "10.0.0.1:9000"), FakeReplica(1, "10.0.0.2:9000")
    a.up = b.up = False
    router = Router([a, b], backoff=60.0)
    router.submit(_req())
    router.submit(_req())
    queued = router.submit(_req())
    a.fail()
    assert router.queued == 1 and not queued.done()  # b is full, not down: it waits for b
    b.fail()
    message = "UNAVAILABLE: every replica is down: 10.0.0.1:9000, 10.0.0.2:9000 ("
    assert queued.result(timeout=0).error.startswith(message) and router.queued == 0
    late = router.submit(_req("s"))
    assert late.result(timeout=0).finish_reason == "error" and late.result().error.startswith(message)
    assert router.dispatched == [1, 1] and router.in_flight == [0, 0]
    router.stop()  # the health checks still pending do nothing

def test_router_over_two_in_process_engines():
    """Two Driver threads behind one router: greedy outputs are right, work is spread, and
    a session's second turn lands on its first replica and reuses its prefix there."""
    model = glmjax.init_model(TINY, seed=0)
    drivers = [Driver(GlmEngine(model, max_concurrent_decodes=2, max_len=64, prefill_buckets=(8, 16))).start()
               for _ in range(2)]
    try:
        router = Router(drivers)
        ps = prompts([7] * 5, seed=12)
        handles = [router.submit(Request(p, 6, session_id=f"s{i}")) for i, p in enumerate(ps)]
        results = [h.result(timeout=300) for h in handles]
        ref = [greedy_reference(model, p, 6) for p in ps]
        assert [r.tokens for r in results] == ref
        assert all(n > 0 for n in router.dispatched)
        home = router._sessions["s3"]
        follow = router.submit(Request(ps[3] + results[3].tokens + [5, 6], 4, session_id="s3"))
        assert follow.result(timeout=300).reused_tokens == 7 + 6 - 1
        assert router._sessions["s3"] == home and drivers[home].stats["reused_tokens"] == 12
    finally:
        for d in drivers:
            d.stop()


class Picky(FakeReplica):
    """Refuses a request whose budget is 99 at submit, as an engine refuses one too long."""

    def submit(self, request, handle=None):
        if request.max_new_tokens == 99:
            raise ValueError("prompt + budget exceed the engine's max_len")
        return super().submit(request, handle)


def test_a_refused_request_among_waiting_ones_dispatches_each_once(monkeypatch):
    """A request the replica refuses at submit finishes inside the router's dispatch, and its
    callback dispatches again; the waiting requests still go out once each, and the thread
    that dispatched raises nothing."""
    raised = []
    monkeypatch.setattr(threading, "excepthook", lambda args: raised.append(args.exc_value))
    picky, busy = Picky(4), FakeReplica(1)
    router = Router([picky, busy], backoff=0.05)
    router.submit(_req())
    router.submit(_req())
    assert (len(picky.held), len(busy.held)) == (1, 1)
    picky.up = False
    picky.fail()  # down until its health check answers
    refused, waiting = router.submit(Request([1, 2, 3], 99)), router.submit(_req())
    assert router.queued == 2  # the one replica up is full
    picky.up = True
    deadline = time.time() + 5.0
    while router.queued and time.time() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)  # the timer thread's dispatch has returned
    assert "exceed the engine's max_len" in refused.result().error
    assert picky.held.count(waiting) == 1 and waiting not in busy.held
    assert raised == [] and router.queued == 0
    router.stop()
