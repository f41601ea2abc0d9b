"""The experts' grouped matmul through megablox: equal to the CPU reference when its kernels
are interpreted on a CPU, and compiled for a TPU v5p with each product counted once."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from glmjax import sharding
from glmjax.layers import expert_parallel, gmm

# memory a kernel never writes reads as NaN, so rows left to it must be masked to show as zeros
NAN_MEMORY = pltpu.InterpretParams(uninitialized_memory="nan")


def _problem(rows, experts, d, f, seed=0):
    rng = np.random.default_rng(seed)
    xs = jnp.asarray(rng.normal(size=(rows, d)), jnp.float32)
    gate, up = (jnp.asarray(rng.normal(size=(experts, d, f)) * 0.5, jnp.float32) for _ in range(2))
    down = jnp.asarray(rng.normal(size=(experts, f, d)) * 0.5, jnp.float32)
    probe = jnp.asarray(rng.normal(size=(rows, d)), jnp.float32)
    return xs, gate, up, down, probe


def _value_and_grads(swiglu, group_sizes, xs, gate, up, down, probe):
    """sum(swiglu(...) * probe), its output, and its gradients for xs and the three stacks."""
    def loss(xs, gate, up, down):
        y = swiglu(xs, group_sizes, gate, up, down)
        return jnp.sum(y * probe), y

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(xs, gate, up, down)


# 37 rows in one row tile, 22 of them in groups; 700 rows (768 computed, row tiles of 256)
# with groups that straddle tiles. Empty groups first, inside and last.
@pytest.mark.parametrize("rows, sizes", [(37, [0, 7, 0, 12, 3, 0]), (700, [0, 190, 0, 301, 2, 150, 0])], ids=str)
def test_interpreted_megablox_equals_cpu_reference(rows, sizes):
    group_sizes = jnp.asarray(sizes, jnp.int32)
    problem = _problem(rows, len(sizes), 8, 6)
    interpreted = lambda *a: gmm.swiglu_megablox(*a, interpret=NAN_MEMORY)  # noqa: E731
    (value, y), grads = _value_and_grads(interpreted, group_sizes, *problem)
    (want_value, want_y), want_grads = _value_and_grads(gmm.swiglu_grouped, group_sizes, *problem)
    np.testing.assert_allclose(float(value), float(want_value), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(y), np.asarray(want_y), rtol=1e-5, atol=1e-5)
    for name, got, want in zip(("xs", "gate", "up", "down"), grads, want_grads):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5, err_msg=name)
    used = sum(sizes)
    np.testing.assert_array_equal(np.asarray(y)[used:], 0)
    np.testing.assert_array_equal(np.asarray(grads[0])[used:], 0)
    empty = [e for e, s in enumerate(sizes) if s == 0]
    for got in grads[1:]:
        np.testing.assert_array_equal(np.asarray(got)[empty], 0)


def test_tilings_divide_glm5_shapes():
    """D = 6144, F = 2048 per expert (512 over a tensor axis of 4) and R rows, for each of a
    product's three calls (forward [m, k] x [k, n], input gradient [m, n] x [n, k], weight
    gradient [k, m] x [m, n])."""
    for rows in (1, 37, 512, 520, 1280, 1300, 5000, 40960):
        m = gmm.megablox_rows(rows)
        assert rows <= m < rows + 128 or rows <= m <= rows * 9 // 8, (rows, m)
        for k, n in ((6144, 2048), (2048, 6144), (6144, 512), (512, 6144)):
            for dims in ((m, k, n), (m, n, k)):
                tiles = gmm.megablox_tiling(*dims)
                assert all(d % t == 0 for d, t in zip(dims, tiles)), (dims, tiles)
                assert tiles[0] % 16 == 0 and all(t % 128 == 0 for t in tiles[1:]), (dims, tiles)
                assert tiles[0] <= gmm.MEGABLOX_ROWS and max(tiles[1:]) <= gmm.MEGABLOX_FEATURES, (dims, tiles)


def _v5p(topology):
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # another process's compile-only client is no conflict
    from jax.experimental import topologies

    return topologies.get_topology_desc(topology, "tpu").devices


# small features, and GLM-5's (D = 6144, F = 2048: the largest tiles) over rows padded to a 208-row tile
@pytest.mark.parametrize("m, d, f", [(1024, 512, 256), (200, 6144, 2048)], ids=str)
def test_compiled_for_tpu_v5p_counts_forward_and_both_gradients_once(m, d, f):
    """Value and gradients of the SwiGLU over G = 4 experts: three products forward, and for
    each an input and a weight gradient of the same size, so 3x the forward's FLOPs.
    (XLA:TPU's count of ragged_dot's weight gradient is G times its size, ~2x in all.)"""
    devices = _v5p("v5p:2x2x1")
    mesh = jax.sharding.Mesh(np.array(devices[:1]), ("data",))
    g = 4
    arg = lambda shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P()))  # noqa: E731
    args = (arg((m, d)), arg((g,), jnp.int32), arg((g, d, f)), arg((g, d, f)), arg((g, f, d)))

    def loss(xs, group_sizes, gate, up, down):
        return jnp.sum(gmm.swiglu_grouped(xs, group_sizes, gate, up, down).astype(jnp.float32))

    with jax.set_mesh(mesh):
        compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 2, 3, 4))).lower(*args).compile()
    assert "ragged" not in compiled.as_text()
    forward = 3 * 2 * m * d * f
    ratio = compiled.cost_analysis()["flops"] / forward
    assert 3 <= ratio <= 1.1 * 3, ratio


def test_compiled_for_tpu_v5p_expert_parallel_forward_and_backward_count_each_product_once():
    """experts_forward with R = c M rows per device on a v5p:2x2x2 EP group of 8, 4 local
    experts each: forward and backward are about 3 c times the routed copies' forward FLOPs."""
    devices = _v5p("v5p:2x2x2")
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

    def loss(x, experts, weights, gate, up, down):
        y = expert_parallel.experts_forward(x, experts, weights, gate, up, down, capacity_factor=c)[0]
        return jnp.sum(y.astype(jnp.float32))

    with jax.set_mesh(mesh):
        compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 2, 3, 4, 5))).lower(*args).compile()
    routed = 3 * 2 * (n // 8) * k * d * f  # gate, up and down for each device's routed copies
    ratio = compiled.cost_analysis()["flops"] / routed
    assert 3 * c <= ratio <= 1.1 * 3 * c, ratio
