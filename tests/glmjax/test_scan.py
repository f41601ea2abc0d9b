"""Scanned layers (glmjax/layers/stack.py) against the looped ones: the same checkpoint gives
the same logits, gradients, cache and bias updates, and the program does not grow with depth."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import glmjax
from glmjax.cache import KVCache
from glmjax.layers.moe import update_correction_biases
from glmjax.model import init_model

# IndexShare in groups of two (FS FS FS FS: the first group dense-then-MoE, then 3 repeats),
# and a DeepSeek-V3.2-like stack with an indexer on every layer (1 dense, then 5 repeats);
# index_topk 4 < the sequence, so the shared layers' top-k flows through the scan.
SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_attention_heads=2,
             num_key_value_heads=2, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
             v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1, index_topk=4,
             index_n_heads=2, index_head_dim=16, initializer_range=0.1, num_nextn_predict_layers=0)
CONFIGS = {
    "index_share": glmjax.ModelConfig(num_hidden_layers=8, index_topk_pattern="FSFSFSFS", **SMALL),
    "every_layer": glmjax.ModelConfig(model_type="deepseek_v32", num_hidden_layers=6, **SMALL),
}


def _ids(seed=0, batch=2, length=10):
    return jnp.asarray(np.random.default_rng(seed).integers(0, SMALL["vocab_size"], (batch, length)))


def _pair(tmp_path, config, **scanned):
    """A looped model and the same checkpoint loaded scanned."""
    looped = init_model(config, seed=3)
    glmjax.save_pretrained(looped, tmp_path)
    return looped, glmjax.from_pretrained(tmp_path, scan_layers=True, **scanned)


def test_segments_follow_index_share_groups():
    assert CONFIGS["index_share"].layer_segments == ((0, 2, 1), (2, 2, 3))
    assert CONFIGS["every_layer"].layer_segments == ((0, 1, 1), (1, 1, 5))
    glm53 = glmjax.ModelConfig(num_hidden_layers=78, index_topk_freq=4, index_skip_topk_offset=3)
    assert glm53.layer_segments == ((0, 1, 2), (2, 4, 1), (6, 4, 18))


@pytest.mark.parametrize("name,remat", [("index_share", "full"), ("every_layer", "matmuls")])
def test_scanned_and_looped_layers_give_equal_logits_and_gradients(tmp_path, name, remat):
    looped, scanned = _pair(tmp_path, CONFIGS[name], remat=remat)
    ids = _ids()
    out_l, out_s = looped(ids), scanned(ids)
    np.testing.assert_allclose(out_s.logits, out_l.logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out_s.topk, out_l.topk)
    np.testing.assert_array_equal(out_s.expert_load, out_l.expert_load)

    loss = lambda m: jnp.mean(jax.nn.log_softmax(m(ids).logits)[..., 0])  # noqa: E731
    grads_l = nnx.grad(loss)(looped)
    grads_s = nnx.grad(loss)(scanned)
    per_layer = [_per_layer(m, g) for m, g in ((looped, grads_l), (scanned, grads_s))]
    assert len(per_layer[1]) == CONFIGS[name].num_hidden_layers
    for i, (gl, gs) in enumerate(zip(*per_layer)):
        for (path, a), (_, b) in zip(jax.tree_util.tree_leaves_with_path(gl), jax.tree_util.tree_leaves_with_path(gs)):
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6, err_msg=f"layer {i} {jax.tree_util.keystr(path)}")
    np.testing.assert_allclose(grads_s["embed_tokens"][...], grads_l["embed_tokens"][...], rtol=1e-5, atol=1e-6)


def _per_layer(model, grads) -> list:
    """The gradients of each decoder layer, in either layout (a scanned one's sliced per layer)."""
    graphdef, _, rest = nnx.split(model, nnx.Param, ...)
    return [nnx.state(layer, nnx.Param) for layer in nnx.merge(graphdef, grads, rest).decoder_layers()]


def test_scanned_cache_prefills_and_decodes_like_the_looped_one(tmp_path):
    looped, scanned = _pair(tmp_path, CONFIGS["index_share"])
    ids = _ids(1, length=9)
    caches = {}
    for name, model in (("looped", looped), ("scanned", scanned)):
        cache = KVCache.init(model.config, 2, 16)
        out = model(ids[:, :6], cache=cache)
        steps = [out.logits[:, -1]]
        for t in range(6, 9):
            out = model(ids[:, t:t + 1], cache=out.cache)
            steps.append(out.logits[:, -1])
        caches[name] = out.cache
        np.testing.assert_allclose(jnp.stack(steps), jnp.stack(caches.get("steps", steps)), rtol=1e-5, atol=1e-5)
        caches["steps"] = steps
    stacked, flat = caches["scanned"], caches["looped"]
    assert stacked.max_len == flat.max_len == 16
    assert stacked.bytes_per_token() == flat.bytes_per_token()
    close = lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5 * np.abs(b).max())  # noqa: E731  fp32, eager vs scanned
    for i in range(8):
        jax.tree.map(close, stacked.layer(i), flat.layer(i))
    # rows move the same way in both layouts (the engine's insert and batching)
    both = KVCache.concatenate([stacked, stacked])
    moved = both.put_rows(jnp.array([3, 0]), stacked)
    jax.tree.map(close, moved.layer(-1), KVCache.concatenate([flat, flat]).put_rows(
        jnp.array([3, 0]), flat).layer(-1))


def test_correction_bias_update_reaches_every_scanned_layer(tmp_path):
    looped, scanned = _pair(tmp_path, CONFIGS["index_share"])
    load = jnp.asarray(np.random.default_rng(2).integers(0, 9, (7, 4)))  # 7 MoE layers
    for model in (looped, scanned):
        update_correction_biases(model, load, 0.5)
    for a, b in zip(looped.decoder_layers()[1:], scanned.decoder_layers()[1:]):
        np.testing.assert_array_equal(a.mlp.router.e_score_correction_bias[...],
                                      b.mlp.router.e_score_correction_bias[...])
    assert np.abs(scanned.decoder_layers()[-1].mlp.router.e_score_correction_bias[...]).sum() > 0


def test_exported_scanned_model_loads_looped(tmp_path):
    looped, scanned = _pair(tmp_path / "a", CONFIGS["every_layer"])
    glmjax.save_pretrained(scanned, tmp_path / "b")
    again = glmjax.from_pretrained(tmp_path / "b")
    for a, b in zip(jax.tree.leaves(nnx.state(looped)), jax.tree.leaves(nnx.state(again))):
        np.testing.assert_array_equal(a, b)


def test_scanned_model_loads_sharded_on_a_mesh(tmp_path):
    looped, _ = _pair(tmp_path, CONFIGS["index_share"])
    mesh = glmjax.sharding.make_mesh(fsdp=2, expert=2, tensor=2)
    with glmjax.sharding.use_mesh(mesh):
        sharded = glmjax.from_pretrained(tmp_path, scan_layers=True, mesh=mesh)
        q_b = sharded.segments[1].group.layers[0].attn.q_b  # [R, Q, H, E]
        assert q_b.shape[0] == 3 and q_b[...].sharding.spec[0] is None  # the repeats axis is whole on each device
        out = nnx.jit(lambda model, ids: model(ids).logits)(sharded, _ids())
    np.testing.assert_allclose(out, looped(_ids()).logits, rtol=1e-5, atol=1e-5)


def _program_size(config) -> int:
    """Characters of the lowered training-gradient program (nothing compiled or allocated)."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: init_model(config)))
    ids = jax.ShapeDtypeStruct((2, 10), jnp.int32)
    grad = jax.jit(lambda state, ids: jax.grad(lambda s: nnx.merge(graphdef, s)(ids).logits.mean())(state))
    return len(grad.lower(state, ids).as_text())


def test_program_size_does_not_grow_with_depth():
    small, deep = CONFIGS["every_layer"], CONFIGS["every_layer"].replace(num_hidden_layers=24)
    scanned = [_program_size(c.replace(scan_layers=True, remat="full")) for c in (small, deep)]
    looped = [_program_size(c) for c in (small, deep)]
    assert scanned[1] < 1.05 * scanned[0], scanned
    assert looped[1] > 3 * looped[0], looped


def test_the_engine_serves_a_scanned_model_with_mtp_drafts_over_its_stacked_cache(tmp_path):
    """Continuous batching with "shared" MTP drafting (the drafter reads the last layer's
    cache, sliced out of its stack): greedy tokens equal the looped model's generate."""
    from rl.engine.driver import Driver, Request
    from rl.engine.engine import GlmEngine
    from tests.engine_util import TINY, greedy_reference, prompts

    looped = init_model(TINY, seed=0)
    glmjax.save_pretrained(looped, tmp_path)
    scanned = glmjax.from_pretrained(tmp_path, scan_layers=True)
    assert scanned.mtp is not None and len(scanned.segments) == 2  # FSSF: [dense-full, moe-shared x 2], [moe-full]
    engine = GlmEngine(scanned, max_concurrent_decodes=2, max_len=48, prefill_buckets=(16,), num_draft=2,
                       mtp_mode="shared")
    ps = prompts([7, 17, 5], seed=6)
    driver = Driver(engine)
    handles = [driver.submit(Request(p, max_new_tokens=n)) for p, n in zip(ps, (8, 5, 6))]
    driver.run_until_idle()
    for p, h, n in zip(ps, handles, (8, 5, 6)):
        assert h.result().tokens == greedy_reference(looped, p, n)
