"""rl/sao.py against hand-computed numbers and plain numpy loops."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl import sao


# SAO policy loss ------------------------------------------------------------------------
def _policy_case():
    # Band for (eps_low, eps_high) = (0.2, 0.28) is the open interval (0.8, 1.28).
    ratios = np.array([[1.1, 1.3, 0.9, 0.79, 50.0]], np.float32)  # last token: observation
    logp = np.array([[-1.0, -2.0, -0.5, -3.0, -4.0]], np.float32)
    logp_rollout = logp - np.log(ratios)
    adv = np.array([[2.0, 1.0, -1.0, 3.0, 7.0]], np.float32)
    mask = np.array([[1, 1, 1, 1, 0]], np.float32)
    return logp, logp_rollout, adv, mask


def test_sao_policy_loss_strict_band_hand_computed():
    logp, logp_rollout, adv, mask = _policy_case()
    loss, aux = sao.sao_policy_loss(logp, logp_rollout, adv, mask, 0.2, 0.28)
    # In band: 1.1 and 0.9. Out of band (1.3, 0.79) give 0 but stay in N = 4.
    expected = -(1.1 * 2.0 * -1.0 + 0.9 * -1.0 * -0.5) / 4
    np.testing.assert_allclose(loss, expected, rtol=1e-5)
    np.testing.assert_allclose(aux["clip_fraction"], 0.5, rtol=1e-6)
    np.testing.assert_allclose(aux["ratio_mean"], (1.1 + 1.3 + 0.9 + 0.79) / 4, rtol=1e-5)
    kl = np.mean([r - 1 - math.log(r) for r in (1.1, 1.3, 0.9, 0.79)])
    np.testing.assert_allclose(aux["kl_rollout"], kl, rtol=1e-4)


def test_sao_policy_loss_gradient_is_importance_weighted_pg():
    logp, logp_rollout, adv, mask = _policy_case()
    grad = jax.grad(lambda lp: sao.sao_policy_loss(lp, logp_rollout, adv, mask, 0.2, 0.28)[0])(jnp.asarray(logp))
    f = np.array([1.1, 0.0, 0.9, 0.0, 0.0], np.float32)
    np.testing.assert_allclose(grad[0], -f * adv[0] / 4, rtol=1e-5, atol=1e-7)


def test_reference_kl_k3_hand_computed_and_its_gradient_pulls_toward_the_reference():
    logp = np.array([[-1.0, -2.0, -0.5, -3.0]], np.float32)
    logp_ref = np.array([[-1.5, -1.0, -0.5, 9.0]], np.float32)  # last token: observation
    mask = np.array([[1, 1, 1, 0]], np.float32)
    d = np.array([-0.5, 1.0, 0.0])
    np.testing.assert_allclose(sao.reference_kl(logp, logp_ref, mask), np.mean(np.exp(d) - d - 1), rtol=1e-5)
    grad = np.asarray(jax.grad(lambda lp: sao.reference_kl(lp, logp_ref, mask))(jnp.asarray(logp)))[0]
    np.testing.assert_allclose(grad, [(1 - math.exp(-0.5)) / 3, (1 - math.e) / 3, 0.0, 0.0], rtol=1e-5, atol=1e-7)
    assert grad[0] > 0 and grad[1] < 0  # descent lowers logp above the reference, raises it below
    w = np.array([[0.5, 0.25, 0.25, 0.0]], np.float32)
    np.testing.assert_allclose(sao.reference_kl(logp, logp_ref, mask, token_weights=w),
                               0.5 * (math.exp(-0.5) - 0.5) + 0.25 * (math.e - 2), rtol=1e-5)
    # a token the policy has abandoned (d = 6: k3 = e^6 - 7 = 396) counts as the bound, with no gradient
    far = logp.copy()
    far[0, 1] = logp_ref[0, 1] - 6.0
    np.testing.assert_allclose(sao.reference_kl(far, logp_ref, mask), (math.exp(-0.5) - 0.5 + 10.0) / 3, rtol=1e-5)
    grad = np.asarray(jax.grad(lambda lp: sao.reference_kl(lp, logp_ref, mask))(jnp.asarray(far)))[0]
    np.testing.assert_allclose(grad, [(1 - math.exp(-0.5)) / 3, 0.0, 0.0, 0.0], rtol=1e-5, atol=1e-7)


def test_sao_policy_loss_garbage_off_mask_stays_finite():
    logp, logp_rollout, adv, mask = _policy_case()
    logp_rollout[0, 4] = -np.inf  # e.g. a prompt position the engine never scored
    loss, aux = sao.sao_policy_loss(logp, logp_rollout, adv, mask, 0.2, 0.28)
    grad = jax.grad(lambda lp: sao.sao_policy_loss(lp, logp_rollout, adv, mask, 0.2, 0.28)[0])(jnp.asarray(logp))
    assert np.isfinite(loss) and all(np.isfinite(v) for v in aux.values()) and np.isfinite(grad).all()


def _pad(rows, t):
    return np.array([list(r) + [0] * (t - len(r)) for r in rows], np.float32)


def test_per_rollout_weights_make_a_split_rollout_count_once():
    # Rollout 0 has 6 action tokens, rollout 1 has 2. Unsplit: 2 rows; split: rollout 0 in 2 segments.
    rng = np.random.default_rng(0)
    lp0, lp1 = rng.normal(size=6).astype(np.float32) - 1, rng.normal(size=2).astype(np.float32) - 1
    a0, a1 = rng.normal(size=6).astype(np.float32), rng.normal(size=2).astype(np.float32)

    def loss(rows_lp, rows_a, rid):
        lp, a, m = _pad(rows_lp, 6), _pad(rows_a, 6), _pad([[1] * len(r) for r in rows_lp], 6)
        w = sao.rollout_token_weights(m, jnp.asarray(rid))
        return sao.sao_policy_loss(lp, lp, a, m, 0.2, 0.28, token_weights=w)[0]

    unsplit = loss([lp0, lp1], [a0, a1], [0, 1])
    split = loss([lp0[:4], lp1, lp0[4:]], [a0[:4], a1, a0[4:]], [0, 1, 0])
    expected = 0.5 * (-np.mean(a0 * lp0) - np.mean(a1 * lp1))  # r = 1: mean over rollouts of token means
    np.testing.assert_allclose(unsplit, expected, rtol=1e-5)
    np.testing.assert_allclose(split, expected, rtol=1e-5)


def test_denominator_override():
    logp, logp_rollout, adv, mask = _policy_case()
    base, _ = sao.sao_policy_loss(logp, logp_rollout, adv, mask, 0.2, 0.28)
    over, _ = sao.sao_policy_loss(logp, logp_rollout, adv, mask, 0.2, 0.28, denominator=8.0)
    np.testing.assert_allclose(over, base / 2, rtol=1e-6)


# GAE ---------------------------------------------------------------------------------
def gae_reference(rewards, values, mask, gamma, lam):
    """The spec, one row at a time: a chain over action tokens; rewards on observation tokens
    after action k count for action k."""
    adv = np.zeros_like(values, dtype=np.float64)
    for b in range(rewards.shape[0]):
        lam_b = lam[b] if np.ndim(lam) else lam
        acts = np.flatnonzero(mask[b])
        next_v = next_a = 0.0
        for k in reversed(range(len(acts))):
            t = acts[k]
            end = acts[k + 1] if k + 1 < len(acts) else rewards.shape[1]
            r = rewards[b, t:end].sum()
            delta = r + gamma * next_v - values[b, t]
            adv[b, t] = delta + gamma * lam_b * next_a
            next_v, next_a = values[b, t], adv[b, t]
    return adv


def test_gae_hand_computed_skips_observation_tokens():
    mask = np.array([[0, 1, 0, 1, 1]], np.float32)
    values = np.array([[9.0, 0.5, 9.0, 0.2, 0.1]], np.float32)  # 9s on non-action tokens must not matter
    rewards = np.array([[0, 0, 0, 0, 1.0]], np.float32)
    adv, ret = sao.gae(rewards, values, mask, 1.0, 1.0)
    np.testing.assert_allclose(adv, [[0, 0.5, 0, 0.8, 0.9]], atol=1e-6)
    np.testing.assert_allclose(ret, [[0, 1, 0, 1, 1]], atol=1e-6)
    adv, _ = sao.gae(rewards, values, mask, 1.0, 0.5)
    np.testing.assert_allclose(adv, [[0, -0.125, 0, 0.35, 0.9]], atol=1e-6)


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (1.0, 0.95), (0.99, 0.5), (0.9, 0.0)])
def test_gae_matches_numpy_loop(gamma, lam):
    rng = np.random.default_rng(int(gamma * 100 + lam * 10))
    b, t = 5, 12
    mask = (rng.random((b, t)) < 0.6).astype(np.float32)
    mask[0] = 0  # a row without actions
    rewards = rng.normal(size=(b, t)).astype(np.float32)  # also on observation tokens: folded back
    values = rng.normal(size=(b, t)).astype(np.float32)
    adv, ret = sao.gae(rewards, values, mask, gamma, lam)
    ref = gae_reference(rewards, values, mask, gamma, lam)
    np.testing.assert_allclose(adv, ref, atol=1e-5)
    np.testing.assert_allclose(ret, np.where(mask > 0, ref + values, 0), atol=1e-5)
    per_row = rng.random(b).astype(np.float32)
    np.testing.assert_allclose(sao.gae(rewards, values, mask, gamma, per_row)[0],
                               gae_reference(rewards, values, mask, gamma, per_row), atol=1e-5)


def test_gae_lambdas_length_adaptive():
    lam_p, lam_c = sao.gae_lambdas(jnp.array([10, 1, 0, 1000]), alpha=1.5)
    np.testing.assert_allclose(lam_p, [1 - 1 / 15, 1 - 1 / 1.5, 0.0, 1 - 1 / 1500], rtol=1e-6)
    np.testing.assert_allclose(lam_c, 1.0)
    np.testing.assert_allclose(sao.gae_lambdas(jnp.array([10]), alpha=0.05)[0], 0.0)  # 1 - 2 < 0: clipped


def _random_rollouts(rng, n_rollouts, t):
    """Rows of random segments (1 to 3 per rollout), shuffled; and each rollout concatenated."""
    rows, whole = [], []
    for rid in range(n_rollouts):
        segs = []
        for s in range(rng.integers(1, 4)):
            seg = {k: rng.normal(size=t).astype(np.float32) for k in ("r", "v")}
            seg["m"] = (rng.random(t) < 0.5).astype(np.float32)
            segs.append(seg)
            rows.append((rid, s, seg))
        whole.append({k: np.concatenate([g[k] for g in segs]) for k in ("r", "v", "m")})
    order = rng.permutation(len(rows))
    rows = [rows[i] for i in order]
    r, v, m = (np.stack([seg[k] for _, _, seg in rows]) for k in ("r", "v", "m"))
    return rows, whole, r, v, m


def test_chained_gae_equals_gae_on_concatenated_rollout():
    rng = np.random.default_rng(3)
    t = 6
    rows, whole, r, v, m = _random_rollouts(rng, 5, t)
    rid = jnp.array([x[0] for x in rows])
    seg = jnp.array([x[1] for x in rows])
    lam_rollout = rng.random(5).astype(np.float32)
    chained = jax.jit(sao.chained_gae, static_argnums=(5,))
    adv, ret = chained(r, v, m, rid, seg, 0.97, lam_rollout[np.asarray(rid)])
    for i, (k, s, _) in enumerate(rows):
        w = whole[k]
        ref = gae_reference(w["r"][None], w["v"][None], w["m"][None], 0.97, lam_rollout[k])[0]
        np.testing.assert_allclose(adv[i], ref[s * t:(s + 1) * t], atol=1e-5)
        np.testing.assert_allclose(ret[i], np.where(m[i] > 0, ref[s * t:(s + 1) * t] + v[i], 0), atol=1e-5)


def _batch(action_rows, values, rewards, rid, seg, t):
    m = _pad([[1] * n for n in action_rows], t) if isinstance(action_rows[0], int) else np.asarray(action_rows)
    b = m.shape[0]
    return sao.Batch(tokens=np.zeros((b, t), np.int32), action_mask=m, logp_rollout=np.zeros((b, t), np.float32),
                     versions=np.zeros((b, t), np.int32), rewards=np.asarray(rewards, np.float32),
                     values=np.asarray(values, np.float32), rollout_id=np.asarray(rid), segment_index=np.asarray(seg))


def test_sao_advantages_on_a_compacted_rollout():
    # Rollout 7 in two segments (rows 1, 0), rollout 3 unsplit; the outcome repeated per segment.
    mask = np.array([[0, 1, 1, 0], [1, 1, 0, 1], [1, 0, 1, 0]], np.float32)
    rng = np.random.default_rng(1)
    values = rng.normal(size=(3, 4)).astype(np.float32)
    batch = _batch(mask, values, [1.0, 1.0, -0.5], [7, 7, 3], [1, 0, 0], 4).check()
    adv, ret = jax.jit(sao.sao_advantages, static_argnames=("alpha", "gamma"))(batch, alpha=1.5)
    np.testing.assert_allclose(ret, mask * np.array([[1.0], [1.0], [-0.5]]), atol=1e-6)  # gamma = lambda = 1
    whole = np.concatenate([mask[1], mask[0]])
    lam7 = 1 - 1 / (1.5 * 5)  # l counts both segments
    r7 = np.zeros(8, np.float32)
    r7[6] = 1.0  # once, on the last action token of the last segment
    ref7 = gae_reference(r7[None], np.concatenate([values[1], values[0]])[None], whole[None], 1.0, lam7)[0]
    np.testing.assert_allclose(adv[1], ref7[:4], atol=1e-5)
    np.testing.assert_allclose(adv[0], ref7[4:], atol=1e-5)
    ref3 = gae_reference(np.array([[0, 0, -0.5, 0]]), values[2:], mask[2:], 1.0, 1 - 1 / 3)[0]
    np.testing.assert_allclose(adv[2], ref3, atol=1e-5)


def test_batch_check_names_the_bad_field():
    batch = _batch([2, 1], np.zeros((2, 3)), [1.0, 0.0], [0, 1], [0, 0], 3)
    with pytest.raises(ValueError, match=r"Batch.values has shape \(2, 4\), expected \(2, 3\)"):
        batch._replace(values=np.zeros((2, 4))).check()


def test_value_loss_hand_computed():
    values = np.array([[1.0, 2.0, 5.0]], np.float32)
    returns = np.array([[0.0, 2.5, -9.0]], np.float32)
    mask = np.array([[1, 1, 0]], np.float32)
    loss, aux = sao.value_loss(values, returns, mask)
    np.testing.assert_allclose(loss, 0.5 * (1.0 + 0.25) / 2, rtol=1e-6)
    grad = jax.grad(lambda v: sao.value_loss(v, returns, mask)[0])(jnp.asarray(values))
    np.testing.assert_allclose(grad, [[0.5, -0.25, 0.0]], rtol=1e-6)
    np.testing.assert_allclose(aux["value_mean"], 1.5)


# Baselines ---------------------------------------------------------------------------
def test_grpo_advantages_hand_computed():
    mask = np.array([[1, 1], [1, 0], [1, 1], [1, 1], [1, 1], [0, 1]], np.float32)
    adv = sao.grpo_advantages(jnp.array([1.0, 0.0, 1.0, 1.0, 2.0, 0.0]), jnp.array([0, 0, 0, 0, 5, 5]), mask)
    std = math.sqrt(0.1875)  # group 0: mean 0.75, population variance 3 * 0.0625 + 0.5625 = 0.75 / 4
    a0, a1 = 0.25 / (std + 1e-6), -0.75 / (std + 1e-6)
    np.testing.assert_allclose(adv, [[a0, a0], [a1, 0], [a0, a0], [a0, a0], [1, 1], [0, -1]], rtol=1e-5)


# Two rows; ratios and advantages chosen so each clip branch is hit.
_R = np.array([[1.5, 0.5, 1.0], [1.1, 0.7, 2.0]], np.float32)
_A = np.array([[1.0, -1.0, 2.0], [-2.0, 1.0, 5.0]], np.float32)
_M = np.array([[1, 1, 1], [1, 1, 0]], np.float32)
_LP = np.full((2, 3), -1.0, np.float32)


def _surrogate(r, a, lo, hi):
    return -min(r * a, min(max(r, 1 - lo), 1 + hi) * a)


def test_grpo_loss_sequence_mean():
    loss, aux = sao.grpo_loss(_LP, _LP - np.log(_R), _A, _M, eps=0.2)
    s = [[_surrogate(_R[b, t], _A[b, t], 0.2, 0.2) for t in range(3) if _M[b, t]] for b in range(2)]
    # row 0: -1.2, 0.8 (min(-0.5, -0.8) = -0.8 -> 0.8), -2.0; row 1: 2.2, -0.7
    np.testing.assert_allclose(s[0], [-1.2, 0.8, -2.0], rtol=1e-6)
    np.testing.assert_allclose(loss, (np.mean(s[0]) + np.mean(s[1])) / 2, rtol=1e-5)
    np.testing.assert_allclose(aux["clip_fraction"], 3 / 5, rtol=1e-6)  # 1.5, 0.5, 0.7


def test_dapo_loss_token_level_clip_higher():
    loss, _ = sao.clipped_surrogate_loss(_LP, _LP - np.log(_R), _A, _M)
    s = [_surrogate(_R[b, t], _A[b, t], 0.2, 0.28) for b in range(2) for t in range(3) if _M[b, t]]
    np.testing.assert_allclose(s, [-1.28, 0.8, -2.0, 2.2, -0.7], rtol=1e-6)
    np.testing.assert_allclose(loss, np.sum(s) / 5, rtol=1e-5)


def test_dapo_keep_group_keeps_groups_whose_rewards_differ():
    assert sao.dapo_keep_group([1.0, 0.0, 1.0, 1.0]) and sao.dapo_keep_group([1.0, 1.0, 0.5])
    assert not sao.dapo_keep_group([1.0] * 4) and not sao.dapo_keep_group([0.0] * 4)  # all right, all wrong
    assert not sao.dapo_keep_group([0.7]) and not sao.dapo_keep_group([])


@pytest.mark.parametrize("length, expected", [
    (0, 0.0), (10, 0.0), (80, 0.0),  # |y| <= L_max - L_cache = 80: no penalty
    (81, -0.05), (90, -0.5), (99, -0.95), (100, -1.0),  # (80 - |y|) / 20 up to L_max = 100
    (101, -1.0), (500, -1.0)])  # beyond the budget
def test_dapo_overlong_penalty_in_its_three_regions(length, expected):
    assert sao.dapo_overlong_penalty(length, max_length=100, cache_length=20) == pytest.approx(expected, abs=1e-12)


def test_dapo_overlong_penalty_edge_buffers_and_bad_buffer():
    assert [sao.dapo_overlong_penalty(n, 8, 0) for n in (7, 8, 9)] == [0.0, 0.0, -1.0]  # no buffer: a hard cut
    assert [sao.dapo_overlong_penalty(n, 4, 4) for n in (0, 1, 4, 5)] == [0.0, -0.25, -1.0, -1.0]  # all buffer
    with pytest.raises(ValueError, match="cache_length=21 is invalid"):
        sao.dapo_overlong_penalty(10, max_length=20, cache_length=21)
    with pytest.raises(ValueError, match="cache_length=-1 is invalid"):
        sao.dapo_overlong_penalty(10, max_length=20, cache_length=-1)


def test_gspo_loss_sequence_ratio():
    loss, aux = sao.gspo_loss(_LP, _LP - np.log(_R), _A, _M, eps_low=0.1, eps_high=0.1)
    s0 = math.exp(np.mean(np.log([1.5, 0.5, 1.0])))  # 0.9086: in band
    s1 = math.exp(np.mean(np.log([1.1, 0.7])))  # 0.8775: clipped
    a0, a1 = np.mean([1.0, -1.0, 2.0]), np.mean([-2.0, 1.0])
    expected = (_surrogate(s0, a0, 0.1, 0.1) + _surrogate(s1, a1, 0.1, 0.1)) / 2
    np.testing.assert_allclose(loss, expected, rtol=1e-5)
    np.testing.assert_allclose(aux["clip_fraction"], 0.5)


def test_ppo_clipped_value_loss():
    values = np.array([[1.0, 0.0, 0.5], [0.3, 2.0, 9.0]], np.float32)
    old = np.array([[0.5, 0.0, 0.5], [0.0, 1.0, 0.0]], np.float32)
    returns = np.array([[0.0, 1.0, 0.5], [1.0, 1.0, 0.0]], np.float32)
    loss = sao.ppo_value_loss(values, old, returns, _M, clip=0.2)
    # Value terms: max((v-R)^2, (v_clip-R)^2) with v_clip = old + clip(v-old, +-0.2).
    v_terms = [max(1.0, 0.7 ** 2), 1.0, 0.0, max(0.49, 0.64), max(1.0, 0.2 ** 2)]
    np.testing.assert_allclose(loss, 0.5 * np.mean(v_terms), rtol=1e-5)


def test_ppo_is_the_symmetric_token_level_clipped_surrogate():
    loss, _ = sao.clipped_surrogate_loss(_LP, _LP - np.log(_R), _A, _M, eps_low=0.2, eps_high=0.2)
    s = [_surrogate(_R[b, t], _A[b, t], 0.2, 0.2) for b in range(2) for t in range(3) if _M[b, t]]
    np.testing.assert_allclose(loss, np.mean(s), rtol=1e-5)


def test_opd_advantages_reverse_kl():
    adv = sao.opd_advantages(jnp.array([[-1.0, -2.0, 0.0]]), jnp.array([[-1.5, -1.0, -np.inf]]),
                             jnp.array([[1, 1, 0]]), kl_coef=2.0)
    np.testing.assert_allclose(adv, [[-1.0, 2.0, 0.0]])
