"""The OpenAI API's requests for rl/engine/openai_api.py: their bodies, errors, the chat
template's rendering and the detokenizer with stop strings, with no HTTP in them.

    body = parse(ChatRequest, raw_bytes)     # APIError(400) naming the field when malformed
    text = render_chat(tokenizer, body.template_messages(), body.tools)
    stream = TextStream(tokenizer, stops=["\\n\\n"], stop_ids={...})   # detokenize, cut at stop strings

Requests are validated here, field by field, so that every refusal is OpenAI's error body
`{"error": {"message", "type", "param", "code"}}` naming the field ("messages[2].tool_calls[0]
.function.arguments"). Fields a client may send that change nothing here (user, metadata,
stream_options without usage, parallel_tool_calls, ...) are accepted and ignored; fields
that would change the answer and are not implemented (top_p other than 1, logit_bias,
penalties, echo, best_of, suffix, response_format other than text, tool_choice other than
auto / none) are refused with a 400 naming them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

MAX_N = 16  # samples per prompt: each is a request in the engine's queue
MAX_STOPS = 16


class APIError(Exception):
    """An answer other than 200, as OpenAI's error body."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(param: str, message: str, code: str | None = None) -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code=code)


def _path(loc: Sequence) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def parse(model: type[BaseModel], raw: bytes) -> Any:
    """The body as `model`; APIError(400) for JSON that does not parse or a field that does
    not validate, naming it."""
    try:
        obj = json.loads(raw)
    except ValueError as err:
        raise APIError(400, f"the request body is not valid JSON ({err}); send a JSON object", code="invalid_json")
    if not isinstance(obj, dict):
        raise APIError(400, f"the request body must be a JSON object, found {type(obj).__name__}",
                       code="invalid_json")
    try:
        return model.model_validate(obj)
    except ValidationError as err:
        first = err.errors()[0]
        param = _path(first["loc"])
        found = "" if first["type"] == "missing" else f" (found {json.dumps(first.get('input'))[:80]})"
        raise invalid(param, f"{first['msg']}{found}") from None


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")  # fields this server ignores (user, metadata, ...)

    model: StrictStr
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = None
    n: StrictInt = Field(1, ge=1, le=MAX_N)
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = None
    stream: StrictBool = False
    stream_options: dict | None = None
    logit_bias: dict | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None

    def check(self) -> None:
        """Refuses what this server does not implement (module docstring)."""
        if self.top_p is not None and self.top_p != 1:
            raise invalid("top_p", f"only 1.0 (the whole distribution) is supported, found {self.top_p}; "
                                   "use temperature to change the distribution")
        if self.logit_bias:
            raise invalid("logit_bias", "not supported; send {} or leave it out")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise invalid(name, f"only 0 is supported, found {getattr(self, name)}")
        if any(s == "" for s in self.stops):
            raise invalid("stop", "an empty string would stop at once; leave it out")
        if len(self.stops) > MAX_STOPS:
            raise invalid("stop", f"at most {MAX_STOPS} strings, found {len(self.stops)}")

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class CompletionRequest(_Body):
    prompt: Any = None
    max_tokens: StrictInt | None = Field(16, ge=1)
    logprobs: StrictInt | None = Field(None, ge=0)
    echo: StrictBool = False
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None

    def check(self) -> None:
        super().check()
        if self.echo:
            raise invalid("echo", "only false is supported")
        if self.best_of not in (None, 1, self.n):
            raise invalid("best_of", f"only best_of = n is supported, found {self.best_of} with n={self.n}")
        if self.suffix:
            raise invalid("suffix", "not supported")

    def prompts(self, tokenizer, encode) -> list[list[int]]:
        """The prompt(s) as token ids: a string, strings, token ids, or lists of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [encode(p)]
        if isinstance(p, list) and p and all(isinstance(x, str) for x in p):
            return [encode(x) for x in p]
        if isinstance(p, list) and p and all(isinstance(x, int) and not isinstance(x, bool) for x in p):
            return [list(p)]
        if (isinstance(p, list) and p and all(isinstance(x, list) and x for x in p)
                and all(isinstance(t, int) and not isinstance(t, bool) for x in p for t in x)):
            return [list(x) for x in p]
        raise invalid("prompt", "expected a non-empty string, list of strings, list of token ids or list of "
                                f"lists of token ids, found {json.dumps(p)[:80]}")


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: StrictStr
    arguments: StrictStr = "{}"  # a JSON object, as a string (OpenAI's wire format)


class ToolCallIn(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: StrictStr | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = None
    name: StrictStr | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: StrictStr | None = None


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: StrictStr
    description: StrictStr | None = None
    parameters: dict | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"]
    function: FunctionSpec


class ChatRequest(_Body):
    messages: list[Message] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0)
    tools: list[Tool] | None = None
    tool_choice: Any = None
    response_format: dict | None = None

    def check(self) -> None:
        super().check()
        if self.top_logprobs and not self.logprobs:
            raise invalid("top_logprobs", "needs logprobs: true")
        if self.tool_choice not in (None, "auto", "none"):
            raise invalid("tool_choice", f"only 'auto' and 'none' are supported, found {json.dumps(self.tool_choice)}")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise invalid("response_format", f"only {{'type': 'text'}} is supported, found {self.response_format}")

    @property
    def budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def tool_dicts(self) -> list[dict] | None:
        """The tools as the chat template takes them; None without tools or with tool_choice none."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def template_messages(self) -> list[dict]:
        """The messages as the chat template takes them: content as text, developer as
        system, each tool call's JSON-string arguments as a dict."""
        out = []
        for i, m in enumerate(self.messages):
            msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                                   "content": _text(m.content, f"messages[{i}].content")}
            if m.name is not None:
                msg["name"] = m.name
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            if m.tool_calls:
                if m.role != "assistant":
                    raise invalid(f"messages[{i}].tool_calls", f"only assistant messages carry tool calls, this is "
                                                               f"a {m.role} message")
                msg["tool_calls"] = [_call(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(m.tool_calls)]
            out.append(msg)
        return out


def _text(content: Any, param: str) -> str:
    """A message's content as text: a string, None, or a list of {"type": "text", "text"} parts."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise invalid(f"{param}[{j}]", f"only text parts ({{'type': 'text', 'text': ...}}) are supported, "
                                               f"found {kind!r}")
            texts.append(part["text"])
        return "".join(texts)
    raise invalid(param, f"expected a string or a list of text parts, found {type(content).__name__}")


def _call(call: ToolCallIn, param: str) -> dict:
    try:
        arguments = json.loads(call.function.arguments or "{}")
    except ValueError as err:
        raise invalid(f"{param}.function.arguments", f"not a JSON object ({err})") from None
    if not isinstance(arguments, dict):
        raise invalid(f"{param}.function.arguments", f"must encode a JSON object, found {type(arguments).__name__}")
    out = {"type": "function", "function": {"name": call.function.name, "arguments": arguments}}
    return out if call.id is None else {"id": call.id, **out}


# Rendering ---------------------------------------------------------------------------------
def render_chat(tokenizer, messages: list[dict], tools: list[dict] | None, generation_prompt: bool = True) -> str:
    """The chat template's text of `messages`; a template that refuses them (jinja's
    raise_exception, a role it does not know) is a 400."""
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                             add_generation_prompt=generation_prompt)
    except Exception as err:  # jinja2's TemplateError and whatever the template itself raises
        raise invalid("messages", f"the chat template cannot render them: {type(err).__name__}: {err}") from None


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of text as the template wrote it (special tokens spelled in it included,
    none added)."""
    return list(tokenizer.encode(text, add_special_tokens=False))


def token_text(tokenizer, token: int) -> str:
    return tokenizer.decode([token], skip_special_tokens=False)


class TextStream:
    """The text of a growing list of generated tokens, cut at the first stop string.

    `add(tokens)` returns the text that is safe to show: stop ids are not text, a trailing
    incomplete UTF-8 character waits for its next token, and the last characters that could
    begin a stop string wait until they cannot. `kept` counts the tokens that make up the
    text: when a stop string appears, the tokens through the one that completed it."""

    def __init__(self, tokenizer, stops: Sequence[str] = (), stop_ids: Sequence[int] = ()):
        self.tokenizer, self.stops, self.stop_ids = tokenizer, list(stops), set(stop_ids)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.tokens: list[int] = []  # every token added
        self.text, self.shown, self.kept, self.stopped = "", 0, 0, False

    def _decode(self, n: int) -> str:
        text = self.tokenizer.decode([t for t in self.tokens[:n] if t not in self.stop_ids], skip_special_tokens=True)
        return text.removesuffix("\ufffd")

    def add(self, tokens: Sequence[int]) -> str:
        if self.stopped:
            return ""
        start = len(self.tokens)
        self.tokens.extend(int(t) for t in tokens)
        text = self._decode(len(self.tokens))
        since = max(0, len(self.text) - self.hold)
        found = [(text.find(s, since), s) for s in self.stops]
        found = [(at, s) for at, s in found if at >= 0]
        if found:
            at, stop = min(found)
            self.text, self.stopped = text[:at], True
            self.kept = next((n for n in range(start + 1, len(self.tokens) + 1)
                              if len(self._decode(n)) >= at + len(stop)), len(self.tokens))
            return self.flush()
        self.text, self.kept = text, len(self.tokens)
        safe = len(text) - self.hold if self.stops else len(text)
        out = text[self.shown:max(self.shown, safe)]
        self.shown += len(out)
        return out

    def flush(self) -> str:
        """The text not shown yet (at the end of the request)."""
        out, self.shown = self.text[self.shown:], len(self.text)
        return out
