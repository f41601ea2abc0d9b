"""The Pallas kernels (interpret mode) against their jnp references, the blockwise references
against naive dense formulas, and the whole model with kernel_impl="pallas" against "xla".

Shapes are tiny and deliberately awkward: lengths that are not multiples of any block,
ragged per-sequence positions, empty (-1) and invisible selections, top-k larger than the
visible keys. Every kernel also lowers to Triton IR for a CUDA target (no GPU needed).
"""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import export

import glmjax
from pallas_kernels import (
    absorbed_mla,
    flash_mla,
    indexer,
    ops,
    pallas_ops,
    reference,
    sparse_mla,
)
from tests import hf_models

B, H, C, R = 2, 3, 24, 8  # C, R not powers of two: the wrappers pad
G, I = 3, 40
SCALE = 0.3
TOL = dict(atol=2e-5, rtol=2e-5)


def _normal(seed, *shapes):
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    return [jax.random.normal(k, s, jnp.float32) for k, s in zip(keys, shapes)]


def _latents(seed, t, s):
    return _normal(seed, (B, t, H, C), (B, t, H, R), (B, s, C), (B, s, R))


def _positions(t, s):
    """Sequence 0 ends at the last key, sequence 1 halfway: ragged lengths."""
    return jnp.stack([jnp.arange(t) + s - t, jnp.arange(t) + (s - t) // 2]).astype(jnp.int32)


def _selection(seed, t, s, p):
    """Distinct key positions per query with ~20% empty slots; some exceed q_pos."""
    keys = jax.random.split(jax.random.key(seed), B * t + 1)
    idx = jnp.stack([jax.random.permutation(k, s)[:p] for k in keys[1:]]).reshape(B, t, p)
    return jnp.where(jax.random.uniform(keys[0], (B, t, p)) < 0.2, -1, idx).astype(jnp.int32)


def _grads(fn, args, argnums):
    """Gradients of a fixed random projection of fn's output."""
    out = fn(*args)
    w = jax.random.normal(jax.random.key(9), out.shape[-1:])
    return jax.grad(lambda *a: jnp.sum(fn(*a) * w), argnums=argnums)(*args)


def _close(a, b, **tol):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), **(tol or TOL))


# -- the references, blockwise, against naive dense formulas ----------------------------

def _naive_mla(q_c, q_r, c_kv, k_r, q_pos, scale):
    s = jnp.einsum("BTHC,BSC->BTHS", q_c, c_kv) + jnp.einsum("BTHR,BSR->BTHS", q_r, k_r)
    visible = jnp.arange(c_kv.shape[1]) <= q_pos[:, :, None, None]
    p = jax.nn.softmax(jnp.where(visible, s * scale, -jnp.inf), axis=-1)
    return jnp.einsum("BTHS,BSC->BTHC", p, c_kv)


def _naive_scores(q, w, k, q_pos):
    logits = jnp.einsum("BTGI,BSI->BTSG", q, k) * q.shape[-1] ** -0.5
    s = jnp.einsum("BTSG,BTG->BTS", jax.nn.relu(logits), w)
    return jnp.where(jnp.arange(k.shape[1]) <= q_pos[:, :, None], s, -jnp.inf)


@pytest.mark.parametrize("t,s,block,key_block", [(37, 37, 8, 16), (2, 50, 256, 16), (5, 70, 2, 32)])
def test_blockwise_references_match_dense_formulas(t, s, block, key_block):
    q_c, q_r, c_kv, k_r = _latents(0, t, s)
    q, w, k = _normal(1, (B, t, G, I), (B, t, G), (B, s, I))
    pos = _positions(t, s)
    out = reference.mla_attention(q_c, q_r, c_kv, k_r, pos, scale=SCALE, block=block, key_block=key_block)
    _close(out, _naive_mla(q_c, q_r, c_kv, k_r, pos, SCALE))
    scores = reference.indexer_scores(q, w, k, pos, block=block, key_block=key_block)
    naive = _naive_scores(q, w, k, pos)
    np.testing.assert_array_equal(np.isfinite(scores), np.isfinite(naive))
    _close(jnp.where(jnp.isfinite(naive), scores, 0), jnp.where(jnp.isfinite(naive), naive, 0))


@pytest.mark.parametrize("topk", [7, 1500])  # 1500: more slots than the first band's 1024 keys
def test_reference_selection_over_key_bands_equals_top_k_of_all_scores(topk):
    t, s = 600, 2500  # key bands [1024, 2048, 2500]: query blocks of 256 end in bands 0, 1 and 2
    assert reference.key_bands(s) == [1024, 2048, 2500]
    q, w, k = _normal(4, (B, t, G, I), (B, t, G), (B, s, I))
    pos = jnp.stack([jnp.arange(t), jnp.arange(t) * 4]).astype(jnp.int32)
    got = reference.indexer_topk(q, w, k, pos, topk=topk)
    scores = _naive_scores(q, w, k, pos)
    want = jax.lax.top_k(scores, topk)[1]
    want = jnp.where(jnp.isfinite(jnp.take_along_axis(scores, want, -1)), want, -1)
    assert got.shape == (B, t, topk)
    _assert_same_selection(got, want, scores)


def test_reference_sparse_equals_dense_when_everything_is_selected():
    t = s = 19
    q_c, q_r, c_kv, k_r = _latents(2, t, s)
    pos = _positions(t, s)
    everything = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (B, t, s))
    _close(reference.sparse_mla_attention(q_c, q_r, c_kv, k_r, pos, everything, scale=SCALE),
           reference.mla_attention(q_c, q_r, c_kv, k_r, pos, scale=SCALE))


# -- 1. flash MLA prefill, expanded heads ---------------------------------------------------

@pytest.mark.parametrize("with_topk", [False, True])
def test_flash_mla_prefill_forward_and_gradients(with_topk):
    t, e, v = 37, 40, 24
    q, k, val = _normal(3, (B, t, H, e), (B, t, H, e), (B, t, H, v))
    pos = _positions(t, t)
    idx = _selection(4, t, t, 12) if with_topk else None
    kernel = lambda q, k, v: flash_mla.flash_mla_prefill(q, k, v, pos, idx, scale=SCALE, block_q=16, block_k=16)  # noqa: E731
    ref = lambda q, k, v: reference.mla_attention_expanded(q, k, v, pos, idx, scale=SCALE)  # noqa: E731
    _close(kernel(q, k, val), ref(q, k, val))
    for got, want in zip(_grads(kernel, (q, k, val), (0, 1, 2)), _grads(ref, (q, k, val), (0, 1, 2))):
        _close(got, want)


# -- 2. absorbed MLA: prefill and decode ------------------------------------------------------

@pytest.mark.parametrize("t,s,splits", [(37, 37, 1), (2, 50, 1), (2, 50, 3), (1, 45, 2)])
def test_absorbed_mla_matches_reference(t, s, splits):
    q_c, q_r, c_kv, k_r = _latents(5, t, s)
    pos = _positions(t, s)
    out = absorbed_mla.mla_attention(q_c, q_r, c_kv, k_r, pos, scale=SCALE, block_k=16, splits=splits)
    _close(out, reference.mla_attention(q_c, q_r, c_kv, k_r, pos, scale=SCALE))


def test_absorbed_mla_gradients():
    t = s = 21
    args = _latents(6, t, s)
    pos = _positions(t, s)
    kernel = lambda *a: absorbed_mla.mla_attention(*a, pos, scale=SCALE, block_k=16)  # noqa: E731
    ref = lambda *a: reference.mla_attention(*a, pos, scale=SCALE)  # noqa: E731
    for got, want in zip(_grads(kernel, args, (0, 1, 2, 3)), _grads(ref, args, (0, 1, 2, 3))):
        _close(got, want)


# -- 3. lightning indexer ---------------------------------------------------------------------

def _assert_same_selection(got, want, scores):
    """Same top-k up to the order of equal scores: the reference scores at both index sets agree."""
    assert got.shape == want.shape
    np.testing.assert_array_equal(np.asarray(got) < 0, np.asarray(want) < 0)
    pick = lambda idx: np.sort(np.take_along_axis(np.asarray(scores), np.maximum(np.asarray(idx), 0), -1), -1)  # noqa: E731
    _close(pick(got), pick(want), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("topk", [5, 30, 64])  # 64 > S: more slots than keys
def test_indexer_topk_matches_reference(topk):
    t, s = 21, 45
    q, w, k = _normal(7, (B, t, G, I), (B, t, G), (B, s, I))
    pos = _positions(t, s)
    scores = reference.indexer_scores(q, w, k, pos)
    got = indexer.indexer_scores(q, w, k, pos, block_k=16)
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(scores))
    _close(jnp.where(jnp.isfinite(scores), got, 0), jnp.where(jnp.isfinite(scores), scores, 0))
    idx = indexer.indexer_topk(q, w, k, pos, topk=topk, chunk=8)
    ref = reference.indexer_topk(q, w, k, pos, topk=topk)
    assert idx.shape == (B, t, min(topk, s)) and idx.dtype == jnp.int32
    _assert_same_selection(idx, ref, scores)


@pytest.mark.parametrize("width", [40, 256])  # one fp8 scale block per row; two per row
def test_indexer_fp8_matches_dequantized_reference(width):
    t, s = 9, 30
    q, w, k = _normal(8, (B, t, G, width), (B, t, G), (B, s, width))
    pos = _positions(t, s)
    qd = reference.fp8_dequantize(*reference.fp8_e4m3_blockwise(q))
    kd = reference.fp8_dequantize(*reference.fp8_e4m3_blockwise(k))
    scores = reference.indexer_scores(qd, w, kd, pos)
    got = indexer.indexer_scores(q, w, k, pos, fp8=True, block_k=16)
    finite = jnp.isfinite(scores)
    _close(jnp.where(finite, got, 0), jnp.where(finite, scores, 0), atol=1e-4, rtol=1e-4)
    exact = reference.indexer_scores(q, w, k, pos)  # fp8 really quantises: visibly different scores
    assert float(jnp.max(jnp.abs(jnp.where(finite, got - exact, 0)))) > 1e-3


def test_fp8_quantisation_round_trips_within_e4m3_precision():
    (x,) = _normal(10, (4, 256))
    values, scales = reference.fp8_e4m3_blockwise(x)
    assert values.dtype == jnp.float8_e4m3fn and scales.shape == (4, 2)
    back = reference.fp8_dequantize(values, scales)
    assert float(jnp.max(jnp.abs(back - x) / (jnp.abs(x) + scales.repeat(128, -1)))) < 2 ** -3


# -- 4. sparse MLA: prefill and decode ------------------------------------------------------

@pytest.mark.parametrize("t,s,p", [(19, 30, 20), (1, 45, 40), (3, 12, 12)])
def test_sparse_mla_matches_reference(t, s, p):
    q_c, q_r, c_kv, k_r = _latents(11, t, s)
    pos = _positions(t, s)
    idx = _selection(12, t, s, p)
    out = sparse_mla.sparse_mla_attention(q_c, q_r, c_kv, k_r, pos, idx, scale=SCALE, block_p=16)
    _close(out, reference.sparse_mla_attention(q_c, q_r, c_kv, k_r, pos, idx, scale=SCALE))


def test_sparse_mla_gradients():
    t, s, p = 13, 24, 20
    args = _latents(13, t, s)
    pos = _positions(t, s)
    idx = _selection(14, t, s, p)
    kernel = lambda *a: sparse_mla.sparse_mla_attention(*a, pos, idx, scale=SCALE, block_p=16)  # noqa: E731
    ref = lambda *a: reference.sparse_mla_attention(*a, pos, idx, scale=SCALE)  # noqa: E731
    for got, want in zip(_grads(kernel, args, (0, 1, 2, 3)), _grads(ref, args, (0, 1, 2, 3))):
        _close(got, want)



def test_sparse_mla_gradients_in_head_blocks():
    """36 heads pad to 64 and the backward runs 4 programs of 16 heads per token, each
    adding its heads' share of dc_kv / dk_rope."""
    t, s, p, h = 5, 16, 8, 36
    args = _normal(15, (B, t, h, C), (B, t, h, R), (B, s, C), (B, s, R))
    pos, idx = _positions(t, s), _selection(16, t, s, p)
    kernel = lambda *a: sparse_mla.sparse_mla_attention(*a, pos, idx, scale=SCALE, block_p=16, block_h=16)  # noqa: E731
    ref = lambda *a: reference.sparse_mla_attention(*a, pos, idx, scale=SCALE)  # noqa: E731
    for got, want in zip(_grads(kernel, args, (0, 1, 2, 3)), _grads(ref, args, (0, 1, 2, 3))):
        _close(got, want)


# -- 5. dispatch and the whole model ------------------------------------------------------

@pytest.mark.parametrize("name", ["mla_attention", "sparse_mla_attention", "indexer_topk"])
def test_pallas_ops_have_the_reference_signatures(name):
    ref, kernel = ops.get(name, "xla"), ops.get(name, "pallas")
    assert ref is getattr(reference, name) and kernel is pallas_ops.OPS[name]
    required = lambda f: [p.name for p in inspect.signature(f).parameters.values()  # noqa: E731
                          if p.default is inspect.Parameter.empty]
    assert required(kernel) == required(ref)
    with pytest.raises(ValueError, match="kernel_impl"):
        ops.get(name, "cuda")


def _tiny_config(**changes):
    return glmjax.ModelConfig(**{**hf_models.COMMON, "index_topk_freq": 2, "index_skip_topk_offset": 1,
                                 "num_nextn_predict_layers": 0, "initializer_range": 0.1,
                                 "max_position_embeddings": 64, **changes})


def test_model_logits_pallas_equal_xla():
    config = _tiny_config()
    assert config.indexer_types == ("full", "shared", "full", "shared")
    xla = glmjax.init_model(config, seed=0)
    pallas = glmjax.init_model(config.replace(kernel_impl="pallas"), seed=0)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (2, 24)))
    assert config.index_topk < ids.shape[1]  # the sparse path runs
    assert float(jnp.max(jnp.abs(xla(ids).logits - pallas(ids).logits))) <= 1e-4
    caches = [m(ids[:, :20], cache=glmjax.KVCache.init(config, 2, 32)).cache for m in (xla, pallas)]
    step = [m(ids[:, 20:22], cache=cache).logits for m, cache in zip((xla, pallas), caches)]
    assert float(jnp.max(jnp.abs(step[0] - step[1]))) <= 1e-4


def test_model_gradients_pallas_equal_xla():
    """A training step through the kernels: the sparse attention's backward kernel gives
    the reference's gradients, and the indexer's selection passes none (it has no VJP)."""
    config = _tiny_config()
    ids = jnp.asarray(np.random.default_rng(1).integers(0, config.vocab_size, (2, 24)))
    grads = []
    for impl in ("xla", "pallas"):
        graphdef, params, rest = nnx.split(glmjax.init_model(config.replace(kernel_impl=impl), seed=0), nnx.Param, ...)
        loss = lambda p: jnp.mean(nnx.merge(graphdef, p, rest)(ids).logits ** 2)  # noqa: E731,B023
        grads.append(jax.grad(loss)(params))
    for got, want in zip(jax.tree.leaves(grads[1]), jax.tree.leaves(grads[0])):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=1e-4)


def test_shared_indexshare_layers_score_nothing_and_cache_no_indexer_keys():
    config = _tiny_config()
    model = glmjax.init_model(config, seed=0)
    cache = glmjax.KVCache.init(config, 1, 32)
    assert [layer.index_k is not None for layer in cache.layers] == [t == "full" for t in config.indexer_types]
    ids = jnp.zeros((1, 24), jnp.int32)
    jaxpr = jax.make_jaxpr(lambda ids: model(ids).logits)(ids)
    # The indexer's selections: top-k over the 24 keys (the MoE routers pick among experts).
    selections = [e for e in _equations(jaxpr.jaxpr) if e.primitive.name == "top_k"
                  and e.invars[0].aval.shape[-1] == ids.shape[1] and e.params["k"] == config.index_topk]
    assert len(selections) == config.indexer_types.count("full")


def _equations(jaxpr):
    """Every equation of a jaxpr, nested ones included."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                sub = getattr(sub, "jaxpr", sub)  # ClosedJaxpr -> Jaxpr
                if hasattr(sub, "eqns"):
                    yield from _equations(sub)


# -- Triton lowering (CUDA target, no GPU needed) ---------------------------------------

def _lowers_for_triton(fn, *args):
    exported = export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=[
        export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args)
    assert "__gpu$xla.gpu.triton" in exported.mlir_module()


def test_every_kernel_lowers_to_triton():
    t, s, h = 16, 64, 16
    q_c, q_r, c_kv, k_r = (jnp.ones(x) for x in ((1, t, h, 64), (1, t, h, 16), (1, s, 64), (1, s, 16)))
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32) + s - t, (1, t))
    idx = jnp.zeros((1, t, 32), jnp.int32)
    grad = lambda f: jax.grad(lambda *a: jnp.sum(f(*a)), argnums=(0, 1, 2, 3))  # noqa: E731
    absorbed = lambda *a: absorbed_mla.mla_attention(*a, pos, scale=SCALE, backend="gpu")  # noqa: E731
    sparse = lambda *a: sparse_mla.sparse_mla_attention(*a, pos, idx, scale=SCALE, backend="gpu")  # noqa: E731
    for fn in (absorbed, grad(absorbed), sparse, grad(sparse)):
        _lowers_for_triton(fn, q_c, q_r, c_kv, k_r)
    q, k, v = jnp.ones((1, t, 2, 64)), jnp.ones((1, t, 2, 64)), jnp.ones((1, t, 2, 32))
    prefill_pos = jnp.arange(t, dtype=jnp.int32)[None]
    for topk in (None, idx):
        expanded = lambda q, k, v: flash_mla.flash_mla_prefill(q, k, v, prefill_pos, topk, scale=SCALE, backend="gpu")  # noqa: E731,B023
        _lowers_for_triton(expanded, q, k, v)
        _lowers_for_triton(jax.grad(lambda *a: jnp.sum(expanded(*a)), argnums=(0, 1, 2)), q, k, v)
    qi, wi, ki = jnp.ones((1, t, 4, 128)), jnp.ones((1, t, 4)), jnp.ones((1, s, 128))
    for fp8 in (False, True):
        _lowers_for_triton(lambda q, w, k: indexer.indexer_topk(q, w, k, pos, topk=8, fp8=fp8, backend="gpu"),  # noqa: B023
                           qi, wi, ki)


def test_triton_kernels_refuse_a_tpu_backend_clearly():
    with pytest.raises(ValueError, match="pallas_kernels/tpu"):
        absorbed_mla.mla_attention(*_latents(0, 2, 4), jnp.zeros((B, 2), jnp.int32), scale=SCALE, backend="tpu")


def test_gpu_kernel_check_runs_in_smoke_mode():
    """benchmarks/gpu_kernels.py --smoke: every case, tiny shapes, interpret mode."""
    import importlib.util
    import pathlib
    import sys

    path = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_kernels.py"
    spec = importlib.util.spec_from_file_location("gpu_kernels", path)
    module = sys.modules.setdefault("gpu_kernels", importlib.util.module_from_spec(spec))
    spec.loader.exec_module(module)
    report = module.run(smoke=True)
    assert len(report["cases"]) == 11
    assert all(case["ok"] for case in report["cases"]), [c for c in report["cases"] if not c["ok"]]


def test_gpu_model_check_runs_in_smoke_mode():
    """benchmarks/gpu_model.py on the tiny model in interpret mode: in float32 the Pallas
    arm computes the reference's logits."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_model.py"
    spec = importlib.util.spec_from_file_location("gpu_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    report = module.run(48, 48, 2, 16, 4, repeats=1, smoke=True, config_file="configs/tiny.py")
    assert report["index_topk"] < 48  # the sparse path runs
    assert report["f32_logits_rel_err_pallas_vs_xla"] <= 1e-4
    assert report["f32_argmax_agreement_pallas_vs_xla"] == 1.0
    assert report["decode"]["pallas"]["tokens_per_s"] > 0
