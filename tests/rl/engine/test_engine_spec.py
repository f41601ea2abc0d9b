"""rl/engine/speculative.py: MTP speculative decoding in the engine. Greedy output equals plain
greedy decoding in both draft modes; rejection sampling keeps the target distribution."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from scipy import stats

import glmjax
from glmjax.cache import KVCache
from glmjax.sampling import SamplingParams
from glmjax.train import mtp_draft_logits, mtp_loss
from rl.engine import serve
from rl.engine.driver import Driver, Request
from rl.engine.engine import GlmEngine
from rl.engine.speculative import accept
from tests.engine_util import TINY, greedy_reference, prompts


@pytest.fixture(scope="module")
def model():
    return glmjax.init_model(TINY, seed=0)


@pytest.mark.parametrize("mode", ["own", "shared"])
def test_speculative_greedy_equals_plain_greedy(model, mode):
    """Three drafts per step from an untrained MTP layer (mostly rejected, sometimes
    accepted), two slots at different lengths, a 17-token prompt over two prefill chunks."""
    engine = GlmEngine(model, max_concurrent_decodes=2, max_len=64, prefill_buckets=(16,), num_draft=3,
                       mtp_mode=mode)
    ps = prompts([7, 7, 17], seed=6)
    budgets = [12, 5, 10]
    driver = Driver(engine)
    handles = [driver.submit(Request(p, max_new_tokens=n)) for p, n in zip(ps, budgets)]
    driver.run_until_idle()
    for p, h, n in zip(ps, handles, budgets):
        assert h.result().tokens == greedy_reference(model, p, n)
        assert len(h.result().log_probs) == n
    assert driver.stats["steps"] <= sum(budgets)
    # acceptance[k]: the (request, step) pairs that accepted k drafts, what glmjax-serve exports
    assert len(driver.acceptance) == 4 and sum(driver.acceptance) == driver.stats["busy_slot_steps"]
    assert sum(k * n for k, n in enumerate(driver.acceptance)) == driver.stats["accepted_drafts"]
    registry = serve.Metrics(driver).registry
    for k in range(4):
        assert registry.get_sample_value("glmjax_serve_mtp_accepted_drafts_bucket", {"le": f"{k}.0"}) == \
            sum(driver.acceptance[:k + 1])
    assert registry.get_sample_value("glmjax_serve_mtp_accepted_drafts_sum") == driver.stats["accepted_drafts"]


def test_speculative_with_a_perfect_drafter_accepts_every_draft(model):
    """A drafter that predicts the target exactly (here: its drafts replaced by the target's
    own greedy continuation) is accepted K times per step, and the output is unchanged."""
    p = prompts([7], seed=7)[0]
    ref = greedy_reference(model, p, 16)
    engine = GlmEngine(model, max_concurrent_decodes=1, max_len=64, prefill_buckets=(8,), num_draft=3)
    state = engine.init_decode_state()
    prefix = engine.prefill(params=None, padded_tokens=np.asarray(p), true_length=len(p))
    assert int(prefix.token[0]) == ref[0]
    state = engine.insert(prefix, state, 0)
    out = [ref[0]]
    while len(out) < 13:
        oracle = jnp.asarray([ref[len(out):len(out) + 3]], jnp.int32)
        state = state._replace(drafts=oracle, draft_logp=jnp.log(jax.nn.one_hot(oracle, TINY.vocab_size)))
        state, result = engine.generate(None, state)
        r = result.convert_to_numpy().get_result_at_slot(0)
        assert r.valid[0].sum() == 4
        out += [int(t) for t in r.tokens[0]]
    assert out == ref[:len(out)]


def _chain(seed, vocab, conditioning):
    """Random conditional distributions [*conditioning, vocab], far from uniform."""
    logits = jax.random.normal(jax.random.key(seed), (*conditioning, vocab)) * 1.5
    return np.asarray(jax.nn.softmax(logits, -1), np.float64)


def test_rejection_sampling_preserves_the_target_distribution():
    """Two drafts on a 5-token vocabulary, 60,000 independent slots: a target p
    (p1, p2(.|x1), p3(.|x1, x2)) and a different drafter q. The first output token follows
    p1; given an accepted first draft x, the second follows p2(.|x); given two accepted
    drafts, the bonus token follows p3(.|x1, x2). Chi-square tests at p > 1e-3, and the
    drafter's own distribution q1 is rejected by the same test."""
    v, n = 5, 60_000
    p1, p2, p3 = _chain(0, v, ()), _chain(1, v, (v,)), _chain(2, v, (v, v))
    q1, q2 = _chain(3, v, ()), _chain(4, v, (v,))
    keys = jax.random.split(jax.random.key(5), 4)
    x1 = np.asarray(jax.random.categorical(keys[0], jnp.log(q1), shape=(n,)))
    x2 = np.asarray(jax.random.categorical(keys[1], jnp.log(q2[x1])))
    target = np.log(np.stack([np.broadcast_to(p1, (n, v)), p2[x1], p3[x1, x2]], 1))
    draft = np.log(np.stack([np.broadcast_to(q1, (n, v)), q2[x1]], 1))
    drafts = np.stack([x1, x2], 1).astype(np.int32)
    accepted, tokens = accept(jnp.asarray(target, jnp.float32), jnp.asarray(draft, jnp.float32),
                              jnp.asarray(drafts), jax.random.split(keys[2], n), jax.random.split(keys[3], n))
    accepted, tokens = np.asarray(accepted), np.asarray(tokens)

    def check(samples, probs):
        counts = np.bincount(samples, minlength=v)
        return stats.chisquare(counts, probs / probs.sum() * counts.sum()).pvalue

    assert check(tokens[:, 0], p1) > 1e-3
    assert check(tokens[:, 0], q1) < 1e-6
    for x in range(v):
        second = tokens[(accepted >= 1) & (tokens[:, 0] == x), 1]
        assert check(second, p2[x]) > 1e-3
    both = accepted == 2
    assert both.sum() > 1000
    pair = x1[both] * v + x2[both]
    for c in np.unique(pair)[np.bincount(pair)[np.unique(pair)] > 400]:
        assert check(tokens[both][pair == c, 2], p3[c // v, c % v]) > 1e-3
    # The acceptance rate of one draft is sum_x min(p, q) (Leviathan et al., section 3.3).
    assert abs(np.mean(accepted >= 1) - np.minimum(p1, q1).sum()) < 0.01


def test_greedy_rows_accept_exactly_the_target_argmax():
    v = 7
    target = jax.nn.log_softmax(jax.random.normal(jax.random.key(0), (3, 3, v)) * 3)
    best = np.asarray(jnp.argmax(target, -1))
    onehot = lambda idx: jnp.where(jnp.arange(v) == idx[..., None], 0.0, -jnp.inf)  # noqa: E731
    drafts = np.stack([best[:, :2][0], [best[1, 0], (best[1, 1] + 1) % v], [(best[2, 0] + 1) % v, best[2, 1]]])
    accepted, tokens = accept(onehot(jnp.asarray(best)), onehot(jnp.asarray(drafts)), jnp.asarray(drafts, jnp.int32),
                              jax.random.split(jax.random.key(1), 3), jax.random.split(jax.random.key(2), 3))
    assert np.asarray(accepted).tolist() == [2, 1, 0]
    np.testing.assert_array_equal(np.asarray(tokens)[0], best[0])
    assert np.asarray(tokens)[1, :2].tolist() == best[1, :2].tolist()
    assert np.asarray(tokens)[2, 0] == best[2, 0]


def test_sampled_speculative_decoding_reports_target_log_probs(model):
    """With sampling, the engine's per-token log-probs are the target's sampling
    distribution at each emitted position (checked against a full forward)."""
    p = prompts([7], seed=8)[0]
    engine = GlmEngine(model, max_concurrent_decodes=1, max_len=64, prefill_buckets=(8,), num_draft=2)
    driver = Driver(engine)
    h = driver.submit(Request(p, max_new_tokens=10, temperature=1.0, seed=3))
    driver.run_until_idle()
    r = h.result()
    logits = np.asarray(model(np.asarray(p + r.tokens, np.int32)[None]).logits[0, len(p) - 1:-1])
    expected = np.asarray(jax.nn.log_softmax(logits, -1))[np.arange(len(r.tokens)), r.tokens]
    np.testing.assert_allclose(r.log_probs, expected, atol=1e-4)


@pytest.mark.parametrize("mode", ["own", "shared"])
def test_training_drafts_match_the_serving_drafts(model, mode):
    """mtp_draft_logits (training) and the engine's drafts see the same inputs: after a
    sampled prefill of 8 tokens, the distribution of draft 1 equals the depth-1 training
    logits at position 7 of the prompt followed by the sampled token, and (in "shared"
    mode, where no cache differs) draft 2's equals depth 2's, given draft 1."""
    ids = np.asarray(prompts([8], seed=9)[0], np.int32)
    engine = GlmEngine(model, max_concurrent_decodes=1, max_len=64, prefill_buckets=(16,), num_draft=2,
                       mtp_mode=mode)
    prefix = engine.prefill(params=None, padded_tokens=ids, true_length=8,
                            sampling=SamplingParams(temperature=1.0, seed=0))
    seq = jnp.asarray(np.concatenate([ids, np.asarray(prefix.token), np.asarray(prefix.drafts[0, :1])])[None])
    depth = mtp_draft_logits(model, seq, 2, mode)
    np.testing.assert_allclose(np.asarray(prefix.draft_logp[0, 0]), np.asarray(jax.nn.log_softmax(depth[0][0, 7])),
                               atol=1e-4)
    if mode == "shared":
        np.testing.assert_allclose(np.asarray(prefix.draft_logp[0, 1]),
                                   np.asarray(jax.nn.log_softmax(depth[1][0, 7])), atol=1e-4)


@pytest.mark.parametrize("mode", ["own", "shared"])
def test_training_drafts_see_no_token_after_their_target(model, mode):
    """Row r of depth j predicts token r + j + 1 from tokens 0..r + j: changing any later
    token leaves it unchanged, and the multi-depth loss is the mean of the depths' losses."""
    ids = np.asarray(prompts([12], seed=10)[0], np.int32)[None]
    base = mtp_draft_logits(model, jnp.asarray(ids), 3, mode)
    for j, logits in enumerate(base, start=1):
        for r in (2, 6):
            changed = ids.copy()
            changed[0, r + j + 1:] = (changed[0, r + j + 1:] + 1) % TINY.vocab_size
            again = mtp_draft_logits(model, jnp.asarray(changed), 3, mode)[j - 1]
            np.testing.assert_allclose(np.asarray(again[0, :r + 1]), np.asarray(logits[0, :r + 1]), atol=1e-5)
    mask = jnp.ones(ids.shape)
    main = model(jnp.asarray(ids), cache=KVCache.init(TINY, 1, 12) if mode == "shared" else None)
    loss, _ = mtp_loss(model, main.hidden, jnp.asarray(ids), mask, depth=3, mode=mode, main=main)
    by_depth = [float(optax.softmax_cross_entropy_with_integer_labels(lg[0, :-1], ids[0, j + 2:]).mean())
                for j, lg in enumerate(base)]
    np.testing.assert_allclose(float(loss), np.mean(by_depth), rtol=1e-5)
