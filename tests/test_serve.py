"""rl/serve.py: JetStream's Orchestrator protocol on 127.0.0.1, from a checkpoint directory."""

import time

import grpc
import pytest

import glmjax
from rl import jetstream_proto, serve
from rl.driver import Request
from rl.router import GrpcReplica, Router
from tests.engine_util import TINY, greedy_reference, prompts

MAX_LEN = 64


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    model = glmjax.init_model(TINY, seed=0)
    glmjax.save_pretrained(model, path)
    args = serve.parse_args(["--checkpoint", str(path), "--host", "127.0.0.1", "--port", "0", "--slots", "2",
                             "--max-len", str(MAX_LEN)])
    driver = serve.build_driver(args)
    srv, port = serve.start_server(driver, args.host, args.port)
    client = serve.Client(f"127.0.0.1:{port}")
    yield driver, client, port, model
    client.close()
    srv.stop(grace=None)
    driver.stop()


def _tokens(stream):
    return [t for response in stream for s in response.stream_content.samples for t in s.token_ids]


def test_decode_streams_the_greedy_tokens(server):
    driver, client, _, model = server
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
    driver, client, _, model = server
    with pytest.raises(grpc.RpcError) as err:
        _tokens(client.decode(tokens, max_tokens=max_tokens, timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in err.value.details()
    assert len(_tokens(client.decode([3, 4, 5], max_tokens=2, timeout=300))) == 2


def test_text_content_is_refused(server):
    _, client, port, _ = server
    pb = jetstream_proto.load()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        decode = channel.unary_stream(jetstream_proto.DECODE, request_serializer=pb.DecodeRequest.SerializeToString,
                                      response_deserializer=pb.DecodeResponse.FromString)
        with pytest.raises(grpc.RpcError) as err:
            list(decode(pb.DecodeRequest(max_tokens=3, text_content=pb.DecodeRequest.TextContent(text="hi")),
                        timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "token_content" in err.value.details()


def test_a_cancelled_stream_frees_its_slot(server):
    driver, client, _, model = server
    call = client.decode(prompts([5], seed=21)[0], max_tokens=50, timeout=300)
    next(call)  # generating now
    call.cancel()
    deadline = time.monotonic() + 120
    while driver.load and time.monotonic() < deadline:
        time.sleep(0.05)
    assert driver.load == 0 and all(s is None for s in driver._slots)


def test_session_cache_reuses_the_prefix_and_router_talks_grpc(server):
    """A GrpcReplica behind the router: a second turn with the same session_cache reuses
    the server's cached prefix."""
    driver, _, port, model = server
    router = Router([GrpcReplica(f"127.0.0.1:{port}", capacity=2)])
    p = prompts([7], seed=22)[0]
    first = router.submit(Request(p, 5, session_id="chat")).result(timeout=300)
    before = driver.stats["reused_tokens"]
    second = router.submit(Request(p + first.tokens + [9], 3, session_id="chat")).result(timeout=300)
    assert first.tokens == greedy_reference(model, p, 5) and len(second.tokens) == 3
    assert driver.stats["reused_tokens"] - before == 7 + 5 - 1
    assert first.finish_reason == "length" and first.versions == [-1] * 5
