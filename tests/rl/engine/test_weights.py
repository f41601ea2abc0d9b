"""rl/engine/weights.py: publishing is a reference swap; the engine reads the newest version at
its next step and every token carries the version that produced it."""

import threading
import time

import jax
import numpy as np
import pytest
from flax import nnx

import glmjax
from rl.engine.driver import Driver, Request
from rl.engine.engine import GlmEngine
from rl.engine.weights import Weights, WeightStore
from tests.engine_util import TINY, greedy_reference, prompts


def test_publish_is_a_reference_swap():
    state = {"w": np.ones((1000, 1000), np.float32)}
    store = WeightStore(state)
    assert store.latest() == Weights(state, 0)
    new = {"w": np.zeros((1000, 1000), np.float32)}
    start = time.perf_counter()
    assert store.publish(new) == 1
    elapsed = time.perf_counter() - start
    assert store.latest().state is new and store.latest().state["w"] is new["w"]  # no copy
    assert store.version == 1 and elapsed < 0.05
    assert store.publish(state, version=5) == 5
    with pytest.raises(ValueError, match="version must increase"):
        store.publish(state, version=5)


def test_wait_for_wakes_on_publish():
    store = WeightStore("v0")
    threading.Timer(0.05, lambda: store.publish("v1")).start()
    assert store.wait_for(1, timeout=10) == Weights("v1", 1)
    assert store.wait_for(3, timeout=0.01).version == 1  # timed out: the newest is returned


def test_tokens_carry_the_version_that_produced_them():
    """Weights published between two steps are used from the next step on: the tokens
    after the swap carry version 1 and follow the new model; those before carry 0."""
    old, new = glmjax.init_model(TINY, seed=0), glmjax.init_model(TINY, seed=1)
    store = WeightStore(nnx.state(old))
    engine = GlmEngine(old, weights=store, max_concurrent_decodes=1, max_len=64, prefill_buckets=(8,))
    driver = Driver(engine)
    p = prompts([7], seed=10)[0]
    handle = driver.submit(Request(p, max_new_tokens=8))
    driver.step()  # prefill (token 1) and one generate step (token 2)
    driver.step()
    store.publish(nnx.state(new))
    driver.run_until_idle()
    r = handle.result()
    assert r.versions == [0, 0, 0] + [1] * 5
    assert r.tokens[:3] == greedy_reference(old, p, 3)
    # Token 4 was computed by the new weights over a cache written by the old ones.
    ids = np.asarray(p + r.tokens[:3], np.int32)[None]
    cache = glmjax.KVCache.init(TINY, 1, 64)
    cache = old(ids[:, :-1], cache=cache).cache
    logits = new(ids[:, -1:], cache=cache).logits
    assert r.tokens[3] == int(np.argmax(np.asarray(logits)[0, -1]))
    assert jax.tree.leaves(engine.weights.latest().state)[0] is jax.tree.leaves(nnx.state(new))[0]
