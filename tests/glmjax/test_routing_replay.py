"""Routing replay (glmjax/layers/moe.py: Router, `model(ids, route_replay=...)`): tokens run
the experts they are given, weighed by the router's own affinities of those experts; the
model reports its routers' own choice either way."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import glmjax
from glmjax.layers.moe import Router
from tests.glmjax.test_moe import _numpy_route
from tests.glmjax.test_scan import CONFIGS, _ids, _pair


def test_the_router_runs_the_replayed_experts_with_its_own_affinities():
    config = glmjax.ModelConfig(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, num_hidden_layers=1,
                                initializer_range=0.3)
    router = Router(config, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)
    x = rng.normal(size=(40, 32)).astype(np.float32)
    replay = np.stack([rng.permutation(16)[:4] for _ in range(40)]).astype(np.int32)
    replay[::3] = -1  # these rows keep the router's choice
    r = router(jnp.asarray(x), jnp.asarray(replay))
    w = np.asarray(router.weight[...])
    own, _ = _numpy_route(x, w, np.zeros(16), 1, 1, 4, 2.5)
    np.testing.assert_array_equal(np.sort(np.asarray(r.own), -1), own)
    ran = np.where(replay[:, :1] >= 0, replay, np.asarray(r.own))
    np.testing.assert_array_equal(np.asarray(r.experts), ran)
    scores = np.take_along_axis(1 / (1 + np.exp(-(x @ w))), ran, axis=1)
    np.testing.assert_allclose(np.asarray(r.weights), scores / scores.sum(-1, keepdims=True) * 2.5, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(r.load), np.bincount(ran.ravel(), minlength=16))


@pytest.mark.parametrize("name", ["index_share", "every_layer"])
def test_replay_in_the_looped_and_scanned_model(tmp_path, name):
    """Replaying a model's own routes changes nothing; replaying other experts changes the
    logits alike in the looped and the scanned model, and the routers still get gradients."""
    config = CONFIGS[name]
    looped, scanned = _pair(tmp_path, config)
    ids = _ids()
    plain = looped(ids)
    moe_layers = sum(config.is_moe(i) for i in range(config.num_hidden_layers))
    assert plain.routes.shape == (moe_layers, *ids.shape, config.num_experts_per_tok)
    np.testing.assert_array_equal(scanned(ids).routes, plain.routes)
    np.testing.assert_array_equal(looped(ids, route_replay=plain.routes).logits, plain.logits)

    rng = np.random.default_rng(2)
    other = np.stack([rng.permutation(config.n_routed_experts)[:config.num_experts_per_tok]
                      for _ in range(plain.routes[..., 0].size)]).reshape(plain.routes.shape).astype(np.int32)
    replayed = looped(ids, route_replay=jnp.asarray(other))
    assert np.abs(np.asarray(replayed.logits - plain.logits)).max() > 1e-3
    # the routers' own choice is reported: the first MoE layer's input is unchanged, so is its choice
    np.testing.assert_array_equal(replayed.routes[0], plain.routes[0])
    assert (np.asarray(replayed.routes) != np.asarray(plain.routes)).any()
    np.testing.assert_allclose(scanned(ids, route_replay=jnp.asarray(other)).logits, replayed.logits, rtol=1e-5,
                               atol=1e-5)

    def loss(m):
        return jnp.mean(jax.nn.log_softmax(m(ids, route_replay=jnp.asarray(other)).logits)[..., 0])

    grads = nnx.grad(loss)(looped)
    router_grads = [g.value for path, g in nnx.to_flat_state(grads) if "router" in path and path[-1] == "weight"]
    assert len(router_grads) == moe_layers and all(np.abs(np.asarray(g)).max() > 0 for g in router_grads)
