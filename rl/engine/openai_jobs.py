"""One OpenAI API request in the engine (rl/engine/openai_api.py): its samples as Driver
requests, their tokens turned into text as they arrive, stop strings, the session record.

    job = Job(server, "chat.completions", prompts, n=2, params=..., stops=["\\n\\n"])
    job.submit()                                  # every sample of every prompt, at once
    async for sample, delta, new, last in job.events():  # text deltas, new token indices, per sample
        ...
    job.close()                                   # cancels what is left, records the session call

Every sample is its own Driver request, submitted together, so the driver's continuous
batching runs them side by side with other clients' requests. The Driver hands tokens
over from its own thread (`Handle.add_chunk_callback`, which also replays those handed
out before it was registered); they cross into the server's event
loop through an asyncio queue. A stop string cancels the sample's request at once
(`Handle.cancel`, its slot is freed at the next step) and keeps the tokens through the one
that completed it. `close` is idempotent and runs however the request ends (answered,
refused, client gone), so no engine slot outlives its client and a session's lock is
always released.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Sequence

from rl.engine.driver import Chunk, Handle, Request
from rl.engine.openai_protocol import TextStream
from rl.engine.sessions import SessionCall


@dataclasses.dataclass
class Params:
    """What every sample of a request shares, besides its prompt and seed."""

    max_tokens: int
    temperature: float
    seed: int
    top_logprobs: int = 0
    session_id: str | None = None


@dataclasses.dataclass
class Sample:
    index: int  # the choice's index: prompt_index * n + j
    prompt_index: int
    prompt: list[int]
    request: Request
    text: TextStream
    handle: Handle | None = None  # once submitted
    tokens: list[int] = dataclasses.field(default_factory=list)  # kept: cut after a stop string
    log_probs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    top: list = dataclasses.field(default_factory=list)
    finish: str | None = None  # the engine's reason, "stop" for a stop string too
    error: str | None = None

    def visible(self, stop_ids) -> list[int]:
        """Indices of the kept tokens that are text (stop tokens are not)."""
        return [i for i, t in enumerate(self.tokens) if t not in stop_ids]


class Job:
    def __init__(self, server, endpoint: str, prompts: Sequence[list[int]], n: int, params: Params,
                 stops: Sequence[str] = (), session=None, messages: list[dict] | None = None,
                 diverged_at: int | None = None, started: float | None = None):
        self.server, self.endpoint, self.params = server, endpoint, params
        self.session, self.messages, self.diverged_at = session, messages, diverged_at
        self.started = started if started is not None else time.perf_counter()
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.samples: list[Sample] = []
        for p, prompt in enumerate(prompts):
            for j in range(n):
                index = p * n + j
                request = Request(prompt=prompt, max_new_tokens=params.max_tokens, temperature=params.temperature,
                                  seed=(params.seed + index) % 2**31, session_id=params.session_id,
                                  stop_ids=server.stop_ids, top_logprobs=params.top_logprobs)
                self.samples.append(Sample(index, p, list(prompt), request,
                                           TextStream(server.tokenizer, stops, server.stop_ids)))
        self.prompt_tokens = sum(len(p) for p in prompts)
        self.body, self.tools = None, None  # the parsed request and its tools, for the response
        self.streamed = False  # a stream reached its end
        self._submitted = self._closed = False

    def submit(self) -> None:
        """Every sample to the driver; ValueError (nothing submitted) when one is refused."""
        for s in self.samples:
            self.server.driver.validate(s.request)
        for s in self.samples:
            s.handle = self.server.driver.submit(s.request)
            s.handle.add_chunk_callback(lambda chunk, i=s.index: self._put((i, chunk)))
            s.handle.add_done_callback(lambda h, i=s.index: self._put((i, None)))
        self._submitted = True

    def _put(self, item) -> None:  # the driver's thread
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    async def events(self) -> AsyncIterator[tuple[Sample, str, range, bool]]:
        """(sample, new text, indices of its new kept tokens, False) as tokens arrive, and
        (sample, the text held back, empty, True) when a sample ends (its `finish` set),
        until every sample has ended."""
        left = len(self.samples)
        while left:
            i, chunk = await self.queue.get()
            s = self.samples[i]
            if chunk is None:
                result = s.handle.result()
                if s.finish is None:
                    s.finish, s.error = result.finish_reason, result.error
                left -= 1
                yield s, s.text.flush(), range(len(s.tokens), len(s.tokens)), True
            elif s.finish is None:
                yield s, *self._take(s, chunk), False

    def _take(self, s: Sample, chunk: Chunk) -> tuple[str, range]:
        start, before = len(s.tokens), len(s.text.tokens)
        delta = s.text.add(chunk.tokens)
        keep = s.text.kept - before if s.text.stopped else len(chunk.tokens)
        s.tokens += chunk.tokens[:keep]
        s.log_probs += chunk.log_probs[:keep]
        s.versions += chunk.versions[:keep]
        s.top += chunk.top_logprobs[:keep]
        if s.text.stopped:
            s.finish = "stop"
            s.handle.cancel()
        return delta, range(start, len(s.tokens))

    @property
    def completion_tokens(self) -> int:
        return sum(len(s.tokens) for s in self.samples)

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    def close(self, status: int | None = None) -> None:
        """Cancels the samples still running, records the session's call (one the engine
        refused is not a call) and releases its lock, counts the tokens and (with `status`)
        the request in the metrics. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for s in self.samples:
            if s.handle is not None and not s.handle.done():
                s.handle.cancel()
        if self.session is not None:
            s = self.samples[0]
            if self._submitted:
                self.server.sessions.record(self.session, SessionCall(
                    endpoint=self.endpoint, prompt_ids=list(s.prompt), completion_ids=list(s.tokens),
                    logprobs=list(s.log_probs), versions=list(s.versions), finish_reason=s.finish or "cancelled",
                    messages=self.messages, rerendered=self.diverged_at is not None, diverged_at=self.diverged_at))
            self.session.lock.release()
        self.server.count(self.endpoint, status, self.started, self.prompt_tokens, self.completion_tokens)
