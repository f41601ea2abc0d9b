"""MoE routing and the grouped expert matmul against plain numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import glmjax
from glmjax.layers import gmm
from glmjax.layers.moe import Router


def _numpy_route(x, w, bias, n_group, topk_group, k, scale):
    scores = 1 / (1 + np.exp(-(x @ w)))
    biased = scores + bias
    n, e = biased.shape
    if n_group > 1:
        g = biased.reshape(n, n_group, e // n_group)
        group_score = np.sort(g, axis=-1)[..., -2:].sum(-1)
        keep = np.argsort(-group_score, axis=-1)[:, :topk_group]
        mask = np.zeros((n, n_group), bool)
        np.put_along_axis(mask, keep, True, axis=1)
        biased = np.where(np.repeat(mask, e // n_group, axis=1), biased, -np.inf)
    experts = np.argsort(-biased, axis=-1)[:, :k]
    weights = np.take_along_axis(scores, experts, axis=1)
    return np.sort(experts, -1), np.take_along_axis(weights / weights.sum(-1, keepdims=True) * scale,
                                                    np.argsort(experts, -1), axis=1)


@pytest.mark.parametrize("n_group,topk_group", [(1, 1), (4, 2)])
def test_router_matches_numpy(n_group, topk_group):
    config = glmjax.ModelConfig(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=n_group,
                                topk_group=topk_group, num_hidden_layers=1, initializer_range=0.3)
    router = Router(config, rngs=nnx.Rngs(0))
    bias = np.random.default_rng(0).normal(0, 0.1, 16).astype(np.float32)
    router.e_score_correction_bias.set_value(jnp.asarray(bias))
    x = np.random.default_rng(1).normal(size=(40, 32)).astype(np.float32)
    r = router(jnp.asarray(x))
    experts, weights = _numpy_route(x, np.asarray(router.weight[...]), bias, n_group, topk_group, 4, 2.5)
    order = np.argsort(np.asarray(r.experts), -1)
    np.testing.assert_array_equal(np.sort(np.asarray(r.experts), -1), experts)
    np.testing.assert_allclose(np.take_along_axis(np.asarray(r.weights), order, 1), weights, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(r.load), np.bincount(experts.ravel(), minlength=16))
    if n_group > 1:  # every token's experts come from at most topk_group groups
        assert max(len(set(row // 4)) for row in experts) <= topk_group


def _numpy_experts(x, experts, weights, gate, up, down):
    out = np.zeros_like(x)
    for n in range(x.shape[0]):
        for e, w in zip(experts[n], weights[n]):
            h = x[n] @ gate[e]
            h = h / (1 + np.exp(-h)) * (x[n] @ up[e])
            out[n] += w * (h @ down[e])
    return out


@pytest.mark.parametrize("tokens", [1, 3, 24, 200])  # tiles of 1, 1, 4 (the loop) and 32 rows (batched)
def test_grouped_matmul_strategies_match_numpy(tokens):
    e, d, f, k = 8, 16, 12, 2
    rng = np.random.default_rng(tokens)
    x = rng.normal(size=(tokens, d)).astype(np.float32)
    experts = np.stack([rng.choice(e, k, replace=False) for _ in range(tokens)]).astype(np.int32)
    weights = rng.uniform(size=(tokens, k)).astype(np.float32)
    gate, up = rng.normal(size=(2, e, d, f)).astype(np.float32) * 0.3
    down = rng.normal(size=(e, f, d)).astype(np.float32) * 0.3
    got = gmm.swiglu_experts(*map(jnp.asarray, (x, experts, weights, gate, up, down)))
    np.testing.assert_allclose(np.asarray(got), _numpy_experts(x, experts, weights, gate, up, down),
                               rtol=1e-5, atol=1e-5)


def test_tiled_layout_keeps_each_tile_in_one_expert():
    sizes = jnp.array([3, 0, 9, 1], jnp.int32)
    layout = gmm.TiledLayout(sizes, 13, tile=4)
    dest = np.asarray(layout.dest)
    assert len(set(dest)) == 13
    groups = np.repeat(np.arange(4), np.asarray(sizes))
    tile_group = np.asarray(layout.tile_group)
    np.testing.assert_array_equal(tile_group[dest // 4], groups)


# tiles of 8 rows (the loop forward, its batched backward) and of 32 rows of small experts
# (batched both ways); some padded, some skipped
@pytest.mark.parametrize("tokens", [16, 64])
def test_expert_gradients_flow_through_the_tiles(tokens):
    """The batched backward of the tile loop: gradients for the rows and all three expert
    weights against autodiff of a one-hot formulation."""
    e, d, f = 4, 8, 6
    rng = np.random.default_rng(tokens)
    x = jnp.asarray(rng.normal(size=(tokens, d)), jnp.float32)
    experts = jnp.asarray(np.stack([rng.choice(e, 2, replace=False) for _ in range(tokens)]), jnp.int32)
    weights = jnp.asarray(rng.uniform(size=(tokens, 2)), jnp.float32)
    gate, up = (jnp.asarray(rng.normal(size=(e, d, f)) * 0.3, jnp.float32) for _ in range(2))
    down = jnp.asarray(rng.normal(size=(e, f, d)) * 0.3, jnp.float32)
    probe = jnp.asarray(rng.normal(size=(tokens, d)), jnp.float32)

    def dense(*a):
        return jnp.sum(jnp.asarray(_numpy_like(a[0], experts, weights, *a[1:])) * probe)

    def tiled(*a):
        return jnp.sum(gmm.swiglu_experts(a[0], experts, weights, *a[1:]) * probe)

    args = (x, gate, up, down)
    for got, want in zip(jax.grad(tiled, argnums=(0, 1, 2, 3))(*args), jax.grad(dense, argnums=(0, 1, 2, 3))(*args)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)


def _numpy_like(x, experts, weights, gate, up, down):
    """The same sum in jnp with one-hot dispatch (an independent formulation)."""
    onehot = jax.nn.one_hot(experts, gate.shape[0]) * weights[..., None]  # [N, X, E]
    combine = onehot.sum(1)
    h = jax.nn.silu(jnp.einsum("ND,EDF->NEF", x, gate)) * jnp.einsum("ND,EDF->NEF", x, up)
    return jnp.einsum("NEF,EFD,NE->ND", h, down, combine)


def test_correction_bias_update_moves_load_toward_balance():
    from glmjax.layers.moe import update_correction_biases
    from tests.glmjax.test_model import TINY

    model = glmjax.init_model(TINY, seed=0)
    ids = jax.random.randint(jax.random.key(0), (4, 32), 0, TINY.vocab_size)
    load = model(ids).expert_load
    before = [np.asarray(layer.mlp.router.e_score_correction_bias[...]) for layer in model.layers[1:]]
    update_correction_biases(model, load, rate=1e-3)
    for layer, b, l in zip(model.layers[1:], before, np.asarray(load)):
        delta = np.asarray(layer.mlp.router.e_score_correction_bias[...]) - b
        np.testing.assert_allclose(delta, 1e-3 * np.sign(l.mean() - l), rtol=1e-6)
    spread = lambda l: np.asarray(l, float).std(-1).mean()  # noqa: E731
    for _ in range(30):
        update_correction_biases(model, model(ids).expert_load, rate=1e-2)
    assert spread(model(ids).expert_load) < spread(load)


def test_train_step_applies_the_bias_update_when_asked():
    from glmjax import train
    from tests.glmjax.test_model import TINY

    model = glmjax.init_model(TINY, seed=1)
    opt = train.make_optimizer(dict(learning_rate=1e-3, warmup=1, steps=10), model)
    ids = jax.random.randint(jax.random.key(2), (4, 24), 0, TINY.vocab_size)
    batch = {"input_ids": ids, "loss_mask": jnp.ones(ids.shape, jnp.float32)}
    bias = lambda: np.asarray(model.layers[1].mlp.router.e_score_correction_bias[...])  # noqa: E731
    before = bias()
    train.train_step(model, opt, batch, mtp_weight=0.0)
    np.testing.assert_array_equal(bias(), before)
    train.train_step(model, opt, batch, mtp_weight=0.0, bias_update_rate=1e-3)
    step = bias() - before
    assert np.allclose(np.abs(step), 1e-3) or (np.abs(step).max() <= 1e-3 and np.abs(step).max() > 0)
