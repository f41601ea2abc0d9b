"""glmjax-serve: the command line of the JetStream gRPC server (rl/engine/serve.py) and of
the OpenAI-compatible HTTP API (rl/engine/openai_api.py) over the same engine.

    glmjax-serve --checkpoint DIR --host 127.0.0.1 --port 9000 [--slots 8 --max-len 2048]
    GLMJAX_SERVE_TOKEN=... glmjax-serve --checkpoint DIR --host 0.0.0.0 --metrics-port 9100
    glmjax-serve --checkpoint DIR --quantize int8
    glmjax-serve --checkpoint DIR --http-port 8000             # gRPC on 9000 and HTTP on 8000
    glmjax-serve --checkpoint DIR --port off --http-port 8000  # HTTP only
    glmjax-serve --route 10.0.0.1:9000,10.0.0.2:9000 --port 9000 --slots 8

Flags: --checkpoint (HF-format directory) or --route, --host, --port (gRPC; `off`: none),
--http-port, --model-name, --slots, --max-len, --num-draft and --mtp-mode (MTP
speculation), --temperature, --top-k, --stop-ids, --prefix-cache, --dtype, --quantize,
--mesh, --warmup, --metrics-port, --auth-token, --insecure.

The OpenAI API (`--http-port PORT`, 0: a free one; on --host, beside the gRPC port or
alone with `--port off`): /v1/models, /v1/completions and /v1/chat/completions as model
`--model-name` (default: the checkpoint directory's name), with the tokenizer and chat
template of the checkpoint directory (transformers.AutoTokenizer). A checkpoint without
tokenizer files or without a chat template is refused before any weights load (one error
line): the API's chat endpoint and its sessions need the template. Requests carry their
own sampling settings; --temperature and --top-k are the gRPC server's. The API stops a
reply at generation_config.json's eos ids, the tokenizer's eos, GLM's <|user|> /
<|observation|> / <|endoftext|> when the vocabulary has them, and --stop-ids. Both servers
check the same token (--auth-token / $GLMJAX_SERVE_TOKEN; HTTP clients send
`Authorization: Bearer <token>`, as the OpenAI SDKs do with api_key) and count in the same
metrics registry, served on --metrics-port. --http-port needs --checkpoint: a --route
router has no tokenizer.

With `--mesh tensor=2,expert=2` the checkpoint loads sharded onto that many
devices and the engine decodes on them (experts all-to-all over `expert`, heads and hidden
over `tensor`, sharding.DECODE_RULES). `--quantize int8|int4` serves the model with its
routed experts stored as integers (rl/engine/quant.py: int8 per output channel, int4 per
group of 32), on one device (not with --mesh). A bad value (a checkpoint directory without
config.json or weights, a --max-len past the model's positions, a --quantize other than
int8 or int4, a port in use, ...) ends before serving with the usage line and one
`glmjax-serve: error: ...` naming it, exit status 2.

Routing: `--route HOST:PORT,HOST:PORT` loads no model; the same service hands each Decode
call to rl/engine/router.py's Router over those servers (a GrpcReplica each, --slots
requests at a time: their own --slots). The router queues what does not fit, gives work to
the least loaded replica and sends a session's turns to the replica that holds its prefix.
The model flags (--max-len, --quantize, --temperature, ...) belong on the replicas' command
lines and are refused here. A replica that fails a request with UNAVAILABLE (down) gets no
new work, its sessions move to the others, until its health check answers again; with
every replica down a request fails at once with UNAVAILABLE naming them. A replica's
INVALID_ARGUMENT is passed on as is, its other failures become INTERNAL. HealthCheck answers is_live while any replica
answers its own.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os

from rl.engine.driver import Driver
from rl.engine.router import GrpcReplica, Router
from rl.engine.serve import TOKEN_ENV, Metrics, Server, check_access, check_bind, serve_metrics, start_server

log = logging.getLogger(__name__)

DEFAULT_MAX_LEN = 2048  # tokens per slot, when the checkpoint allows that many


def build_driver(args: argparse.Namespace) -> Driver:
    """The Driver over --checkpoint's model: loaded in --dtype on --mesh, its routed experts
    quantized when --quantize says so (rl/engine/quant.py), behind a GlmEngine."""
    import jax

    import glmjax
    from glmjax import sharding
    from rl.engine import quant
    from rl.engine.engine import GlmEngine

    mesh = None
    if args.mesh:  # the serving layout: experts over `expert`, heads / hidden / vocabulary over `tensor`
        mesh = glmjax.make_mesh(**args.mesh, devices=jax.devices()[:math.prod(args.mesh.values())])
    with sharding.use_rules(sharding.DECODE_RULES):
        model = glmjax.from_pretrained(args.checkpoint, dtype=args.dtype, mesh=mesh)
    if args.quantize:
        model = quant.quantize(model, args.quantize)
    if args.num_draft and model.mtp is None:
        log.warning("--num-draft %d is ignored: %s has no MTP layer", args.num_draft, args.checkpoint)
    engine = GlmEngine(model, max_concurrent_decodes=args.slots, max_len=args.max_len,
                       num_draft=args.num_draft if model.mtp is not None else 0, mtp_mode=args.mtp_mode, mesh=mesh,
                       rules=sharding.DECODE_RULES)
    if args.warmup:
        engine.warmup(top_logprobs=args.http_port is not None)  # the API's log-prob requests run their own programs
    return Driver(engine, prefix_cache_size=args.prefix_cache)


def build_router(args: argparse.Namespace) -> Router:
    """The Router over --route's servers: a GrpcReplica each, given --slots requests at a
    time, sending the router's own token (the replicas share it)."""
    return Router([GrpcReplica(target, capacity=args.slots, token=args.auth_token) for target in args.route])


def start_from_args(args: argparse.Namespace, backend: Driver | Router, metrics: Metrics | None = None) -> Server:
    """start_server with the command line's address, access, metrics and sampling settings."""
    return start_server(backend, args.host, args.port, token=args.auth_token, insecure=args.insecure,
                        metrics_port=args.metrics_port, metrics=metrics, temperature=args.temperature,
                        top_k=args.top_k, stop_ids=args.stop_ids)


def http_stop_ids(args: argparse.Namespace) -> tuple[int, ...]:
    """The tokens that end an API reply: generation_config.json's eos ids, the tokenizer's
    (openai_api.default_stop_ids) and --stop-ids."""
    from rl.engine.openai_api import default_stop_ids

    stops = []
    config = os.path.join(args.checkpoint, "generation_config.json")
    if os.path.isfile(config):
        with open(config) as f:
            eos = json.load(f).get("eos_token_id")
        stops = [eos] if isinstance(eos, int) else list(eos or ())
    return tuple(dict.fromkeys([int(t) for t in stops] + list(default_stop_ids(args.tokenizer)) + list(args.stop_ids)))


def start_http_from_args(args: argparse.Namespace, driver: Driver, metrics: Metrics | None = None):
    """The OpenAI API (rl/engine/openai_api.py) over `driver` on --host:--http-port."""
    from rl.engine.openai_api import OpenAIServer

    server = OpenAIServer(driver, args.tokenizer, args.model_name, auth_token=args.auth_token, metrics=metrics,
                          max_len=args.max_len, stop_ids=http_stop_ids(args))
    return server.start(args.host, args.http_port, insecure=args.insecure)


def _port(text: str) -> int | None:
    """--port: a number, or `off` for no gRPC server."""
    if text == "off":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number or 'off'") from None


QUANTIZE = ("int8", "int4")  # --quantize's choices: rl/engine/quant.py's integer modes


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="glmjax-serve", description=__doc__.split("\n\n")[0])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", metavar="DIR", help="HF-format directory (config.json + safetensors)")
    source.add_argument("--route", metavar="HOST:PORT,...",
                        help="serve no model: route requests to these glmjax-serve replicas, "
                             "comma-separated HOST:PORT, e.g. 10.0.0.1:9000,10.0.0.2:9000")
    p.add_argument("--host", default="127.0.0.1", help="a non-loopback address needs a token or --insecure")
    p.add_argument("--port", type=_port, default=9000,
                   help="the gRPC server's port (0: a free one; off: no gRPC server, with --http-port)")
    p.add_argument("--http-port", type=int, default=None,
                   help="also serve the OpenAI-compatible HTTP API on this port (0: a free one)")
    p.add_argument("--model-name", default=None,
                   help="the model's name in the OpenAI API (default: the checkpoint directory's name)")
    p.add_argument("--slots", type=int, default=8, help="concurrent decodes (with --route: each replica's --slots)")
    p.add_argument("--max-len", type=int, default=None,
                   help="tokens per slot: prompt + generated (default 2048, or the checkpoint's "
                        "max_position_embeddings when smaller)")
    p.add_argument("--num-draft", type=int, default=0, help="MTP drafts per step (0: plain decoding)")
    p.add_argument("--mtp-mode", default="own", choices=("own", "shared"))
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--stop-ids", default="", help="comma-separated token ids that end a response")
    p.add_argument("--prefix-cache", type=int, default=32, help="sessions whose last turn is kept")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--quantize", default=None, choices=QUANTIZE,
                   help="store the routed experts as int8 (per output channel) or int4 (groups of 32); "
                        "default: as loaded")
    p.add_argument("--mesh", default="", help="the engine's mesh, e.g. tensor=2,expert=2 (default: one device)")
    p.add_argument("--warmup", action="store_true", help="compile every prefill shape before serving")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics over HTTP on this port (0: a free one)")
    p.add_argument("--auth-token", default=None,
                   help=f"the token Decode calls must send (default ${TOKEN_ENV}, which ps does not show); "
                        "with --route also sent to the replicas")
    p.add_argument("--insecure", action="store_true", help="allow a non-loopback --host without a token")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, checked against the checkpoint's config.json before any weights
    load (with --route, checked without one); a bad value is `parser.error` (exit status
    2). `auth_token` falls back to $GLMJAX_SERVE_TOKEN, `stop_ids` becomes a tuple of ints
    and `route` a list of "host:port"."""
    parser = make_parser()
    args = parser.parse_args(argv)
    args.auth_token = args.auth_token or os.environ.get(TOKEN_ENV) or None
    try:
        if args.route is not None:
            _check_route(args, parser)
        else:
            _check_args(args)
            _check_http(args)
    except ValueError as err:
        parser.error(str(err))
    return args


# Flags that set up a served model; a router's replicas take them on their own command lines.
_MODEL_FLAGS = ("max_len", "num_draft", "mtp_mode", "temperature", "top_k", "stop_ids", "prefix_cache", "dtype",
                "quantize", "mesh", "warmup", "http_port", "model_name")


def _check_route(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """--route as a list of distinct "host:port", without model flags."""
    for dest in _MODEL_FLAGS:
        if getattr(args, dest) != parser.get_default(dest):
            raise ValueError(f"--{dest.replace('_', '-')} sets up a served model: with --route, give it to each "
                             "replica's own glmjax-serve --checkpoint command line")
    targets = [t.strip() for t in args.route.split(",") if t.strip()]
    for target in targets:
        host, _, port = target.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) <= 65535:
            raise ValueError(f"--route {args.route!r}: {target!r} is not HOST:PORT; expected comma-separated "
                             "replicas, e.g. 10.0.0.1:9000,10.0.0.2:9000")
    if not targets:
        raise ValueError(f"--route {args.route!r} names no replica: expected HOST:PORT,HOST:PORT")
    twice = sorted({t for t in targets if targets.count(t) > 1})
    if twice:
        raise ValueError(f"--route lists {', '.join(twice)} more than once: name each replica once")
    if args.slots < 1:
        raise ValueError(f"--slots {args.slots} must be >= 1")
    _check_listen(args)
    args.route, args.stop_ids = targets, ()


def _check_listen(args: argparse.Namespace) -> None:
    """--port, --http-port and --metrics-port in range and distinct, at least one server,
    and --host allowed by the access rule."""
    ports = (("--port", args.port), ("--http-port", args.http_port), ("--metrics-port", args.metrics_port))
    for flag, port in ports:
        if port is not None and not 0 <= port <= 65535:
            raise ValueError(f"{flag} {port} must be in [0, 65535]")
    if args.port is None and args.http_port is None:
        raise ValueError("--port off serves nothing: add --http-port PORT for the OpenAI API, or give --port a number")
    named = [(flag, port) for flag, port in ports if port]
    for i, (flag, port) in enumerate(named):
        for other, same in named[i + 1:]:
            if port == same:
                raise ValueError(f"{flag} and {other} are both {port}: each server needs its own port")
    check_access(args.host, args.auth_token, args.insecure)


def _check_http(args: argparse.Namespace) -> None:
    """With --http-port: the checkpoint's tokenizer loads and has a chat template (kept as
    args.tokenizer), and --model-name defaults to the directory's name."""
    args.tokenizer = None
    if args.http_port is None:
        return
    from transformers import AutoTokenizer

    path = args.checkpoint
    try:
        args.tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError) as err:
        raise ValueError(f"--http-port needs the tokenizer of --checkpoint {path}, which does not load "
                         f"({type(err).__name__}: {' '.join(str(err).split())[:200]}); expected tokenizer.json or "
                         "the tokenizer's own files beside config.json") from None
    if not getattr(args.tokenizer, "chat_template", None):
        raise ValueError(f"--http-port needs a chat template: --checkpoint {path}'s tokenizer has none (add "
                         "chat_template.jinja beside tokenizer_config.json)")
    args.model_name = args.model_name or os.path.basename(os.path.normpath(path))


def _check_args(args: argparse.Namespace) -> None:
    from glmjax.config import ModelConfig

    path = args.checkpoint
    if not os.path.isdir(path):
        raise ValueError(f"--checkpoint {path} {'is not a directory' if os.path.exists(path) else 'does not exist'}")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"--checkpoint {path} has no config.json: expected a Hugging Face-format directory "
                         "(config.json + *.safetensors), as glmjax.save_pretrained writes")
    if not any(f.endswith(".safetensors") for f in os.listdir(path)):
        raise ValueError(f"--checkpoint {path} has no *.safetensors weights")
    try:
        config = ModelConfig.from_hf(path)
    except (OSError, ValueError, TypeError) as err:  # unreadable or invalid JSON, an unsupported model
        raise ValueError(f"--checkpoint {path}: config.json: {err}") from None
    if args.max_len is None:
        args.max_len = min(DEFAULT_MAX_LEN, config.max_position_embeddings)
    if not 2 <= args.max_len <= config.max_position_embeddings:
        raise ValueError(f"--max-len {args.max_len} must be in [2, {config.max_position_embeddings}] "
                         f"(the checkpoint's max_position_embeddings)")
    for flag, value, low in (("--slots", args.slots, 1), ("--num-draft", args.num_draft, 0),
                             ("--prefix-cache", args.prefix_cache, 0), ("--temperature", args.temperature, 0)):
        if value < low:
            raise ValueError(f"{flag} {value} must be >= {low}")
    top_k = min(64, config.vocab_size)  # GlmEngine's max_top_k
    if not 0 <= args.top_k <= top_k:
        raise ValueError(f"--top-k {args.top_k} must be in [0, {top_k}]")
    try:
        args.stop_ids = tuple(int(t) for t in args.stop_ids.split(",") if t.strip())
    except ValueError:
        raise ValueError(f"--stop-ids {args.stop_ids!r} must be comma-separated token ids, e.g. 1,2") from None
    bad = [t for t in args.stop_ids if not 0 <= t < config.vocab_size]
    if bad:
        raise ValueError(f"--stop-ids {bad} lie outside the vocabulary [0, {config.vocab_size})")
    args.mesh = _check_mesh(args.mesh)
    if args.quantize and args.mesh:
        raise ValueError(f"--quantize {args.quantize} serves on one device: drop --mesh "
                         f"{','.join(f'{k}={v}' for k, v in args.mesh.items())} (quantized experts have no "
                         "sharded layout)")
    _check_listen(args)


def _check_mesh(text: str) -> dict[str, int]:
    """--mesh as axis sizes, on no more devices than this process sees."""
    import jax

    from glmjax import sharding

    try:
        sizes = sharding.parse_axes(text)
    except ValueError as err:
        raise ValueError(f"--mesh: {err}") from None
    needed, available = math.prod(sizes.values()), len(jax.devices())
    if needed > available:
        raise ValueError(f"--mesh {text} needs {needed} devices, {available} are available")
    return sizes


def main(argv=None) -> None:
    from safetensors import SafetensorError

    from glmjax.hf import CheckpointMismatch

    logging.basicConfig(level=logging.INFO)
    args = parse_args(argv)
    if args.http_port:  # a taken port is found before the weights load
        try:
            check_bind(args.host, args.http_port)
        except OSError as err:
            make_parser().error(str(err))
    if args.route:
        backend = build_router(args)
    else:
        try:
            backend = build_driver(args)
        except (OSError, json.JSONDecodeError, CheckpointMismatch, SafetensorError) as err:
            make_parser().error(f"--checkpoint {args.checkpoint}: {err}")
    metrics = Metrics(backend) if args.metrics_port is not None else None
    server = http = metrics_http = None
    try:
        if args.port is not None:
            server = start_from_args(args, backend, metrics)
        elif metrics is not None:
            metrics_http = serve_metrics(metrics, args.host, args.metrics_port)
        if args.http_port is not None:
            http = start_http_from_args(args, backend, metrics)
    except OSError as err:
        for running in (server, http):
            if running is not None:
                running.stop()
        make_parser().error(str(err))
    metrics_port = server.metrics_port if server is not None else metrics_http and metrics_http.server_port
    if args.route:
        for replica in backend.replicas:
            if not replica.running:
                log.warning("glmjax-serve: replica %s does not answer HealthCheck: its requests fail with "
                            "UNAVAILABLE until it does", replica.target)
        what, slots = f"a router over {', '.join(args.route)}", f"{args.slots} slots each"
    else:
        what, slots = args.checkpoint, f"{args.slots} slots" + (f", {args.quantize} experts" if args.quantize else "")
    where = ([f"gRPC on {args.host}:{server.port}"] if server else []) + ([f"OpenAI API on {http.base_url} as "
                                                                            f"{args.model_name!r}"] if http else [])
    log.info("glmjax-serve: %s, %s (%s%s%s)", what, " and ".join(where), slots,
             ", token required" if args.auth_token else "",
             f", metrics on http://{args.host}:{metrics_port}/metrics" if metrics is not None else "")
    try:
        server.wait() if server is not None else http.wait()
    except KeyboardInterrupt:
        pass
    finally:
        if http is not None:
            http.stop()
        if server is not None:
            server.stop(grace=1.0)
        if metrics_http is not None:
            metrics_http.shutdown()
        backend.stop()


if __name__ == "__main__":
    main()
