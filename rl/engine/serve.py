"""JetStream's gRPC protocol (the Orchestrator service of google-jetstream 0.2.2) in front
of the in-process Driver, or of a Router over other glmjax-serve servers.

The command line is rl/engine/cli.py; this module is the service, its server and a client:

    server = start_server(driver_or_router, host, port, token=...)
    Client(f"127.0.0.1:{server.port}").decode(token_ids, max_tokens)

`Decode(DecodeRequest) -> stream DecodeResponse`: token-in, token-out. The request's
`token_content.token_ids` is the prompt, `max_tokens` the budget and `session_cache`, when
set, the session whose cached prefix a follow-up turn reuses. Each generate step sends
one `stream_content` with the new token ids (JetStream's own server sends one per token;
with speculation a step may carry several). `text_content` is refused: the server has no
tokenizer. Malformed requests (no tokens, too long, ids outside the vocabulary, no
budget) end with INVALID_ARGUMENT and the server keeps serving; a client that cancels its
stream frees its slot at the next step. `HealthCheck` answers is_live once the driver runs.

A Router (rl/engine/router.py) over other glmjax-serve servers takes the Driver's place:
the same service hands each Decode call to it, and HealthCheck answers is_live while any
replica answers its own.

Access: with a token (--auth-token, or better $GLMJAX_SERVE_TOKEN, which `ps` does not
show) every Decode must carry the gRPC metadata `authorization: Bearer <token>` (compared
in constant time); a call without it, or with another token, ends with UNAUTHENTICATED and
the server keeps serving. HealthCheck stays open, for load balancers and orchestrators that
probe without credentials; it tells only whether the server is up. Binding a non-loopback
--host needs a token or an explicit --insecure, else the server refuses to start. A router
checks its callers the same way and sends its token on to the replicas.

Metrics (--metrics-port; Prometheus text format over HTTP on --host, no token, counts
only): requests waiting (`glmjax_serve_queue_depth`), slots in use and in all
(`glmjax_serve_slots_in_use`, `glmjax_serve_slots`), tokens handed to requests
(`glmjax_serve_generated_tokens_total`, whose rate() is tokens/s, and the recent rate as
`glmjax_serve_generated_tokens_per_second`), time to first token
(`glmjax_serve_time_to_first_token_seconds`, a histogram), drafts accepted per request
per step when speculating (`glmjax_serve_mtp_accepted_drafts`, a histogram over
0..num_draft) and Decode calls by how they ended (`glmjax_serve_requests_total{status}`:
ok, invalid_argument, unauthenticated, cancelled (by the client or its deadline), error).
With the OpenAI API beside it (glmjax-serve --http-port, rl/engine/openai_api.py), the same
registry also counts its requests by endpoint and HTTP status
(`glmjax_serve_http_requests_total{endpoint,status}`, 499 for a client that left), their
prompt and completion tokens (`glmjax_serve_http_tokens_total{endpoint,kind}`) and the
seconds to each answer's end (`glmjax_serve_http_request_seconds{endpoint}`).
A router exports the requests by status, time to first token, its queue depth and the
replicas' slots in use and in all; each replica counts its own tokens and drafts. Each
server has its own registry.

Needs the `serve` extra (grpcio, protobuf; prometheus-client for --metrics-port).
"""

from __future__ import annotations

import collections
import dataclasses
import hmac
import ipaddress
import itertools
import logging
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent import futures
from typing import Any

from rl.engine import jetstream_proto
from rl.engine.driver import Driver, Request
from rl.engine.router import Router

log = logging.getLogger(__name__)

TOKEN_ENV = "GLMJAX_SERVE_TOKEN"
STATUSES = ("ok", "invalid_argument", "unauthenticated", "cancelled", "error")
# Time to first token, seconds: a warm prefill takes milliseconds, a first compile tens of seconds.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address, IPv6 with or without brackets) is this machine
    only. Names other than localhost count as reachable from outside."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_access(host: str, token: str | None, insecure: bool) -> None:
    """Raises ValueError when `host` is reachable from other machines and neither a token
    nor `insecure` says who may call."""
    if not is_loopback(host) and not token and not insecure:
        raise ValueError(f"--host {host} is reachable from other machines: set ${TOKEN_ENV} (or --auth-token) so "
                         "that clients must send 'authorization: Bearer <token>', or pass --insecure to serve "
                         "anyone who can connect")


class _LoadCollector:
    """Requests waiting, slots in use and slots in all, read from the backend (a Driver or
    a Router) at each scrape."""

    def __init__(self, backend: Driver | Router):
        self.backend = backend

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        b = self.backend
        yield GaugeMetricFamily("glmjax_serve_queue_depth", "Decode requests waiting for a slot", value=b.queued)
        yield GaugeMetricFamily("glmjax_serve_slots_in_use", "Slots holding a request", value=b.active)
        yield GaugeMetricFamily("glmjax_serve_slots", "Slots (concurrent decodes)", value=b.capacity)


class _DriverCollector(_LoadCollector):
    """The load, and the tokens and drafts read from the driver at each scrape (its
    counters are the record)."""

    def __init__(self, driver: Driver, window: float = 60.0):
        super().__init__(driver)
        self.driver, self.window = driver, window
        # (monotonic seconds, tokens) at the start and at each scrape since
        self._samples = collections.deque([(time.monotonic(), driver.stats["tokens"])])
        self._lock = threading.Lock()

    def _rate(self, tokens: int) -> float:
        """Tokens per second since the newest scrape at least `window` seconds old (before
        there is one, since the server started)."""
        now = time.monotonic()
        with self._lock:
            self._samples.append((now, tokens))
            while len(self._samples) > 2 and now - self._samples[1][0] >= self.window:
                self._samples.popleft()
            then, before = self._samples[0]
        return (tokens - before) / (now - then) if now > then else 0.0

    def collect(self):
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        yield from super().collect()
        d = self.driver
        tokens = d.stats["tokens"]
        yield CounterMetricFamily("glmjax_serve_generated_tokens", "Tokens handed to requests", value=tokens)
        yield GaugeMetricFamily("glmjax_serve_generated_tokens_per_second",
                                "Generated tokens per second since the newest scrape a minute old",
                                value=self._rate(tokens))
        if d.engine.num_draft:
            counts = list(d.acceptance)  # [num_draft + 1]: steps of one request that accepted k drafts
            buckets = [(str(float(k)), c) for k, c in enumerate(itertools.accumulate(counts))]
            yield HistogramMetricFamily("glmjax_serve_mtp_accepted_drafts",
                                        "MTP drafts accepted per request per generate step",
                                        buckets=buckets + [("+Inf", sum(counts))],
                                        sum_value=sum(k * c for k, c in enumerate(counts)))


class Metrics:
    """One server's Prometheus metrics (module docstring), in a registry of its own; over a
    Router, the Decode calls and the load only (each replica's server counts its tokens)."""

    def __init__(self, backend: Driver | Router):
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry()
        self.requests = Counter("glmjax_serve_requests", "Decode calls by how they ended", ["status"],
                                registry=self.registry)
        for status in STATUSES:  # every series exists from the start, at 0
            self.requests.labels(status=status)
        self.ttft = Histogram("glmjax_serve_time_to_first_token_seconds",
                              "Seconds from a Decode call's arrival to its first tokens", buckets=TTFT_BUCKETS,
                              registry=self.registry)
        # the OpenAI API beside it (rl/engine/openai_api.py), when one serves the same backend
        self.http_requests = Counter("glmjax_serve_http_requests", "OpenAI API requests by endpoint and HTTP status",
                                     ["endpoint", "status"], registry=self.registry)
        self.http_latency = Histogram("glmjax_serve_http_request_seconds",
                                      "Seconds from an OpenAI API request's arrival to its answer's end", ["endpoint"],
                                      buckets=TTFT_BUCKETS, registry=self.registry)
        self.http_tokens = Counter("glmjax_serve_http_tokens", "Prompt and completion tokens of OpenAI API requests",
                                   ["endpoint", "kind"], registry=self.registry)
        self.registry.register(_DriverCollector(backend) if isinstance(backend, Driver) else _LoadCollector(backend))


class _Outcome:
    """How one Decode call ended, counted once: the first status recorded wins."""

    def __init__(self, metrics: Metrics | None):
        self.metrics, self.status = metrics, None
        self._lock = threading.Lock()

    def __call__(self, status: str) -> None:
        with self._lock:
            if self.status is not None:
                return
            self.status = status
        if self.metrics is not None:
            self.metrics.requests.labels(status=status).inc()


# A replica's status that the router's caller can act on (fix the request, retry later) is
# passed on, with the metrics status it counts as; any other failure is INTERNAL, "error".
_PASSED_ON = {"INVALID_ARGUMENT": "invalid_argument", "UNAVAILABLE": "error"}


class OrchestratorService:
    """The servicer: each Decode call becomes a Request submitted to the shared backend,
    the in-process Driver or a Router over replicas (--route). With a `token`, Decode needs
    `authorization: Bearer <token>`; HealthCheck never does."""

    def __init__(self, backend: Driver | Router, *, token: str | None = None, metrics: Metrics | None = None,
                 temperature: float = 0.0, top_k: int = 0, stop_ids: Sequence[int] = ()):
        self.backend, self.metrics = backend, metrics
        self.pb = jetstream_proto.load()
        self._expected = None if token is None else f"Bearer {token}".encode()
        self.temperature, self.top_k, self.stop_ids = temperature, top_k, tuple(stop_ids)

    def _refusal(self, context) -> str | None:
        """Why the call's credentials are refused; None when they are not needed or right."""
        if self._expected is None:
            return None
        sent = dict(context.invocation_metadata()).get("authorization")
        if sent is None:
            return "no 'authorization' metadata: send 'authorization: Bearer <token>'"
        if not hmac.compare_digest(sent.encode(), self._expected):
            return "the 'authorization' metadata does not carry this server's token"
        return None

    def Decode(self, request, context) -> Iterator:
        import grpc

        start = time.perf_counter()
        ended = _Outcome(self.metrics)
        context.add_callback(lambda: ended("cancelled"))  # the call ended before an outcome: the client left
        refusal = self._refusal(context)
        if refusal:
            ended("unauthenticated")
            context.abort(grpc.StatusCode.UNAUTHENTICATED, refusal)
        kind = request.WhichOneof("content")
        if kind != "token_content":
            ended("invalid_argument")
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"DecodeRequest.{kind or 'content'}: glmjax-serve is token-in/token-out; "
                          "send token_content.token_ids")
        try:
            handle = self.backend.submit(Request(
                prompt=list(request.token_content.token_ids), max_new_tokens=request.max_tokens,
                temperature=self.temperature, top_k=self.top_k, stop_ids=self.stop_ids,
                session_id=request.session_cache or None))
        except ValueError as err:
            ended("invalid_argument")
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"DecodeRequest: {err}")
        context.add_callback(handle.cancel)  # fires when the client goes away (and at the end)
        sample = self.pb.DecodeResponse.StreamContent.Sample
        for i, chunk in enumerate(handle.stream()):
            if i == 0 and self.metrics is not None:
                self.metrics.ttft.observe(time.perf_counter() - start)
            yield self.pb.DecodeResponse(stream_content=self.pb.DecodeResponse.StreamContent(
                samples=[sample(token_ids=chunk)]))
        result = handle.result()
        if result.finish_reason != "error":
            ended("cancelled" if result.finish_reason == "cancelled" else "ok")
            return
        status = (result.error or "").split(":", 1)[0]  # a GrpcReplica's errors start with its status
        if status in _PASSED_ON:
            ended(_PASSED_ON[status])
            context.abort(grpc.StatusCode[status], result.error)
        ended("error")
        context.abort(grpc.StatusCode.INTERNAL, f"generation failed: {result.error}")

    def HealthCheck(self, request, context):
        return self.pb.HealthCheckResponse(is_live=self.backend.running)


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


def check_bind(host: str, port: int) -> None:
    """Raises OSError naming host:port and the socket's reason when it cannot be listened on
    (gRPC itself reports only that binding failed)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as err:
        raise OSError(f"cannot listen on {host}:{port}: {host} does not resolve ({err.strerror})") from None
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC and http.server bind
        try:
            probe.bind(address)
        except OSError as err:
            raise OSError(f"cannot listen on {host}:{port}: {err.strerror}") from None


@dataclasses.dataclass
class Server:
    """A running glmjax-serve: gRPC on `port`, metrics over HTTP on `metrics_port` (None
    without them)."""

    grpc_server: Any
    port: int
    metrics: Metrics | None = None
    metrics_port: int | None = None
    _http: Any = None

    def wait(self) -> None:
        self.grpc_server.wait_for_termination()

    def stop(self, grace: float | None = None) -> None:
        self.grpc_server.stop(grace)
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()


def start_server(backend: Driver | Router, host: str = "127.0.0.1", port: int = 0, *, token: str | None = None,
                 insecure: bool = False, metrics_port: int | None = None, max_workers: int = 64,
                 metrics: Metrics | None = None, **sampling) -> Server:
    """Binds host:port (0 picks a free port) and, with `metrics_port` (0: a free one), the
    metrics endpoint on the same host, then starts the server (and a Driver's thread) in
    front of `backend`: a Driver, or a Router over replicas.
    `token`: what Decode calls must present (module docstring); a non-loopback host needs
    it or `insecure` (ValueError otherwise). OSError naming the address when one cannot be
    bound, before anything starts. `sampling`: temperature, top_k, stop_ids for every
    request. `metrics`: the registry to count in (one the OpenAI API shares), made here by
    default when `metrics_port` is given."""
    import grpc

    check_access(host, token, insecure)
    check_bind(host, port)
    if metrics_port:
        check_bind(host, metrics_port)
    if metrics is None and metrics_port is not None:
        metrics = Metrics(backend)
    # Without so_reuseport a second server on a busy port fails instead of sharing its traffic.
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=[("grpc.so_reuseport", 0)])
    add_service(server, OrchestratorService(backend, token=token, metrics=metrics, **sampling))
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError:
        bound = 0
    if not bound:
        raise OSError(f"cannot listen on {host}:{port}")
    http, bound_metrics = None, None
    if metrics_port is not None:
        try:
            http = serve_metrics(metrics, host, metrics_port)
        except OSError:
            server.stop(None)
            raise
        bound_metrics = http.server_port
    if isinstance(backend, Driver):
        backend.start()
    server.start()
    return Server(server, bound, metrics, bound_metrics, http)


def serve_metrics(metrics: Metrics, host: str, port: int):
    """The registry in Prometheus' text format over HTTP on host:port (0: a free one), in a
    daemon thread; the http.server it runs (`.server_port`, `.shutdown()`)."""
    from prometheus_client import start_http_server

    try:
        http, _ = start_http_server(port, addr=host.strip("[]"), registry=metrics.registry)
    except OSError as err:
        raise OSError(f"cannot serve metrics on {host}:{port}: {err.strerror or err}") from None
    return http


class Client:
    """A small client for the Orchestrator service (what JetStream's generated stub does).
    `token`: sent as `authorization: Bearer <token>` with every call."""

    def __init__(self, target: str, token: str | None = None):
        import grpc

        self.pb = jetstream_proto.load()
        # gRPC waits up to 120 s between reconnects by default: a server back after an
        # outage would answer its health checks only that long after
        self.channel = grpc.insecure_channel(target, options=[("grpc.max_reconnect_backoff_ms", 5000)])
        self._metadata = (("authorization", f"Bearer {token}"),) if token is not None else None
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
        return self._decode(request, timeout=timeout, metadata=self._metadata)

    def health(self, timeout: float = 10.0) -> bool:
        return self._health(self.pb.HealthCheckRequest(), timeout=timeout, metadata=self._metadata).is_live

    def close(self) -> None:
        self.channel.close()
