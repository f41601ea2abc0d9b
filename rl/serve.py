"""glmjax-serve: JetStream's gRPC protocol (the Orchestrator service of google-jetstream
0.2.2) in front of the in-process Driver.

    glmjax-serve --checkpoint DIR --host 127.0.0.1 --port 9000 [--slots 8 --max-len 2048]

`Decode(DecodeRequest) -> stream DecodeResponse`: token-in, token-out. The request's
`token_content.token_ids` is the prompt, `max_tokens` the budget and `session_cache`, when
set, the session whose cached prefix a follow-up turn reuses. Each generate step sends
one `stream_content` with the new token ids (JetStream's own server sends one per token;
with speculation a step may carry several). `text_content` is refused: the server has no
tokenizer. Malformed requests (no tokens, too long, ids outside the vocabulary, no
budget) end with INVALID_ARGUMENT and the server keeps serving; a client that cancels its
stream frees its slot at the next step. `HealthCheck` answers is_live once the driver runs.
Needs the `serve` extra (grpcio, protobuf).
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Iterator, Sequence
from concurrent import futures

from rl import jetstream_proto
from rl.driver import Driver, Request

log = logging.getLogger(__name__)


class OrchestratorService:
    """The servicer: each Decode call becomes a Request on the shared Driver."""

    def __init__(self, driver: Driver, *, temperature: float = 0.0, top_k: int = 0, stop_ids: Sequence[int] = ()):
        self.driver = driver
        self.pb = jetstream_proto.load()
        self.temperature, self.top_k, self.stop_ids = temperature, top_k, tuple(stop_ids)

    def Decode(self, request, context) -> Iterator:
        import grpc

        kind = request.WhichOneof("content")
        if kind != "token_content":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"DecodeRequest.{kind or 'content'}: glmjax-serve is token-in/token-out; "
                          "send token_content.token_ids")
        try:
            handle = self.driver.submit(Request(
                prompt=list(request.token_content.token_ids), max_new_tokens=request.max_tokens,
                temperature=self.temperature, top_k=self.top_k, stop_ids=self.stop_ids,
                session_id=request.session_cache or None))
        except ValueError as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"DecodeRequest: {err}")
        context.add_callback(handle.cancel)  # fires when the client goes away (and at the end)
        sample = self.pb.DecodeResponse.StreamContent.Sample
        for chunk in handle.stream():
            yield self.pb.DecodeResponse(stream_content=self.pb.DecodeResponse.StreamContent(
                samples=[sample(token_ids=chunk)]))
        result = handle.result()
        if result.finish_reason == "error":
            context.abort(grpc.StatusCode.INTERNAL, f"generation failed: {result.error}")

    def HealthCheck(self, request, context):
        return self.pb.HealthCheckResponse(is_live=self.driver._thread is not None)


def add_service(server, service: OrchestratorService) -> None:
    import grpc

    pb = service.pb
    handlers = {
        "Decode": grpc.unary_stream_rpc_method_handler(
            service.Decode, request_deserializer=pb.DecodeRequest.FromString,
            response_serializer=pb.DecodeResponse.SerializeToString),
        "HealthCheck": grpc.unary_unary_rpc_method_handler(
            service.HealthCheck, request_deserializer=pb.HealthCheckRequest.FromString,
            response_serializer=pb.HealthCheckResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(jetstream_proto.SERVICE, handlers),))


def start_server(driver: Driver, host: str = "127.0.0.1", port: int = 0, *, max_workers: int = 64, **sampling):
    """Starts the driver's thread and a gRPC server on host:port (0 picks a free port).
    Returns (server, port). `sampling`: temperature, top_k, stop_ids for every request."""
    import grpc

    driver.start()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers))
    add_service(server, OrchestratorService(driver, **sampling))
    bound = server.add_insecure_port(f"{host}:{port}")
    if not bound:
        raise OSError(f"could not bind {host}:{port}")
    server.start()
    return server, bound


class Client:
    """A small client for the Orchestrator service (what JetStream's generated stub does)."""

    def __init__(self, target: str):
        import grpc

        self.pb = jetstream_proto.load()
        self.channel = grpc.insecure_channel(target)
        self._decode = self.channel.unary_stream(jetstream_proto.DECODE,
                                                 request_serializer=self.pb.DecodeRequest.SerializeToString,
                                                 response_deserializer=self.pb.DecodeResponse.FromString)
        self._health = self.channel.unary_unary(jetstream_proto.HEALTH_CHECK,
                                                request_serializer=self.pb.HealthCheckRequest.SerializeToString,
                                                response_deserializer=self.pb.HealthCheckResponse.FromString)

    def decode(self, token_ids: Sequence[int], max_tokens: int, session_id: str | None = None, timeout=None):
        """The response stream (a grpc call: iterate it, or .cancel() it)."""
        request = self.pb.DecodeRequest(max_tokens=max_tokens, session_cache=session_id or "",
                                        token_content=self.pb.DecodeRequest.TokenContent(token_ids=list(token_ids)))
        return self._decode(request, timeout=timeout)

    def health(self, timeout: float = 10.0) -> bool:
        return self._health(self.pb.HealthCheckRequest(), timeout=timeout).is_live

    def close(self) -> None:
        self.channel.close()


def build_driver(args: argparse.Namespace) -> Driver:
    import glmjax
    from rl.engine import GlmEngine

    model = glmjax.from_pretrained(args.checkpoint, dtype=args.dtype)
    engine = GlmEngine(model, max_concurrent_decodes=args.slots, max_len=args.max_len,
                       num_draft=args.num_draft if model.mtp is not None else 0, mtp_mode=args.mtp_mode)
    if args.warmup:
        engine.warmup()
    return Driver(engine, prefix_cache_size=args.prefix_cache)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="glmjax-serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="HF-format directory (config.json + safetensors)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9000)
    p.add_argument("--slots", type=int, default=8, help="concurrent decodes")
    p.add_argument("--max-len", type=int, default=2048, help="tokens per slot: prompt + generated")
    p.add_argument("--num-draft", type=int, default=0, help="MTP drafts per step (0: plain decoding)")
    p.add_argument("--mtp-mode", default="own", choices=("own", "shared"))
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--stop-ids", default="", help="comma-separated token ids that end a response")
    p.add_argument("--prefix-cache", type=int, default=32, help="sessions whose last turn is kept")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--warmup", action="store_true", help="compile every prefill shape before serving")
    return p.parse_args(argv)


def main(argv=None) -> None:
    logging.basicConfig(level=logging.INFO)
    args = parse_args(argv)
    driver = build_driver(args)
    stop_ids = tuple(int(t) for t in args.stop_ids.split(",") if t)
    server, port = start_server(driver, args.host, args.port, temperature=args.temperature, top_k=args.top_k,
                                stop_ids=stop_ids)
    log.info("glmjax-serve: %s on %s:%d (%d slots)", args.checkpoint, args.host, port, args.slots)
    try:
        server.wait_for_termination()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop(grace=1.0)
        driver.stop()


if __name__ == "__main__":
    main()
