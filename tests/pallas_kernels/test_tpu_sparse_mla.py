"""The Mosaic sparse MLA (`pallas_kernels/tpu/sparse_mla.py`) against its jnp reference in
TPU interpret mode, and compiled for a TPU v5p by libtpu on this CPU.

Interpret mode runs every DMA as a host callback, so the shapes are tiny; they are
awkward as in test_kernels.py: T not a multiple of the query block, P not a multiple of
the DMA block (two blocks per query: the online softmax crosses a block), ragged
per-sequence positions that start past 0 as in a cache decode, empty (-1) and invisible
selections, rows selected by many queries (the backward's scatter-add).
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import pallas_ops, reference
from pallas_kernels.tpu import sparse_mla

B, H, C, R = 2, 2, 32, 8
SCALE = 0.3
TOL = dict(atol=2e-5, rtol=2e-5)


def _inputs(t, s, p):
    keys = jax.random.split(jax.random.key(0), 6)
    shapes = [(B, t, H, C), (B, t, H, R), (B, s, C), (B, s, R)]
    latents = [jax.random.normal(k, x, jnp.float32) for k, x in zip(keys, shapes)]
    # Sequence 0 ends at the last key; sequence 1 is a decode whose cache starts at 3.
    pos = jnp.stack([jnp.arange(t) + s - t, jnp.arange(t) + 3]).astype(jnp.int32)
    rows = jax.random.split(keys[4], B * t)
    idx = jnp.stack([jax.random.permutation(k, s)[:p] for k in rows]).reshape(B, t, p)
    idx = jnp.where(jax.random.uniform(keys[5], (B, t, p)) < 0.2, -1, idx).astype(jnp.int32)
    return latents, pos, idx


def test_forward_and_gradients_match_reference():
    t, s, p = 11, 40, 12  # query blocks of 8: 2 grid steps, 5 padded queries; P = 12: DMA blocks of 8
    latents, pos, idx = _inputs(t, s, p)
    valid = (idx >= 0) & (idx <= pos[..., None])
    assert 0 < int(valid.sum()) < valid.size and bool((valid.sum(-1) < p).any())
    # Rows selected by several queries: their gradients add.
    assert np.bincount(np.asarray(idx[0][valid[0]]), minlength=s).max() > 1

    kernel = lambda *a: sparse_mla.sparse_mla_attention(  # noqa: E731
        *a, pos, idx, scale=SCALE, block_t=8, block_p=8, backend="tpu-interpret")
    ref = lambda *a: reference.sparse_mla_attention(*a, pos, idx, scale=SCALE)  # noqa: E731
    out, want = kernel(*latents), ref(*latents)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), **TOL)

    w = jax.random.normal(jax.random.key(9), (C,))
    grads = [jax.grad(lambda *a: jnp.sum(f(*a) * w), argnums=(0, 1, 2, 3))(*latents) for f in (kernel, ref)]  # noqa: B023
    for got, expected in zip(*grads):
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), **TOL)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, TOL), (jnp.bfloat16, dict(atol=2e-2, rtol=2e-2))])
def test_ops_dispatch_to_the_mosaic_kernel_on_tpu_interpret(dtype, tol):
    """One decode step through pallas_ops. In bf16 the latents travel as packed words (two
    columns a word): a swapped unpacking would be off by O(1), bf16 rounding by ~1e-2."""
    t, s, p = 1, 24, 8
    latents, pos, idx = _inputs(t, s, p)
    latents = [x.astype(dtype) for x in latents]
    out = pallas_ops.OPS["sparse_mla_attention"](*latents, pos, idx, scale=SCALE, backend="tpu-interpret")
    want = reference.sparse_mla_attention(*latents, pos, idx, scale=SCALE)
    assert out.dtype == dtype
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32), **tol)


def test_forward_and_backward_compile_for_tpu_v5p():
    """GLM-5's latent widths (C = 512, R = 64) and top-k (2048), bf16, 16 heads."""
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other test processes may hold libtpu
    from jax.experimental import topologies

    device = topologies.get_topology_desc("v5p:2x2x1", "tpu").devices[0]
    t, s, p, h = 16, 4096, 2048, 16
    spec = lambda shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(  # noqa: E731
        shape, dtype, sharding=jax.sharding.SingleDeviceSharding(device))

    def loss(q_c, q_r, c_kv, k_r, q_pos, topk_idx):
        o = sparse_mla.sparse_mla_attention(q_c, q_r, c_kv, k_r, q_pos, topk_idx, scale=SCALE, backend="tpu")
        return jnp.sum(o.astype(jnp.float32))

    args = [spec((1, t, h, 512)), spec((1, t, h, 64)), spec((1, s, 512)), spec((1, s, 64)),
            spec((1, t), jnp.int32), spec((1, t, p), jnp.int32)]
    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3))).lower(*args).compile()
    text = compiled.as_text()
    assert "sparse_mla_forward" in text and "sparse_mla_backward" in text
