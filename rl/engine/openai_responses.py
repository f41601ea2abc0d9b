"""What rl/engine/openai_api.py answers with: OpenAI's response bodies and server-sent
event streams, built from a finished or running Job (rl/engine/openai_jobs.py).

    completion_body(server, job) / chat_body(server, job)       # once every sample has ended
    SSEStream(completion_stream(server, job), job)              # as tokens arrive

`server` is the OpenAIServer (its tokenizer, model_name, stop_ids and tool_style are read).
Stop tokens are not text: they have no log-prob entry and no text, though usage counts
them. A chat reply's tool calls (tool_formats, in the template's format) become
`message.tool_calls` with `call_...` ids and their arguments as a JSON string; streamed,
the content stops where a <tool_call> may begin and the calls come in the final chunks,
before the chunk with `finish_reason` ("tool_calls").
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi.responses import Response, StreamingResponse

from rl.engine.openai_jobs import Job, Sample
from rl.engine.openai_protocol import APIError, token_text
from tool_formats import OPEN, extract_tool_calls


def sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def finish_reason(reason: str | None) -> str:
    return {"stop": "stop", "length": "length"}.get(reason, reason or "stop")


def engine_error(job: Job) -> APIError | None:
    failed = [s for s in job.samples if s.finish == "error"]
    if not failed:
        return None
    return APIError(503, f"the engine failed the request: {failed[0].error}", type="server_error",
                    code="engine_error")


# Log-probs ---------------------------------------------------------------------------------
def _text_tokens(server, s: Sample, new: range) -> list[int]:
    return [i for i in new if s.tokens[i] not in server.stop_ids]


def chat_logprobs(server, s: Sample, new: range) -> list[dict]:
    """`logprobs.content` entries of sample s's tokens `new` (indices)."""
    def entry(token, logprob):
        text = token_text(server.tokenizer, token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    asked = s.request.top_logprobs
    return [{**entry(s.tokens[i], s.log_probs[i]), "top_logprobs": [entry(a, b) for a, b in s.top[i]] if asked else []}
            for i in _text_tokens(server, s, new)]


def completion_logprobs(server, s: Sample, new: range, k: int | None, offset: int = 0) -> dict | None:
    """The completions API's `logprobs` of sample s's tokens `new`: tokens, token_logprobs,
    top_logprobs (a dict per token, text -> logprob) and text_offset; None unless asked."""
    if k is None:
        return None
    keep = _text_tokens(server, s, new)
    texts = [token_text(server.tokenizer, s.tokens[i]) for i in keep]
    offsets = []
    for text in texts:
        offsets.append(offset)
        offset += len(text)

    def alternatives(alts) -> dict:
        out = {}
        for a, b in alts:  # most likely first: of tokens with the same text (bytes of a character) keep that one
            out.setdefault(token_text(server.tokenizer, a), b)
        return out

    return {"tokens": texts, "token_logprobs": [s.log_probs[i] for i in keep],
            "top_logprobs": [alternatives(s.top[i]) for i in keep] if k else None, "text_offset": offsets}


# Completions -------------------------------------------------------------------------------
def _head(server, kind: str) -> dict:
    prefix = "cmpl" if kind == "text_completion" else "chatcmpl"
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()),
            "model": server.model_name}


def completion_body(server, job: Job) -> dict:
    k = job.body.logprobs
    choices = [{"index": s.index, "text": s.text.text, "finish_reason": finish_reason(s.finish),
                "logprobs": completion_logprobs(server, s, range(len(s.tokens)), k)} for s in job.samples]
    return {**_head(server, "text_completion"), "choices": choices, "usage": job.usage()}


async def completion_stream(server, job: Job) -> AsyncIterator[str]:
    head, k = _head(server, "text_completion"), job.body.logprobs
    offsets = [0] * len(job.samples)
    async for s, delta, new, last in job.events():
        lp = completion_logprobs(server, s, new, k, offsets[s.index])
        offsets[s.index] += len(delta)
        if last and s.finish == "error":
            continue
        if delta or (lp and lp["tokens"]) or last:
            yield sse({**head, "choices": [{"index": s.index, "text": delta, "logprobs": lp,
                                            "finish_reason": finish_reason(s.finish) if last else None}]})
    async for event in _tail(job, head):
        yield event


# Chat --------------------------------------------------------------------------------------
def message(server, s: Sample, tools) -> tuple[dict, str]:
    """The assistant message of sample s and its finish_reason (module docstring)."""
    text, reason = s.text.text, finish_reason(s.finish)
    if not tools or server.tool_style is None:
        return {"role": "assistant", "content": text}, reason
    content, calls = extract_tool_calls(text, server.tool_style, tools)
    if not calls:
        return {"role": "assistant", "content": text}, reason
    calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
              "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for c in calls]
    return ({"role": "assistant", "content": content if content.strip() else None, "tool_calls": calls},
            "tool_calls" if reason == "stop" else reason)


def chat_body(server, job: Job) -> dict:
    choices = []
    for s in job.samples:
        msg, reason = message(server, s, job.tools)
        lp = {"content": chat_logprobs(server, s, range(len(s.tokens)))} if job.body.logprobs else None
        choices.append({"index": s.index, "message": msg, "logprobs": lp, "finish_reason": reason})
    return {**_head(server, "chat.completion"), "choices": choices, "usage": job.usage()}


def _before_call(text: str) -> int:
    """Where content must stop: the first <tool_call>, or a tail that may begin one."""
    at = text.find(OPEN)
    if at >= 0:
        return at
    for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-k:]):
            return len(text) - k
    return len(text)


async def chat_stream(server, job: Job) -> AsyncIterator[str]:
    head, body, tools = _head(server, "chat.completion.chunk"), job.body, job.tools
    hold = bool(tools) and server.tool_style is not None
    shown = [""] * len(job.samples)  # text the TextStream let out so far, per sample
    sent = [0] * len(job.samples)  # how much of it went out as content

    def chunk(s, delta: dict, logprobs=None, finish=None) -> str:
        return sse({**head, "choices": [{"index": s.index, "delta": delta, "logprobs": logprobs,
                                         "finish_reason": finish}]})

    for s in job.samples:
        yield chunk(s, {"role": "assistant", "content": ""})
    async for s, delta, new, last in job.events():
        shown[s.index] += delta
        text = shown[s.index]
        upto = _before_call(text) if hold else len(text)
        piece = text[sent[s.index]:upto] if upto > sent[s.index] else ""
        sent[s.index] += len(piece)
        lp = {"content": chat_logprobs(server, s, new)} if body.logprobs and len(new) else None
        if piece or lp:
            yield chunk(s, {"content": piece}, lp)
        if last and s.finish != "error":
            msg, reason = message(server, s, tools)
            rest = (msg["content"] or "")[sent[s.index]:]
            if rest:
                yield chunk(s, {"content": rest})
            if msg.get("tool_calls"):
                yield chunk(s, {"tool_calls": [{"index": k, **c} for k, c in enumerate(msg["tool_calls"])]})
            yield chunk(s, {}, finish=reason)
    async for event in _tail(job, head):
        yield event


async def _tail(job: Job, head: dict) -> AsyncIterator[str]:
    """A stream's last events: the engine's error (the status is already 200), the usage
    when asked for, [DONE]."""
    error = engine_error(job)
    if error is not None:
        yield sse(error.body())
    if job.body.include_usage:
        yield sse({**head, "choices": [], "usage": job.usage()})
    yield "data: [DONE]\n\n"
    job.streamed = True


class SSEStream(StreamingResponse):
    """A server-sent-event response whose job is closed however it ends: streamed to the
    end, or cancelled by Starlette when the client disconnects (even before the first
    event), so the engine's requests never outlive their client."""

    def __init__(self, events: AsyncIterator[str], job: Job):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.job = job

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            # 499, nginx's "client closed request": a stream whose client left before its end
            self.job.close(200 if self.job.streamed else 499)


class Gone(Response):
    """The answer to a request whose client left: nothing (no one is there to read it)."""

    async def __call__(self, scope, receive, send):
        return None
