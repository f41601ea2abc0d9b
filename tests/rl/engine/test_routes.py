"""An engine that records routes (GlmEngine(record_routes=True)): each request's Result
holds, for every position the engine ran, the experts each MoE layer chose there, and they
are the ones a teacher-forced forward of the same tokens chooses."""

import jax.numpy as jnp
import numpy as np
import pytest

import glmjax
from rl.engine.driver import Driver, Request
from rl.engine.engine import GlmEngine
from tests.engine_util import TINY, prompts


@pytest.fixture(scope="module")
def model():
    return glmjax.init_model(TINY, seed=1)


def _forced(model, tokens) -> np.ndarray:
    """The routers' choice at each position of `tokens`, [T, L_moe, X], experts sorted."""
    routes = model(jnp.asarray(tokens, jnp.int32)[None]).routes[:, 0]  # [L_moe, T, X]
    return np.sort(np.transpose(np.asarray(routes), (1, 0, 2)), -1)


@pytest.mark.parametrize("num_draft", [0, 2])
def test_recorded_routes_are_the_teacher_forced_ones(model, num_draft):
    """Sampled requests (speculative or not), a prompt longer than the largest prefill
    bucket, and a second turn of a session whose prefix is reused (its rows -1)."""
    engine = GlmEngine(model, max_concurrent_decodes=4, max_len=128, max_prefill_length=32, num_draft=num_draft,
                       record_routes=True)
    driver = Driver(engine)
    first = [driver.submit(Request(p, 12, temperature=1.0, seed=i, session_id=f"s{i}"))
             for i, p in enumerate(prompts([5, 40, 17], seed=3))]
    driver.run_until_idle()
    results = [h.result() for h in first]
    again = [r.prompt for r in (h.request for h in first[:1])][0] + results[0].tokens + [7, 9, 11]
    second = driver.submit(Request(again, 6, temperature=1.0, seed=9, session_id="s0"))
    driver.run_until_idle()
    moe = sum(TINY.is_moe(i) for i in range(TINY.num_hidden_layers))
    for handle in [*first, second]:
        r = handle.result()
        tokens = list(handle.request.prompt) + r.tokens
        assert r.routes.shape == (len(tokens) - 1, moe, TINY.num_experts_per_tok) and r.routes.dtype == np.int16
        known = r.routes[:, 0, 0] >= 0
        assert known.sum() == len(tokens) - 1 - r.reused_tokens and not known[:r.reused_tokens].any()
        np.testing.assert_array_equal(np.sort(r.routes[known], -1), _forced(model, tokens[:-1])[known])
    assert second.result().reused_tokens > 0


def test_an_engine_without_moe_layers_cannot_record():
    dense = glmjax.init_model(TINY.replace(first_k_dense_replace=TINY.num_hidden_layers), seed=0)
    with pytest.raises(ValueError, match="no MoE layer"):
        GlmEngine(dense, record_routes=True)
