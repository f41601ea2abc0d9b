"""The Mosaic lightning indexer (`pallas_kernels/tpu/indexer.py`) against its jnp reference
in TPU interpret mode, and compiled for a TPU v5p by libtpu on this CPU.

Tiny, awkward shapes (interpret mode is slow): T and S not multiples of any block, ragged
per-sequence positions that start past 0 as in a cache decode, top-k larger than the
visible keys and than S.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import pallas_ops, reference
from pallas_kernels.tpu import indexer

B, T, S, G, I = 2, 13, 45, 2, 32


def _inputs():
    """Random q, w, k whose visible scores have no ties: head 0's logits are positive (q and
    k non-negative), so no score is an exact relu zero shared by several keys."""
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (B, T, G, I), jnp.float32)
    q = q.at[:, :, 0].set(jnp.abs(q[:, :, 0]))
    w = jax.random.normal(keys[1], (B, T, G), jnp.float32)
    k = jnp.abs(jax.random.normal(keys[2], (B, S, I), jnp.float32))
    # Sequence 0 ends at the last key; sequence 1 is a decode whose cache starts at 4, so
    # its first queries see fewer keys than top-k.
    pos = jnp.stack([jnp.arange(T) + S - T, jnp.arange(T) + 4]).astype(jnp.int32)
    return q, w, k, pos


def test_scores_match_reference():
    q, w, k, pos = _inputs()
    got = indexer.indexer_scores(q, w, k, pos, block_q=8, block_k=128, backend="tpu-interpret")
    want = reference.indexer_scores(q, w, k, pos)
    finite = np.isfinite(np.asarray(want))
    np.testing.assert_array_equal(np.isfinite(np.asarray(got)), finite)
    np.testing.assert_allclose(np.where(finite, got, 0), np.where(finite, want, 0), atol=1e-5, rtol=1e-5)
    for row, visible in zip(np.asarray(want).reshape(B * T, S), finite.reshape(B * T, S)):
        assert len(np.unique(row[visible])) == visible.sum(), "the inputs must have no tied scores"


@pytest.mark.parametrize("topk", [6, 30, 64])  # 30: more than sequence 1's first queries see; 64 > S
def test_selection_equals_reference(topk):
    q, w, k, pos = _inputs()
    got = pallas_ops.OPS["indexer_topk"](q, w, k, pos, topk=topk, chunk=8, block_q=8, backend="tpu-interpret")
    want = reference.indexer_topk(q, w, k, pos, topk=topk)
    assert got.shape == want.shape == (B, T, min(topk, S)) and got.dtype == jnp.int32
    # The same selected sets, and with untied scores the same order (best first, -1 last).
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert topk < S or bool((want == -1).any())


def test_compiles_for_tpu_v5p():
    """GLM-5's indexer (32 heads of 128) and top-k (2048) over 2048 keys, bf16."""
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other test processes may hold libtpu
    from jax.experimental import topologies

    device = topologies.get_topology_desc("v5p:2x2x1", "tpu").devices[0]
    t, s, g, i = 256, 2048, 32, 128
    spec = lambda shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(  # noqa: E731
        shape, dtype, sharding=jax.sharding.SingleDeviceSharding(device))
    select = lambda q, w, k, pos: indexer.indexer_topk(q, w, k, pos, topk=2048, backend="tpu")  # noqa: E731
    args = [spec((1, t, g, i)), spec((1, t, g)), spec((1, s, i)), spec((1, t), jnp.int32)]
    compiled = jax.jit(select).lower(*args).compile()
    assert "lightning_indexer_scores" in compiled.as_text()
