"""rl/engine/openai_api.py through real clients: the official `openai` package, raw HTTP for
what a client library would not send, and inspect-ai's evaluation harness; sessions
(rl/engine/sessions.py) token for token; glmjax-serve's --http-port wiring.

One module-scoped server over the real engine and a checkpoint whose reply is certain:
glmjax.tiny_checkpoint's model with weights edited so that after a "\\n" (the end of every
chat generation prompt and of every tool-result turn) it writes REPLY, a GLM tool call,
then <|observation|>, with probability ~1 at any temperature, while a prompt ending
elsewhere gets random text that never stops before max_tokens (`_certain_checkpoint`).
So the tool-call path runs end to end on the engine's own tokens: the model writes the
call, the API parses it, the client sends it back, the template renders it again.
"""

import concurrent.futures
import json
import time
import types

import httpx
import numpy as np
import openai
import pytest
from safetensors.numpy import load_file, save_file
from transformers import AutoTokenizer

from glmjax import tiny_checkpoint
from rl.engine import cli as serve_cli
from rl.engine import serve
from rl.engine.driver import Request

TOKEN = "api-s3cret"
MODEL = "glm-tiny"  # the checkpoint directory's name, which --model-name defaults to
REPLY = "Sure.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>"
WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
# GLM's template, writing tool calls without the newlines between their tags, as the model does
TEMPLATE = tiny_checkpoint.GLM_STYLE_TEMPLATE.replace(
    "{{ '\\n' }}<arg_key>{{ k }}</arg_key>\n<arg_value>", "<arg_key>{{ k }}</arg_key><arg_value>").replace(
    "</arg_value>{% endfor %}{{ '\\n' }}</tool_call>", "</arg_value>{% endfor %}</tool_call>")
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


def _certain_checkpoint(path) -> list[int]:
    """glmjax.tiny_checkpoint's checkpoint at `path`, edited so that "\\n" REPLY
    <|observation|> is a chain the model follows with certainty. Returns the chain's ids.

    The first m + 1 of the 64 hidden dimensions are set aside: chain token i's embedding is
    100 sqrt(64) e_i (every other token's is 0 there, and 0.1 in dimension z = m, "not in
    the chain"), no attention or MLP output writes into them, and the LM head row of the
    token after chain token i is 10 e_i. At a chain token the residual is its own
    embedding and the next chain token's logit is ~80 above the rest; elsewhere dimension z
    gives the chain tokens and the stop tokens a logit ~-10 x z below the rest, so random
    text neither enters the chain nor stops."""
    tiny_checkpoint.make_checkpoint(str(path), extra_texts=[REPLY] * 200)  # REPLY's words as whole tokens
    (path / "chat_template.jinja").write_text(TEMPLATE)
    tok = AutoTokenizer.from_pretrained(path)
    stops = json.loads((path / "generation_config.json").read_text())["eos_token_id"]
    chain = (tok.encode("\n", add_special_tokens=False) + tok.encode(REPLY, add_special_tokens=False)
             + [tok.convert_tokens_to_ids("<|observation|>")])
    assert len(set(chain)) == len(chain), "the chain must not repeat a token: a token has one successor"
    w = load_file(path / "model.safetensors")
    emb, head = w["model.embed_tokens.weight"], w["lm_head.weight"]
    m, d = len(chain) - 1, emb.shape[1]
    reserved = list(range(m + 1))
    for name, x in w.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):  # [hidden, ...]: what writes the residual
            x[reserved] = 0
    emb[:, reserved] = 0
    emb[:, m] = 0.1
    for i, (t, nxt) in enumerate(zip(chain, chain[1:])):
        emb[t] = 0
        emb[t, i] = 100 * np.sqrt(d)
        head[nxt] = 0
        head[nxt, i] = 10
    for t in set(chain) | set(stops):
        head[t, m] = -10
    save_file(w, path / "model.safetensors", metadata={"format": "pt"})
    return chain


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    """The checkpoint served as glmjax-serve --port off --http-port 0 would, with a token and
    metrics, over a driver of 4 slots."""
    path = tmp_path_factory.mktemp("ckpt") / MODEL
    chain = _certain_checkpoint(path)
    args = serve_cli.parse_args(["--checkpoint", str(path), "--port", "off", "--http-port", "0", "--slots", "4",
                                 "--max-len", "256", "--auth-token", TOKEN])
    driver = serve_cli.build_driver(args)
    metrics = serve.Metrics(driver)
    server = serve_cli.start_http_from_args(args, driver, metrics)
    client = openai.OpenAI(base_url=server.base_url, api_key=TOKEN, max_retries=0, timeout=120)
    http = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120)
    tok = args.tokenizer
    yield types.SimpleNamespace(server=server, driver=driver, client=client, http=http, tok=tok, path=path,
                                metrics=metrics, chain=chain, reply_ids=chain[1:], args=args)
    http.close()
    server.stop()
    driver.stop()


def _encode(api, messages, tools=None) -> list[int]:
    """The template's tokens of a whole conversation as a client sends it (tool-call
    arguments as JSON strings), up to the generation prompt."""
    messages = [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.loads(
        c["function"]["arguments"])}} for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in messages]
    text = api.tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    return api.tok.encode(text, add_special_tokens=False)


def _idle(driver, timeout=30.0) -> bool:
    return _until(lambda: driver.load == 0, timeout)


def test_models_lists_the_checkpoint_by_its_directory_name(api):
    assert [m.id for m in api.client.models.list().data] == [MODEL]
    assert api.client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as err:
        api.client.models.retrieve("gpt-4o")
    assert err.value.code == "model_not_found"
    assert api.http.get("/health").json() == {"status": "ok"}


def test_a_tool_call_comes_back_as_tool_calls(api):
    """The model's GLM tool call becomes message.tool_calls (arguments a JSON string), its
    markup leaves the content; without tools the text comes as written."""
    r = api.client.chat.completions.create(model=MODEL, messages=USER, tools=WEATHER, max_tokens=40)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure."
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert r.usage.prompt_tokens == len(_encode(api, USER, WEATHER))
    assert r.usage.completion_tokens == len(api.reply_ids)  # the stop token counts, as the engine ran it
    plain = api.client.chat.completions.create(model=MODEL, messages=USER, max_completion_tokens=40, temperature=0)
    assert plain.choices[0].message.content == REPLY and plain.choices[0].finish_reason == "stop"
    assert plain.choices[0].message.tool_calls is None


def test_a_streamed_chat_ends_with_its_tool_calls(api):
    chunks = list(api.client.chat.completions.create(
        model=MODEL, messages=USER, tools=WEATHER, max_tokens=40, stream=True, logprobs=True, top_logprobs=2,
        stream_options={"include_usage": True}))
    deltas = [c.choices[0] for c in chunks if c.choices]
    assert deltas[0].delta.role == "assistant"
    assert "".join(d.delta.content or "" for d in deltas) == "Sure."
    calls = [tc for d in deltas for tc in d.delta.tool_calls or ()]
    assert [(tc.index, tc.function.name, json.loads(tc.function.arguments)) for tc in calls] == [
        (0, "get_weather", {"city": "Paris"})]
    assert [d.finish_reason for d in deltas if d.finish_reason] == ["tool_calls"]
    assert deltas[-1].finish_reason == "tool_calls"
    # every text token has its log-prob, the ones held back from `content` included
    entries = [e for d in deltas if d.logprobs for e in d.logprobs.content]
    assert "".join(e.token for e in entries) == REPLY
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(api.reply_ids)


def test_completions_streamed_and_not_and_every_prompt_form(api):
    prompt = "The weather in Paris is"
    ids = api.tok.encode(prompt, add_special_tokens=False)
    r = api.client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 6
    assert r.usage.prompt_tokens == len(ids)
    streamed = list(api.client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                                  stream=True))
    assert "".join(c.choices[0].text for c in streamed) == r.choices[0].text
    assert streamed[-1].choices[0].finish_reason == "length"
    assert api.client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0).choices[0].text == (
        r.choices[0].text)
    many = api.client.completions.create(model=MODEL, prompt=[prompt, "Rain"], n=2, max_tokens=6, temperature=0)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert many.choices[0].text == many.choices[1].text == r.choices[0].text
    assert many.usage.prompt_tokens == len(ids) + len(api.tok.encode("Rain", add_special_tokens=False))
    tokens = api.client.completions.create(model=MODEL, prompt=[ids, ids[:3]], max_tokens=6, temperature=0)
    assert tokens.choices[0].text == r.choices[0].text and len(tokens.choices) == 2


def test_log_probs_are_the_engines(api):
    """Greedy: the API's log-probs are the engine's for the same request, and each token is
    its own top-1 alternative with the same value. Sampled: log-probs of the temperature-
    scaled distribution, alternatives sorted, probabilities summing to <= 1."""
    ids = api.tok.encode("Tomorrow in Lyon", add_special_tokens=False)
    r = api.client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0, logprobs=5)
    lp = r.choices[0].logprobs
    direct = api.driver.submit(Request(ids, 5, stop_ids=api.server.stop_ids, top_logprobs=5)).result(timeout=60)
    np.testing.assert_allclose(lp.token_logprobs, direct.log_probs, atol=1e-6)
    assert len(lp.tokens) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    for value, top, (best, *_) in zip(lp.token_logprobs, lp.top_logprobs, direct.top_logprobs):
        assert max(top.values()) == pytest.approx(value, abs=1e-6) == best[1]
        assert all(v <= 0 for v in top.values()) and sum(np.exp(v) for v in top.values()) <= 1 + 1e-6
    chat = api.client.chat.completions.create(model=MODEL, messages=USER, temperature=0.7, max_tokens=40,
                                              logprobs=True, top_logprobs=3)
    for entry in chat.choices[0].logprobs.content:  # REPLY: each token certain
        assert [t.token for t in entry.top_logprobs][0] == entry.token and len(entry.top_logprobs) == 3
        assert entry.logprob == entry.top_logprobs[0].logprob and entry.logprob > -1e-3
        assert entry.bytes == list(entry.token.encode())
    hot = api.client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=1.5, seed=1, logprobs=20)
    for value, top in zip(hot.choices[0].logprobs.token_logprobs, hot.choices[0].logprobs.top_logprobs):
        assert value <= 0 and sum(np.exp(v) for v in top.values()) <= 1 + 1e-6
        assert list(top.values()) == sorted(top.values(), reverse=True)


def test_n_gives_n_choices_and_a_seed_repeats_its_samples(api):
    chat = api.client.chat.completions.create(model=MODEL, messages=USER, n=3, tools=WEATHER, max_tokens=40)
    assert [c.index for c in chat.choices] == [0, 1, 2]
    assert all(c.message.tool_calls[0].function.name == "get_weather" for c in chat.choices)
    assert chat.usage.completion_tokens == 3 * len(api.reply_ids)

    def sample(seed, n=1):
        r = api.client.completions.create(model=MODEL, prompt="Cloudy", max_tokens=6, temperature=1.0, seed=seed, n=n)
        return [c.text for c in r.choices]

    three = sample(7, n=3)
    assert len(three) == 3 and sample(7, n=3) == three  # sample i uses seed + i
    assert sample(7) == three[:1] and sample(8) == three[1:2]
    assert len({sample(s)[0] for s in (1, 2, 3)}) > 1


def test_stop_strings_cut_the_reply_and_free_the_slot(api):
    """The text ends before the stop string; usage counts the tokens through the one that
    completed it; the engine's request is cancelled at once (the chain would go on)."""
    cut = "Sure.<tool_call>get_"
    through = len(api.tok.encode("Sure.<tool_call>get_weather", add_special_tokens=False))
    r = api.client.chat.completions.create(model=MODEL, messages=USER, max_tokens=40, stop=["weather", "Lyon"])
    assert r.choices[0].message.content == cut and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == through
    streamed = list(api.client.chat.completions.create(model=MODEL, messages=USER, max_tokens=40, stop="weather",
                                                       stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == cut
    assert streamed[-1].choices[0].finish_reason == "stop"
    assert _idle(api.driver)


def test_a_wrong_or_missing_token_is_401_and_health_is_open(api):
    wrong = openai.OpenAI(base_url=api.server.base_url, api_key="not-it", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as err:
        wrong.chat.completions.create(model=MODEL, messages=USER)
    assert err.value.code == "invalid_api_key"
    bare = httpx.post(api.server.url + "/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert bare.status_code == 401 and "Authorization" in bare.json()["error"]["message"]
    assert httpx.get(api.server.url + "/health").status_code == 200


CHAT = {"model": MODEL, "messages": USER, "max_tokens": 4}
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
BAD = [  # (path, body, status, code, param, words in the message)
    ("/v1/chat/completions", b'{"model": "glm-tiny", "messages": [', 400, "invalid_json", None, "not valid JSON"),
    ("/v1/chat/completions", b"[1, 2]", 400, "invalid_json", None, "must be a JSON object"),
    ("/v1/chat/completions", {**CHAT, "model": "gpt-4o"}, 404, "model_not_found", "model", "'gpt-4o' does not exist"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 250}, 400, "context_length_exceeded", "messages",
     "maximum context length is 255 tokens"),
    ("/v1/completions", {**COMPLETION, "prompt": "word " * 400}, 400, "context_length_exceeded", "prompt",
     "maximum context length"),
    ("/v1/completions", {**COMPLETION, "prompt": [1, 2, 5000]}, 400, None, "prompt", "outside the vocabulary"),
    ("/v1/completions", {**COMPLETION, "prompt": [1.5]}, 400, None, "prompt", "list of token ids"),
    ("/v1/chat/completions", {**CHAT, "top_p": 0.5}, 400, None, "top_p", "only 1.0"),
    ("/v1/chat/completions", {**CHAT, "temperature": 3}, 400, None, "temperature", "less than or equal to 2"),
    ("/v1/chat/completions", {**CHAT, "n": 0}, 400, None, "n", "greater than or equal to 1"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, 400, None, "messages", "at least 1 item"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "robot", "content": "x"}]}, 400, None,
     "messages[0].role", "'system', 'developer', 'user', 'assistant' or 'tool'"),
    ("/v1/chat/completions", {**CHAT, "messages": USER + [{"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{city"}}]}]}, 400, None,
     "messages[1].tool_calls[0].function.arguments", "not a JSON object"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     None, "messages[0].content[0]", "only text parts"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, 400, None, "top_logprobs", "needs logprobs: true"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, 400, None, "top_logprobs", "at most 20"),
    ("/v1/chat/completions", {**CHAT, "tool_choice": "required"}, 400, None, "tool_choice", "only 'auto' and 'none'"),
    ("/v1/completions", {**COMPLETION, "echo": True}, 400, None, "echo", "only false"),
    ("/v1/completions", {**COMPLETION, "stop": ["", "x"]}, 400, None, "stop", "empty string"),
    ("/v1/completions", {**COMPLETION, "logit_bias": {"1": 5}}, 400, None, "logit_bias", "not supported"),
    ("/v1/embeddings", {"model": MODEL, "input": "x"}, 404, "not_found", None, "/v1/embeddings"),
    ("/v1/models", {}, 405, "method_not_allowed", None, "Method Not Allowed"),
]


def _post(http, path, body):
    return http.post(path, content=body) if isinstance(body, bytes) else http.post(path, json=body)


@pytest.mark.parametrize("path, body, status, code, param, words", BAD,
                         ids=[f"{i}-{b[4] or b[3]}" for i, b in enumerate(BAD)])
def test_a_bad_request_gets_openais_error_naming_the_field(api, path, body, status, code, param, words):
    r = _post(api.http, path, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert (error["code"], error["param"]) == (code, param) and words in error["message"], error


def test_bad_requests_and_cancelled_streams_among_valid_ones_leave_the_server_serving(api):
    """24 requests at once: valid chats (tools, streamed or not) and completions (n=2), bad
    ones of every kind, and streams whose clients leave after their first event. Every
    valid one gets its right answer, every bad one its error, the cancelled streams' slots
    are freed, and the server serves afterwards."""
    def valid_chat(stream):
        r = api.client.chat.completions.create(model=MODEL, messages=USER, tools=WEATHER, max_tokens=40,
                                               stream=stream)
        if stream:
            calls = [tc.function.name for c in r if c.choices for tc in c.choices[0].delta.tool_calls or ()]
            return calls == ["get_weather"]
        return r.choices[0].message.tool_calls[0].function.name == "get_weather"

    def valid_completion():
        r = api.client.completions.create(model=MODEL, prompt="Sunny", max_tokens=8, n=2, temperature=1.0)
        return [c.finish_reason for c in r.choices] == ["length"] * 2 and r.usage.completion_tokens == 16

    def bad(i):
        path, body, status, code, param, _ = BAD[i % len(BAD)]
        r = _post(api.http, path, body)
        return r.status_code == status and r.json()["error"]["param"] == param

    def cancelled():
        body = {**COMPLETION, "max_tokens": 200, "stream": True}
        with api.http.stream("POST", "/v1/completions", json=body) as r:
            first = next(r.iter_lines())
        return r.status_code == 200 and first.startswith("data: ")

    jobs = ([lambda s=s: valid_chat(s) for s in (False, True)] * 3 + [valid_completion] * 4
            + [lambda i=i: bad(i) for i in range(0, len(BAD), 2)] + [cancelled] * 3)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(lambda job: job(), jobs))
    assert len(outcomes) == 24 and all(outcomes), outcomes
    assert _idle(api.driver), "a cancelled stream kept its slot"
    after = api.client.chat.completions.create(model=MODEL, messages=USER, tools=WEATHER, max_tokens=40)
    assert after.choices[0].finish_reason == "tool_calls"


def _count(api, endpoint, status) -> float:
    value = api.metrics.registry.get_sample_value("glmjax_serve_http_requests_total",
                                                  {"endpoint": endpoint, "status": str(status)})
    return value or 0.0


def _until(condition, timeout=30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def test_a_client_that_leaves_cancels_its_requests_streamed_or_not(api):
    """With the driver paused, requests wait in its queue: a client that gives up (a read
    timeout, or closing a stream before its first event) has them cancelled (counted as
    499), and the driver, resumed, finishes nothing for them."""
    before = _count(api, "completions", 499)
    tokens = api.driver.stats["tokens"]
    api.driver.pause()
    try:
        with pytest.raises(httpx.ReadTimeout):
            api.http.post("/v1/completions", json={**COMPLETION, "max_tokens": 50, "n": 2}, timeout=0.5)
        with api.http.stream("POST", "/v1/completions", json={**COMPLETION, "stream": True}, timeout=0.5) as r:
            with pytest.raises(httpx.ReadTimeout):
                next(r.iter_lines())
        assert _until(lambda: _count(api, "completions", 499) == before + 2)
    finally:
        api.driver.resume()
    assert _idle(api.driver) and api.driver.stats["tokens"] == tokens


def test_an_engine_failure_is_a_503_and_the_server_goes_on(api, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(api.driver.engine, "generate_rows", broken)
    with pytest.raises(openai.InternalServerError) as err:
        api.client.chat.completions.create(model=MODEL, messages=USER, max_tokens=40)
    assert err.value.status_code == 503 and err.value.code == "engine_error" and "injected failure" in err.value.message
    with api.http.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
        events = [line for line in r.iter_lines() if line]
    assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == "engine_error"
    assert events[-1] == "data: [DONE]"
    monkeypatch.undo()
    assert api.client.chat.completions.create(model=MODEL, messages=USER).choices[0].message.content == REPLY


def test_a_session_is_recorded_token_for_token_over_tool_turns(api):
    """Three tool turns through a session base URL: each call's prompt is the previous
    prompt and completion, exactly as the engine produced them, plus the template's tokens
    of the tool result; the template's own rendering agrees (rerendered False), so the row
    the learner trains on is what the engine saw; the session's prefix is reused. An edited
    past turn is marked rerendered where it diverges and still continues the tokens. A
    closed session refuses calls (410)."""
    sid, sessions = "episode-1", api.server.sessions
    agent = openai.OpenAI(base_url=api.server.session_url(sid), api_key=TOKEN, max_retries=0, timeout=120)
    messages = [{"role": "system", "content": "You check the weather."}, *USER]
    sent, reused = [], api.driver.stats["reused_tokens"]
    for turn in range(3):
        r = agent.chat.completions.create(model=MODEL, messages=messages, tools=WEATHER, max_tokens=40,
                                          temperature=1.0)
        sent.append(list(messages))
        reply = r.choices[0].message
        messages += [reply.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}),
                     {"role": "tool", "tool_call_id": reply.tool_calls[0].id, "content": f"sunny, {20 + turn} C"}]
    calls = sessions.calls(sid)
    assert len(calls) == 3
    for k, call in enumerate(calls):
        assert call.endpoint == "chat.completions" and call.finish_reason == "stop"
        assert call.completion_ids == api.reply_ids and len(call.logprobs) == len(call.versions) == len(api.reply_ids)
        assert not call.rerendered and call.diverged_at is None
        assert call.prompt_ids == _encode(api, sent[k], WEATHER)
        assert [m["role"] for m in call.messages] == [m["role"] for m in sent[k]]
        if k:
            before = calls[k - 1].prompt_ids + calls[k - 1].completion_ids
            assert call.prompt_ids[:len(before)] == before
            new = api.tok.decode(call.prompt_ids[len(before):])
            assert new.startswith("\n<tool_response>\nsunny") and new.endswith("</tool_response><|assistant|>\n")
    # the messages as the template took them: the tool call's arguments a dict
    assert calls[2].messages[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    # the cache of each turn but its last (pending) token was reused by the next
    assert api.driver.stats["reused_tokens"] - reused == sum(len(c.prompt_ids) + len(c.completion_ids) - 1
                                                             for c in calls[:2])
    assert sessions.tokens(sid) == calls[2].prompt_ids + calls[2].completion_ids

    edited = [dict(messages[0], content="You check the weather twice."), *messages[1:]]
    agent.chat.completions.create(model=MODEL, messages=edited, tools=WEATHER, max_tokens=40)
    last = sessions.calls(sid)[-1]
    rendered = _encode(api, edited, WEATHER)
    assert last.rerendered and last.prompt_ids[:last.diverged_at] == rendered[:last.diverged_at]
    assert last.prompt_ids[last.diverged_at] != rendered[last.diverged_at]
    assert last.prompt_ids[:len(sessions.calls(sid)[2].prompt_ids)] == calls[2].prompt_ids  # the engine went on
    assert len(sessions.close(sid)) == 4 and sid not in sessions
    with pytest.raises(openai.APIStatusError) as err:
        agent.chat.completions.create(model=MODEL, messages=edited, tools=WEATHER, max_tokens=40)
    assert err.value.status_code == 410 and err.value.code == "session_closed"


def test_a_session_by_header_records_completions_and_refuses_n(api):
    headers = {"X-Session-Id": "by-header"}
    api.client.completions.create(model=MODEL, prompt="Fog", max_tokens=4, temperature=0, extra_headers=headers)
    first = api.server.sessions.calls("by-header")[0]
    r = api.client.completions.create(model=MODEL, prompt=first.prompt_ids + first.completion_ids, max_tokens=4,
                                      extra_headers=headers)
    second = api.server.sessions.calls("by-header")[1]
    assert second.prompt_ids == first.prompt_ids + first.completion_ids and not second.rerendered
    assert second.messages is None and r.usage.completion_tokens == len(second.completion_ids) == 4
    with pytest.raises(openai.BadRequestError, match="n must be 1"):
        api.client.completions.create(model=MODEL, prompt="Fog", n=2, extra_headers=headers)
    mismatch = api.http.post("/sessions/a/v1/completions", json=COMPLETION, headers={"X-Session-Id": "b"})
    assert mismatch.status_code == 400 and mismatch.json()["error"]["param"] == "X-Session-Id"
    with pytest.raises(openai.BadRequestError, match="previous reply"):  # a history, and no assistant turn sent
        api.client.chat.completions.create(model=MODEL, messages=USER, extra_headers=headers)
    api.server.sessions.close("by-header")


def test_requests_are_counted_in_the_serving_metrics(api):
    from prometheus_client import generate_latest

    text = generate_latest(api.metrics.registry).decode()
    for series in ('glmjax_serve_http_requests_total{endpoint="chat.completions",status="200"}',
                   'glmjax_serve_http_requests_total{endpoint="completions",status="400"}',
                   'glmjax_serve_http_requests_total{endpoint="chat.completions",status="401"}',
                   'glmjax_serve_http_requests_total{endpoint="other",status="404"}',
                   'glmjax_serve_http_tokens_total{endpoint="chat.completions",kind="completion"}',
                   'glmjax_serve_http_request_seconds_count{endpoint="models"}', "glmjax_serve_generated_tokens_total"):
        assert series in text, series


@pytest.mark.parametrize("what, message", [
    ("no_tokenizer", "--http-port needs the tokenizer of --checkpoint {path}, which does not load"),
    ("no_template", "--http-port needs a chat template: --checkpoint {path}'s tokenizer has none"),
    ("port_off", "--port off serves nothing: add --http-port PORT"),
    ("same_ports", "--port and --http-port are both 8123: each server needs its own port"),
    ("route", "--http-port sets up a served model"),
])
def test_bad_http_command_lines_are_one_line_errors(api, tmp_path, capsys, what, message):
    path = tmp_path / "ckpt"
    path.mkdir()
    for name in ("config.json", "model.safetensors") + (("tokenizer.json", "tokenizer_config.json")
                                                        if what == "no_template" else ()):
        (path / name).symlink_to(api.path / name)
    argv = {"no_tokenizer": ["--checkpoint", str(path), "--http-port", "0"],
            "no_template": ["--checkpoint", str(path), "--http-port", "0"],
            "port_off": ["--checkpoint", str(api.path), "--port", "off"],
            "same_ports": ["--checkpoint", str(api.path), "--port", "8123", "--http-port", "8123"],
            "route": ["--route", "127.0.0.1:9", "--http-port", "0"]}[what]
    with pytest.raises(SystemExit):
        serve_cli.parse_args(argv)
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("glmjax-serve: error: " + message.format(path=path)), lines[-1]


def test_the_command_line_serves_the_checkpoint_name_and_stop_tokens(api):
    assert api.server.model_name == MODEL and api.server.tool_style == "glm"
    assert set(json.loads((api.path / "generation_config.json").read_text())["eos_token_id"]) <= set(
        api.server.stop_ids)
    named = serve_cli.parse_args(["--checkpoint", str(api.path), "--port", "off", "--http-port", "0",
                                  "--model-name", "other", "--max-len", "256"])
    second = serve_cli.start_http_from_args(named, api.driver)  # the same driver: nothing compiles again
    try:
        client = openai.OpenAI(base_url=second.base_url, api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["other"]
        assert client.chat.completions.create(model="other", messages=USER).choices[0].message.content == REPLY
    finally:
        second.stop()


def test_inspect_ai_evaluates_through_the_api(api, tmp_path):
    """inspect-ai's openai-api provider against the server: a plain task scored on the
    reply, and a tool-use loop in which inspect runs the model's get_weather calls and
    sends the results back until its message limit."""
    from inspect_ai import Task
    from inspect_ai import eval as inspect_eval
    from inspect_ai.dataset import Sample
    from inspect_ai.model import GenerateConfig
    from inspect_ai.scorer import includes
    from inspect_ai.solver import generate, use_tools
    from inspect_ai.tool import tool

    @tool
    def get_weather():
        async def execute(city: str):
            """The weather in a city.

            Args:
              city: the city
            """
            return f"sunny in {city}"

        return execute

    config = GenerateConfig(max_tokens=40, temperature=0)
    plain = Task(dataset=[Sample(input=f"Weather {i}?", target="Paris") for i in range(3)], solver=generate(),
                 scorer=includes(), config=config)
    agent = Task(dataset=[Sample(input="Weather in Paris?", target="sunny")], solver=[use_tools(get_weather()),
                 generate()], scorer=includes(), config=config, message_limit=6)
    logs = inspect_eval([plain, agent], model=f"openai-api/glmjax/{MODEL}", model_base_url=api.server.base_url,
                        model_args={"api_key": TOKEN}, log_dir=str(tmp_path), display="none")
    assert [log.status for log in logs] == ["success", "success"], [log.error for log in logs]
    assert logs[0].results.scores[0].metrics["accuracy"].value == 1.0  # REPLY names Paris
    messages = logs[1].samples[0].messages
    results = [m for m in messages if m.role == "tool"]
    assert results and all(m.function == "get_weather" and m.text == "sunny in Paris" for m in results)
    assert all(c.arguments == {"city": "Paris"} for m in messages if m.role == "assistant" for c in m.tool_calls)
