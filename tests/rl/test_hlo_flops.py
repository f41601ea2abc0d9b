"""rl/hlo_flops.py against XLA's own cost analysis: equal on loop-free programs, the loop
body counted once per trip where XLA counts it once; on XLA:CPU and compiled for a TPU."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl import hlo_flops

M, K, N, TRIPS = 64, 96, 80, 7


def _xla_flops(compiled) -> float:
    cost = compiled.cost_analysis()
    return (cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"]


def _scanned_matmuls(x, w):
    """TRIPS steps of x <- tanh(x @ w), then one more product outside the loop."""
    def step(x, _):
        return jnp.tanh(x @ w), None

    x, _ = jax.lax.scan(step, x, None, length=TRIPS)
    return x @ w


def _args(device=None):
    shapes = ((M, K), (K, K))
    if device is None:
        rng = np.random.default_rng(0)
        return tuple(jnp.asarray(rng.normal(size=s), jnp.float32) for s in shapes)
    place = jax.sharding.SingleDeviceSharding(device)
    return tuple(jax.ShapeDtypeStruct(s, jnp.float32, sharding=place) for s in shapes)


def test_a_loop_body_counts_once_per_trip_on_cpu():
    compiled = jax.jit(_scanned_matmuls).lower(*_args()).compile()
    report = hlo_flops.matmul_flops(compiled.as_text())
    assert report.unknown_trip_counts == []
    assert report.flops == (TRIPS + 1) * 2 * M * K * K
    assert _xla_flops(compiled) < 3 * 2 * M * K * K  # XLA's own count sees the body once


@pytest.mark.parametrize("padding,stride,dilation", [("VALID", 1, 1), ("SAME", 2, 1), ([(3, 1)], 1, 2)])
def test_convolutions_count_as_xla_counts_them(padding, stride, dilation):
    """Padded, strided and dilated windows: only the positions that read a real input count."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(2, 5, 33)), jnp.float32)  # [batch, features, width]
    w = jnp.asarray(rng.normal(size=(7, 5, 4)), jnp.float32)  # [out, in, window]
    conv = lambda x, w: jax.lax.conv_general_dilated(x, w, (stride,), padding, rhs_dilation=(dilation,))  # noqa: E731
    compiled = jax.jit(conv).lower(x, w).compile()
    assert hlo_flops.matmul_flops(compiled.as_text()).flops == _xla_flops(compiled)


def test_dot_general_with_batch_dimensions():
    rng = np.random.default_rng(2)
    a = jnp.asarray(rng.normal(size=(3, M, K)), jnp.float32)
    b = jnp.asarray(rng.normal(size=(3, K, N)), jnp.float32)
    compiled = jax.jit(lambda a, b: jnp.einsum("BMK,BKN->BMN", a, b)).lower(a, b).compile()
    assert hlo_flops.matmul_flops(compiled.as_text()).flops == 3 * 2 * M * K * N


def test_compiled_for_tpu_with_a_pallas_cost_estimate():
    """XLA:TPU's loops (a counter started from a copy of a constant) and a Mosaic kernel's
    cost estimate, counted once per trip of the loop around it."""
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import pallas as pl
    from jax.experimental import topologies

    device = topologies.get_topology_desc("v5p:2x2x1", "tpu").devices[0]

    def kernel(x_ref, w_ref, o_ref):
        o_ref[...] = jnp.dot(x_ref[...], w_ref[...], preferred_element_type=jnp.float32)

    def product(x, w):
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((M, K), jnp.float32),
                              cost_estimate=pl.CostEstimate(flops=2 * M * K * K, transcendentals=0,
                                                            bytes_accessed=4 * (M * K + 2 * K * K)))(x, w)

    def looped(x, w):
        def step(x, _):
            return jnp.tanh(product(x, w)), None

        return jax.lax.scan(step, x, None, length=TRIPS)[0] @ w

    compiled = jax.jit(looped).lower(*_args(device)).compile()
    report = hlo_flops.matmul_flops(compiled.as_text())
    assert report.unknown_trip_counts == []
    assert report.flops == (TRIPS + 1) * 2 * M * K * K
