"""rl/engine/engine.py and rl/engine/driver.py: the JetStream Engine API, continuous batching, prefix
reuse, per-slot sampling with log-probs, cancellation and request validation."""

import inspect

import jax
import numpy as np
import pytest

import glmjax
from glmjax.sampling import SamplingParams
from rl.engine import engine as engine_lib
from rl.engine.driver import Driver, Request
from rl.engine.engine import GlmEngine, Prefix, ResultTokens
from tests.engine_util import TINY, greedy_reference, prompts

SLOTS, MAX_LEN, BUCKETS = 2, 64, (8, 16)


@pytest.fixture(scope="module")
def model():
    return glmjax.init_model(TINY, seed=0)


@pytest.fixture(scope="module")
def engine(model):
    return GlmEngine(model, max_concurrent_decodes=SLOTS, max_len=MAX_LEN, prefill_buckets=BUCKETS)


def test_engine_api_matches_jetstream_0_2_2(engine):
    """The methods and properties of jetstream.engine.engine_api.Engine, with its argument
    names, and a ResultTokens laid out as JetStream's (tokens | valid | lengths)."""
    assert isinstance(engine, engine_lib._Engine)
    abstract = {"prefill", "generate", "insert", "load_params", "get_prefix_destination_sharding",
                "get_tokenizer", "init_decode_state", "max_concurrent_decodes", "samples_per_slot",
                "max_prefill_length", "mesh", "colocated_cpus"}
    assert abstract <= set(engine_lib._Engine.__abstractmethods__) | {"build_tokenizer"}
    params = inspect.signature(GlmEngine.prefill).parameters
    for name in ("params", "existing_prefix", "padded_tokens", "true_length"):
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY
    assert list(inspect.signature(GlmEngine.generate).parameters) == ["self", "params", "decode_state"]
    assert list(inspect.signature(GlmEngine.insert).parameters) == ["self", "prefix", "decode_state", "slot"]
    assert (engine.max_concurrent_decodes, engine.samples_per_slot, engine.max_prefill_length) == (SLOTS, 1, MAX_LEN)
    assert engine.colocated_cpus is None and engine.mesh.size == 1
    assert engine.get_prefix_destination_sharding() is not None

    params = engine.load_params()
    state = engine.init_decode_state()
    prefix = engine.prefill(params=params, padded_tokens=np.arange(1, 6), true_length=5)
    assert isinstance(prefix, Prefix) and int(prefix.cache.lengths[0]) == 5
    state = engine.insert(prefix, state, slot=1)
    state, result = engine.generate(params, state)
    assert isinstance(result, ResultTokens)
    assert (result.tokens_idx, result.valid_idx, result.length_idx, result.samples_per_slot) == ((0, 1), (1, 2),
                                                                                                  (2, 3), 1)
    slot = result.convert_to_numpy().get_result_at_slot(1)
    assert slot.tokens.shape == (1, 1) and slot.valid[0, 0] == 1 and slot.lengths[0] == 2
    assert slot.versions[0, 0] == 0 and np.isfinite(slot.log_probs[0, 0])
    assert result.get_result_at_slot(0).valid[0, 0] == 0  # an empty slot emits nothing valid
    with pytest.raises(ValueError, match="max_prefill_length"):
        engine.bucket(MAX_LEN + 1)


def test_continuous_batching_keeps_slots_busy_and_matches_generate(model, engine):
    """Six requests of different budgets through two slots, one with a prompt longer than
    the largest bucket (chunked prefill): outputs equal glmjax.generate's greedy tokens, and
    no slot is idle while a request waits."""
    budgets = [3, 12, 2, 9, 5, 7]
    ps = prompts([7] * 5 + [21], seed=1)
    driver = Driver(engine, record_trace=True)
    handles = [driver.submit(Request(p, max_new_tokens=n)) for p, n in zip(ps, budgets)]
    queued_steps = []
    while driver.step():
        queued_steps.append(len(driver._queue) > 0)
    refs = [greedy_reference(model, p, 12) for p in ps]  # one compile per prompt length
    for h, ref, n in zip(handles, refs, budgets):
        r = h.result(timeout=0)
        assert r.tokens == ref[:n] and r.finish_reason == "length"
        assert len(r.log_probs) == n and r.versions == [0] * n
    busy = [b for _, _, b in driver.trace]
    waiting = [b for b, q in zip(busy, queued_steps) if q]
    assert waiting and all(b == SLOTS for b in waiting)
    assert driver.stats["busy_slot_steps"] == sum(busy)
    assert sum(budgets) - len(budgets) == driver.stats["tokens"] - len(budgets)


def test_prefix_reuse_computes_fewer_tokens_and_gives_identical_output(model, engine):
    """Turn 2 continues turn 1 (its prompt, its answer, new tokens): only the tokens after
    the cached ones are prefilled, and the answer equals a run without reuse."""
    p1, extra = prompts([7, 4], seed=2)
    driver = Driver(engine)
    first = driver.submit(Request(p1, max_new_tokens=6, session_id="chat"))
    driver.run_until_idle()
    p2 = p1 + first.result().tokens + extra
    before = driver.stats["prefill_tokens"]
    second = driver.submit(Request(p2, max_new_tokens=6, session_id="chat"))
    driver.run_until_idle()
    assert second.result().reused_tokens == len(p1) + 6 - 1  # the last answer token was never written
    assert driver.stats["prefill_tokens"] - before == len(p2) - second.result().reused_tokens

    fresh = Driver(engine)
    again = fresh.submit(Request(p2, max_new_tokens=6))
    fresh.run_until_idle()
    assert again.result().reused_tokens == 0
    assert second.result().tokens == again.result().tokens

    diverged = p1[:3] + [(p1[3] + 1) % TINY.vocab_size] + p1[4:]  # shares only 3 tokens with the cache
    third = driver.submit(Request(diverged, max_new_tokens=4, session_id="chat"))
    driver.run_until_idle()
    assert third.result().reused_tokens == 3
    assert third.result().tokens == greedy_reference(model, diverged, 4)


def test_sampling_is_per_slot_and_log_probs_are_the_sampling_distribution(model, engine):
    """A sampled (T=0.7, top-5) and a greedy request side by side: sampled tokens lie in
    the full forward's top 5 with log-prob log softmax(top5(logits) / T); greedy log-probs
    are log softmax(logits); the same seed gives the same tokens."""
    p = prompts([7], seed=3)[0]
    driver = Driver(engine)
    hot = driver.submit(Request(p, max_new_tokens=8, temperature=0.7, top_k=5, seed=11))
    cold = driver.submit(Request(p, max_new_tokens=8))
    driver.run_until_idle()
    for r, temperature in ((hot.result(), 0.7), (cold.result(), 0.0)):
        ids = np.asarray(p + r.tokens, np.int32)[None]
        logits = np.asarray(model(ids).logits[0, len(p) - 1:-1])  # the logits each token was drawn from
        for t, (row, token, lp) in enumerate(zip(logits, r.tokens, r.log_probs)):
            if temperature:
                top = np.sort(row)[-5:]
                assert row[token] >= top[0]
                scaled = np.where(row >= top[0], row / temperature, -np.inf)
            else:
                assert token == int(np.argmax(row))
                scaled = row
            expected = scaled[token] - np.log(np.sum(np.exp(scaled - scaled.max()))) - scaled.max()
            assert abs(lp - expected) < 1e-4, (t, lp, expected)
    repeat = Driver(engine)
    same = repeat.submit(Request(p, max_new_tokens=8, temperature=0.7, top_k=5, seed=11))
    repeat.run_until_idle()
    assert same.result().tokens == hot.result().tokens


def test_top_logprobs_come_from_the_distribution_each_token_was_drawn_from(model, engine):
    """Request.top_logprobs = k: per token, the k most likely tokens under the distribution
    its log-prob is taken from (log softmax(logits) for greedy, the temperature-scaled one
    for sampled), from the prefill's token and every step's; the tokens are those of the
    same request without them, and a request beside them that did not ask gets none."""
    p = prompts([7], seed=6)[0]
    driver = Driver(engine)
    plain = [driver.submit(Request(p, 6)), driver.submit(Request(p, 6, temperature=0.7, seed=3))]
    driver.run_until_idle()
    asked = [driver.submit(Request(p, 6, top_logprobs=5)),
             driver.submit(Request(p, 6, temperature=0.7, seed=3, top_logprobs=engine.max_top_logprobs))]
    other = driver.submit(Request(p, 6))
    driver.run_until_idle()
    assert other.result().top_logprobs == [] and other.result().tokens == plain[0].result().tokens
    for temperature, before, handle in zip((0.0, 0.7), plain, asked):
        r = handle.result()
        assert r.tokens == before.result().tokens and len(r.top_logprobs) == len(r.tokens)
        logits = np.asarray(model(np.asarray(p + r.tokens, np.int32)[None]).logits[0, len(p) - 1:-1])
        for row, token, lp, top in zip(logits, r.tokens, r.log_probs, r.top_logprobs):
            logp = jax.nn.log_softmax(row / (temperature or 1.0))
            expected = np.argsort(-np.asarray(logp))[:len(top)]
            assert [t for t, _ in top] == list(expected)
            np.testing.assert_allclose([v for _, v in top], np.asarray(logp)[expected], atol=1e-4)
            if temperature == 0:
                assert top[0][0] == token
            if token in dict(top):  # a sampled token may rank below the top k
                assert dict(top)[token] == pytest.approx(lp, abs=1e-6)  # the same value as its own log-prob
            assert sum(np.exp(v) for _, v in top) <= 1 + 1e-5
    with pytest.raises(ValueError, match="top_logprobs"):
        driver.submit(Request(p, 4, top_logprobs=engine.max_top_logprobs + 1))


def test_a_chunk_callback_sees_every_token_with_its_log_prob_however_late_it_registers(engine):
    p = prompts([7], seed=7)[0]
    driver = Driver(engine)
    handle = driver.submit(Request(p, 6, temperature=0.7, seed=2, top_logprobs=2))
    early, late = [], []
    handle.add_chunk_callback(early.append)
    for _ in range(3):
        driver.step()
    handle.add_chunk_callback(late.append)  # replays what was handed out, then goes on
    driver.run_until_idle()
    r = handle.result()
    for chunks in (early, late):
        assert [t for c in chunks for t in c.tokens] == r.tokens
        assert [x for c in chunks for x in c.log_probs] == r.log_probs
        assert [x for c in chunks for x in c.top_logprobs] == r.top_logprobs and len(r.top_logprobs) == 6
    assert len(late) < len(early)


def test_stop_ids_finish_at_once_and_cancel_frees_the_slot(model, engine):
    p, q = prompts([7, 7], seed=4)
    ref = greedy_reference(model, p, 12)
    driver = Driver(engine)
    stopped = driver.submit(Request(p, max_new_tokens=12, stop_ids=(ref[2],)))
    long = driver.submit(Request(q, max_new_tokens=40))
    waiting = driver.submit(Request(q, max_new_tokens=2))
    for _ in range(3):
        driver.step()
    assert stopped.result(timeout=0).tokens == ref[:ref.index(ref[2]) + 1]
    assert stopped.result().finish_reason == "stop"
    long.cancel()
    driver.step()  # the cancelled request leaves, the waiting one takes its slot in the same step
    assert long.result(timeout=0).finish_reason == "cancelled"
    driver.run_until_idle()
    assert waiting.result(timeout=0).finish_reason == "length"
    assert driver.load == 0 and all(s is None for s in driver._slots)


@pytest.mark.parametrize("request_, message", [
    (Request([], 4), "prompt is empty"),
    (Request([1, 2, TINY.vocab_size], 4), "outside the vocabulary"),
    (Request([-1], 4), "outside the vocabulary"),
    (Request([1] * 40, 30), "exceeds the engine's limit"),
    (Request([1], 0), "max_new_tokens"),
    (Request([1], 4, top_k=1000), "top_k"),
])
def test_invalid_requests_are_rejected_with_the_field_named(engine, request_, message):
    with pytest.raises(ValueError, match=message):
        Driver(engine).submit(request_)


def test_background_thread_serves_submissions(model, engine):
    p = prompts([7], seed=5)[0]
    driver = Driver(engine).start()
    try:
        handle = driver.submit(Request(p, max_new_tokens=5, temperature=0.0))
        chunks = list(handle.stream(timeout=60))
        assert sum(chunks, []) == handle.result(timeout=60).tokens == greedy_reference(model, p, 5)
    finally:
        driver.stop()


def test_prefill_with_existing_prefix_equals_one_prefill(engine):
    """JetStream's existing_prefix: prefilling 5 tokens after a 6-token prefix gives the
    same cache and first token as prefilling all 11."""
    ids = np.arange(3, 14)
    params = engine.load_params()
    whole = engine.prefill(params=params, padded_tokens=ids, true_length=11)
    head = engine.prefill(params=params, padded_tokens=ids[:6], true_length=6)
    tail = engine.prefill(params=params, existing_prefix=head, padded_tokens=ids[6:], true_length=5,
                          sampling=SamplingParams())
    assert int(tail.token[0]) == int(whole.token[0])
    for a, b in zip(jax.tree.leaves(whole.cache), jax.tree.leaves(tail.cache)):
        if a.ndim == 3:
            np.testing.assert_allclose(np.asarray(a[:, :11]), np.asarray(b[:, :11]), atol=1e-5)


def test_warmup_compiles_every_prefill_shape(model):
    """After warmup, admitting 1..3 requests at once and decoding compiles nothing."""
    engine = GlmEngine(model, max_concurrent_decodes=3, max_len=32, prefill_buckets=(8,))
    engine.warmup()
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, _, **kw: compiles.append(event) if event == "/jax/core/compile/backend_compile_duration" else None)
    driver = Driver(engine)
    for n in (3, 1, 2):
        for p in prompts([5] * n, seed=13 + n):
            driver.submit(Request(p, 2))
        driver.run_until_idle()
    assert compiles == []


def test_requests_hold_the_lowest_slots_and_steps_run_only_those_rows(model):
    """36 requests with random budgets through 12 slots: each step runs the smallest
    decode row count that covers the requests in flight (finished requests' slots are
    filled by moving the highest ones down), and every output still equals
    glmjax.generate's greedy tokens."""
    engine = GlmEngine(model, max_concurrent_decodes=12, max_len=48, prefill_buckets=(8,))
    assert engine.decode_rows == (8, 12)
    budgets = [int(n) for n in np.random.default_rng(5).integers(1, 20, 36)]
    ps = prompts([7] * len(budgets), seed=21)
    steps = []  # (rows run, requests in flight)
    generate_rows = engine.generate_rows

    def recording(params, state, rows, **kwargs):
        steps.append((rows, sum(s is not None for s in driver._slots)))
        return generate_rows(params, state, rows, **kwargs)

    engine.generate_rows = recording
    driver = Driver(engine)
    handles = [driver.submit(Request(p, max_new_tokens=n)) for p, n in zip(ps, budgets)]
    driver.run_until_idle()
    assert all(rows == engine.rows_for(busy) for rows, busy in steps)
    assert {rows for rows, _ in steps} == {8, 12}
    for h, p, n in zip(handles, ps, budgets):
        assert h.result(timeout=0).tokens == greedy_reference(model, p, 19)[:n]


def test_a_paused_driver_holds_its_requests_until_resumed(model, engine):
    driver = Driver(engine).start()
    try:
        driver.pause()
        handle = driver.submit(Request(prompts([5], seed=31)[0], max_new_tokens=3))
        assert not handle._done.wait(0.5) and driver.load == 1
        driver.resume()
        assert handle.result(timeout=60).finish_reason == "length"
    finally:
        driver.stop()
