"""Compaction (CompactionRL, arXiv 2607.05378): rollouts that outgrow the context window.

When the context (prompt + answer so far) would exceed the window, the answer is cut
back to its last whole word, the observation OPEN asks the model for a summary, the
model writes it up to CLOSE, and the rollout continues from [task prompt, OPEN, summary,
CLOSE]. Each context is one segment: a learner row with the rollout's id and its segment
index; the summary tokens are actions (the model learns to summarise), OPEN is not.
The verifier reads the transcript, the answer parts of all segments joined; the reward
sits on the last segment, GAE chains the segments (`sao.chained_gae`) and the loss
normalises per rollout (`sao.rollout_token_weights`).

    window 40, task prompt P = "count 13 to 46 by 3=", summary budget 4
    segment 0:  P | 13 16 19 22 25 _ OPEN 25 ;          (the half-written "28" is cut)
    segment 1:  P OPEN 25 ; | 28 31 34 37 40 _ OPEN 40 ;
    segment 2:  P OPEN 40 ; | 43 46 \\n
    transcript: 13 16 19 22 25 28 31 34 37 40 43 46 \\n -> task.verify

`Answer` is this as a state machine over driver requests (one `Answer` without
compaction is one request); `oracle_segments` replays it on a known answer to make the
supervised demonstrations, so the base model sees exactly the layout RL produces.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from rl.engine.driver import Request, Result
from rl.rollout import RouteLog, Trajectory, decode, encode


@dataclasses.dataclass(frozen=True)
class Compaction:
    window: int  # tokens a context may hold (prompt + completion), at most what the engine serves
    summary_tokens: int = 6  # most tokens a summary may take, CLOSE included
    max_segments: int = 4
    open: str = "|"
    close: str = ";"
    separator: str = " "  # answers are cut back to just after the last one

    def __post_init__(self):
        for name in ("open", "close", "separator"):
            if len(encode(getattr(self, name))) != 1:
                raise ValueError(f"compaction.{name}={getattr(self, name)!r} must be one token")
        if self.summary_tokens < 2 or self.max_segments < 1:
            raise ValueError(f"compaction needs summary_tokens >= 2 and max_segments >= 1, got "
                             f"{self.summary_tokens} and {self.max_segments}")

    @classmethod
    def from_config(cls, cfg, window: int) -> Compaction | None:
        """The job's `rl.compaction` (rl/config.py: CompactionConfig; None when not enabled)."""
        if not cfg.enabled:
            return None
        return cls(window=window, summary_tokens=cfg.summary_tokens, max_segments=cfg.max_segments)

    @property
    def reserve(self) -> int:
        """Tokens kept free at the end of a context for OPEN and the summary."""
        return 1 + self.summary_tokens


@dataclasses.dataclass
class Segment:
    prompt: list[int]
    completion: list[int]
    log_probs: list[float]
    versions: list[int]
    observation_mask: list[int]
    routes: np.ndarray | None = None  # [prompt + completion, L_moe, X] the engine's experts (rollout.RouteLog)


class Answer:
    """A one-turn answer, compacted or not, as the requests it needs (wrapped into the
    rl/rollout.py protocol by `TextRollout`): `request()` gives the next (None once done),
    `receive(result)` takes its result.

    max_new_tokens bounds the transcript (answer tokens over all segments); sampling
    settings are the driver's (`temperature`, `seed`, ...; the seed advances per request)."""

    def __init__(self, prompt: Sequence[int], max_new_tokens: int, *, compaction: Compaction | None = None,
                 stop_ids: Sequence[int] = (), temperature: float = 0.0, seed: int = 0, session_id=None,
                 decode: Callable[[Sequence[int]], str] = decode):
        self.prompt, self.compaction, self.decode = list(prompt), compaction, decode
        self.max_new_tokens, self.stop_ids = max_new_tokens, tuple(stop_ids)
        self.temperature, self.seed, self.session_id = temperature, seed, session_id
        if compaction is not None:
            room = compaction.window - len(self.prompt) - 2 * compaction.reserve
            if room < 2:
                raise ValueError(f"a prompt of {len(self.prompt)} tokens leaves {room} tokens per segment in a "
                                 f"compaction window of {compaction.window} (summary budget "
                                 f"{compaction.summary_tokens}): raise the window or shorten the prompt")
        self.context = list(self.prompt)
        self.segments: list[Segment] = []
        self.transcript: list[int] = []
        self.finish_reason: str | None = None
        self._kept: list[int] | None = None  # the cut answer while its summary is being written
        self._answer: Result | None = None
        self.routes = RouteLog()  # the engine's experts over the open segment's positions
        self._requests = 0

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        return self.decode(self.transcript)

    @property
    def summarising(self) -> bool:
        """The next request asks for a summary (of `transcript + pending`)."""
        return self._kept is not None

    @property
    def pending(self) -> list[int]:
        """The cut answer of the segment whose summary is being written ([] otherwise)."""
        return list(self._kept or [])

    def request(self) -> Request | None:
        if self.done:
            return None
        self._requests += 1
        kw = dict(temperature=self.temperature, seed=self.seed + 7919 * (self._requests - 1),
                  session_id=self.session_id)
        c = self.compaction
        if self.summarising:
            return Request(self.context + self._kept + encode(c.open), c.summary_tokens,
                           stop_ids=tuple(encode(c.close)), **kw)
        budget = self.max_new_tokens - len(self.transcript)
        if c is not None:  # a segment that may still compact leaves room for its summary
            last = len(self.segments) + 1 == c.max_segments
            budget = min(budget, c.window - len(self.context) - (0 if last else c.reserve))
        return Request(self.context, budget, stop_ids=self.stop_ids, **kw)

    def receive(self, result: Result) -> None:
        if result.finish_reason in ("error", "cancelled"):
            self.finish_reason = result.finish_reason
            return
        self.routes.add(result)
        if not self.summarising:
            self._receive_answer(result)
        else:
            self._receive_summary(result)

    def _receive_answer(self, res: Result) -> None:
        c = self.compaction
        can_compact = (c is not None and res.finish_reason == "length" and len(self.segments) + 1 < c.max_segments
                       and len(self.transcript) + len(res.tokens) < self.max_new_tokens)
        cut = _after_last(res.tokens, encode(c.separator)[0]) if can_compact else 0
        if not cut:  # finished, out of budget, or no whole word to keep: the last segment
            self._close_segment(res.tokens, res.log_probs, res.versions)
            self.transcript += res.tokens
            self.finish_reason = res.finish_reason
            return
        self._kept, self._answer = res.tokens[:cut], res

    def _receive_summary(self, res: Result) -> None:
        c, kept, answer = self.compaction, self._kept, self._answer
        n = len(kept)
        open_id = encode(c.open)
        version = res.versions[0] if res.versions else (answer.versions[n - 1] if n else 0)
        self._close_segment(kept + open_id + res.tokens, answer.log_probs[:n] + [0.0] + res.log_probs,
                            answer.versions[:n] + [version] + res.versions, observation_at=n)
        self.transcript += kept
        self._kept = self._answer = None
        if res.finish_reason != "stop":  # the summary overran its budget: the rollout ends unfinished
            self.finish_reason = "length"
            return
        self.context = self.prompt + open_id + res.tokens

    def _close_segment(self, completion, log_probs, versions, observation_at=None) -> None:
        obs = [0] * len(completion)
        if observation_at is not None:
            obs[observation_at] = 1
        routes = self.routes.take(len(self.context) + len(completion))
        self.segments.append(Segment(list(self.context), list(completion), list(log_probs), list(versions), obs, routes))
        self.routes = RouteLog()

    def trajectories(self, reward: float, rollout_id: int, **meta) -> list[Trajectory]:
        """The learner rows of a finished rollout, one per segment (reward on each; the
        learner reads the last segment's)."""
        return [Trajectory(s.prompt, s.completion, s.log_probs, s.versions, reward, rollout_id=rollout_id,
                           segment_index=i, observation_mask=s.observation_mask if any(s.observation_mask) else None,
                           routes=s.routes,
                           finish_reason=self.finish_reason if i == len(self.segments) - 1 else "compacted", **meta)
                for i, s in enumerate(self.segments)]


def _after_last(tokens: Sequence[int], separator: int) -> int:
    """Index just after the last `separator` in tokens, 0 when there is none."""
    for i in range(len(tokens) - 1, -1, -1):
        if tokens[i] == separator:
            return i + 1
    return 0


def last_word(text: str) -> str:
    """The default demonstration summary: the last whole word of the answer so far (the
    whole state of a `counting` answer)."""
    return text.split()[-1] if text.split() else ""


def oracle_segments(prompt: Sequence[int], answer: Sequence[int], compaction: Compaction | None,
                    summarize: Callable[[str], str] = last_word) -> list[Segment]:
    """The segments a rollout would have if the model wrote `answer` and summarised with
    `summarize(transcript so far)`: the supervised demonstrations for compaction."""
    rollout = Answer(prompt, len(answer), compaction=compaction)
    while (req := rollout.request()) is not None:
        if not rollout.summarising:
            start = len(rollout.transcript)
            tokens = list(answer[start:start + req.max_new_tokens])
            reason = "stop" if start + len(tokens) >= len(answer) else "length"
        else:
            tokens = encode(summarize(decode(rollout.transcript + rollout.pending)) + compaction.close)
            reason = "stop" if len(tokens) <= req.max_new_tokens else "length"
            tokens = tokens[:req.max_new_tokens]
        rollout.receive(Result(tokens, [0.0] * len(tokens), [0] * len(tokens), reason))
    if rollout.transcript != list(answer):
        raise ValueError(f"the answer {decode(answer)!r} does not fit compaction {compaction}: the demonstration "
                         f"ends at {rollout.text!r}")
    return rollout.segments
