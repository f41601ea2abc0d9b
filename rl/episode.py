"""Episodes: multi-turn rollouts in which the model acts in an environment.

    reset (env) -> model turn -> env step (its commands run) -> model turn -> ... -> reward

    episode = Episode(task, ShellEnv(...), ByteChat(), turn_tokens=48, window=191, session_id="ep-7")
    while (work := episode.next()) is not None:     # the collector does this (rl/collector.py)
        if isinstance(work, Request): episode.receive(engine_result_for(work))
        else: work()                                  # blocking: in the worker pool
    rows = episode.trajectories(rollout_id=7)

Token in, token out: the episode's row is `chat.start(instruction)`, then each model turn's
tokens exactly as the engine sampled them (the stop token that ended the turn included),
then each observation's tokens as `chat.observation` appended them; it is never rebuilt
from text. Every model turn's prompt is the row so far, so the engine continues the
session's cached prefix (`session_id`) and the history is not prefilled again.
Observation tokens carry mask 1 (`Trajectory.observation_mask`): no policy loss, and GAE
steps over them (`rl/sao.py`); their log-probs are 0 and their version is that of the
token before them.

The episode ends at submit or the environment's turn limit (the env runs the verifier
and returns the reward), when the window leaves fewer than `min_turn_tokens` for the next
turn (an observation that would leave less is not appended), or `seconds` after the
environment was reset (the env's `finish()` runs the verifier on the state as it is).
With `compaction`, a history that would outgrow the window is summarised instead: the
observation `compaction.open` asks for a summary, the model writes it up to
`compaction.close`, and the episode continues in a new segment whose prompt is the task
and the summary, followed by the command output that did not fit, if that is what set
it off (each segment a learner row; all train with the episode's reward). While an
episode may still compact, every turn leaves room for OPEN and the summary.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from rl.compaction import Compaction
from rl.engine.driver import Request, Result
from rl.rollout import RouteLog, Trajectory


class Episode:
    def __init__(self, task, env, chat, *, turn_tokens: int, window: int, temperature: float = 0.0, seed: int = 0,
                 session_id: str | None = None, seconds: float | None = None, min_turn_tokens: int = 8,
                 compaction: Compaction | None = None, system: str | None = None, blank_observations: bool = False):
        self.task, self.env, self.chat = task, env, chat
        self.turn_tokens, self.window, self.min_turn_tokens = turn_tokens, window, min_turn_tokens
        self.temperature, self.seed, self.session_id = temperature, seed, session_id
        self.seconds, self.compaction, self.system = seconds, compaction, system
        self.deadline: float | None = None  # `seconds` after the environment is reset
        self.blank_observations = blank_observations
        self.reward: float | None = None
        self.finish_reason: str | None = None
        self.info: dict = {}
        self.instruction = ""  # the env's first observation: the task as the model reads it
        self.turns = 0
        self.env_seconds = 0.0
        self.prompt: list[int] = []  # the current segment's prompt
        self.row: list[int] = []  # everything after it: model turns and observations
        self.log_probs: list[float] = []
        self.versions: list[int] = []
        self.obs_mask: list[int] = []
        self.requests: list[list[int]] = []  # every model turn's prompt, as submitted
        self.segments: list[tuple] = []  # closed segments: (prompt, row, log_probs, versions, obs_mask, routes)
        self.routes = RouteLog()  # the engine's experts over the current segment's positions
        self._phase = "reset"
        self._turn: list[int] = []  # the last model turn's tokens
        self._summary: bool = False
        self._pending: str | None = None  # an output that set off compaction, for the next segment

    # The protocol (rl/rollout.py) ------------------------------------------------------
    def next(self):
        if self._phase == "done":
            return None
        if self._phase in ("reset", "step", "finish"):
            return self._env_work
        if self.deadline is not None and time.time() > self.deadline:
            return self._end("time")
        context = self.prompt + self.row
        if self._summary:
            budget = min(self.compaction.summary_tokens, self.window - len(context))
            return self._request(context, budget, (self.chat.encode_text(self.compaction.close)[0],))
        room = self.window - len(context) - self._reserve
        if room < self.min_turn_tokens:
            if self._can_compact:
                self._start_summary()
                return self.next()
            return self._end("length")
        budget = min(self.turn_tokens, room)
        return self._request(context, budget, self.chat.stop_ids)

    def receive(self, result: Result) -> None:
        if result.finish_reason in ("error", "cancelled"):
            self.finish_reason, self._phase = result.finish_reason, "done"
            self.info["error"] = result.error
            return
        self._turn = list(result.tokens)
        self.routes.add(result)
        self.row += self._turn
        self.log_probs += list(result.log_probs)
        self.versions += list(result.versions)
        self.obs_mask += [0] * len(self._turn)
        if self._summary:
            self._new_segment()
            return
        self.turns += 1
        self._phase = "step"

    def trajectories(self, rollout_id: int, **meta) -> list[Trajectory]:
        segments = self.segments + [self._segment()]
        last = len(segments) - 1
        return [Trajectory(list(p), list(r), list(lp), list(v), self.reward, rollout_id=rollout_id, segment_index=i,
                           observation_mask=list(m) if any(m) else None, routes=routes,
                           finish_reason=self.finish_reason if i == last else "compacted", **meta)
                for i, (p, r, lp, v, m, routes) in enumerate(segments)]

    def _segment(self) -> tuple:
        return (self.prompt, self.row, self.log_probs, self.versions, self.obs_mask,
                self.routes.take(len(self.prompt) + len(self.row)))

    def close(self) -> None:
        self.env.close()

    # Parts -----------------------------------------------------------------------------
    def _request(self, context: Sequence[int], budget: int, stop_ids) -> Request:
        self.requests.append(list(context))
        seed = self.seed + 7919 * (len(self.requests) - 1)
        return Request(list(context), budget, temperature=self.temperature, seed=seed, session_id=self.session_id,
                       stop_ids=tuple(stop_ids))

    def _end(self, reason: str):
        self.finish_reason, self._phase = reason, "finish"
        return self._env_work

    def _env_work(self) -> None:
        """The blocking part of the current phase: reset, the step of the last model turn,
        or the verifier of an episode out of budget. Runs in the collector's worker pool."""
        start, phase = time.time(), self._phase
        try:
            if phase == "reset":
                self.instruction = self.env.reset(self.task)
                self.deadline = time.time() + self.seconds if self.seconds else None
                self.prompt = self.chat.start(self.instruction, self.system)
                self._phase = "model"
                return
            if phase == "finish":
                return self._finish_now()
            step = self.env.step(self.chat.decode(self._turn))
            if step.done:
                return self._done(step)
            observation = "" if self.blank_observations else step.observation
            tokens = self.chat.observation(observation, after=self._turn)
            self._phase = "model"
            if len(self.prompt) + len(self.row) + len(tokens) + self.min_turn_tokens + self._reserve <= self.window:
                self._append(tokens, observation=True)
            elif self._can_compact:  # summarise first; the new segment opens with this output
                self._pending = observation
                self._start_summary()
            else:  # no room to read it and answer: the verifier decides now
                self.finish_reason = "length"
                self._finish_now()
        finally:
            self.env_seconds += time.time() - start

    def _append(self, tokens: Sequence[int], observation: bool) -> None:
        version = self.versions[-1] if self.versions else 0
        self.row += list(tokens)
        self.log_probs += [0.0] * len(tokens)
        self.versions += [version] * len(tokens)
        self.obs_mask += [int(observation)] * len(tokens)

    def _done(self, step) -> None:
        self.reward, self.info = float(step.reward), dict(step.info)
        self.finish_reason = self.finish_reason or ("error" if "error" in step.info else "stop")
        self._phase = "done"
        self.env.close()

    def _finish_now(self) -> None:
        self._done(self.env.finish())

    @property
    def _reserve(self) -> int:
        """Tokens a turn leaves free for OPEN and a summary, while the episode may compact."""
        return self.compaction.reserve if self._can_compact else 0

    @property
    def _can_compact(self) -> bool:
        return self.compaction is not None and len(self.segments) + 1 < self.compaction.max_segments

    def _start_summary(self) -> None:
        self._append(self.chat.encode_text(self.compaction.open), observation=True)
        self._summary = True

    def _new_segment(self) -> None:
        """The summary is written: close the segment; the next starts from the task and the
        summary (then the output that did not fit, if a command's output set it off)."""
        self.segments.append(self._segment())
        self.routes = RouteLog()
        summary, version = self._turn, self.versions[-1]
        start = self.chat.start(self.instruction, self.system)
        head = start[:-1] + self.chat.encode_text(self.compaction.open) + summary
        self.row, self.log_probs, self.versions, self.obs_mask = [], [], [], []
        self._summary = False
        if len(summary) == 0 or summary[-1] != self.chat.encode_text(self.compaction.close)[0]:
            self.prompt = head + start[-1:]
            self._end("length")  # the summary overran its budget
            return
        if self._pending is None:
            self.prompt = head + start[-1:]
            return
        self.prompt = head
        tokens = self.chat.observation(self._pending, after=())  # its role token, the output, <|assistant|>
        self._pending = None
        self.row, self.log_probs = list(tokens), [0.0] * len(tokens)
        self.versions, self.obs_mask = [version] * len(tokens), [1] * len(tokens)
        if len(self.prompt) + len(self.row) + self.min_turn_tokens + self._reserve > self.window:
            self._end("length")
