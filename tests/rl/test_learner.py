"""The learner: log-probs, the value model, SAO steps, warm-up, frozen attention, NaN batches."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import glmjax
from rl import learner, sao
from rl.config import RLConfig
from tests.glmjax.test_sharding import CONFIG

CFG = RLConfig(algorithm="sao", eps_low=0.2, eps_high=4.0, alpha=1.5, gamma=1.0, actor_lr=3e-3, critic_lr=3e-3,
               critic_steps=2, critic_warmup=0, freeze_critic_attention=False, grad_clip=1.0, temperature=1.0)


def _batch(seed=0, b=4, t=12, prompt=5):
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(0, CONFIG.vocab_size, (b, t)), jnp.int32)
    mask = jnp.asarray(np.arange(t)[None, :] >= prompt, jnp.float32) * jnp.ones((b, 1))
    return sao.Batch(tokens=tokens, action_mask=mask, logp_rollout=jnp.zeros((b, t)), versions=jnp.zeros((b, t),
                     jnp.int32), rewards=jnp.asarray([1.0, 0.0, 1.0, 0.0][:b]), values=jnp.zeros((b, t)),
                     rollout_id=jnp.arange(b), segment_index=jnp.zeros(b, jnp.int32))


def _models(seed=0):
    policy = glmjax.init_model(CONFIG, seed=seed)
    critic = learner.ValueModel(glmjax.init_model(CONFIG, seed=seed + 1))
    return policy, critic


def test_token_logprobs_match_log_softmax():
    policy, _ = _models()
    tokens = _batch().tokens
    logp, entropy = learner.token_logprobs(policy, tokens)
    logits = np.asarray(policy(tokens).logits, np.float64)
    ls = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - \
        logits.max(-1, keepdims=True)
    expected = np.take_along_axis(ls[:, :-1], np.asarray(tokens)[:, 1:, None], -1)[..., 0]
    np.testing.assert_allclose(np.asarray(logp)[:, 1:], expected, atol=1e-5)
    assert (np.asarray(logp)[:, 0] == 0).all() and (np.asarray(entropy) >= 0).all()


def test_sao_steps_raise_rewarded_tokens_and_fit_the_critic():
    policy, critic = _models()
    batch = _batch()
    logp0, _ = learner.token_logprobs(policy, batch.tokens)
    batch = batch._replace(logp_rollout=logp0)  # on-policy rollout log-probs
    lrn = learner.Learner(policy, critic, CFG)
    first = lrn.step(batch)
    for _ in range(5):
        last = lrn.step(batch)
    assert last["value_loss"] < first["value_loss"]
    logp1, _ = learner.token_logprobs(policy, batch.tokens)
    gain = np.asarray((logp1 - logp0) * batch.action_mask).sum(1)
    assert gain[0] > 0 and gain[2] > 0  # rewarded rollouts became more likely
    assert gain[0] > gain[1] and gain[2] > gain[3]
    assert 0 <= last["clip_fraction"] <= 1 and np.isfinite(last["kl_rollout"])


def test_the_value_model_generalizes_a_value_the_tokens_determine():
    """Fresh batches each step; the outcome is 1 when the prompt's first token is even, which
    every state shows, so a learning critic explains most of the returns' variance on
    batches it has not trained on (Learner.step reports the explained variance before the
    batch's last critic update)."""
    policy, critic = _models()
    lrn = learner.Learner(policy, critic, dataclasses.replace(CFG, critic_warmup=10 ** 6, critic_lr=1e-3))
    ev = []
    for seed in range(80):
        batch = _batch(seed, b=16)
        batch = batch._replace(rewards=(batch.tokens[:, 0] % 2 == 0).astype(jnp.float32))
        ev.append(lrn.step(batch)["explained_variance"])
    assert np.mean(ev[:5]) < 0.3 and np.mean(ev[-10:]) > 0.6, ev


def test_critic_warmup_leaves_the_policy_unchanged():
    policy, critic = _models()
    before = jax.tree.map(np.asarray, nnx.state(policy, nnx.Param))
    lrn = learner.Learner(policy, critic, dataclasses.replace(CFG, critic_warmup=2))
    assert lrn.step(_batch())["critic_warmup"] == 1.0
    lrn.step(_batch())
    after = jax.tree.map(np.asarray, nnx.state(policy, nnx.Param))
    jax.tree.map(np.testing.assert_array_equal, before, after)
    assert "policy_loss" in lrn.step(_batch())


def test_actor_warmup_ramps_the_rate_from_zero():
    """With `actor_warmup` the first actor update has rate 0 (the policy does not move) and
    later ones move it; critic warm-up steps do not count toward the ramp."""
    policy, critic = _models()
    params = lambda: jax.tree.map(np.asarray, nnx.state(policy, nnx.Param))  # noqa: E731

    def on_policy(seed):
        batch = _batch(seed)
        return batch._replace(logp_rollout=learner.token_logprobs(policy, batch.tokens)[0])

    lrn = learner.Learner(policy, critic, dataclasses.replace(CFG, critic_warmup=1, actor_warmup=4))
    lrn.step(on_policy(0))  # critic warm-up
    before = params()
    lrn.step(on_policy(1))  # the ramp's first update: rate 0
    jax.tree.map(np.testing.assert_array_equal, before, params())
    lrn.step(on_policy(2))
    moved = jax.tree.map(lambda a, b: np.abs(a - b).max(), before, params())
    assert max(jax.tree.leaves(moved)) > 0


def test_kl_coef_holds_the_policy_near_the_starting_one():
    """The same rewarded batch, trained 6 steps with and without `kl_coef`: the KL term to
    the starting policy is reported, and the anchored policy ends nearer the start (by the
    same k3 KL on the batch's action tokens; measured 1.24 without, 0.31 at 0.2) while
    still raising the rewarded rollouts."""
    kl, gain = {}, {}
    for beta in (0.0, 0.2):
        policy, critic = _models()
        batch = _batch()
        logp0, _ = learner.token_logprobs(policy, batch.tokens)
        batch = batch._replace(logp_rollout=logp0)
        lrn = learner.Learner(policy, critic, dataclasses.replace(CFG, kl_coef=beta))
        for _ in range(6):
            metrics = lrn.step(batch)
        assert ("kl_reference" in metrics) == (beta > 0)
        logp1, _ = learner.token_logprobs(policy, batch.tokens)
        kl[beta] = float(sao.reference_kl(logp1, logp0, batch.action_mask))
        gain[beta] = np.asarray((logp1 - logp0) * batch.action_mask).sum(1)
    assert kl[0.2] < 0.5 * kl[0.0], kl
    assert gain[0.2][0] > 0 and gain[0.2][2] > 0, gain


def test_frozen_critic_attention():
    policy, critic = _models()
    attn = lambda: jax.tree.map(np.asarray, nnx.state(critic.backbone.layers[0].attn, nnx.Param))  # noqa: E731
    mlp = lambda: np.asarray(critic.backbone.layers[0].mlp.gate[...])  # noqa: E731
    a0, m0 = attn(), mlp()
    learner.Learner(policy, critic, dataclasses.replace(CFG, freeze_critic_attention=True)).step(_batch())
    jax.tree.map(np.testing.assert_array_equal, a0, attn())
    assert np.abs(mlp() - m0).max() > 0


def test_nonfinite_batch_is_skipped_and_training_goes_on():
    policy, critic = _models()
    lrn = learner.Learner(policy, critic, CFG)
    before = jax.tree.map(np.asarray, nnx.state(policy, nnx.Param))
    critic_before = jax.tree.map(np.asarray, nnx.state(critic, nnx.Param))
    for bad in (_batch()._replace(logp_rollout=_batch().logp_rollout.at[0, 7].set(jnp.nan)),
                _batch()._replace(rewards=jnp.array([1.0, jnp.inf, 0.0, 0.0]))):
        assert lrn.step(bad)["skipped_nonfinite"] == 1.0
    assert lrn.skipped == 2
    jax.tree.map(np.testing.assert_array_equal, critic_before, jax.tree.map(np.asarray, nnx.state(critic, nnx.Param)))
    jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.asarray, nnx.state(policy, nnx.Param)))
    assert "skipped_nonfinite" not in lrn.step(_batch())


def test_grpo_needs_groups_and_runs_without_a_critic():
    policy, _ = _models()
    lrn = learner.Learner(policy, None, dataclasses.replace(CFG, algorithm="grpo", group_size=2))
    with pytest.raises(ValueError, match="group_ids"):
        lrn.step(_batch())
    assert np.isfinite(lrn.step(_batch(), group_ids=jnp.array([0, 0, 1, 1]))["policy_loss"])
    with pytest.raises(ValueError, match="rl.algorithm"):
        learner.Learner(policy, None, dataclasses.replace(CFG, algorithm="reinforce"))


def test_mtp_step_trains_the_mtp_layer_alone():
    """rl.mtp_lr: the MTP loss on the action tokens falls, only the MTP layer moves (the
    critic is warming up, so the actor does not step), and a model without one is refused."""
    config = CONFIG.replace(num_nextn_predict_layers=1)
    policy = glmjax.init_model(config, seed=0)
    critic = learner.ValueModel(glmjax.init_model(config, seed=1))
    lrn = learner.Learner(policy, critic, dataclasses.replace(CFG, critic_warmup=10 ** 6, mtp_lr=1e-2))
    trunk = lambda: jax.tree.map(np.asarray, nnx.state(policy, nnx.All(nnx.Param, nnx.Not(nnx.PathContains("mtp")))))  # noqa: E731
    mtp = lambda: jax.tree.map(np.asarray, nnx.state(policy.mtp, nnx.Param))  # noqa: E731
    trunk0, mtp0 = trunk(), mtp()
    batch = _batch()
    losses = [lrn.step(batch)["mtp_loss"] for _ in range(6)]
    assert losses[-1] < losses[0]
    jax.tree.map(np.testing.assert_array_equal, trunk0, trunk())
    moved = jax.tree.map(lambda a, b: np.abs(a - b).max(), mtp0, mtp())
    assert max(jax.tree.leaves(moved)) > 0
    with pytest.raises(ValueError, match="num_nextn_predict_layers"):
        learner.Learner(glmjax.init_model(CONFIG), critic, dataclasses.replace(CFG, mtp_lr=1e-3))


def test_policy_updated_in_place_equals_the_copying_step():
    """donate_policy: the same update, its old parameter arrays deleted (their memory reused);
    by default they outlive the step, as an engine decoding from them needs. The critic's
    are always the learner's own."""
    batch = _batch()
    results = {}
    for donate in (False, True):
        policy, critic = _models()
        old = [x for x in jax.tree.leaves(nnx.state(policy, nnx.Param))]
        old_critic = jax.tree.leaves(nnx.state(critic, nnx.Param))
        lrn = learner.Learner(policy, critic, CFG, donate_policy=donate)
        metrics = lrn.step(batch._replace(logp_rollout=learner.token_logprobs(policy, batch.tokens)[0]))
        results[donate] = (metrics, jax.tree.map(np.asarray, nnx.state(policy, nnx.Param)),
                           jax.tree.map(np.asarray, nnx.state(critic, nnx.Param)))
        trained = [x for x in old if x.is_deleted()]
        assert bool(trained) == donate and (not donate or len(trained) > len(old) // 2)
        assert all(x.is_deleted() for x in old_critic)
    assert results[False][0] == pytest.approx(results[True][0], rel=1e-6)
    for copied, in_place in zip(jax.tree.leaves(results[False][1:]), jax.tree.leaves(results[True][1:])):
        np.testing.assert_array_equal(copied, in_place)


def test_donating_steps_leave_the_arrays_of_modules_cloned_from_the_policy():
    """nnx.clone shares arrays: a critic whose trunk is the policy's clone (as the trainer
    builds it) and the KL reference beside a policy updated in place get their own, so the
    donating steps delete none of the policy's (an engine decodes from them) or the
    reference's."""
    batch = _batch()
    policy = glmjax.init_model(CONFIG, seed=0)
    start = jax.tree.map(np.asarray, nnx.state(policy))
    published = jax.tree.leaves(nnx.state(policy))
    lrn = learner.Learner(policy, learner.ValueModel(nnx.clone(policy)), CFG)
    lrn.step(batch._replace(logp_rollout=learner.token_logprobs(policy, batch.tokens)[0]))
    assert not any(x.is_deleted() for x in published)

    policy = glmjax.init_model(CONFIG, seed=0)
    lrn = learner.Learner(policy, learner.ValueModel(nnx.clone(policy)), dataclasses.replace(CFG, kl_coef=0.1),
                          donate_policy=True)
    lrn.step(batch._replace(logp_rollout=learner.token_logprobs(policy, batch.tokens)[0]))
    for got, want in zip(jax.tree.leaves(nnx.state(lrn.reference)), jax.tree.leaves(start)):
        np.testing.assert_array_equal(np.asarray(got), want)


def test_a_critic_cloned_after_supervised_steps_shares_no_buffer_with_the_policy():
    """On fsdp=4, a policy after supervised steps (the trainer's base, trained in the same
    process) and its clone as the critic, placed on the mesh as the trainer places it: some
    of the critic's arrays are new objects over the policy's own buffers, which the
    critic's donating steps would delete (the indexer's, which no actor step rewrites, so
    the next publish failed); the learner copies by buffer, not by array object."""
    from glmjax import sharding
    from rl.base_model import supervised
    from rl.config import BaseConfig

    mesh = glmjax.make_mesh(fsdp=4, devices=jax.devices()[:4])
    batch = _batch()
    with sharding.use_mesh(mesh):
        policy = glmjax.init_model(CONFIG, seed=0, mesh=mesh)
        ids = np.asarray(batch.tokens)
        supervised(policy, ids, np.ones(ids.shape, np.float32), BaseConfig(steps=2, batch_size=4, warmup=0), mesh=mesh)
        critic = sharding.shard_model(learner.ValueModel(nnx.clone(policy)), mesh)
        lrn = learner.Learner(policy, critic, dataclasses.replace(CFG, critic_warmup=1), mesh=mesh, donate_policy=True)
        lrn.step(batch._replace(logp_rollout=learner.token_logprobs(policy, jnp.asarray(batch.tokens))[0]))
    assert not [p for p, x in jax.tree_util.tree_leaves_with_path(nnx.state(policy)) if x.is_deleted()]
