"""The Mosaic absorbed-MLA kernels (`pallas_kernels/tpu/mla.py`) against `reference.mla_attention`.

Values and gradients run in JAX's TPU interpret mode on this CPU at tiny, awkward shapes:
rows (T * H) and keys (S) that do not fill their blocks, query positions that start inside
a cache, key blocks past every row's causal limit, several key splits. The same kernels
then compile for a TPU v5p through libtpu (no TPU needed) at GLM-5's latent widths, which
is where Mosaic checks the block shapes and the VMEM they take.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import pallas_ops, reference
from pallas_kernels.tpu import mla

H, C, R = 2, 32, 8  # C, R under a lane: the wrapper pads them to 128
SCALE = 0.3
TOL = dict(atol=2e-5, rtol=2e-5)
SMALL = dict(block_m=16, block_k=16, backend="tpu-interpret")  # several row and key blocks at tiny sizes


def _latents(seed, b, t, s):
    keys = jax.random.split(jax.random.key(seed), 4)
    shapes = ((b, t, H, C), (b, t, H, R), (b, s, C), (b, s, R))
    return [jax.random.normal(k, shape, jnp.float32) for k, shape in zip(keys, shapes)]


def _positions(b, t, starts):
    """Sequence i's queries at starts[i], starts[i] + 1, ...: its cache holds starts[i] keys."""
    return (jnp.asarray(starts[:b])[:, None] + jnp.arange(t)[None, :]).astype(jnp.int32)


def _close(got, want):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), **TOL)


def _grads(fn, args):
    """Gradients with respect to q_c, q_r, c_kv, k_r of a fixed random projection of fn's output."""
    w = jax.random.normal(jax.random.key(9), (C,))
    return jax.grad(lambda *a: jnp.sum(fn(*a) * w), argnums=(0, 1, 2, 3))(*args)


# -- TPU interpret mode against the reference --------------------------------------------

@pytest.mark.parametrize("t, s, start", [(20, 20, 0), (12, 40, 23)], ids=["prefill", "cache"])
def test_prefill_forward_equals_reference(t, s, start):
    """T * H rows in blocks of 16 and keys in blocks of 16, neither filling its last block;
    key blocks past a row block's last position are skipped (the first row block's second
    block in the prefill, its third with a cache)."""
    args, pos = _latents(0, 1, t, s), _positions(1, t, [start])
    got = mla.mla_attention(*args, pos, scale=SCALE, splits=1, **SMALL)
    _close(got, reference.mla_attention(*args, pos, scale=SCALE))


@pytest.mark.parametrize("b, splits", [(1, None), (2, 3)])
def test_split_key_decode_equals_reference(b, splits):
    """Three new tokens against a 40-key cache filled to ragged lengths (sequence 1 sees one
    key block, so two of its three splits see nothing); splits=None gives one batch's one
    row block two splits, one per TensorCore."""
    t, s = 3, 40
    args, pos = _latents(1, b, t, s), _positions(b, t, [34, 9])
    got = mla.mla_attention(*args, pos, scale=SCALE, splits=splits, **SMALL)
    _close(got, reference.mla_attention(*args, pos, scale=SCALE))


def test_decode_through_pallas_ops_with_default_blocks():
    """The model's entry point on backend="tpu-interpret", at the default block sizes."""
    t, s = 2, 40
    args, pos = _latents(2, 1, t, s), _positions(1, t, [30])
    got = pallas_ops.OPS["mla_attention"](*args, pos, scale=SCALE, backend="tpu-interpret")
    _close(got, reference.mla_attention(*args, pos, scale=SCALE))


@pytest.mark.parametrize("b, t, s, starts", [(1, 12, 40, [23]), (2, 3, 40, [34, 9])], ids=["prefill", "decode"])
def test_gradients_equal_reference(b, t, s, starts):
    """dq_c, dq_r (dq kernel) and dc_kv, dk_r (dk kernel, which skips the row blocks that see
    none of its keys); keys no query sees get zero gradient."""
    args, pos = _latents(3, b, t, s), _positions(b, t, starts)
    got = _grads(lambda *a: mla.mla_attention(*a, pos, scale=SCALE, **SMALL), args)
    want = _grads(lambda *a: reference.mla_attention(*a, pos, scale=SCALE), args)
    for g, w in zip(got, want):
        _close(g, w)


def test_refuses_what_it_cannot_run():
    args, pos = _latents(0, 1, 12, 40), _positions(1, 12, [0])
    with pytest.raises(ValueError, match=r"expected q_c \[B, T, H, C\]"):
        mla.mla_attention(args[0], args[1], args[2][:, :, :8], args[3], pos, scale=SCALE, backend="tpu")
    with pytest.raises(ValueError, match="multiple of 128 or every row"):
        mla.mla_attention(*args, pos, scale=SCALE, block_m=16, backend="tpu")
    with pytest.raises(ValueError, match="absorbed_mla"):
        mla.mla_attention(*args, pos, scale=SCALE, backend="cpu")


# -- compiled for a TPU v5p by libtpu ------------------------------------------------------

@pytest.fixture(scope="module")
def v5p():
    """A v5p TensorCore to compile for. Executables for a device that is not here cannot be
    loaded back, so they stay out of the persistent cache."""
    from jax.experimental import topologies

    cached = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        yield topologies.get_topology_desc("v5p:2x2x1", "tpu").devices[0]
    finally:
        jax.config.update("jax_enable_compilation_cache", cached)


def _compile_for(device, fn, t, s, b=1, h=16):
    """Compiles fn(q_c, q_r, c_kv, k_r, q_pos) for device at GLM-5's widths C=512, R=64 in
    bf16; returns the optimised HLO text and the output's shape and dtype."""
    sharding = jax.sharding.SingleDeviceSharding(device)
    shapes = [((b, t, h, 512), jnp.bfloat16), ((b, t, h, 64), jnp.bfloat16), ((b, s, 512), jnp.bfloat16),
              ((b, s, 64), jnp.bfloat16), ((b, t), jnp.int32)]
    specs = [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for shape, dtype in shapes]
    lowered = jax.jit(fn).lower(*specs)
    return lowered.compile().as_text(), lowered.out_info


def _on_tpu(*a):
    return mla.mla_attention(*a, scale=0.1, backend="tpu")


def test_prefill_forward_compiles_for_tpu(v5p):
    hlo, out = _compile_for(v5p, _on_tpu, t=1024, s=1024)
    assert "mla_flash_forward" in hlo and "tpu_custom_call" in hlo
    assert (out.shape, out.dtype) == ((1, 1024, 16, 512), jnp.bfloat16)


def test_backward_compiles_for_tpu(v5p):
    grad = jax.grad(lambda *a: jnp.sum(_on_tpu(*a).astype(jnp.float32)), argnums=(0, 1, 2, 3))
    hlo, out = _compile_for(v5p, grad, t=1024, s=1024)
    assert "mla_flash_dq" in hlo and "mla_flash_dkv" in hlo
    assert [x.shape for x in out] == [(1, 1024, 16, 512), (1, 1024, 16, 64), (1, 1024, 512), (1, 1024, 64)]


def test_split_key_decode_compiles_for_tpu(v5p):
    hlo, out = _compile_for(v5p, _on_tpu, t=4, s=4096)
    assert "mla_flash_forward" in hlo and out.shape == (1, 4, 16, 512)
