"""The rollout engine: a JetStream-API engine over the glmjax model, and what serves it.

Imports `glmjax` and nothing of the learning loop (`rl/`), which imports this package.

    engine.py           GlmEngine: prefill / insert / generate over a paged batch of slots
    driver.py           Driver: continuous batching of requests in a background thread
    weights.py          WeightStore: versioned weights; publishing is a reference swap or a reshard
    prefix_cache.py     reuse of prompt prefixes' KV across requests
    speculative.py      MTP drafts and their acceptance (speculative decoding)
    quant.py            int8 / int4 weight-only quantisation for serving
    router.py           Router: requests over replicas (drivers or gRPC servers), sticky by session
    serve.py            the JetStream Orchestrator gRPC service and server over a driver or a
                        router, and its client
    cli.py              glmjax-serve: a checkpoint's server (--quantize int8|int4, --mesh, ...)
                        or a router over servers (--route HOST:PORT,...)
    jetstream_proto.py  the JetStream protocol's messages, built from its descriptor
"""

from rl.engine.driver import Driver, Handle, Request, Result
from rl.engine.engine import GlmEngine
from rl.engine.weights import WeightStore

__all__ = ["Driver", "GlmEngine", "Handle", "Request", "Result", "WeightStore"]
