"""An OpenAI-compatible HTTP API over the in-process Driver: what evaluation harnesses and
agent frameworks talk to.

    server = OpenAIServer(driver, tokenizer, "glm-tiny", auth_token=None).start("127.0.0.1", 8000)
    client = openai.OpenAI(base_url=server.base_url, api_key="unused")
    client.chat.completions.create(model="glm-tiny", messages=[{"role": "user", "content": "hi"}])
    server.stop()

FastAPI on uvicorn, in a background thread (`start`), as vLLM and SGLang serve theirs.
Routes, each also under `/sessions/{id}` (rl/engine/sessions.py):

    GET  /v1/models, /v1/models/{model}
    POST /v1/completions         prompt: a string, strings, token ids or lists of them
    POST /v1/chat/completions    messages rendered by the tokenizer's chat template, tools too
    GET  /health                 200 while the driver runs; no token needed

Sampling: temperature (default 1; 0 is greedy), seed (sample i of a request uses seed + i;
without a seed each sample draws one), n, max_tokens (completions: default 16; chat, also
max_completion_tokens: default the rest of the context), stop strings (cut before the
string; the engine's request is cancelled at once), top_p = 1 only. Every sample is its
own Driver request, submitted together (rl/engine/openai_jobs.py), so continuous batching
and, within a session, prefix reuse work as for the learner. The engine stops a sample at
the stop tokens: `stop_ids` (default the tokenizer's eos and GLM's <|user|>,
<|observation|>, <|endoftext|> when it has them; glmjax-serve adds generation_config.json's).

Log-probs: chat `logprobs: true` (+ `top_logprobs: k`), completions `logprobs: k`, k <= 20;
each value is the token's log-prob under the distribution it was sampled from (the
temperature-scaled one; log softmax of the logits for greedy requests), the same value the
learner receives as the behaviour policy (glmjax/sampling.py). Stop tokens are not text
and have no entry; usage.completion_tokens counts them.

Tool calls: with `tools` in a chat request, the reply's calls in the chat template's
format (tool_formats: "glm" when the template writes <arg_key>, else "json" when it writes
<tool_call>) become `message.tool_calls` (`call_...` ids, arguments as a JSON string),
their markup leaves `content`, and `finish_reason` is "tool_calls". Streamed, content stops
at the first <tool_call> and the calls come in the final chunks. A template with no
tool-call markup returns the text as it is.

Sessions, for agent RL (rl/engine/sessions.py): a request with the header `X-Session-Id: ID`
or under the base URL `/sessions/ID/v1` is recorded (`server.sessions.calls(ID)`, a
SessionCall per call: prompt_ids, completion_ids, logprobs, versions, finish_reason,
messages, rerendered, diverged_at), its prompt continues the session's tokens exactly as
the engine produced them, and it reuses the session's cached prefix; unknown ids open on
first use, `server.sessions.close(ID)` returns the calls and ends the session.

Errors are OpenAI's body `{"error": {"message", "type", "param", "code"}}`: 400 for JSON
that does not parse, a field that does not validate or is not supported (named in `param`)
and a prompt past the context (code context_length_exceeded); 401 for a missing or wrong
bearer token when the server has one (`Authorization: Bearer <token>`, compared in
constant time, the gRPC server's rule); 404 for an unknown model (model_not_found) or
route; 405 for a wrong method; 410 for a closed session; 503 when the engine failed the
request. A client that disconnects, streaming or not, has its requests cancelled and
their slots freed. Metrics go into the gRPC server's registry (rl/engine/serve.py
`Metrics`): requests by endpoint and HTTP status, prompt and completion tokens, latency.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import socket
import threading
import time
from typing import Any

import uvicorn
from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from rl.engine.driver import Driver
from rl.engine.openai_jobs import Job, Params
from rl.engine.openai_protocol import APIError, ChatRequest, CompletionRequest, encode, invalid, parse, render_chat
from rl.engine.openai_responses import (
    Gone,
    SSEStream,
    chat_body,
    chat_stream,
    completion_body,
    completion_stream,
    engine_error,
)
from rl.engine.serve import check_access
from rl.engine.sessions import Sessions, check_session_id, continue_chat, first_difference
from tool_formats import style_of

log = logging.getLogger(__name__)

GLM_STOPS = ("<|user|>", "<|observation|>", "<|endoftext|>")
SESSION_HEADER = "x-session-id"
DISCONNECT_POLL_S = 0.25  # how often a non-streaming request checks that its client is still there


def default_stop_ids(tokenizer) -> tuple[int, ...]:
    """The tokenizer's eos and GLM's turn-ending role tokens, when its vocabulary has them."""
    ids = [tokenizer.eos_token_id] + [tokenizer.convert_tokens_to_ids(t) for t in GLM_STOPS]
    return tuple(dict.fromkeys(int(t) for t in ids if t is not None and t != tokenizer.unk_token_id))


class OpenAIServer:
    """The API over `driver`, with `tokenizer` (a transformers tokenizer; its chat template,
    when it has one, serves /v1/chat/completions) as model `model_name`.

    auth_token: what requests must send as `Authorization: Bearer <token>` (None: open).
    metrics: the gRPC server's rl.engine.serve.Metrics, to count in the same registry.
    max_len: the context (prompt + max_tokens) the API allows, at most the engine's.
    stop_ids: the tokens that end a reply (default `default_stop_ids(tokenizer)`).
    start_driver: `start` starts the driver's thread when it is not running; False for a
    driver that its owner steps (the RL loop), to which the server only submits.
    `sessions`: rl/engine/sessions.py's Sessions, the agent-RL record."""

    def __init__(self, driver: Driver, tokenizer, model_name: str, *, auth_token: str | None = None,
                 metrics=None, max_len: int | None = None, stop_ids=None, max_sessions: int = 4096,
                 start_driver: bool = True):
        engine = driver.engine
        if max_len is not None and not 2 <= max_len <= engine.max_len:
            raise ValueError(f"max_len={max_len} must be in [2, the engine's max_len={engine.max_len}]")
        self.driver, self.tokenizer, self.model_name, self.metrics = driver, tokenizer, model_name, metrics
        self.max_len = max_len or engine.max_len
        self.room = self.max_len - engine.num_draft - 1  # Driver.validate's limit: a verify step writes num_draft + 1
        self.stop_ids = tuple(stop_ids) if stop_ids is not None else default_stop_ids(tokenizer)
        self.template = getattr(tokenizer, "chat_template", None)
        try:
            self.tool_style = style_of(self.template)
        except ValueError:
            self.tool_style = None
        self._expected = None if auth_token is None else f"Bearer {auth_token}".encode()
        self.sessions = Sessions(max_sessions)
        self.created = int(time.time())
        self.start_driver = start_driver
        self.app = self._app()
        self._uvicorn = self._thread = None
        self.host, self.port = None, None

    # Running ---------------------------------------------------------------------------
    def start(self, host: str = "127.0.0.1", port: int = 0, *, insecure: bool = False) -> "OpenAIServer":
        """Binds host:port (0: a free port; OSError naming it when taken) and serves in a
        daemon thread; starts the driver's thread (unless start_driver=False). A non-loopback
        host needs a token or `insecure` (rl/engine/serve.py's rule)."""
        check_access(host, None if self._expected is None else "set", insecure)
        try:
            family, kind, proto, _, address = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)[0]
        except socket.gaierror as err:
            raise OSError(f"cannot listen on {host}:{port}: {host} does not resolve ({err.strerror})") from None
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as err:
            sock.close()
            raise OSError(f"cannot listen on {host}:{port}: {err.strerror}") from None
        sock.listen(128)
        self.host, self.port = host, sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="warning", lifespan="off", timeout_graceful_shutdown=2)
        self._uvicorn = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._uvicorn.run, kwargs={"sockets": [sock]},
                                        name="glmjax-openai", daemon=True)
        if self.start_driver and not self.driver.running:
            self.driver.start()
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise OSError(f"the HTTP server on {host}:{self.port} did not start")
            time.sleep(0.01)
        return self

    @property
    def url(self) -> str:
        host = f"[{self.host.strip('[]')}]" if self.host and ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def base_url(self) -> str:
        """What an OpenAI client takes as base_url."""
        return f"{self.url}/v1"

    def session_url(self, session_id: str) -> str:
        """A base_url whose every call belongs to session `session_id` (letters, digits and
        . _ : @ -, as a URL path segment allows unescaped)."""
        return f"{self.url}/sessions/{check_session_id(session_id)}/v1"

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()

    def stop(self) -> None:
        """Stops serving (requests in flight get 2 s); the driver keeps running."""
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
            self._thread.join(timeout=10)
            self._uvicorn = self._thread = None

    # Metrics ---------------------------------------------------------------------------
    def count(self, endpoint: str, status: int | None, started: float, prompt_tokens: int = 0,
              completion_tokens: int = 0) -> None:
        m = self.metrics
        if m is None:
            return
        if status is not None:
            m.http_requests.labels(endpoint=endpoint, status=str(status)).inc()
            m.http_latency.labels(endpoint=endpoint).observe(time.perf_counter() - started)
        if prompt_tokens or completion_tokens:
            m.http_tokens.labels(endpoint=endpoint, kind="prompt").inc(prompt_tokens)
            m.http_tokens.labels(endpoint=endpoint, kind="completion").inc(completion_tokens)

    # The app ---------------------------------------------------------------------------
    def _app(self) -> FastAPI:
        app = FastAPI(title="glmjax OpenAI-compatible API", docs_url=None, redoc_url=None, openapi_url=None)

        @app.exception_handler(HTTPException)
        async def _http_error(request, exc):  # unknown routes (404) and methods (405), as OpenAI's body
            code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
            self.count("other", exc.status_code, time.perf_counter())
            error = APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code=code)
            return JSONResponse(error.body(), status_code=exc.status_code)

        def route(path: str, endpoint: str, handler, method: str) -> None:
            async def serve(request, session_id: str | None = None):
                started = time.perf_counter()
                try:
                    response = await handler(request, session_id, started)
                except APIError as err:
                    self.count(endpoint, err.status, started)
                    return JSONResponse(err.body(), status_code=err.status)
                except Exception as err:  # a bug must cost one request, not the server
                    log.exception("%s failed", path)
                    self.count(endpoint, 500, started)
                    body = APIError(500, f"internal error: {type(err).__name__}: {err}", type="server_error").body()
                    return JSONResponse(body, status_code=500)
                if isinstance(response, dict):
                    self.count(endpoint, 200, started)
                    return JSONResponse(response)
                return response  # a stream counts itself when it ends

            async def plain(request: HTTPRequest):
                return await serve(request)

            async def in_session(session_id: str, request: HTTPRequest):
                return await serve(request, session_id)

            app.add_api_route(path, plain, methods=[method])
            app.add_api_route("/sessions/{session_id}" + path, in_session, methods=[method])

        route("/v1/models", "models", self._models, "GET")
        route("/v1/models/{model:path}", "models", self._model, "GET")
        route("/v1/completions", "completions", self._completions, "POST")
        route("/v1/chat/completions", "chat.completions", self._chat, "POST")

        @app.get("/health")
        async def health():
            ok = self.driver.running
            return JSONResponse({"status": "ok" if ok else "engine stopped"}, status_code=200 if ok else 503)

        return app

    def _authorize(self, request) -> None:
        if self._expected is None:
            return
        sent = request.headers.get("authorization")
        if sent is None:
            raise APIError(401, "no Authorization header: send 'Authorization: Bearer <token>'",
                           code="invalid_api_key")
        if not hmac.compare_digest(sent.encode(), self._expected):
            raise APIError(401, "the Authorization header does not carry this server's token",
                           code="invalid_api_key")

    def _check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(404, f"The model {model!r} does not exist: this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    def _card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "glmjax",
                "max_model_len": self.max_len}

    async def _models(self, request, session_id, started) -> dict:
        self._authorize(request)
        return {"object": "list", "data": [self._card()]}

    async def _model(self, request, session_id, started) -> dict:
        self._authorize(request)
        self._check_model(request.path_params["model"])
        return self._card()

    def _session_id(self, request, session_id: str | None) -> str | None:
        header = request.headers.get(SESSION_HEADER)
        if header is not None and session_id is not None and header != session_id:
            raise invalid("X-Session-Id", f"{header!r} differs from the URL's session {session_id!r}")
        session_id = session_id if session_id is not None else header
        if session_id is not None:
            try:
                check_session_id(session_id)
            except ValueError as err:
                raise invalid("X-Session-Id" if header is not None else "session_id", str(err)) from None
        return session_id

    def _budget(self, prompt: list[int], max_tokens: int | None, what: str) -> int:
        """max_tokens, checked against the context; its default is the rest of the context."""
        total = len(prompt) + (max_tokens or 1)
        if total > self.room:
            asked = f"{len(prompt)} in the {what}" + (f", {max_tokens} in the completion" if max_tokens else "")
            raise APIError(400, f"This model's maximum context length is {self.room} tokens. However, you requested "
                                f"{total} tokens ({asked}). Please reduce the length of the {what} or completion.",
                           param=what, code="context_length_exceeded")
        return max_tokens or self.room - len(prompt)

    async def _join(self, session_id: str | None, body) -> Any:
        """The session a call belongs to, its lock held (released by Job.close)."""
        if session_id is None:
            return None
        if body.n != 1:
            raise invalid("n", f"a session is one trajectory: n must be 1, found {body.n}")
        session = self.sessions.join(session_id)
        if session.lock is None:
            session.lock = asyncio.Lock()
        await session.lock.acquire()
        return session

    async def _run(self, request, job: Job, stream, body) -> Any:
        """Submits the job, then streams it (`stream(server, job)`, SSE events) or waits for
        it and answers `body(server, job)`, cancelling it when the client leaves."""
        try:
            job.submit()
        except ValueError as err:
            job.close(None)
            raise invalid("prompt" if job.endpoint == "completions" else "messages", str(err)) from None
        if job.body.stream:
            return SSEStream(stream(self, job), job)
        try:
            events, pending = job.events(), None
            while True:
                pending = pending or asyncio.ensure_future(anext(events))
                done, _ = await asyncio.wait({pending}, timeout=DISCONNECT_POLL_S)
                if not done:
                    if await request.is_disconnected():
                        pending.cancel()
                        job.close(499)
                        return Gone()
                    continue
                if isinstance(pending.exception(), StopAsyncIteration):
                    break
                pending.result()  # raises what the job's events raised
                pending = None
        finally:
            job.close(None)
        error = engine_error(job)
        if error is not None:
            raise error
        return body(self, job)

    def _job(self, endpoint: str, body, prompts, session, session_id, budget, top_logprobs, started, **record) -> Job:
        params = Params(budget, 1.0 if body.temperature is None else body.temperature,
                        secrets.randbits(31) if body.seed is None else body.seed, top_logprobs, session_id)
        job = Job(self, endpoint, prompts, body.n, params, body.stops, session, started=started, **record)
        job.body = body
        return job

    async def _completions(self, request, session_id, started):
        self._authorize(request)
        body = parse(CompletionRequest, await request.body())
        body.check()
        self._check_model(body.model)
        if body.logprobs is not None and body.logprobs > self.driver.engine.max_top_logprobs:
            raise invalid("logprobs", f"at most {self.driver.engine.max_top_logprobs}, found {body.logprobs}")
        prompts = body.prompts(self.tokenizer, lambda text: encode(self.tokenizer, text))
        budget = min(self._budget(p, body.max_tokens, "prompt") for p in prompts)
        session_id = self._session_id(request, session_id)
        if session_id is not None and len(prompts) != 1:
            raise invalid("prompt", "a session is one trajectory: send one prompt")
        session = await self._join(session_id, body)
        try:
            # the client sends the whole prompt: it continues the session when it starts with the history
            diverged = first_difference(session.history, prompts[0][:len(session.history)]) if session else None
            job = self._job("completions", body, prompts, session, session_id, budget, body.logprobs or 0, started,
                            diverged_at=diverged)
        except BaseException:
            if session is not None:
                session.lock.release()
            raise
        return await self._run(request, job, completion_stream, completion_body)

    async def _chat(self, request, session_id, started):
        self._authorize(request)
        body = parse(ChatRequest, await request.body())
        body.check()
        self._check_model(body.model)
        if self.template is None:
            raise APIError(400, f"{self.model_name} has no chat template: use /v1/completions", param="messages",
                           code="no_chat_template")
        if body.top_logprobs is not None and body.top_logprobs > self.driver.engine.max_top_logprobs:
            raise invalid("top_logprobs", f"at most {self.driver.engine.max_top_logprobs}, found {body.top_logprobs}")
        messages, tools = body.template_messages(), body.tool_dicts
        session_id = self._session_id(request, session_id)
        session = await self._join(session_id, body)
        try:
            prompt, diverged = continue_chat(session.history if session else [], messages,
                                             lambda m, gen: render_chat(self.tokenizer, m, tools, gen),
                                             lambda text: encode(self.tokenizer, text), self.stop_ids)
            budget = self._budget(prompt, body.budget, "messages")
            top = (body.top_logprobs or 0) if body.logprobs else 0
            job = self._job("chat.completions", body, [prompt], session, session_id, budget, top, started,
                            messages=messages, diverged_at=diverged)
        except BaseException:
            if session is not None:
                session.lock.release()
            raise
        job.tools = tools
        return await self._run(request, job, chat_stream, chat_body)
