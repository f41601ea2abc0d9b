"""Sessions of the OpenAI API (rl/engine/openai_api.py): an agent's calls, recorded token
for token, for agent RL.

A request joins a session through the header `X-Session-Id: ID` or the base URL
`/sessions/ID/v1` (for clients that can set only a base URL). An unknown id opens a session
on its first call; `close(ID)` ends it, and later calls with that id are refused (410).

What a session's next chat call sends to the engine is its token history (the previous
call's prompt and completion, exactly as the engine produced them) followed by the tokens
of what is new in the request, so that the learner trains on exactly what the engine saw:

    history  = calls[-1].prompt_ids + calls[-1].completion_ids      (stop token included)
    new      = the template's text after the last assistant message, up to the generation
               prompt, encoded on its own, e.g. <|observation|>\\n<tool_response>..<|assistant|>\\n
               (a first token that the model already wrote as its stop token is dropped)
    prompt   = history + new

The chat template's own rendering of the whole request is compared with that prompt: when
they differ (the agent edited or re-rendered a past turn, or the model's tokens do not
re-encode to the same ids), the call is marked `rerendered=True` with `diverged_at`, the
first position where they differ, and the engine still continues from the history. A
/v1/completions call in a session sends its prompt as given and is marked rerendered when
it does not start with the history.

What is recorded: every call the engine ran, in order. One it refused (a 4xx: the context
exceeded, a malformed request) is not a call. One cut by a stop string keeps its tokens
through the one that completed the string. One cancelled (its client left) or failed is
recorded with that finish_reason but does not extend the history, so a retry continues
from where the last completed call left off. A session's calls run one at a time, and n
must be 1: a session is one trajectory.

Unknown ids open on first use rather than 404, so that any client that can set a header or
a base URL takes part without a call to this process first; open sessions are capped
(`max_open`) and are the caller's to close.

    server.sessions.open("episode-7")                # optional: the first call opens it
    ... the agent calls http://host:port/sessions/episode-7/v1 ...
    calls = server.sessions.close("episode-7")       # [SessionCall], in call order
    row = calls[-1].prompt_ids + calls[-1].completion_ids
"""

from __future__ import annotations

import dataclasses
import re
import threading
from collections.abc import Callable, Sequence

from rl.engine.openai_protocol import APIError

_ID = re.compile(r"[A-Za-z0-9._:@-]{1,200}")


def check_session_id(session_id: str) -> str:
    """The id, when it can stand in a URL path unescaped; ValueError otherwise."""
    if not isinstance(session_id, str) or not _ID.fullmatch(session_id):
        raise ValueError(f"session id {session_id!r}: expected 1 to 200 letters, digits or . _ : @ -")
    return session_id


@dataclasses.dataclass(frozen=True)
class SessionCall:
    """One call of a session, as the engine saw it."""

    endpoint: str  # "chat.completions" | "completions"
    prompt_ids: list[int]  # exactly the tokens sent to the engine
    completion_ids: list[int]  # the tokens the engine produced (stop token included; cut after a stop string)
    logprobs: list[float]  # the behaviour log-prob of each completion token (glmjax/sampling.py)
    versions: list[int]  # the weight version that produced each completion token
    finish_reason: str  # the engine's: "stop" (a stop token or string), "length", "cancelled", "error"
    messages: list[dict] | None  # the request's messages as sent (chat); None for completions
    rerendered: bool = False  # the template's rendering of the request differs from prompt_ids
    diverged_at: int | None = None  # the first index where it differs, when rerendered


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where a and b differ (the shorter length when one extends the
    other); None when equal."""
    if list(a) == list(b):
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


class _Session:
    def __init__(self):
        self.calls: list[SessionCall] = []
        self.history: list[int] = []
        self.closed = False
        self.lock = None  # an asyncio.Lock of the server's loop: one call at a time


class Sessions:
    """The server's sessions (module docstring). Thread-safe: the API's loop records calls
    while a learner's thread reads or closes sessions."""

    def __init__(self, max_open: int = 4096):
        self.max_open = max_open
        self._open: dict[str, _Session] = {}
        self._closed: set[str] = set()
        self._lock = threading.Lock()

    def open(self, session_id: str) -> None:
        """Opens a session (a first call would too). ValueError if it is open or was closed,
        or if max_open sessions are open."""
        check_session_id(session_id)
        with self._lock:
            if session_id in self._open or session_id in self._closed:
                state = "open" if session_id in self._open else "closed"
                raise ValueError(f"session {session_id!r} is already {state}")
            self._admit(session_id)

    def calls(self, session_id: str) -> list[SessionCall]:
        """The session's calls so far, in order. KeyError for an id that is not open."""
        with self._lock:
            return list(self._get(session_id).calls)

    def tokens(self, session_id: str) -> list[int]:
        """The history the session's next chat call continues."""
        with self._lock:
            return list(self._get(session_id).history)

    def close(self, session_id: str) -> list[SessionCall]:
        """Ends the session and returns its calls (none for an id that made no call); later
        calls with its id are refused (410). A call still in flight when it closes is not
        recorded. KeyError when it was closed before."""
        with self._lock:
            if session_id in self._closed:
                raise KeyError(f"session {session_id!r} was closed before: its first close() returned its calls")
            session = self._open.pop(session_id, None)
            self._closed.add(session_id)
            if session is None:
                return []
            session.closed = True
            return list(session.calls)

    def __contains__(self, session_id: str) -> bool:
        with self._lock:
            return session_id in self._open

    def ids(self) -> list[str]:
        """The open sessions."""
        with self._lock:
            return list(self._open)

    def _get(self, session_id: str) -> _Session:
        if session_id in self._closed:
            raise KeyError(f"session {session_id!r} is closed: close() returned its calls")
        if session_id not in self._open:
            raise KeyError(f"no session {session_id!r}: open ones are {sorted(self._open)[:10]}")
        return self._open[session_id]

    def _admit(self, session_id: str) -> _Session:
        if len(self._open) >= self.max_open:
            raise ValueError(f"{self.max_open} sessions are open: close some (server.sessions.close) before "
                             f"opening {session_id!r}")
        session = self._open[session_id] = _Session()
        return session

    # The API's side ------------------------------------------------------------------------
    def join(self, session_id: str) -> _Session:
        """The session a call belongs to, opened on first use; 410 once closed."""
        with self._lock:
            if session_id in self._closed:
                raise APIError(410, f"session {session_id!r} is closed: start a new session id",
                               param="session_id", code="session_closed")
            try:
                return self._open.get(session_id) or self._admit(session_id)
            except ValueError as err:
                raise APIError(400, str(err), param="session_id", code="too_many_sessions") from None

    def record(self, session: _Session, call: SessionCall) -> None:
        """Appends the call; a completed one (stop or length) becomes the history."""
        with self._lock:
            if session.closed:
                return
            session.calls.append(call)
            if call.finish_reason in ("stop", "length"):
                session.history = list(call.prompt_ids) + list(call.completion_ids)


def continue_chat(history: Sequence[int], messages: list[dict], render: Callable[[list[dict], bool], str],
                  encode: Callable[[str], list[int]], stop_ids: Sequence[int]) -> tuple[list[int], int | None]:
    """The prompt of a session's chat call (module docstring) and where the template's
    rendering of the whole request differs from it (None: it does not).

    render(messages, generation_prompt) -> text; encode(text) -> ids."""
    full = render(messages, True)
    rendered = encode(full)
    if not history:
        return rendered, None
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
    if last is None:
        raise APIError(400, "messages: this session has a history, so the request must carry the assistant's "
                            "previous reply and what follows it; start a new session id for a new conversation",
                       param="messages", code="session_mismatch")
    before = render(messages[:last + 1], False)
    if not full.startswith(before):
        raise APIError(400, f"messages: the chat template does not render messages[:{last + 1}] as the start of the "
                            "whole conversation, so the session cannot append what follows the assistant's reply "
                            "(a template that rewrites earlier turns)", param="messages", code="session_mismatch")
    new = encode(full[len(before):])
    if new[:1] == list(history[-1:]) and new[0] in stop_ids:
        new = new[1:]
    prompt = list(history) + new
    return prompt, first_difference(prompt, rendered)
