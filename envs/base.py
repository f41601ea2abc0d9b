"""Tasks, environments and transcripts: the contract between ``envs/`` and the RL loop.

Two kinds of task:

- ``TextTask``: one prompt, one short completion, a strict verifier. The procedural
  families (arithmetic, sorting, ...) are text tasks small enough for a byte-level model:
  prompt ``"12+7="``, answer ``"19\\n"``. The answer is the completion up to the first
  ``terminator`` (``"\\n"``); a completion that stops without one is taken whole.
  ``TextEnv`` runs them as one-step episodes.
- ``HarborTask`` (``envs/harbor/task.py``): a working directory, an instruction, a reference
  solution (``solve.sh``) and hidden tests (``tests/test.sh``), run multi-turn by
  ``ShellEnv`` (``envs/shell.py``) in a ``Sandbox``.

Action format for tool use (what a model writes in its text; ``parse_action``):

    <bash>ls -la /app</bash>            run a command in the sandbox; its output (stdout and
                                        stderr together, then "[exit N, 0.01s]") is the
                                        next observation. Several blocks run in order.
    <submit/>  or  <submit>text</submit>  finish: the tests are copied in and run; the text
                                        (optional) is the final answer some tasks grade.

Text outside the tags is free reasoning and is ignored. An action with neither tag (or an
unclosed ``<bash>``) runs nothing; the observation says so and ``info["parsed"]`` is
False. Each command runs in a fresh ``bash -c``: files persist between commands,
processes, shell variables and ``cd`` do not.

``Env`` is gym-like: ``reset(task) -> observation`` and
``step(action) -> Step(observation, reward, done, info)`` (a NamedTuple, so it unpacks
as a 4-tuple); the reward is 0 until the step that ends the episode.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Mapping, NamedTuple, Protocol

FULL_REWARD = 1.0
_EPS = 1e-6


def is_full(reward: float) -> bool:
    return reward >= FULL_REWARD - _EPS


def is_zero(reward: float) -> bool:
    return abs(reward) <= _EPS


@dataclasses.dataclass(frozen=True, kw_only=True)
class Task:
    """What every task has. ``difficulty``: 1 (easiest) ... 5, graded per family."""

    id: str
    instruction: str
    domain: str
    difficulty: int = 1
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if not self.id or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", self.id):
            raise ValueError(f"Task.id must be a non-empty [A-Za-z0-9._-] name, got {self.id!r}")
        if not 1 <= self.difficulty <= 5:
            raise ValueError(f"Task.difficulty must be in 1..5, got {self.difficulty} (task {self.id})")


class AnswerVerifier(Protocol):
    """Scores an extracted answer (the completion without its terminator): 0.0 ... 1.0."""

    def __call__(self, answer: str) -> float: ...


@dataclasses.dataclass(frozen=True)
class ExactAnswer:
    """Full reward for exactly ``expected`` (no stripping, no case folding), else 0."""

    expected: str

    def __call__(self, answer: str) -> float:
        return FULL_REWARD if answer == self.expected else 0.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class TextTask(Task):
    """A one-turn task: ``prompt`` in, ``answer`` (the oracle completion, terminator
    included) out. ``partials``: completions of a half-done solution; each must score 0."""

    answer: str
    verifier: AnswerVerifier
    partials: tuple[str, ...] = ()
    terminator: str = "\n"

    def __post_init__(self):
        super().__post_init__()
        if not self.answer.endswith(self.terminator):
            raise ValueError(f"TextTask {self.id}: answer {self.answer!r} must end with {self.terminator!r}")

    @property
    def prompt(self) -> str:
        return self.instruction

    def oracle(self) -> str:
        return self.answer

    def extract(self, completion: str) -> str:
        return completion.split(self.terminator, 1)[0]

    def verify(self, completion: str) -> float:
        return float(self.verifier(self.extract(completion)))


class Step(NamedTuple):
    observation: str
    reward: float
    done: bool
    info: dict


class Env(Protocol):
    def reset(self, task: Task) -> str: ...

    def step(self, action: str) -> Step: ...

    def close(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class Action:
    """A parsed model action. ``parsed``: it held at least one command or a submit."""

    commands: tuple[str, ...]
    submit: bool
    answer: str | None
    parsed: bool
    error: str | None = None


_TAG = re.compile(r"<bash>(.*?)</bash>|<submit\s*/>|<submit>(.*?)</submit>", re.DOTALL)


def parse_action(text: str) -> Action:
    """Commands and submit from a model's text (see the module docstring)."""
    commands, submit, answer = [], False, None
    for match in _TAG.finditer(text):
        if match.group(0).startswith("<bash>"):
            command = match.group(1).strip("\n")
            if command.strip():
                commands.append(command)
        else:
            submit = True
            answer = match.group(2).strip() if match.group(2) is not None else answer
    rest = _TAG.sub("", text)
    if "<bash>" in rest:
        return Action(tuple(commands), submit, answer, False, "unclosed <bash> tag")
    if not commands and not submit:
        return Action((), False, None, False, "no <bash>...</bash> command and no <submit/>")
    return Action(tuple(commands), submit, answer, True)


ACTION_HELP = (
    "Run shell commands by writing <bash>command</bash>; the output comes back. "
    "Each command starts in /app in a fresh shell. When the task is done, write <submit/>."
)


@dataclasses.dataclass
class Turn:
    role: str  # "prompt" | "model" | "tool"
    text: str


@dataclasses.dataclass
class Transcript:
    """One episode: the turns in order, the final reward, and what the env reported."""

    task_id: str
    turns: list[Turn] = dataclasses.field(default_factory=list)
    reward: float | None = None
    info: dict = dataclasses.field(default_factory=dict)

    def add(self, role: str, text: str) -> None:
        self.turns.append(Turn(role, text))

    def render(self) -> str:
        """The episode as one text a completion model continues from."""
        parts = []
        for turn in self.turns:
            parts.append(f"\n<output>\n{turn.text}</output>\n" if turn.role == "tool" else turn.text)
        return "".join(parts)

    def to_dict(self) -> dict:
        return {"task_id": self.task_id, "reward": self.reward, "info": self.info,
                "turns": [dataclasses.asdict(t) for t in self.turns]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), default=str)


class TextEnv:
    """One-step episodes over ``TextTask``: the observation is the prompt, the action the
    completion, the reward ``task.verify(completion)``."""

    def __init__(self):
        self.task: TextTask | None = None
        self.transcript: Transcript | None = None

    def reset(self, task: TextTask) -> str:
        if not isinstance(task, TextTask):
            raise TypeError(f"TextEnv runs TextTask, got {type(task).__name__} ({getattr(task, 'id', '?')})")
        self.task = task
        self.transcript = Transcript(task.id, [Turn("prompt", task.prompt)])
        return task.prompt

    def step(self, action: str) -> Step:
        if self.task is None:
            raise RuntimeError("TextEnv.step before reset")
        reward = self.task.verify(action)
        self.transcript.add("model", action)
        self.transcript.reward = reward
        info = {"answer": self.task.extract(action), "parsed": self.task.terminator in action}
        self.transcript.info = info
        self.task = None
        return Step("", reward, True, info)

    def close(self) -> None:
        self.task = None

