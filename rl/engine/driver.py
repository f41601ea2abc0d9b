"""Continuous batching in process: the API the learner and the gRPC server call.

    driver = Driver(GlmEngine(model, max_concurrent_decodes=8, max_len=1024))
    handle = driver.submit(Request(prompt=[1, 2, 3], max_new_tokens=64, temperature=1.0,
                                   session_id="rollout-7", stop_ids=(1,)))
    driver.run_until_idle()          # or driver.start() for a background thread
    result = handle.result()         # tokens, log_probs, versions, finish_reason

`Request.top_logprobs = k` also returns, per generated token, the k most likely tokens
and their log-probs under the distribution the token was sampled from
(glmjax/sampling.top_logprobs); a step computes them only when a request in it asks.

Each `step` first moves the highest-numbered requests down into free slots (requests
hold the lowest slots, so a step runs only as many rows as are in flight), then fills
every free slot from the queue (one batched prefill per bucket length, reusing the
session's cached prefix when the prompt continues it, then insert), then runs one
generate step over the slots in use and hands each request its new tokens; a request
that hits a stop id or its token budget (or is cancelled) gives its slot back at once.
Every step reads the WeightStore's newest version; each token carries the version that
produced it. Drive it either with `step` / `run_until_idle` from one thread or with
`start()`, not both.
What a server reports about it is read, not pushed: `queued` and `active` (requests
waiting and slots in use), `stats` (counters: generate steps, tokens handed to requests,
prefill and reused prompt tokens, accepted drafts) and `acceptance` (how often a request's
step accepted 0, 1, ... num_draft drafts); rl/engine/serve.py turns them into metrics.
The learner must not donate (`donate_argnums`) parameter buffers it has published: the
engine may still be reading them.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import numpy as np

from glmjax.sampling import SamplingParams
from rl.engine.engine import GlmEngine
from rl.engine.prefix_cache import PrefixCache

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Request:
    prompt: Sequence[int]
    max_new_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    seed: int = 0
    session_id: str | None = None
    stop_ids: Sequence[int] = ()
    top_logprobs: int = 0  # k alternatives per generated token (<= the engine's max_top_logprobs)


@dataclasses.dataclass
class Result:
    tokens: list[int]
    log_probs: list[float]  # behaviour-policy log-prob of each token (glmjax/sampling.py)
    versions: list[int]  # the WeightStore version that produced each token
    finish_reason: str  # "stop" | "length" | "cancelled" | "error"
    prompt_tokens: int = 0
    reused_tokens: int = 0  # prompt tokens taken from the session's cached prefix
    error: str | None = None
    # per token, when Request.top_logprobs = k: [(token id, log-prob), ...], k of them, most
    # likely first, under the same distribution as log_probs (tokens of probability 0 left out)
    top_logprobs: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)
    # from an engine that records routes (GlmEngine(record_routes=True)): the experts each MoE
    # layer chose at every position the engine ran, [len(prompt) + len(tokens) - 1, L_moe, X]
    # int16 (the last token is never fed), -1 on the prompt positions taken from a cached prefix
    routes: np.ndarray | None = None


class Chunk(NamedTuple):
    """Tokens handed to a request by one step, with what the Result records of each."""

    tokens: list[int]
    log_probs: list[float]
    versions: list[int]
    top_logprobs: list[list[tuple[int, float]]]  # empty unless the request asked


class Handle:
    """A submitted request: a future for its Result and a stream of its token chunks."""

    def __init__(self, request: Request):
        self.request = request
        self._done = threading.Event()
        self._result: Result | None = None
        self._chunks: queue.SimpleQueue = queue.SimpleQueue()
        self._callbacks: list[Callable[[Handle], None]] = []
        self._chunk_callbacks: list[Callable[[Chunk], None]] = []
        self._emitted, self._partial = 0, None  # tokens handed out so far, and the Result holding them
        self._tokens: list[int] = []  # the tokens handed out, for a chunk callback registered late
        self._lock = threading.Lock()
        self.cancelled = False
        self.on_cancel: Callable[[], None] | None = None

    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> Result:
        if not self._done.wait(timeout):
            raise TimeoutError(f"request not finished after {timeout} s")
        return self._result

    def cancel(self) -> None:
        """Stops the request; its slot is freed at the driver's next step."""
        self.cancelled = True
        if self.on_cancel is not None:
            self.on_cancel()

    def stream(self, timeout: float | None = None) -> Iterator[list[int]]:
        """Token chunks as they are produced, until the request finishes."""
        while True:
            chunk = self._chunks.get(timeout=timeout)
            if chunk is None:
                return
            yield chunk

    def add_done_callback(self, fn: Callable[["Handle"], None]) -> None:
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def add_chunk_callback(self, fn: Callable[[Chunk], None]) -> None:
        """Calls fn(Chunk) with the tokens handed out so far (one chunk, if any), then with
        every later chunk, in order, in the driver's thread: fn must not block."""
        with self._lock:
            self._chunk_callbacks.append(fn)
            if self._emitted:  # under the lock: no later chunk can overtake these
                fn(self._chunk(self._partial, 0, self._emitted))

    def _chunk(self, result: Result | None, start: int, end: int) -> Chunk:
        """Tokens [start, end) of the request's output, from `result` (None: a replica's
        stream, which carries token ids only)."""
        if result is None:
            n = end - start
            return Chunk(self._tokens[start:end], [float("nan")] * n, [-1] * n, [])
        top = result.top_logprobs[start:end] if self.request.top_logprobs else []
        return Chunk(result.tokens[start:end], result.log_probs[start:end], result.versions[start:end], top)

    def _emit(self, tokens: list[int], result: Result | None = None) -> None:
        """Hands out new tokens; `result` (the request's, already holding them) gives their
        log-probs, versions and alternatives."""
        if not tokens:
            return
        self._chunks.put(tokens)
        with self._lock:
            start = self._emitted
            self._emitted += len(tokens)
            self._partial = result
            self._tokens.extend(tokens)
            callbacks = list(self._chunk_callbacks)
        if callbacks:
            chunk = self._chunk(result, start, start + len(tokens))
            for fn in callbacks:
                fn(chunk)

    def _finish(self, result: Result) -> None:
        with self._lock:
            if self._done.is_set():
                return
            self._result = result
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        self._chunks.put(None)
        for fn in callbacks:
            fn(self)


@dataclasses.dataclass
class _Slot:
    handle: Handle
    prompt: list[int]
    reused: int
    out: Result
    emitted: list[int]  # every token the engine produced, past a stop included (for the cache)
    routes: list[np.ndarray] | None = None  # per position run so far, in order (record_routes)


class Driver:
    def __init__(self, engine: GlmEngine, *, prefix_cache_size: int = 32, record_trace: bool = False):
        self.engine = engine
        self.params = engine.load_params()
        self.state = engine.init_decode_state()
        self.prefixes = PrefixCache(prefix_cache_size)
        self.stats: collections.Counter = collections.Counter()
        # acceptance[k]: (request, generate step) pairs that accepted k MTP drafts, k = 0..num_draft
        self.acceptance: list[int] = [0] * (engine.num_draft + 1)
        # (start, end, busy slots) of each step, prefill included: for utilisation figures
        self.trace: list[tuple[float, float, int]] | None = [] if record_trace else None
        self._slots: list[_Slot | None] = [None] * engine.max_concurrent_decodes
        self._queue: collections.deque[Handle] = collections.deque()
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._paused = False

    # Submission ------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return len(self._slots)

    @property
    def load(self) -> int:
        """Requests queued or decoding."""
        return self.queued + self.active

    @property
    def queued(self) -> int:
        """Requests waiting for a slot."""
        return len(self._queue)

    @property
    def active(self) -> int:
        """Slots holding a request."""
        return sum(s is not None for s in self._slots)

    @property
    def running(self) -> bool:
        """Whether the background thread (`start`) is running."""
        return self._thread is not None

    def validate(self, request: Request) -> None:
        """Raises ValueError naming the request field that the engine cannot serve."""
        e, vocab = self.engine, self.engine.config.vocab_size
        prompt = list(request.prompt)
        if not prompt:
            raise ValueError("Request.prompt is empty: at least one token id is needed")
        bad = [t for t in prompt if not 0 <= int(t) < vocab]
        if bad:
            raise ValueError(f"Request.prompt has token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        if request.max_new_tokens < 1:
            raise ValueError(f"Request.max_new_tokens={request.max_new_tokens} must be >= 1")
        room = e.max_len - e.num_draft - 1  # a verify step writes num_draft + 1 entries
        if len(prompt) + request.max_new_tokens > room:
            raise ValueError(f"Request.prompt ({len(prompt)} tokens) + max_new_tokens ({request.max_new_tokens}) "
                             f"= {len(prompt) + request.max_new_tokens} exceeds the engine's limit of {room} "
                             f"(max_len={e.max_len} less num_draft + 1)")
        if request.temperature < 0:
            raise ValueError(f"Request.temperature={request.temperature} must be >= 0")
        if not 0 <= request.top_k <= e.max_top_k:
            raise ValueError(f"Request.top_k={request.top_k} must be in [0, max_top_k={e.max_top_k}]")
        if not 0 <= request.top_logprobs <= e.max_top_logprobs:
            raise ValueError(f"Request.top_logprobs={request.top_logprobs} must be in "
                             f"[0, max_top_logprobs={e.max_top_logprobs}]")

    def submit(self, request: Request, handle: Handle | None = None) -> Handle:
        """Queues a request (ValueError at once if it cannot be served). `handle`: fill
        this one instead of a new one (the router's)."""
        self.validate(request)
        handle = handle or Handle(request)
        handle.on_cancel = self._notify
        with self._wake:
            self._queue.append(handle)
            self._wake.notify_all()
        return handle

    def _notify(self) -> None:
        with self._wake:
            self._wake.notify_all()

    # Scheduling ------------------------------------------------------------------------
    def step(self) -> bool:
        """Admits queued requests into free slots, then one generate step. Returns whether
        any request is still queued or decoding."""
        start = time.perf_counter()
        self._admit()
        busy = [i for i, s in enumerate(self._slots) if s is not None]
        if not busy:
            return bool(self._queue)
        rows = self.engine.rows_for(busy[-1] + 1)  # requests hold the lowest slots (_compact)
        top = any(self._slots[i].handle.request.top_logprobs for i in busy)
        self.state, result = self.engine.generate_rows(self.params, self.state, rows, top_logprobs=top)
        result = result.convert_to_numpy()
        self.stats["steps"] += 1
        self.stats["busy_slot_steps"] += len(busy)
        for i in busy:
            r = result.get_result_at_slot(i)
            n = int(r.valid[0].sum())
            self.stats["accepted_drafts"] += n - 1
            self.acceptance[n - 1] += 1
            self._take(i, r.tokens[0, :n], r.log_probs[0, :n], r.versions[0, :n],
                       None if r.top_ids is None else (r.top_ids[0, :n], r.top_logps[0, :n]),
                       None if r.routes is None else r.routes[0, :n])
        if self.trace is not None:
            self.trace.append((start, time.perf_counter(), len(busy)))
        return self.load > 0

    def run_until_idle(self) -> None:
        while self.step():
            pass

    def _admit(self) -> None:
        """Fills the free slots: one batched prefill per bucket length (a prompt longer than
        the largest bucket runs its leading chunks alone first), then one insert each."""
        for i, slot in enumerate(self._slots):
            if slot is not None and slot.handle.cancelled:
                self._release(i, "cancelled")
        self._compact()
        free = [i for i, s in enumerate(self._slots) if s is None]
        taken = []
        with self._wake:
            while len(taken) < len(free) and self._queue:
                handle = self._queue.popleft()
                if handle.cancelled:
                    handle._finish(Result([], [], [], "cancelled", len(handle.request.prompt)))
                else:
                    taken.append(handle)
        e, weights, groups = self.engine, self.engine._weights(self.params), {}
        for i, handle in zip(free, taken):
            req = handle.request
            prompt = [int(t) for t in req.prompt]
            cache, reused = self.prefixes.match(req.session_id, prompt)
            routes = [self._unknown_routes(reused)] if e.record_routes else None
            pos, chunk = reused, e.buckets[-1]
            while len(prompt) - pos > chunk:
                piece = np.asarray(prompt[pos:pos + chunk], np.int32)
                prefix = e.prefill_batch(params=weights, tokens=[piece], existing=[cache])
                cache = prefix.cache
                if routes is not None:
                    routes.append(e.fetch(prefix.routes)[0])
                pos += chunk
            groups.setdefault(e.bucket(len(prompt) - pos), []).append((i, handle, prompt, reused, cache, pos, routes))
        for group in groups.values():
            try:
                self._start(group, weights)
            except Exception as err:  # a request that breaks prefill must not stop the others
                log.exception("prefill failed")
                for _, handle, prompt, *_ in group:
                    handle._finish(Result([], [], [], "error", len(prompt), error=repr(err)))

    def _start(self, group, weights) -> None:
        e = self.engine
        sampling = [SamplingParams(h.request.temperature, h.request.top_k, h.request.seed) for _, h, *_ in group]
        top = any(h.request.top_logprobs for _, h, *_ in group)
        prefix = e.prefill_batch(params=weights, tokens=[np.asarray(p[pos:], np.int32) for _, _, p, _, _, pos, _ in group],
                                 existing=[c for *_, c, _, _ in group], sampling=sampling, top_logprobs=top)
        self.state = e.insert_batch(prefix, self.state, [i for i, *_ in group])
        tokens, log_probs, versions, top, prefilled = e.fetch((prefix.token, prefix.log_prob, prefix.version,
                                                               prefix.top, prefix.routes))
        top_ids, top_logps = (None, None) if top is None else top
        for row, (i, handle, prompt, reused, _, pos, routes) in enumerate(group):
            self.stats["prefill_tokens"] += len(prompt) - reused
            self.stats["reused_tokens"] += reused
            if routes is not None:
                routes.append(prefilled[row, :len(prompt) - pos])
            self._slots[i] = _Slot(handle, prompt, reused, Result([], [], [], "", len(prompt), reused), [], routes)
            self._take(i, tokens[row:row + 1], log_probs[row:row + 1], versions[row:row + 1],
                       None if top_ids is None else (top_ids[row:row + 1], top_logps[row:row + 1]))

    def _take(self, i: int, tokens, log_probs, versions, top=None, routes=None) -> None:
        """Hands slot i's new tokens to its request; finishes it on a stop id or its budget.
        top: (ids, log-probs) [n, max_top_logprobs] of the step's alternatives, or None.
        routes [n, L_moe, X]: the experts of the positions the step fed (the token before
        each new one), or None."""
        slot = self._slots[i]
        req, out = slot.handle.request, slot.out
        slot.emitted.extend(int(t) for t in tokens)
        new, reason = [], None
        for j, (t, lp, v) in enumerate(zip(tokens, log_probs, versions)):
            new.append(int(t))
            out.log_probs.append(float(lp))
            out.versions.append(int(v))
            if req.top_logprobs:
                ids, logps = top[0][j, :req.top_logprobs], top[1][j, :req.top_logprobs]
                out.top_logprobs.append([(int(a), float(b)) for a, b in zip(ids, logps) if b > -np.inf])
            if int(t) in req.stop_ids:
                reason = "stop"
            elif len(out.tokens) + len(new) >= req.max_new_tokens:
                reason = "length"
            if reason:
                break
        out.tokens.extend(new)
        if routes is not None:
            slot.routes.append(routes[:len(new)])
        self.stats["tokens"] += len(new)
        slot.handle._emit(new, out)
        if reason:
            self._release(i, reason)

    def _release(self, i: int, reason: str) -> None:
        slot = self._slots[i]
        self._slots[i] = None
        if slot.handle.request.session_id is not None and reason != "cancelled":
            held = len(slot.prompt) + len(slot.emitted) - 1  # the last token is pending, not cached
            self.prefixes.put(slot.handle.request.session_id, (slot.prompt + slot.emitted)[:held],
                              self.engine.extract(self.state, i))
        self.state = self.engine.free(self.state, i)
        slot.out.finish_reason = reason
        if slot.routes is not None:
            slot.out.routes = np.concatenate(slot.routes)
        slot.handle._finish(slot.out)

    def _unknown_routes(self, n: int) -> np.ndarray:
        """[n, L_moe, X] of -1: positions whose experts this request did not run (a cached prefix)."""
        c = self.engine.config
        layers = sum(c.is_moe(i) for i in range(c.num_hidden_layers))
        return np.full((n, layers, c.num_experts_per_tok), -1, np.int16)

    def _compact(self) -> None:
        """Moves the highest-numbered requests into the free slots below them, so that the n
        requests in flight hold slots [0, n) and a step runs rows_for(n) rows."""
        n = sum(s is not None for s in self._slots)
        holes = [i for i in range(n) if self._slots[i] is None]
        above = [i for i in range(n, len(self._slots)) if self._slots[i] is not None]
        for dst, src in zip(holes, above):  # as many requests above n as holes below it
            self.state = self.engine.move(self.state, src, dst)
            self._slots[dst], self._slots[src] = self._slots[src], None

    # Background thread -----------------------------------------------------------------
    def start(self) -> "Driver":
        """Runs steps in a daemon thread whenever there is work."""
        if self._thread is None:
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name="glmjax-driver", daemon=True)
            self._thread.start()
        return self

    def pause(self) -> None:
        """Holds the background thread between steps (requests stay queued or in flight, and
        submissions are accepted) until `resume`: for a colocated learner that has all the
        data it needs, so that generation does not compete with it for the machine."""
        with self._wake:
            self._paused = True

    def resume(self) -> None:
        with self._wake:
            if self._paused:
                self._paused = False
                self._wake.notify_all()

    def stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def abandon(self) -> list[Handle]:
        """Gives up on this driver without waiting for its thread (a step that hangs): the
        thread, if it ever returns, ends at its next wait; returns the handles of the
        requests it held, in slots and queued, unfinished, for the caller to end."""
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
            held = [s.handle for s in self._slots if s is not None] + list(self._queue)
            self._queue.clear()
        return held

    def _loop(self) -> None:
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._stopping or (self.load > 0 and not self._paused))
                if self._stopping:
                    return
            try:
                self.step()
            except Exception as err:  # fail the requests in flight, keep serving the next ones
                log.exception("generate step failed")
                for i, slot in enumerate(self._slots):
                    if slot is not None:
                        self._slots[i] = None
                        slot.out.finish_reason, slot.out.error = "error", repr(err)
                        slot.handle._finish(slot.out)
                self.state = self.engine.init_decode_state()
