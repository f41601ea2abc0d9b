"""Model clients: what environment generation and evaluation talk to.

The protocol is one method::

    class ModelClient(Protocol):
        def complete(self, prompt: str, *, max_tokens: int = 256, temperature: float = 0.0,
                     stop: Sequence[str] | None = None) -> str: ...

``complete`` returns the continuation of ``prompt`` (text only; a stop sequence, when
one ends the text, is not included). Implementations here: ``OpenAIClient`` (any
OpenAI-compatible ``/v1/completions`` endpoint, standard library only),
``ScriptedClient`` (fixed replies or a function of the prompt: tests, deterministic
runs) and ``OracleClient`` (answers from the tasks' reference solutions: the ceiling of
an evaluation). The glmjax engine adapter (``rl/engine/engine.py``'s author adds it) only has to
implement ``complete`` with the engine's tokenizer and sampler; ``client_from_spec``
names it ``engine:`` and says so until it exists.
"""

from __future__ import annotations

import json
import os
import re
import urllib.error
import urllib.request
from typing import Callable, Protocol, Sequence

from envs.base import Task, TextTask


class ModelError(RuntimeError):
    """A model endpoint failed or answered something that is not a completion."""


class ModelClient(Protocol):
    def complete(self, prompt: str, *, max_tokens: int = 256, temperature: float = 0.0,
                 stop: Sequence[str] | None = None) -> str: ...


class OpenAIClient:
    """POST ``{base_url}/completions`` with ``{model, prompt, max_tokens, temperature, stop}``;
    returns ``choices[0].text``. ``api_key`` defaults to ``$OPENAI_API_KEY`` (optional)."""

    def __init__(self, base_url: str, model: str, *, api_key: str | None = None, timeout: float = 120.0):
        self.url = base_url.rstrip("/") + "/completions"
        self.model, self.timeout = model, timeout
        self.api_key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY")

    def complete(self, prompt: str, *, max_tokens: int = 256, temperature: float = 0.0,
                 stop: Sequence[str] | None = None) -> str:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature}
        if stop:
            body["stop"] = list(stop)
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(self.url, json.dumps(body).encode(), headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                data = json.loads(response.read())
        except urllib.error.HTTPError as err:
            raise ModelError(f"{self.url}: HTTP {err.code}: {err.read()[:300]!r}") from err
        except (urllib.error.URLError, OSError, ValueError) as err:
            raise ModelError(f"{self.url}: {err}") from err
        try:
            return data["choices"][0]["text"]
        except (KeyError, IndexError, TypeError) as err:
            raise ModelError(f"{self.url}: expected choices[0].text in the reply, got {str(data)[:300]}") from err


class ScriptedClient:
    """Replies from a list (in order; ``ModelError`` when it runs out) or a function of
    the prompt. ``prompts`` records what it was asked."""

    def __init__(self, replies: Sequence[str] | Callable[[str], str]):
        self.replies, self.prompts, self._next = replies, [], 0

    def complete(self, prompt: str, *, max_tokens: int = 256, temperature: float = 0.0,
                 stop: Sequence[str] | None = None) -> str:
        self.prompts.append(prompt)
        if callable(self.replies):
            return self.replies(prompt)
        if self._next >= len(self.replies):
            raise ModelError(f"ScriptedClient ran out of replies after {len(self.replies)}")
        self._next += 1
        return self.replies[self._next - 1]


class OracleClient:
    """Answers with the reference solution of whichever task the prompt holds: a text
    task's answer; for a sandboxed task its solve.sh as one command, then a submit
    (naming ``metadata["vulnerable_function"]`` when the task has one)."""

    def __init__(self, tasks: Sequence[Task]):
        self.tasks = sorted(tasks, key=lambda t: -len(t.instruction))

    def complete(self, prompt: str, *, max_tokens: int = 256, temperature: float = 0.0,
                 stop: Sequence[str] | None = None) -> str:
        for task in self.tasks:
            if isinstance(task, TextTask) and prompt.endswith(task.prompt):
                return task.answer
            if not isinstance(task, TextTask) and prompt.startswith(task.instruction.rstrip("\n")):
                if "<output>" not in prompt:
                    return f"<bash>{task.solution}</bash>"
                name = task.metadata.get("vulnerable_function")
                return f"<submit>{name}</submit>" if name else "<submit/>"
        raise ModelError("OracleClient: the prompt belongs to none of its tasks")


def client_from_spec(spec: str, *, tasks: Sequence[Task] = ()) -> ModelClient:
    """``openai:http://host:port/v1#model-name`` | ``oracle`` | ``noop`` | ``engine:...``."""
    if spec == "oracle":
        return OracleClient(tasks)
    if spec == "noop":
        return ScriptedClient(lambda prompt: "<submit/>")
    if spec.startswith("openai:"):
        url, _, model = spec[len("openai:"):].partition("#")
        if not re.match(r"https?://", url) or not model:
            raise ValueError(f"expected openai:http(s)://host[:port]/v1#model-name, got {spec!r}")
        return OpenAIClient(url, model)
    if spec.startswith("engine:"):
        raise NotImplementedError(
            "envs does not import the engine: build rl.env_client.EngineClient (a ModelClient over "
            "GlmEngine) in Python, or use openai:URL#model against a served engine")
    raise ValueError(f"unknown model {spec!r}: use openai:URL#model, oracle, noop or engine:...")
