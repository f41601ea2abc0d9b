"""Expert-parallel dispatch on 8 fake CPU devices against the one-device grouped matmul, and
compiled for a TPU v5p slice: no expert weight gathered, expert FLOPs bounded by the capacity."""

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import glmjax
from glmjax import sharding
from glmjax.layers import expert_parallel
from glmjax.layers.gmm import swiglu_experts

E, D, F, X = 16, 8, 6, 4


def _problem(tokens, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(tokens, D)), jnp.float32)
    experts = jnp.asarray(np.stack([rng.choice(E, X, replace=False) for _ in range(tokens)]), jnp.int32)
    weights = jnp.asarray(rng.uniform(size=(tokens, X)), jnp.float32)
    gate, up = (jnp.asarray(rng.normal(size=(E, D, F)) * 0.5, jnp.float32) for _ in range(2))
    down = jnp.asarray(rng.normal(size=(E, F, D)) * 0.5, jnp.float32)
    probe = jnp.asarray(rng.normal(size=(tokens, D)), jnp.float32)
    return x, experts, weights, gate, up, down, probe


def _value_and_grads(forward, x, experts, weights, gate, up, down, probe):
    """sum(forward(...) * probe) and its gradients for x, weights and the three expert stacks."""
    def loss(x, weights, gate, up, down):
        return jnp.sum(forward(x, experts, weights, gate, up, down) * probe)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))(x, weights, gate, up, down)


def _on_mesh(mesh, x, experts, weights, gate, up, down, probe, capacity_factor, chunk_tokens=None):
    """The EP layer with the expert stacks placed as the rules place them."""
    spec = lambda names, a: NamedSharding(mesh, sharding.logical_spec(names, a.shape, mesh=mesh))  # noqa: E731
    gate, up = (jax.device_put(w, spec(("experts", "embed", "mlp"), w)) for w in (gate, up))
    down = jax.device_put(down, spec(("experts", "mlp", "embed"), down))
    with sharding.use_mesh(mesh):
        ep = lambda *a: expert_parallel.experts_forward(*a, capacity_factor=capacity_factor,  # noqa: E731
                                                        chunk_tokens=chunk_tokens)[0]
        return _value_and_grads(ep, x, experts, weights, gate, up, down, probe)


# (expert 2, fsdp 4): one EP group of 8, two experts per device; (data 2, expert 2, tensor 2):
# EP over `expert` with F split over `tensor`. 60 tokens do not divide over 8 devices (padding);
# chunks of 3 tokens do not divide a device's 8 or 15 (padded chunks, rematerialised in the backward).
@pytest.mark.parametrize("axes", [dict(fsdp=4, expert=2), dict(data=2, expert=2, tensor=2)], ids=str)
@pytest.mark.parametrize("capacity_factor,chunk_tokens", [(None, None), (8.0, None), (None, 3), (8.0, 3)])
def test_forward_and_gradients_equal_one_device(axes, capacity_factor, chunk_tokens):
    problem = _problem(60)
    want_value, want_grads = _value_and_grads(swiglu_experts, *problem)
    value, grads = _on_mesh(glmjax.make_mesh(**axes), *problem, capacity_factor=capacity_factor,
                            chunk_tokens=chunk_tokens)
    np.testing.assert_allclose(float(value), float(want_value), rtol=1e-5)
    for name, got, want in zip(("x", "weights", "gate", "up", "down"), grads, want_grads):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5, err_msg=name)


def test_experts_split_over_expert_and_fsdp_as_stored():
    mesh = glmjax.make_mesh(fsdp=4, expert=2)
    assert sharding.logical_spec(("experts", "embed", "mlp"), (E, D, F), mesh=mesh) == P(("expert", "fsdp"), None, None)
    with sharding.use_mesh(mesh):
        assert expert_parallel.ep_axes(E) == ("expert", "fsdp")
        assert expert_parallel.ep_axes(6) == ("expert",)  # 6 experts do not divide over 8 devices; they do over 2
    with sharding.use_mesh(glmjax.make_mesh(sequence=4, tensor=2)):
        assert not expert_parallel.enabled(E)


def test_small_capacity_drops_whole_copies_fairly():
    """Every token routed to experts 0 and 1, both on device 0 of the EP group (expert 8):
    each device sends it 2 tokens x 2 copies, M = 4. Capacity factor 2 gives R = 8 rows for
    8 sources, one each: every source keeps the first copy of its chunk (its first token's
    copy to expert 0), the other copies contribute exactly zero, and the kept ones are exact."""
    x, _, _, gate, up, down, _ = _problem(16)
    experts = jnp.tile(jnp.array([[0, 1]], jnp.int32), (16, 1))
    weights = jnp.asarray(np.random.default_rng(1).uniform(size=(16, 2)), jnp.float32)
    with sharding.use_mesh(glmjax.make_mesh(expert=8)):
        y, kept = jax.jit(lambda *a: expert_parallel.experts_forward(*a, capacity_factor=2.0))(
            x, experts, weights, gate, up, down)
    expected_kept = np.zeros((16, 2), bool)
    expected_kept[::2, 0] = True
    np.testing.assert_array_equal(np.asarray(kept), expected_kept)
    want = swiglu_experts(x, experts, weights * expected_kept, gate, up, down)
    np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_random_routing_with_drops_keeps_the_rest_exact():
    """Capacity factor 0.75 on random routing: the dropped copies are the only difference."""
    x, experts, weights, gate, up, down, _ = _problem(64, seed=3)
    with sharding.use_mesh(glmjax.make_mesh(fsdp=4, expert=2)):
        y, kept = jax.jit(lambda *a: expert_parallel.experts_forward(*a, capacity_factor=0.75))(
            x, experts, weights, gate, up, down)
    assert not np.asarray(kept).all()
    want = swiglu_experts(x, experts, weights * kept, gate, up, down)
    np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_compiled_for_tpu_v5p_gathers_no_expert_weight_and_computes_about_c_times_the_copies():
    """XLA:TPU counts the grouped matmul (megablox) as 2 M K N for its static rows M: with
    R = c M rows per device the expert FLOPs are about c times the routed copies' (here they
    are nearly all of the program's). The expert stacks enter whole, as stored: no all-gather
    of them. Compiled under the suite's fp32 matmul precision, which the bf16 kernels ignore."""
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # another process's compile-only client is no conflict
    from jax.experimental import topologies

    devices = topologies.get_topology_desc("v5p:2x2x2", "tpu").devices
    mesh = jax.sharding.Mesh(np.array(devices).reshape(1, 1, 4, 2, 1, 1), sharding.AXES)
    n, d, f, e, k, c = 8 * 256, 512, 256, 32, 4, 1.25
    tokens = NamedSharding(mesh, P(("fsdp", "expert")))
    stack = lambda shape, names: jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(  # noqa: E731
        mesh, sharding.logical_spec(names, shape, mesh=mesh)))
    args = (jax.ShapeDtypeStruct((n, d), jnp.bfloat16, sharding=tokens),
            jax.ShapeDtypeStruct((n, k), jnp.int32, sharding=tokens),
            jax.ShapeDtypeStruct((n, k), jnp.float32, sharding=tokens),
            stack((e, d, f), ("experts", "embed", "mlp")), stack((e, d, f), ("experts", "embed", "mlp")),
            stack((e, f, d), ("experts", "mlp", "embed")))
    assert args[3].sharding.spec == P(("expert", "fsdp"), None, None)
    with jax.set_mesh(mesh):
        compiled = jax.jit(lambda *a: expert_parallel.experts_forward(*a, capacity_factor=c)[0]).lower(*args).compile()
    hlo = compiled.as_text()
    gathers = [line for line in hlo.splitlines() if re.search(r"\ball-gather(-start)?\(", line)]
    assert not [g for g in gathers if "bf16" in g.split("all-gather")[0]], gathers  # only the int32 counts
    assert len(re.findall(r"\bragged-all-to-all\(", hlo)) == 2
    routed = 3 * 2 * (n // 8) * k * d * f  # gate, up and down for each device's routed copies
    ratio = compiled.cost_analysis()["flops"] / routed
    assert c <= ratio <= 1.05 * c, ratio
