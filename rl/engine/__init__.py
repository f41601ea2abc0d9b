"""The rollout engine: a JetStream-API engine over the glmjax model, and what serves it.

Imports `glmjax` (and `tool_formats`, the tool-call formats it shares with envs/) and
nothing of the learning loop (`rl/`), which imports this package.

    engine.py           GlmEngine: prefill / insert / generate over a paged batch of slots
    state.py            what it hands out and keeps: a step's ResultTokens, a Prefix, the DecodeState
    driver.py           Driver: continuous batching of requests in a background thread
    weights.py          WeightStore: versioned weights; publishing is a reference swap or a reshard
    prefix_cache.py     reuse of prompt prefixes' KV across requests
    speculative.py      MTP drafts and their acceptance (speculative decoding)
    quant.py            int8 / int4 weight-only quantisation for serving
    router.py           Router: requests over replicas (drivers or gRPC servers), sticky by session
    groups.py           EngineGroups: engines over blocks of the learner's devices behind a router,
                        a watchdog that rebuilds a group that stops or stalls
    serve.py            the JetStream Orchestrator gRPC service and server over a driver or a
                        router, and its client; the metrics registry both servers count in
    openai_api.py       OpenAIServer: the OpenAI-compatible HTTP API (FastAPI + uvicorn) over a
                        driver: /v1/models, /v1/completions, /v1/chat/completions, tool calls
    openai_protocol.py  its request bodies, errors, chat rendering, detokenizing and stop strings
    openai_jobs.py      one API request in the engine: its samples, streamed text, the record
    sessions.py         Sessions: an agent's calls token for token (SessionCall), for agent RL
    cli.py              glmjax-serve: a checkpoint's server (--quantize int8|int4, --mesh,
                        --http-port for the OpenAI API, ...) or a router over servers (--route)
    jetstream_proto.py  the JetStream protocol's messages, built from its descriptor
"""

from rl.engine.driver import Chunk, Driver, Handle, Request, Result
from rl.engine.engine import GlmEngine
from rl.engine.weights import WeightStore

# The OpenAI API (rl.engine.openai_api.OpenAIServer, rl.engine.sessions.SessionCall) is
# imported from its module: it needs the serving packages (fastapi, uvicorn).
__all__ = ["Chunk", "Driver", "GlmEngine", "Handle", "Request", "Result", "WeightStore"]
