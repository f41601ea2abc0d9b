"""The model on its own: the cache path against the full forward, sizes, generation, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import glmjax
from glmjax.model import GlmForCausalLM

TINY = glmjax.ModelConfig(
    vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=24,
    qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=1,
    index_topk=6, index_n_heads=8, index_head_dim=32, index_topk_pattern="FSSF", initializer_range=0.1,
    max_position_embeddings=256, num_nextn_predict_layers=1,
)


@pytest.fixture(scope="module")
def model():
    return glmjax.init_model(TINY, seed=0)


def _ids(seed, batch=2, length=21):
    return jax.random.randint(jax.random.key(seed), (batch, length), 0, TINY.vocab_size)


@pytest.mark.parametrize("step", [1, 5])
def test_prefill_then_decode_equals_full_forward(model, step):
    """Prefill 6 tokens, then decode `step` tokens per call; the cache (capacity 32) is larger
    than the sequence, and top-k (6) is smaller, so the sparse path and the -1 slots of short
    prefixes are both exercised."""
    ids = _ids(1)
    full = np.asarray(model(ids).logits)
    cache = glmjax.KVCache.init(TINY, ids.shape[0], 32)
    out = model(ids[:, :6], cache=cache)
    pieces, cache = [np.asarray(out.logits)], out.cache
    for start in range(6, ids.shape[1], step):
        out = model(ids[:, start:start + step], cache=cache)
        pieces.append(np.asarray(out.logits))
        cache = out.cache
    np.testing.assert_array_equal(np.asarray(cache.lengths), [21, 21])
    assert np.abs(np.concatenate(pieces, axis=1) - full).max() <= 1e-5


def test_logits_at_gives_those_positions_logits_and_the_same_cache(model):
    ids = _ids(4)
    at = jnp.asarray([[20, 3], [7, 7]])  # per row, any positions, repeats allowed
    full = model(ids, cache=glmjax.KVCache.init(TINY, 2, 24))
    some = model(ids, cache=glmjax.KVCache.init(TINY, 2, 24), logits_at=at)
    assert some.logits.shape == (2, 2, TINY.vocab_size)
    np.testing.assert_allclose(np.asarray(some.logits), np.asarray(full.logits)[np.arange(2)[:, None], np.asarray(at)],
                               rtol=1e-6, atol=1e-6)
    for a, b in zip(jax.tree.leaves(some.cache), jax.tree.leaves(full.cache)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_ragged_lengths_in_one_decode_batch(model):
    """Sequences at different lengths decode together: each attends to its own prefix."""
    a, b = _ids(2, batch=1, length=11), _ids(3, batch=1, length=7)
    cache = glmjax.KVCache.init(TINY, 2, 16)
    cache_a = model(a[:, :10], cache=glmjax.KVCache.init(TINY, 1, 16)).cache
    cache_b = model(b[:, :6], cache=glmjax.KVCache.init(TINY, 1, 16)).cache
    cache = jax.tree.map(lambda x, y: jnp.concatenate([x, y]), cache_a, cache_b)
    step = model(jnp.concatenate([a[:, 10:], b[:, 6:]]), cache=cache).logits[:, 0]
    np.testing.assert_allclose(np.asarray(step[0]), np.asarray(model(a).logits[0, -1]), atol=1e-5)
    np.testing.assert_allclose(np.asarray(step[1]), np.asarray(model(b).logits[0, -1]), atol=1e-5)


def test_shared_layers_cache_no_indexer_keys():
    cache = glmjax.KVCache.init(TINY, 1, 8)
    assert [layer.index_k is not None for layer in cache.layers] == [True, False, False, True]
    model = glmjax.init_model(TINY)
    assert [layer.attn.indexer is not None for layer in model.layers] == [True, False, False, True]


def test_full_size_parameter_counts():
    """GLM-5, every stored array (the experts' correction biases included), from eval_shape."""
    from tests.presets_util import load_model_config

    glm5 = load_model_config("configs/glm5.py")
    assert glmjax.count_params(glm5, include_mtp=False) == 743_911_218_432
    assert glmjax.count_params(glm5, include_mtp=True) == 753_864_139_008


def test_full_size_forward_shapes_without_allocating():
    from flax import nnx

    from tests.presets_util import load_model_config

    config = load_model_config("configs/glm53.py").replace(num_hidden_layers=4, index_topk_pattern="FSSS")
    abstract = nnx.eval_shape(lambda: glmjax.init_model(config))
    graphdef, state = nnx.split(abstract)
    ids = jax.ShapeDtypeStruct((1, 4096), jnp.int32)
    out = jax.eval_shape(lambda s, i: nnx.merge(graphdef, s)(i), state, ids)
    assert out.logits.shape == (1, 4096, 154880)
    assert out.expert_load.shape == (1, 256)


def test_mtp_predicts_from_hidden_and_next_token(model):
    ids = _ids(4)
    out = model(ids)
    mtp = model.mtp_forward(out.hidden[:, :-1], ids[:, 1:])
    assert mtp.logits.shape == (2, 20, TINY.vocab_size)
    # Position t depends on tokens <= t+1 only: changing the last token leaves the rest.
    ids2 = ids.at[:, -1].set((ids[:, -1] + 1) % TINY.vocab_size)
    out2 = model(ids2)
    mtp2 = model.mtp_forward(out2.hidden[:, :-1], ids2[:, 1:])
    np.testing.assert_allclose(np.asarray(mtp.logits[:, :-1]), np.asarray(mtp2.logits[:, :-1]), atol=1e-5)
    assert np.abs(np.asarray(mtp.logits[:, -1] - mtp2.logits[:, -1])).max() > 1e-3


def test_generate_greedy_equals_argmax_of_full_forward(model):
    prompt = _ids(5, length=5)
    seq = np.asarray(glmjax.generate(model, prompt, 8))
    logits = np.asarray(model(jnp.asarray(seq)).logits)
    np.testing.assert_array_equal(logits[:, 4:-1].argmax(-1), seq[:, 5:])


def test_generate_sampling_is_seeded_and_follows_top_k(model):
    prompt = _ids(6, length=5)
    a = glmjax.generate(model, prompt, 6, temperature=1.0, seed=1)
    b = glmjax.generate(model, prompt, 6, temperature=1.0, seed=1)
    c = glmjax.generate(model, prompt, 6, temperature=1.0, seed=2)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.array_equal(np.asarray(a), np.asarray(c))
    one = np.asarray(glmjax.generate(model, prompt, 6, temperature=1.0, top_k=1, seed=3))
    np.testing.assert_array_equal(one, np.asarray(glmjax.generate(model, prompt, 6)))


def test_generate_pads_after_eos(model):
    prompt = _ids(7, length=5)
    greedy = np.asarray(glmjax.generate(model, prompt, 8))
    eos = int(greedy[0, 7])  # the third generated token of row 0
    seq = np.asarray(glmjax.generate(model, prompt, 8, eos_token_id=eos))
    assert (seq[0, 7:] == eos).all()


def test_bad_inputs_get_clear_errors(model):
    with pytest.raises(ValueError, match=r"input_ids must be \[B, T\]"):
        glmjax.generate(model, np.zeros(5, np.int32), 4)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        glmjax.generate(model, np.zeros((1, 250), np.int32), 10)
    with pytest.raises(ValueError, match="kernel_impl"):
        TINY.replace(kernel_impl="cuda")
    with pytest.raises(ValueError, match="no MTP layer"):
        glmjax.init_model(TINY.replace(num_nextn_predict_layers=0)).mtp_forward(None, _ids(0))


def test_bfloat16_compute_runs_and_tracks_float32(model):
    from flax import nnx

    bf16 = nnx.merge(nnx.graphdef(GlmForCausalLM(TINY.replace(dtype="bfloat16"), rngs=nnx.Rngs(0))),
                     nnx.state(model))
    ids = _ids(8)
    a, b = np.asarray(model(ids).logits), np.asarray(bf16(ids).logits)
    assert b.dtype == np.float32 and np.isfinite(b).all()
    assert np.corrcoef(a.ravel(), b.ravel())[0, 1] > 0.99


def test_a_repeated_eager_forward_compiles_nothing(model):
    """The attention ops and the expert scan carry loops: called eagerly they run jitted
    (`jit_when_eager`), so a second eager forward at the same shapes compiles nothing."""
    from jax import monitoring

    compiles = []

    def listen(event, seconds, **kw):
        if event.endswith("backend_compile_duration"):
            compiles.append(event)

    monitoring.register_event_duration_secs_listener(listen)
    try:
        ids = _ids(9)
        first = np.asarray(model(ids).logits)  # compiles, or finds it all cached by earlier tests
        n = len(compiles)
        second = np.asarray(model(ids).logits)
        m = len(compiles)
        jax.jit(lambda x: x * 3.0 + 1.0)(jnp.arange(9.0)).block_until_ready()  # too quick to be cached on disk
    finally:
        monitoring.unregister_event_duration_listener(listen)
    assert len(compiles) > m  # the listener sees compiles
    assert m == n, compiles[n:m]
    np.testing.assert_array_equal(first, second)
