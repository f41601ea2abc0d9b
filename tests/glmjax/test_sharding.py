"""Sharded forward and gradients equal the single-device ones, on 8 fake CPU devices."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import glmjax
from glmjax import sharding

CONFIG = glmjax.ModelConfig(
    vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
    qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=1,
    index_topk=8, index_n_heads=4, index_head_dim=16, index_topk_pattern="FSFS", initializer_range=0.1,
    max_position_embeddings=128, num_nextn_predict_layers=0,
)
MESHES = {
    "data2-expert2-tensor2": dict(data=2, expert=2, tensor=2),
    "fsdp4-expert2": dict(fsdp=4, expert=2),
    "sequence4-tensor2": dict(sequence=4, tensor=2),
    "stage2-expert2-tensor2": dict(stage=2, expert=2, tensor=2),
}


def _loss(state, graphdef, ids):
    logits = nnx.merge(graphdef, state)(ids).logits
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], ids[:, 1:]).mean(), logits


@pytest.fixture(scope="module")
def reference():
    model = glmjax.init_model(CONFIG, seed=0)
    graphdef, state = nnx.split(model)
    ids = jax.random.randint(jax.random.key(1), (8, 16), 0, CONFIG.vocab_size)
    params = nnx.state(model, nnx.Param)
    (loss, logits), grads = jax.value_and_grad(
        lambda p: _loss(nnx.merge_state(state, p), graphdef, ids), has_aux=True)(params)
    return graphdef, state, ids, logits, grads


@pytest.mark.parametrize("name", list(MESHES))
def test_sharded_forward_and_gradients_match_one_device(name, reference):
    graphdef, state, ids, logits, grads = reference
    mesh = glmjax.make_mesh(**MESHES[name])
    with sharding.use_mesh(mesh):
        sharded_state = jax.device_put(state, sharding.param_shardings(state, mesh))
        ids_s = jax.device_put(ids, jax.sharding.NamedSharding(mesh, sharding.logical_spec(
            ("batch", "length"), ids.shape, mesh=mesh)))
        params = nnx.state(nnx.merge(graphdef, sharded_state), nnx.Param)

        @jax.jit
        def step(p, ids):
            return jax.value_and_grad(lambda p: _loss(nnx.merge_state(sharded_state, p), graphdef, ids),
                                      has_aux=True)(p)

        (_, got_logits), got_grads = step(params, ids_s)
    assert np.abs(np.asarray(got_logits) - np.asarray(logits)).max() <= 1e-5
    for (path, g), (_, r) in zip(nnx.to_flat_state(got_grads), nnx.to_flat_state(grads)):
        np.testing.assert_allclose(np.asarray(g[...]), np.asarray(r[...]), atol=1e-5, rtol=1e-4, err_msg=str(path))


def test_experts_are_split_over_the_expert_axis():
    mesh = glmjax.make_mesh(fsdp=4, expert=2)
    with sharding.use_mesh(mesh):
        model = glmjax.init_model(CONFIG, mesh=mesh)
    gate = model.layers[1].mlp.experts.gate[...]
    full = gate.size * gate.dtype.itemsize
    assert gate.sharding.spec == jax.sharding.PartitionSpec(("expert", "fsdp"), None, None)  # whole experts
    assert {s.data.nbytes for s in gate.addressable_shards} == {full // 8}
    # Nothing large is replicated: every parameter with >= 4096 values is split.
    for path, var in nnx.to_flat_state(nnx.state(model)):
        x = var[...]
        if x.size >= 4096:
            assert max(s.data.size for s in x.addressable_shards) < x.size, f"{path} is replicated"
    per_device = sharding.per_device_bytes(nnx.state(model))
    total = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))
    assert max(per_device.values()) < total / 3


def test_capacity_factor_drops_only_overflow():
    """Every token routed to the same two experts (both on expert shard 0). Each device holds
    2 tokens = 4 copies for shard 0; capacity factor 1 gives it 4 receive rows, 2 for each of
    the two sources: each source's copies to expert 0 arrive, those to expert 1 are dropped.
    The default capacity drops nothing."""
    from glmjax.layers import expert_parallel

    n, d, f, e = 16, 8, 4, 4
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(n, d)), jnp.float32)
    experts = jnp.tile(jnp.array([[0, 1]], jnp.int32), (n, 1))  # all on device 0's experts
    weights = jnp.ones((n, 2), jnp.float32)
    gate, up = (jnp.asarray(rng.normal(size=(e, d, f)), jnp.float32) for _ in range(2))
    down = jnp.asarray(rng.normal(size=(e, f, d)), jnp.float32)
    mesh = glmjax.make_mesh(data=4, expert=2)
    from glmjax.layers.gmm import swiglu_experts

    expected = np.asarray(swiglu_experts(x, experts, weights, gate, up, down))
    with sharding.use_mesh(mesh):
        full, full_kept = jax.jit(lambda *a: expert_parallel.experts_forward(*a))(x, experts, weights, gate, up, down)
        small, kept = jax.jit(lambda *a: expert_parallel.experts_forward(*a, capacity_factor=1.0))(
            x, experts, weights, gate, up, down)
    np.testing.assert_allclose(np.asarray(full), expected, atol=1e-5)
    assert np.asarray(full_kept).all()
    np.testing.assert_array_equal(np.asarray(kept), np.tile([[True, False]], (n, 1)))
    only_first = np.asarray(swiglu_experts(x, experts, weights * jnp.array([1.0, 0.0]), gate, up, down))
    np.testing.assert_allclose(np.asarray(small), only_first, atol=1e-5)


def test_pipeline_over_stages_matches_one_device(reference):
    """(stage 2, expert 2, tensor 2): two stages of two layers, 4 microbatches (GPipe)."""
    from glmjax import pipeline

    graphdef, state, ids, _, grads = reference
    model = nnx.merge(graphdef, state)
    mesh = glmjax.make_mesh(stage=2, expert=2, tensor=2)
    pipe = pipeline.Pipeline(model, mesh, num_microbatches=4)
    loss, stage_grads = pipe.loss_and_grads(ids)
    expected_loss = _loss(state, graphdef, ids)[0]
    assert abs(loss - float(expected_loss)) <= 1e-5
    ref = {path: np.asarray(v[...]) for path, v in nnx.to_flat_state(grads)}
    # Stage paths: ("layers", j, ...) within the stage, plus ("model", ...) for embed / norm / head.
    flat_stage = []
    for s, g in enumerate(stage_grads):
        offset = 0 if s == 0 else 2
        for path, v in nnx.to_flat_state(g):
            name = path if path[0] != "layers" else ("layers", path[1] + offset) + path[2:]
            flat_stage.append((name, np.asarray(v[...])))
    seen = {}
    for name, value in flat_stage:
        seen[name] = seen.get(name, 0) + value
    assert set(seen) == set(ref)
    for name, value in seen.items():
        np.testing.assert_allclose(value, ref[name], atol=1e-5, rtol=1e-4, err_msg=str(name))
    bubble = pipe.measure_bubble(ids)
    assert abs(bubble["stated"] - 1 / 5) < 1e-9 and 0 <= bubble["measured"] < 1
