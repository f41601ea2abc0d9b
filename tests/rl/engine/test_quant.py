"""rl/engine/quant.py: weight-only quantization of the routed experts, against numpy."""

import jax.numpy as jnp
import numpy as np
import pytest

import glmjax
from rl.engine import quant
from rl.engine.driver import Driver, Request
from rl.engine.engine import GlmEngine
from tests.engine_util import TINY, prompts


@pytest.mark.parametrize("mode,qmax,group", [("int8", 127, 48), ("int4", 7, 16)])
def test_quantize_array_matches_numpy_groupwise_rounding(mode, qmax, group):
    w = np.random.default_rng(0).normal(size=(3, 48, 5)).astype(np.float32)
    q = quant.quantize_array(jnp.asarray(w), mode, 1)
    g = w.reshape(3, 48 // group, group, 5)
    scale = np.abs(g).max(axis=2, keepdims=True) / qmax
    expected = (np.clip(np.round(g / scale), -qmax, qmax) * scale).reshape(w.shape)
    np.testing.assert_allclose(np.asarray(q.astype(jnp.float32)), expected, rtol=1e-6, atol=1e-7)
    assert np.abs(np.asarray(q.astype(jnp.float32)) - w).max() <= scale.max() / 2 + 1e-7
    np.testing.assert_allclose(np.asarray(q[1].astype(jnp.float32)), expected[1], rtol=1e-6, atol=1e-7)
    assert q.nbytes == w.size * (8 if mode == "int8" else 4) // 8 + scale.size * 4


def test_only_the_experts_change_and_the_engine_serves_the_quantized_model():
    model = glmjax.init_model(TINY, seed=0)
    served = quant.quantize(model, "int8")
    assert isinstance(served.layers[1].mlp.experts.gate[...], quant.Quantized)
    np.testing.assert_array_equal(np.asarray(served.layers[1].attn.q_a[...]), np.asarray(model.layers[1].attn.q_a[...]))
    assert isinstance(model.layers[1].mlp.experts.gate[...], jnp.ndarray)  # the original is untouched
    p = prompts([9], seed=3)[0]
    reference = glmjax.generate(served, np.asarray(p, np.int32)[None], 8)
    driver = Driver(GlmEngine(served, max_concurrent_decodes=2, max_len=32, prefill_buckets=(16,)))
    h = driver.submit(Request(p, 8))
    driver.run_until_idle()
    assert h.result().tokens == [int(t) for t in np.asarray(reference)[0, len(p):]]
