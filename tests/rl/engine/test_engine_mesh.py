"""GlmEngine on a mesh of 8 fake CPU devices: the same greedy tokens and log-probs as on
one device, a decode state laid out by the rules, expert-parallel dispatch (all-to-all,
no gathered expert stack) at every decode row count, and no recompiles between steps."""

import re

import jax
import numpy as np
import pytest
from flax import nnx

import glmjax
from glmjax import sharding
from rl.engine.driver import Driver, Request
from rl.engine.engine import GlmEngine
from rl.engine.weights import WeightStore
from tests.engine_util import TINY, prompts

MAX_LEN, BUCKETS, NEW = 64, (8, 16), 6
# 8 slots over expert=4 (tensor splits heads and expert hidden), in the serving rules; 6
# slots do not divide over data x expert = 8, so their decode tokens are padded for the
# all-to-all, in the default (FSDP) rules
MESHES = {"expert4-tensor2-decode-rules": (dict(expert=4, tensor=2), 8, sharding.DECODE_RULES),
          "data2-expert4": (dict(data=2, expert=4), 6, None)}


@pytest.fixture(scope="module")
def model():
    return glmjax.init_model(TINY, seed=0)


def _run(engine, ps):
    driver = Driver(engine)
    handles = [driver.submit(Request(p, NEW, temperature=0.0)) for p in ps]
    driver.run_until_idle()
    return [h.result(timeout=0) for h in handles]


@pytest.fixture(scope="module")
def reference(model):
    ps = prompts([5, 11, 3, 9, 14, 7, 12, 4], seed=3)
    return ps, _run(GlmEngine(model, max_concurrent_decodes=8, max_len=MAX_LEN, prefill_buckets=BUCKETS), ps)


@pytest.mark.parametrize("name", list(MESHES))
def test_sharded_engine_matches_one_device(name, model, reference):
    axes, slots, rules = MESHES[name]
    mesh = glmjax.make_mesh(**axes)
    engine = GlmEngine(model, max_concurrent_decodes=slots, max_len=MAX_LEN, prefill_buckets=BUCKETS, mesh=mesh,
                       rules=rules)
    state, model_state = engine.weights.latest().state, nnx.state(model)
    # every parameter as the engine's rules split it
    for (path, var), (_, placed) in zip(nnx.to_flat_state(model_state), nnx.to_flat_state(state)):
        assert placed[...].sharding.spec == sharding.variable_spec(var, mesh=mesh, rules=engine.rules), path
    assert state["layers"][1]["mlp"]["experts"]["gate"][...].sharding.spec[0] == "expert"
    decode = engine.init_decode_state()
    assert decode.cache.layers[0].c_kv.sharding == engine.state_shardings.cache.layers[0].c_kv
    # the slots split over the batch axes they divide: 8 over expert, 6 over data only
    assert decode.tokens.sharding.spec == jax.sharding.PartitionSpec("expert" if slots == 8 else "data")

    ps, expected = reference
    got = _run(engine, ps)
    for g, e in zip(got, expected):
        assert g.tokens == e.tokens
        np.testing.assert_allclose(g.log_probs, e.log_probs, atol=1e-5)


def test_decode_step_dispatches_all_to_all_and_gathers_no_expert_stack(model):
    mesh = glmjax.make_mesh(expert=4, tensor=2)
    engine = GlmEngine(model, max_concurrent_decodes=6, max_len=MAX_LEN, prefill_buckets=BUCKETS, mesh=mesh)
    leaves = engine._leaves(engine.weights.latest())
    e, d = TINY.n_routed_experts, TINY.hidden_size
    stack = re.compile(rf"= f32\[{e},({d},\d+|\d+,{d})\]")  # every expert's gate / up / down, or a slice of F
    with engine._on_mesh():
        for rows in engine.decode_rows:
            step = engine._generate_fn[False]  # the step of requests that ask for no alternatives
            hlo = step.lower(leaves, engine.init_decode_state(), np.int32(0), rows).compile().as_text()
            assert "all-to-all" in hlo, rows
            gathers = [line for line in hlo.splitlines() if re.search(r"\ball-gather(-start)?\(", line)]
            assert gathers and not [g for g in gathers if stack.search(g)], gathers


def test_no_recompiles_between_steps_and_publishes(model):
    """After warmup, steps, inserts and a publish in the engine's layout compile nothing."""
    mesh = glmjax.make_mesh(expert=4, tensor=2)
    engine = GlmEngine(model, max_concurrent_decodes=8, max_len=MAX_LEN, prefill_buckets=(16,), mesh=mesh)
    engine.warmup()
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, _, **kw: compiles.append(event) if event == "/jax/core/compile/backend_compile_duration" else None)
    store: WeightStore = engine.weights
    _run(engine, prompts([5, 9, 3], seed=1))
    store.publish(store.latest().state)
    _run(engine, prompts([7, 2, 12, 8, 6], seed=2))
    assert compiles == []
