"""rl/engine/serve.py and its command line (rl/engine/cli.py): JetStream's Orchestrator protocol on 127.0.0.1, from a checkpoint directory;
its Prometheus metrics, its token check, and its one-line errors for bad command lines."""

import os
import shutil
import socket
import time
import types
import urllib.request

import grpc
import jax.numpy as jnp
import pytest
from prometheus_client.parser import text_string_to_metric_families

import glmjax
from rl.engine import cli as serve_cli
from rl.engine import jetstream_proto, quant, serve
from rl.engine.driver import Request
from rl.engine.router import GrpcReplica, Router
from tests.engine_util import TINY, greedy_reference, prompts

MAX_LEN = 64
TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The tiny model behind a server with metrics (no token) and, on the same driver, a
    second server that requires TOKEN."""
    path = tmp_path_factory.mktemp("tiny")
    model = glmjax.init_model(TINY, seed=0)
    glmjax.save_pretrained(model, path)
    args = serve_cli.parse_args(["--checkpoint", str(path), "--host", "127.0.0.1", "--port", "0", "--slots", "2",
                             "--max-len", str(MAX_LEN)])
    driver = serve_cli.build_driver(args)
    srv = serve.start_server(driver, args.host, args.port, metrics_port=0)
    secured = serve.start_server(driver, "127.0.0.1", 0, token=TOKEN, metrics_port=0)
    client = serve.Client(f"127.0.0.1:{srv.port}")
    yield types.SimpleNamespace(driver=driver, client=client, server=srv, secured=secured, model=model, path=path)
    client.close()
    srv.stop(grace=None)
    secured.stop(grace=None)
    driver.stop()


def _tokens(stream):
    return [t for response in stream for s in response.stream_content.samples for t in s.token_ids]


def test_decode_streams_the_greedy_tokens(server):
    client, model = server.client, server.model
    assert client.health()
    p = prompts([7], seed=20)[0]
    responses = list(client.decode(p, max_tokens=9, timeout=300))
    assert len(responses) >= 2  # streamed, one message per step
    assert _tokens(responses) == greedy_reference(model, p, 9)


@pytest.mark.parametrize("tokens, max_tokens, message", [
    ([], 4, "prompt is empty"),
    ([1] * 60, 10, "exceeds the engine's limit"),
    ([1, TINY.vocab_size + 5], 4, "outside the vocabulary"),
    ([1, -3], 4, "outside the vocabulary"),
    ([1, 2], 0, "max_new_tokens"),
])
def test_malformed_requests_get_invalid_argument_and_the_server_keeps_serving(server, tokens, max_tokens, message):
    client = server.client
    with pytest.raises(grpc.RpcError) as err:
        _tokens(client.decode(tokens, max_tokens=max_tokens, timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in err.value.details()
    assert len(_tokens(client.decode([3, 4, 5], max_tokens=2, timeout=300))) == 2


def test_text_content_is_refused(server):
    pb = jetstream_proto.load()
    with grpc.insecure_channel(f"127.0.0.1:{server.server.port}") as channel:
        decode = channel.unary_stream(jetstream_proto.DECODE, request_serializer=pb.DecodeRequest.SerializeToString,
                                      response_deserializer=pb.DecodeResponse.FromString)
        with pytest.raises(grpc.RpcError) as err:
            list(decode(pb.DecodeRequest(max_tokens=3, text_content=pb.DecodeRequest.TextContent(text="hi")),
                        timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "token_content" in err.value.details()


def test_a_cancelled_stream_frees_its_slot_and_counts_as_cancelled(server):
    driver, client = server.driver, server.client
    before = _scrape(server.server)
    call = client.decode(prompts([5], seed=21)[0], max_tokens=50, timeout=300)
    next(call)  # generating now
    call.cancel()
    deadline = time.monotonic() + 120
    while (driver.load or _scrape(server.server)[_REQUESTS("cancelled")] == before[_REQUESTS("cancelled")]) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    assert driver.load == 0 and all(s is None for s in driver._slots)
    after = _scrape(server.server)
    assert after[_REQUESTS("cancelled")] - before[_REQUESTS("cancelled")] == 1
    assert after[_REQUESTS("ok")] == before[_REQUESTS("ok")]


def test_session_cache_reuses_the_prefix_and_router_talks_grpc(server):
    """A GrpcReplica behind the router: a second turn with the same session_cache reuses
    the server's cached prefix."""
    driver, model = server.driver, server.model
    router = Router([GrpcReplica(f"127.0.0.1:{server.server.port}", capacity=2)])
    p = prompts([7], seed=22)[0]
    first = router.submit(Request(p, 5, session_id="chat")).result(timeout=300)
    before = driver.stats["reused_tokens"]
    second = router.submit(Request(p + first.tokens + [9], 3, session_id="chat")).result(timeout=300)
    assert first.tokens == greedy_reference(model, p, 5) and len(second.tokens) == 3
    assert driver.stats["reused_tokens"] - before == 7 + 5 - 1
    assert first.finish_reason == "length" and first.versions == [-1] * 5


def _REQUESTS(status):
    return ("glmjax_serve_requests_total", (("status", status),))


def _scrape(srv) -> dict:
    """{(sample name, labels): value} from the server's metrics endpoint, over HTTP."""
    with urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics", timeout=30) as response:
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_count_requests_tokens_and_time_to_first_token(server):
    client, srv = server.client, server.server
    before = _scrape(srv)
    assert before[("glmjax_serve_slots", ())] == 2
    assert len(_tokens(client.decode(prompts([6], seed=23)[0], max_tokens=6, timeout=300))) == 6
    with pytest.raises(grpc.RpcError):
        _tokens(client.decode([], max_tokens=3, timeout=60))
    after = _scrape(srv)
    delta = lambda key: after[key] - before[key]  # noqa: E731
    assert delta(_REQUESTS("ok")) == 1 and delta(_REQUESTS("invalid_argument")) == 1
    assert delta(_REQUESTS("error")) == 0 and delta(_REQUESTS("unauthenticated")) == 0
    assert delta(("glmjax_serve_generated_tokens_total", ())) == 6
    assert delta(("glmjax_serve_time_to_first_token_seconds_count", ())) == 1
    assert delta(("glmjax_serve_time_to_first_token_seconds_sum", ())) > 0
    assert after[("glmjax_serve_generated_tokens_per_second", ())] > 0  # tokens came since an earlier scrape
    assert after[("glmjax_serve_queue_depth", ())] == 0 and after[("glmjax_serve_slots_in_use", ())] == 0
    assert not any(name.startswith("glmjax_serve_mtp") for name, _ in after)  # no speculation here


def test_a_missing_or_wrong_token_is_unauthenticated_and_the_right_one_is_served(server):
    secured, target = server.secured, f"127.0.0.1:{server.secured.port}"
    p = prompts([6], seed=24)[0]
    expected = _tokens(server.client.decode(p, max_tokens=4, timeout=300))
    before = _scrape(secured)
    for token, message in ((None, "no 'authorization' metadata"), ("wrong", "does not carry this server's token")):
        client = serve.Client(target, token=token)
        with pytest.raises(grpc.RpcError) as err:
            _tokens(client.decode(p, max_tokens=4, timeout=60))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED and message in err.value.details()
        assert client.health()  # HealthCheck needs no token
        client.close()
    client = serve.Client(target, token=TOKEN)
    assert _tokens(client.decode(p, max_tokens=4, timeout=300)) == expected
    client.close()
    router = Router([GrpcReplica(target, capacity=1, token=TOKEN)])  # a router in front passes the token on
    handle = router.submit(Request(prompt=p, max_new_tokens=4))
    assert handle.result(timeout=300).tokens == expected
    after = _scrape(secured)
    assert after[_REQUESTS("unauthenticated")] - before[_REQUESTS("unauthenticated")] == 2
    assert after[_REQUESTS("ok")] - before[_REQUESTS("ok")] == 2


def test_a_non_loopback_host_needs_a_token_or_insecure(server, monkeypatch, capsys):
    argv = ["--checkpoint", str(server.path), "--max-len", str(MAX_LEN), "--host", "0.0.0.0"]
    monkeypatch.delenv(serve.TOKEN_ENV, raising=False)
    with pytest.raises(SystemExit) as exit_:
        serve_cli.parse_args(argv)
    line = _one_error_line(exit_, capsys)
    assert line.startswith("glmjax-serve: error: --host 0.0.0.0 is reachable from other machines: set "
                           "$GLMJAX_SERVE_TOKEN (or --auth-token)") and "or pass --insecure" in line
    assert serve_cli.parse_args(argv + ["--insecure"]).auth_token is None
    monkeypatch.setenv(serve.TOKEN_ENV, TOKEN)
    assert serve_cli.parse_args(argv).auth_token == TOKEN
    with pytest.raises(ValueError, match="is reachable from other machines"):
        serve.start_server(server.driver, "0.0.0.0", 0)
    assert serve.is_loopback("localhost") and serve.is_loopback("[::1]") and serve.is_loopback("127.0.0.2")
    assert not serve.is_loopback("::") and not serve.is_loopback("my-host")


def _one_error_line(exit_, capsys) -> str:
    """The `prog: error: message` line of a parser.error exit, checked to be the only one."""
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.startswith("usage: glmjax-serve")
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and err.rstrip("\n").endswith(errors[0]), err
    return errors[0]


def _checkpoint_variant(tmp_path, source, kind):
    """A copy of the tiny checkpoint directory broken one way."""
    path = tmp_path / kind
    shutil.copytree(source, path)
    if kind == "no_config":
        os.remove(path / "config.json")
    elif kind == "no_weights":
        for f in path.glob("*.safetensors"):
            os.remove(f)
    elif kind == "bad_config":
        (path / "config.json").write_text('{"vocab_size": 128,')
    elif kind == "truncated_weights":
        (weights,) = path.glob("*.safetensors")
        os.truncate(weights, weights.stat().st_size // 2)
    return path


@pytest.mark.parametrize("kind, extra, message", [
    ("missing", [], "--checkpoint {path} does not exist"),
    ("file", [], "--checkpoint {path} is not a directory"),
    ("no_config", [], "--checkpoint {path} has no config.json: expected a Hugging Face-format directory"),
    ("no_weights", [], "--checkpoint {path} has no *.safetensors weights"),
    ("bad_config", [], "--checkpoint {path}: config.json: Expecting property name"),
    ("good", ["--max-len", "4096"], "--max-len 4096 must be in [2, 256] (the checkpoint's max_position_embeddings)"),
    ("good", ["--slots", "0"], "--slots 0 must be >= 1"),
    ("good", ["--top-k", "500"], "--top-k 500 must be in [0, 64]"),
    ("good", ["--stop-ids", "10,x"], "--stop-ids '10,x' must be comma-separated token ids"),
    ("good", ["--stop-ids", "10,999"], "--stop-ids [999] lie outside the vocabulary [0, 128)"),
    ("good", ["--port", "70000"], "--port 70000 must be in [0, 65535]"),
    ("good", ["--port", "busy"], "cannot listen on 127.0.0.1:{busy}: Address already in use"),
    ("good", ["--port", "0", "--metrics-port", "busy"], "cannot listen on 127.0.0.1:{busy}: Address already in use"),
    ("truncated_weights", ["--port", "0"], "--checkpoint {path}: Error while deserializing header"),
    ("good", ["--mesh", "expert=2,experts=2"], "--mesh: mesh 'expert=2,experts=2': unknown axis 'experts'"),
    ("good", ["--mesh", "tensor=0"], "--mesh: mesh 'tensor=0': 'tensor=0' must be AXIS=SIZE with a positive size"),
    ("good", ["--mesh", "expert=4,tensor=4"], "--mesh expert=4,tensor=4 needs 16 devices, 8 are available"),
    ("good", ["--quantize", "int3"], "argument --quantize: invalid choice: 'int3' (choose from 'int8', 'int4')"),
    ("good", ["--quantize", "int8", "--mesh", "expert=2"], "--quantize int8 serves on one device: drop --mesh expert=2"),
])
def test_bad_command_lines_are_one_line_errors(server, tmp_path, capsys, kind, extra, message):
    if kind == "missing":
        path = tmp_path / "nonexistent"
    elif kind == "file":
        path = tmp_path / "model.safetensors"
        path.write_bytes(b"")
    elif kind == "good":
        path = server.path
    else:
        path = _checkpoint_variant(tmp_path, server.path, kind)
    busy = server.server.port  # a port the module's server holds
    argv = ["--checkpoint", str(path), "--max-len", str(MAX_LEN), "--slots", "2"]  # the fixture's shapes
    argv += [str(busy) if a == "busy" else a for a in extra]
    with pytest.raises(SystemExit) as exit_:
        serve_cli.main(argv)
    line = _one_error_line(exit_, capsys)
    assert line.startswith("glmjax-serve: error: " + message.format(path=path, busy=busy)), line


def test_max_len_defaults_to_the_checkpoint_positions_when_fewer(server):
    """TINY has max_position_embeddings 256 < 2048: without --max-len the server starts with 256."""
    assert TINY.max_position_embeddings < serve_cli.DEFAULT_MAX_LEN
    assert serve_cli.parse_args(["--checkpoint", str(server.path)]).max_len == TINY.max_position_embeddings


def test_a_mesh_server_streams_the_one_device_greedy_tokens(server):
    """--mesh expert=2,tensor=2: the checkpoint loads split over 4 devices (experts over
    `expert`) and the gRPC stream carries the same greedy tokens."""
    args = serve_cli.parse_args(["--checkpoint", str(server.path), "--port", "0", "--slots", "2", "--max-len",
                             str(MAX_LEN), "--mesh", "expert=2,tensor=2"])
    driver = serve_cli.build_driver(args)
    srv = serve.start_server(driver, args.host, args.port)
    client = serve.Client(f"127.0.0.1:{srv.port}")
    try:
        gate = driver.engine.weights.latest().state["layers"][1]["mlp"]["experts"]["gate"][...]
        assert gate.sharding.spec[0] == "expert" and len(gate.sharding.device_set) == 4
        for p in prompts([6, 11], seed=8):
            assert _tokens(client.decode(p, max_tokens=5, timeout=300)) == greedy_reference(server.model, p, 5)
    finally:
        client.close()
        srv.stop(grace=None)
        driver.stop()


def test_quantize_serves_the_models_experts_quantized_by_quant_py(server):
    """--quantize int8: the engine holds int8 experts and streams the greedy tokens of
    quant.quantize(model, "int8"); --quantize int4 loads int4 experts."""
    argv = ["--checkpoint", str(server.path), "--port", "0", "--slots", "2", "--max-len", str(MAX_LEN)]
    args = serve_cli.parse_args(argv + ["--quantize", "int8"])
    driver = serve_cli.build_driver(args)
    srv = serve_cli.start_from_args(args, driver)
    client = serve.Client(f"127.0.0.1:{srv.port}")
    try:
        experts = driver.engine.weights.latest().state["layers"][1]["mlp"]["experts"]
        assert all(isinstance(experts[w][...], quant.Quantized) and experts[w][...].values.dtype == jnp.int8
                   for w in ("gate", "up", "down"))
        p = prompts([9], seed=9)[0]
        assert _tokens(client.decode(p, max_tokens=5, timeout=300)) == greedy_reference(
            quant.quantize(server.model, "int8"), p, 5)
    finally:
        client.close()
        srv.stop(grace=None)
        driver.stop()
    int4 = serve_cli.build_driver(serve_cli.parse_args(argv + ["--quantize", "int4"]))
    assert int4.engine.weights.latest().state["layers"][1]["mlp"]["experts"]["gate"][...].values.dtype == jnp.int4


def _wait_until(condition, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_router_over_two_servers_keeps_a_session_on_its_replica(server, monkeypatch):
    """glmjax-serve --route A,B with $GLMJAX_SERVE_TOKEN, as main starts it: callers need the
    token and the replicas get it; the stream carries the replicas' greedy tokens; a
    session's second turn goes back to the replica of its first (B), where its prefix is
    cached, although A is as idle."""
    second = serve_cli.build_driver(serve_cli.parse_args(["--checkpoint", str(server.path), "--slots", "2",
                                                  "--max-len", str(MAX_LEN)]))
    replica_b = serve.start_server(second, "127.0.0.1", 0, token=TOKEN)
    drivers = [server.driver, second]
    targets = [f"127.0.0.1:{server.secured.port}", f"127.0.0.1:{replica_b.port}"]
    monkeypatch.setenv(serve.TOKEN_ENV, TOKEN)
    args = serve_cli.parse_args(["--route", ",".join(targets), "--port", "0", "--slots", "2", "--metrics-port", "0"])
    router = serve_cli.build_router(args)
    srv = serve_cli.start_from_args(args, router)
    client = serve.Client(f"127.0.0.1:{srv.port}", token=TOKEN)
    try:
        assert client.health()
        anonymous = serve.Client(f"127.0.0.1:{srv.port}")
        with pytest.raises(grpc.RpcError) as err:
            _tokens(anonymous.decode([1, 2], max_tokens=2, timeout=60))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        anonymous.close()
        server.driver.pause()  # A holds what it is given, so that the session starts on B
        held = client.decode(prompts([5], seed=30)[0], max_tokens=3, timeout=300)
        _wait_until(lambda: router.in_flight == [1, 0])
        p = prompts([7], seed=31)[0]
        first = _tokens(client.decode(p, max_tokens=5, session_id="chat", timeout=300))
        assert router.dispatched == [1, 1]
        server.driver.resume()
        assert len(_tokens(held)) == 3
        _wait_until(lambda: router.active == 0)
        before = [d.stats["reused_tokens"] for d in drivers]
        _tokens(client.decode(p + first + [9], max_tokens=3, session_id="chat", timeout=300))
        assert router.dispatched == [1, 2]  # both idle: least-loaded alone would have picked A
        assert [d.stats["reused_tokens"] - b for d, b in zip(drivers, before)] == [0, 7 + 5 - 1]
        direct = serve.Client(targets[1], token=TOKEN)
        assert first == _tokens(direct.decode(p, max_tokens=5, timeout=300)) == greedy_reference(server.model, p, 5)
        direct.close()
        metrics = _scrape(srv)
        assert metrics[("glmjax_serve_slots", ())] == 4 and metrics[_REQUESTS("ok")] == 3
        assert metrics[_REQUESTS("unauthenticated")] == 1 and metrics[("glmjax_serve_queue_depth", ())] == 0
        with pytest.raises(grpc.RpcError) as err:  # the replica's refusal reaches the caller as it is
            _tokens(client.decode([], max_tokens=2, timeout=60))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt is empty" in err.value.details()
    finally:
        server.driver.resume()
        client.close()
        srv.stop(grace=None)
        router.stop()
        replica_b.stop(grace=None)
        second.stop()


def _free_ports(n: int) -> list[int]:
    """`n` distinct ports that nothing listens on once the probes close."""
    probes = [socket.socket() for _ in range(n)]
    for probe in probes:
        probe.bind(("127.0.0.1", 0))
    ports = [probe.getsockname()[1] for probe in probes]
    for probe in probes:
        probe.close()
    return ports


def test_a_router_moves_work_off_a_dead_replica_and_back_once_it_listens(server):
    """A router over an address where nothing listens (first, so that it wins ties) and the
    live server: after the first request fails, every request, a new session and the
    failed one's session too, gets the live server's greedy tokens, and the dead replica
    gets nothing through several back-offs; once a server listens there, it gets work again."""
    (port,) = _free_ports(1)
    dead, live = f"127.0.0.1:{port}", f"127.0.0.1:{server.server.port}"
    router = Router([GrpcReplica(dead, capacity=2), GrpcReplica(live, capacity=2)], backoff=0.2)
    revived = None
    try:
        p = prompts([7] * 4, seed=40)  # one length: one compile of the reference
        failed = router.submit(Request(p[0], 5, session_id="chat")).result(timeout=60)
        assert failed.finish_reason == "error" and failed.error.startswith(f"UNAVAILABLE: replica {dead}: ")
        _wait_until(lambda: router.active == 0)
        assert router.down == {0}
        for prompt, session in ((p[0], "chat"), (p[1], "new"), (p[2], None)):
            result = router.submit(Request(prompt, 5, session_id=session)).result(timeout=300)
            assert result.tokens == _tokens(server.client.decode(prompt, max_tokens=5, timeout=300)) \
                == greedy_reference(server.model, prompt, 5)
            _wait_until(lambda: router.active == 0)
        time.sleep(0.6)  # three back-offs: each health check finds nothing listening
        assert router.down == {0} and router.dispatched == [1, 3]
        revived = serve.start_server(server.driver, "127.0.0.1", port)
        _wait_until(lambda: not router.down)  # gRPC's own reconnect back-off takes a second or two
        assert not router.down
        result = router.submit(Request(p[3], 5)).result(timeout=300)
        assert router.dispatched == [2, 3] and result.tokens == greedy_reference(server.model, p[3], 5)
    finally:
        router.stop()
        if revived is not None:
            revived.stop(grace=None)


def test_when_every_replica_is_down_each_request_fails_at_once_with_unavailable(server):
    """A router whose replicas do not listen: each Decode ends at once with UNAVAILABLE
    naming its replica, and once each has failed, naming them all (none is tried again
    before its health check answers); HealthCheck says not live; the router keeps serving."""
    dead = [f"127.0.0.1:{port}" for port in _free_ports(2)]
    args = serve_cli.parse_args(["--route", ",".join(dead), "--port", "0"])
    router = serve_cli.build_router(args)
    srv = serve_cli.start_from_args(args, router)
    client = serve.Client(f"127.0.0.1:{srv.port}")
    try:
        assert not client.health()
        for expected in (f"UNAVAILABLE: replica {dead[0]}: ", f"UNAVAILABLE: replica {dead[1]}: ",
                         f"UNAVAILABLE: every replica is down: {dead[0]}, {dead[1]} (",
                         f"UNAVAILABLE: every replica is down: {dead[0]}, {dead[1]} ("):
            start = time.monotonic()
            with pytest.raises(grpc.RpcError) as err:
                _tokens(client.decode([1, 2, 3], max_tokens=4, timeout=60))
            assert time.monotonic() - start < 5.0
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and err.value.details().startswith(expected)
            _wait_until(lambda: router.active == 0)  # the router has seen the failure
        assert router.dispatched == [1, 1] and router.in_flight == [0, 0] and router.queued == 0
    finally:
        client.close()
        srv.stop(grace=None)
        router.stop()


@pytest.mark.parametrize("extra, message", [
    ([], "one of the arguments --checkpoint --route is required"),
    (["--route", "127.0.0.1:9001", "--checkpoint", "DIR"], "argument --checkpoint: not allowed with argument --route"),
    (["--route", "127.0.0.1"], "--route '127.0.0.1': '127.0.0.1' is not HOST:PORT; expected comma-separated"),
    (["--route", "h:1,h:x"], "--route 'h:1,h:x': 'h:x' is not HOST:PORT"),
    (["--route", ","], "--route ',' names no replica"),
    (["--route", "h:1,h:2,h:1"], "--route lists h:1 more than once"),
    (["--route", "h:1", "--quantize", "int8"], "--quantize sets up a served model: with --route, give it to each"),
    (["--route", "h:1", "--max-len", "64"], "--max-len sets up a served model"),
    (["--route", "h:1", "--slots", "0"], "--slots 0 must be >= 1"),
    (["--route", "h:1", "--host", "0.0.0.0"], "--host 0.0.0.0 is reachable from other machines"),
])
def test_bad_route_command_lines_are_one_line_errors(monkeypatch, capsys, extra, message):
    monkeypatch.delenv(serve.TOKEN_ENV, raising=False)
    with pytest.raises(SystemExit) as exit_:
        serve_cli.parse_args(extra)
    line = _one_error_line(exit_, capsys)
    assert line.startswith("glmjax-serve: error: " + message), line
