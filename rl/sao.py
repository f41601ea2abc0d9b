"""Advantages and policy losses: SAO (the default), and GRPO, DAPO, GSPO, PPO, OPD beside it
(rl/algorithms.py names each algorithm's loss).

SAO, "Single-Rollout Asynchronous Optimization" (arXiv 2607.07508), trains on one rollout
per prompt with advantages from a value model:

    r_t  = exp(logp_theta(a_t) - logp_rollout(a_t))
    f(r) = r if 1 - eps_low < r < 1 + eps_high else 0
    L    = -1/N sum_t sg(f(r_t)) A_t logp_theta(a_t)       N = all action tokens
    A    = GAE(lambda_policy = 1 - 1/(alpha l)),   value target = GAE(lambda_critic = 1)

How it differs from textbook PPO (Schulman et al. 2017):
  * no pi_old: the ratio is taken against the policy that sampled each token, whose
    log-prob the engine records (`logp_rollout`), so no extra forward pass ("direct
    double-sided importance sampling"); tokens of one rollout may come from different
    weight versions;
  * a strict two-sided band instead of min/clip: a token with r outside (1 - eps_low,
    1 + eps_high) gets no gradient whatever the sign of A (PPO zeroes only the side where
    the clip binds), and it stays in the mean's denominator; inside the band the gradient,
    r A grad logp = A grad r, equals PPO's unclipped surrogate gradient;
  * wide, asymmetric bands: reported (0.7, 6.0) for reasoning, (0.2, 4.0) for coding;
  * G = 1: no group baseline; the baseline is a value model, trained with plain masked MSE
    (no value clipping) on returns fixed from a pre-update value snapshot;
  * GAE over action tokens only: tool output and other observation tokens are not MDP
    steps, so an action token bootstraps from the next *action* token; gamma 1; the
    outcome reward sits on the last generated token; the value after it is 0;
  * decoupled lambdas: 1.0 for the critic's targets, length-adaptive for the policy;
  * compaction (CompactionRL, arXiv 2607.05378): the segments of one rollout are chained
    in GAE and may be weighted so that the rollout counts once (`rollout_token_weights`);
  * no entropy bonus, no advantage whitening; a KL-to-reference term is an option beside it
    (`reference_kl`, rl.kl_coef), off by default.

Everything is a pure function of arrays. Shapes use the einsum legend (B rows, T tokens).
A row is one trajectory, or one segment of a compacted one; rows of a rollout share
`rollout_id` and are numbered by `segment_index` (0, 1, ...; unique per rollout).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp

sg = jax.lax.stop_gradient


class Batch(NamedTuple):
    """The padded arrays the learner consumes (stacked rollout trajectories + values)."""

    tokens: jax.Array  # [B, T] int32
    action_mask: jax.Array  # [B, T] 1 on tokens the policy generated (summaries too), 0 on prompt/obs/pad
    logp_rollout: jax.Array  # [B, T] log-prob of each token under the weights that sampled it
    versions: jax.Array  # [B, T] int32 weight version that generated each token
    rewards: jax.Array  # [B] outcome of the row's rollout (only the last segment's row is read)
    values: jax.Array  # [B, T] value-model estimates (snapshot before the update)
    rollout_id: jax.Array  # [B] int
    segment_index: jax.Array  # [B] int
    routes: jax.Array | None = None  # [B, T, L_moe, X] int16 the engine's experts per position, -1 unknown

    def check(self) -> Batch:
        """Raises ValueError naming the field whose shape is not [B, T] / [B]."""
        b, t = self.tokens.shape
        for name, value in self._asdict().items():
            if value is None:
                continue
            want = (b,) if name in ("rewards", "rollout_id", "segment_index") else (b, t)
            if name == "routes":
                want = (b, t, *value.shape[2:])
            if tuple(value.shape) != want:
                raise ValueError(f"Batch.{name} has shape {tuple(value.shape)}, expected {want} (B={b}, T={t})")
        return self


# Rollout structure ----------------------------------------------------------------------
def _same_rollout(rollout_id: jax.Array) -> jax.Array:
    return rollout_id[:, None] == rollout_id[None, :]  # [B, B]


def rollout_sum(x: jax.Array, rollout_id: jax.Array) -> jax.Array:
    """x [B] summed over the rows of each row's rollout -> [B]."""
    return jnp.einsum("BC,C->B", _same_rollout(rollout_id).astype(x.dtype), x)


def next_segment(rollout_id: jax.Array, segment_index: jax.Array) -> jax.Array:
    """The row holding segment i+1 of each row's rollout, -1 for a rollout's last row [B]."""
    succ = _same_rollout(rollout_id) & (segment_index[None, :] == segment_index[:, None] + 1)  # [B, B]
    return jnp.where(succ.any(1), jnp.argmax(succ, 1), -1)


def place_rewards(rewards: jax.Array, action_mask: jax.Array, rollout_id: jax.Array,
                  segment_index: jax.Array) -> jax.Array:
    """Per-token rewards [B, T]: each rollout's outcome rewards [B] on the last action token
    of its last segment (of a row with no action token: its last position, which GAE folds
    into the previous action token); every other token gets 0."""
    mask = action_mask.astype(bool)
    t = mask.shape[1]
    last = jnp.where(mask.any(1), t - 1 - jnp.argmax(mask[:, ::-1], 1), t - 1)  # [B]
    is_last_segment = next_segment(rollout_id, segment_index) < 0
    r = jnp.where(is_last_segment, rewards, 0.0).astype(jnp.float32)
    return jnp.where(jnp.arange(t)[None, :] == last[:, None], r[:, None], 0.0)


def rollout_token_weights(action_mask: jax.Array, rollout_id: jax.Array) -> jax.Array:
    """[B, T] weights 1 / (action tokens of the token's rollout) on action tokens, 0 elsewhere.

    Passed as `token_weights`, the loss becomes the mean over rollouts of each rollout's
    token mean, so a compacted rollout split into k segments counts once, not k times.
    (A plain token mean is already invariant to splitting; this is the per-rollout
    denominator of CompactionRL / slime's `rollout_mask_sums`.)"""
    mask = action_mask.astype(jnp.float32)
    n = rollout_sum(mask.sum(1), rollout_id)  # [B]
    return jnp.where(n[:, None] > 0, mask / jnp.maximum(n, 1.0)[:, None], 0.0)


# GAE ---------------------------------------------------------------------------------
class GaeCarry(NamedTuple):
    """What the reverse scan knows about the future of a row: [B] each."""

    value: jax.Array  # value of the next action token (the bootstrap before any is seen)
    advantage: jax.Array  # its advantage
    reward: jax.Array  # rewards on observation tokens after the current position, not yet assigned


def _zero_carry(b: int) -> GaeCarry:
    z = jnp.zeros((b,), jnp.float32)
    return GaeCarry(z, z, z)


def _gae_scan(rewards, values, action_mask, gamma, lam, carry: GaeCarry):
    """Reverse scan over T. Returns (advantages [B, T], the carry at the row's start)."""
    gl = gamma * jnp.broadcast_to(jnp.asarray(lam, jnp.float32), rewards.shape[:1])  # [B]

    def step(c: GaeCarry, x):
        r, v, m = x  # [B] each
        delta = r + c.reward + gamma * c.value - v
        adv = delta + gl * c.advantage
        new = GaeCarry(jnp.where(m, v, c.value), jnp.where(m, adv, c.advantage), jnp.where(m, 0.0, c.reward + r))
        return new, jnp.where(m, adv, 0.0)

    xs = (rewards.astype(jnp.float32).T, values.astype(jnp.float32).T, action_mask.astype(bool).T)  # [T, B]
    carry, adv_tb = jax.lax.scan(step, carry, xs, reverse=True)
    return adv_tb.T, carry


def gae(rewards: jax.Array, values: jax.Array, action_mask: jax.Array, gamma: float, lam,
        bootstrap: GaeCarry | None = None) -> tuple[jax.Array, jax.Array]:
    """GAE (Schulman et al. 2016) over the action tokens of each row, as a reverse lax.scan.

    rewards [B, T] (per token), values [B, T], action_mask [B, T]; lam a scalar or [B].
    Returns (advantages [B, T], returns = advantages + values [B, T]), 0 off action tokens.

    With a_1 < a_2 < ... the positions of the action tokens of a row:
        delta_k = r_k + gamma V(a_{k+1}) - V(a_k),   A_k = delta_k + gamma lam A_{k+1}
    Observation tokens between a_k and a_{k+1} are not steps: no discount, no value, and
    any reward on them is added to r_k (rewards before a row's first action are passed on
    to `bootstrap`-chained predecessors, else dropped). After the last action token the
    chain continues from `bootstrap` (default: terminal, V = A = 0; for a row cut off by a
    length limit rather than ended, pass GaeCarry(V(next state), 0, 0)).
    """
    carry = _zero_carry(rewards.shape[0]) if bootstrap is None else bootstrap
    adv, _ = _gae_scan(rewards, values, action_mask, gamma, lam, carry)
    return adv, jnp.where(action_mask.astype(bool), adv + values, 0.0)


def chained_gae(rewards: jax.Array, values: jax.Array, action_mask: jax.Array, rollout_id: jax.Array,
                segment_index: jax.Array, gamma: float, lam) -> tuple[jax.Array, jax.Array]:
    """`gae` across the segments of compacted rollouts ("cross-trajectory GAE").

    The last action token of segment i bootstraps from the first action token of segment
    i+1 of the same rollout (its value and advantage), exactly as if the segments were one
    row concatenated along T. Implementation: each row's scan ends in the carry its
    predecessor needs (`GaeCarry` at the row's start), so S - 1 rounds, S the longest
    chain, pass that carry one segment back; a final scan gives the advantages. Rollouts
    without compaction (segment_index 0 only) need no round. A missing segment index
    breaks the chain there (the earlier part is treated as terminal).
    """
    nxt = next_segment(rollout_id, segment_index)  # [B]
    has_next, nxt = nxt >= 0, jnp.maximum(nxt, 0)

    def from_successor(c: GaeCarry) -> GaeCarry:
        return jax.tree.map(lambda x: jnp.where(has_next, x[nxt], 0.0), c)

    def round_(_, boot):
        return from_successor(_gae_scan(rewards, values, action_mask, gamma, lam, boot)[1])

    rounds = jnp.max(segment_index) - jnp.min(segment_index)
    boot = jax.lax.fori_loop(0, rounds, round_, _zero_carry(rewards.shape[0]))
    return gae(rewards, values, action_mask, gamma, lam, bootstrap=boot)


def gae_lambdas(lengths: jax.Array, alpha: float) -> tuple[jax.Array, jax.Array]:
    """(lambda_policy [B], lambda_critic [B]) from each rollout's action-token count [B].

    lambda_policy = clip(1 - 1/(alpha l), 0, 1) (length-adaptive, VAPO / SAO; alpha 1.5 in
    SAO's reports, 0.05 in VAPO), so long rollouts keep long-range credit; lambda_critic =
    1 makes the value targets Monte Carlo returns, unbiased whatever the critic's error."""
    l = lengths.astype(jnp.float32)
    lam = jnp.where(l > 0, 1.0 - 1.0 / (alpha * jnp.maximum(l, 1.0)), 0.0)
    return jnp.clip(lam, 0.0, 1.0), jnp.ones_like(l)


def sao_advantages(batch: Batch, *, alpha: float, gamma: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """SAO's (policy advantages [B, T], value targets [B, T]) from a Batch.

    Rewards go on each rollout's last action token (`place_rewards`); both GAEs run across
    compacted segments (`chained_gae`); l in lambda_policy counts the whole rollout's
    action tokens. Values are a constant (the pre-update snapshot)."""
    mask, rid, seg = batch.action_mask, batch.rollout_id, batch.segment_index
    rewards = place_rewards(batch.rewards, mask, rid, seg)
    values = sg(batch.values.astype(jnp.float32))
    lam_policy, lam_critic = gae_lambdas(rollout_sum(mask.astype(jnp.float32).sum(1), rid), alpha)
    advantages, _ = chained_gae(rewards, values, mask, rid, seg, gamma, lam_policy)
    _, returns = chained_gae(rewards, values, mask, rid, seg, gamma, lam_critic)
    return advantages, returns


# Losses ------------------------------------------------------------------------------
def _mean(x: jax.Array, weights: jax.Array, denominator=None) -> jax.Array:
    """sum(w x) / sum(w) over the tokens with w != 0 (or / denominator when given)."""
    total = weights.sum() if denominator is None else denominator
    return jnp.where(weights != 0, weights * x, 0.0).sum() / jnp.where(total > 0, total, 1.0)


def _log_ratio(logp, logp_old, mask):
    # Prompt and padding positions may hold anything (even -inf): keep exp() finite there.
    return jnp.where(mask, logp.astype(jnp.float32) - logp_old.astype(jnp.float32), 0.0)


def sao_policy_loss(logp: jax.Array, logp_rollout: jax.Array, advantages: jax.Array, action_mask: jax.Array,
                    eps_low: float, eps_high: float, *, token_weights: jax.Array | None = None,
                    denominator=None) -> tuple[jax.Array, dict]:
    """SAO's direct double-sided importance-sampling loss (arXiv 2607.07508).

    logp [B, T] under the current parameters (differentiated), logp_rollout [B, T] from the
    engine, advantages [B, T], action_mask [B, T]. Strict band: 1 - eps_low < r < 1 +
    eps_high keeps the token with weight sg(r), anything else (on the edge too) weight 0;
    every action token stays in the denominator N. token_weights [B, T] (e.g.
    `rollout_token_weights`) turn the token mean into a weighted mean sum(w x) / sum(w);
    `denominator` overrides N (the whole batch's, under gradient accumulation).
    d loss / d logp_t = -w_t f(r_t) A_t / N. aux: clip_fraction (out-of-band share; below
    and above the band: clip_low_fraction, clip_high_fraction),
    ratio_mean, kl_rollout (mean of r - 1 - log r, the k3 estimate of KL(rollout || theta)).
    """
    mask = action_mask.astype(bool)
    log_r = _log_ratio(logp, logp_rollout, mask)
    ratio = jnp.exp(sg(log_r))
    in_band = (ratio > 1.0 - eps_low) & (ratio < 1.0 + eps_high)
    f = jnp.where(in_band, ratio, 0.0)
    w = mask.astype(jnp.float32) if token_weights is None else jnp.where(mask, token_weights, 0.0)
    loss = _mean(-f * sg(advantages) * logp.astype(jnp.float32), w, denominator)
    m = mask.astype(jnp.float32)
    aux = {
        "clip_fraction": _mean(1.0 - in_band.astype(jnp.float32), m),
        "clip_low_fraction": _mean((ratio <= 1.0 - eps_low).astype(jnp.float32), m),
        "clip_high_fraction": _mean((ratio >= 1.0 + eps_high).astype(jnp.float32), m),
        "ratio_mean": _mean(ratio, m),
        "kl_rollout": _mean(ratio - 1.0 - sg(log_r), m),
    }
    return loss, aux


def reference_kl(logp: jax.Array, logp_ref: jax.Array, action_mask: jax.Array, *,
                 token_weights: jax.Array | None = None, bound: float = 10.0) -> jax.Array:
    """KL(pi_theta || pi_ref) on the sampled action tokens, by the k3 estimator (Schulman 2020):

        k3_t = min(exp(logp_ref_t - logp_t) - (logp_ref_t - logp_t) - 1, bound)  >= 0

    unbiased for tokens drawn from pi_theta (the rollout policy is within SAO's band of it),
    its gradient pulls log pi_theta toward the reference on each sampled token. logp [B, T]
    (differentiated), logp_ref [B, T] (constant), action_mask [B, T]; the same weighted token
    mean as the policy loss. Off in SAO as published; an anchor for the tokens that the reward
    does not depend on (fixed command syntax), which otherwise drift under the updates of
    the ones it does. `bound` (verl's low_var_kl clamps at 10): a token the policy has all but
    given up while the reference still likes it (exp(d) unbounded; a stale rollout's token
    at a high learning rate reached k3 = 708 in one step) adds at most `bound` and no gradient,
    rather than deciding the whole step."""
    mask = action_mask.astype(bool)
    d = jnp.where(mask, sg(logp_ref).astype(jnp.float32) - logp.astype(jnp.float32), 0.0)
    w = mask.astype(jnp.float32) if token_weights is None else jnp.where(mask, token_weights, 0.0)
    return _mean(jnp.minimum(jnp.exp(d) - d - 1.0, bound), w)


def value_loss(values: jax.Array, returns: jax.Array, action_mask: jax.Array, *,
               token_weights: jax.Array | None = None, denominator=None) -> tuple[jax.Array, dict]:
    """0.5 * masked mean of (V - R)^2 over action tokens, no clipping (SAO's critic).
    values [B, T] (differentiated), returns [B, T] (constant targets)."""
    mask = action_mask.astype(bool)
    w = mask.astype(jnp.float32) if token_weights is None else jnp.where(mask, token_weights, 0.0)
    v, r = values.astype(jnp.float32), sg(returns.astype(jnp.float32))
    loss = 0.5 * _mean(jnp.square(v - r), w, denominator)
    m = mask.astype(jnp.float32)
    r_mean = _mean(r, m)
    var_r = _mean(jnp.square(r - r_mean), m)
    resid = sg(v) - r
    var_e = _mean(jnp.square(resid - _mean(resid, m)), m)
    aux = {"value_mean": _mean(sg(v), m), "return_mean": r_mean,
           # 0 when the returns are (numerically) constant: there is no variance to explain.
           "explained_variance": jnp.where(var_r > 1e-8, 1.0 - var_e / jnp.maximum(var_r, 1e-8), 0.0)}
    return loss, aux


# Baselines for ablations -----------------------------------------------------------------
def grpo_advantages(rewards: jax.Array, group_ids: jax.Array, action_mask: jax.Array, *,
                    eps: float = 1e-6) -> jax.Array:
    """GRPO (DeepSeekMath): (R - mean_g) / (std_g + eps) over each prompt's group, broadcast
    on the row's action tokens -> [B, T]. rewards [B], group_ids [B]. std is the population
    std (ddof 0; torch's default .std() is ddof 1, larger by sqrt(G / (G - 1)))."""
    same = (group_ids[:, None] == group_ids[None, :]).astype(jnp.float32)  # [B, B]
    r = rewards.astype(jnp.float32)
    n = same.sum(1)
    mean = same @ r / n
    var = jnp.einsum("BC,BC->B", same, jnp.square(r[None, :] - mean[:, None])) / n
    adv = (r - mean) / (jnp.sqrt(var) + eps)
    return jnp.where(action_mask.astype(bool), adv[:, None], 0.0)


def _clipped_surrogate(logp, logp_old, advantages, mask, eps_low, eps_high):
    """PPO's per-token -min(r A, clip(r) A) [B, T] and the out-of-band indicator."""
    ratio = jnp.exp(_log_ratio(logp, logp_old, mask))
    a = sg(advantages).astype(jnp.float32)
    surrogate = -jnp.minimum(ratio * a, jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high) * a)
    return surrogate, ratio, (ratio < 1.0 - eps_low) | (ratio > 1.0 + eps_high)


def _sequence_mean(x, m):
    """Mean over rows (with >= 1 action token) of each row's token mean."""
    n = m.sum(1)
    per_row = jnp.where(m, x, 0.0).sum(1) / jnp.maximum(n, 1.0)
    return _mean(per_row, (n > 0).astype(jnp.float32))


def grpo_loss(logp: jax.Array, logp_old: jax.Array, advantages: jax.Array, action_mask: jax.Array, *,
              eps: float = 0.2) -> tuple[jax.Array, dict]:
    """GRPO's PPO-clip loss: token mean within each sequence, then mean over sequences (no
    KL-to-reference term). logp_old is the behaviour policy (logp_rollout, or recomputed)."""
    mask = action_mask.astype(bool)
    surrogate, ratio, clipped = _clipped_surrogate(logp, logp_old, advantages, mask, eps, eps)
    m = mask.astype(jnp.float32)
    return _sequence_mean(surrogate, mask), {"clip_fraction": _mean(clipped, m), "ratio_mean": _mean(sg(ratio), m)}


def clipped_surrogate_loss(logp: jax.Array, logp_old: jax.Array, advantages: jax.Array, action_mask: jax.Array, *,
                           eps_low: float = 0.2, eps_high: float = 0.28) -> tuple[jax.Array, dict]:
    """PPO's clipped surrogate at the token level: the sum over all action tokens of the
    batch of -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), over their count. PPO with
    eps_high = eps_low; DAPO's (arXiv 2503.14476) with clip-higher, eps_high > eps_low."""
    mask = action_mask.astype(bool)
    surrogate, ratio, clipped = _clipped_surrogate(logp, logp_old, advantages, mask, eps_low, eps_high)
    m = mask.astype(jnp.float32)
    return _mean(surrogate, m), {"clip_fraction": _mean(clipped, m), "ratio_mean": _mean(sg(ratio), m)}


def dapo_keep_group(rewards: Sequence[float]) -> bool:
    """DAPO's dynamic sampling (arXiv 2503.14476): whether one prompt's group carries a
    gradient. The paper samples until every group satisfies

        0 < |{o_i : is_equivalent(a, o_i)}| < G

    i.e. drops all-right and all-wrong groups, whose GRPO advantages (R_i - mean) / std are
    all 0. Here the test is that the group's scored rewards are not all equal, which is the
    same for 0/1 rewards and also keeps a group whose members a shaped reward (the overlong
    penalty below) tells apart. An empty group, or one of a single member, is not kept."""
    return len(rewards) > 1 and min(rewards) < max(rewards)


def dapo_overlong_penalty(length: int, max_length: int, cache_length: int) -> float:
    """DAPO's soft overlong punishment (arXiv 2503.14476), added to a response's reward;
    |y| = length generated tokens, L_max = max_length (the generation budget), L_cache =
    cache_length (the buffer before it):

        R_length(y) = 0                                    if |y| <= L_max - L_cache
                      ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
                      -1                                   if L_max < |y|

    cache_length 0 leaves only the last case (no penalty within the budget)."""
    if not 0 <= cache_length <= max_length:
        raise ValueError(f"cache_length={cache_length} is invalid: expected 0 <= cache_length <= "
                         f"max_length={max_length}")
    soft = max_length - cache_length
    if length <= soft:
        return 0.0
    if length <= max_length:
        return (soft - length) / cache_length
    return -1.0


def gspo_loss(logp: jax.Array, logp_old: jax.Array, advantages: jax.Array, action_mask: jax.Array, *,
              eps_low: float = 3e-4, eps_high: float = 4e-4) -> tuple[jax.Array, dict]:
    """GSPO (arXiv 2507.18071): sequence ratio s = exp(mean_t log r_t), PPO-clipped with the
    sequence advantage (the row's mean advantage over action tokens), mean over rows."""
    mask = action_mask.astype(bool)
    m = mask.astype(jnp.float32)
    n = jnp.maximum(m.sum(1), 1.0)
    s = jnp.exp(_log_ratio(logp, logp_old, mask).sum(1) / n)  # [B]
    a = sg(jnp.where(mask, advantages, 0.0).sum(1) / n)
    surrogate = -jnp.minimum(s * a, jnp.clip(s, 1.0 - eps_low, 1.0 + eps_high) * a)
    rows = (m.sum(1) > 0).astype(jnp.float32)
    clipped = (s < 1.0 - eps_low) | (s > 1.0 + eps_high)
    return _mean(surrogate, rows), {"clip_fraction": _mean(clipped, rows), "ratio_mean": _mean(sg(s), rows)}


def ppo_value_loss(values: jax.Array, old_values: jax.Array, returns: jax.Array, action_mask: jax.Array, *,
                   clip: float = 0.2) -> jax.Array:
    """PPO's clipped value loss: 0.5 * token mean of max((V - R)^2, (V_clip - R)^2),
    V_clip = old + clip(V - old, -clip, clip). [B, T] arrays; values differentiated."""
    v, old, r = values.astype(jnp.float32), sg(old_values.astype(jnp.float32)), sg(returns.astype(jnp.float32))
    v_clip = old + jnp.clip(v - old, -clip, clip)
    return 0.5 * _mean(jnp.maximum(jnp.square(v - r), jnp.square(v_clip - r)), action_mask.astype(jnp.float32))


def opd_advantages(logp_student: jax.Array, logp_teacher: jax.Array, action_mask: jax.Array, *,
                   kl_coef: float = 1.0) -> jax.Array:
    """On-policy distillation: A_t = -kl_coef (logp_student - logp_teacher) on the student's
    sampled tokens [B, T] (per-token reverse KL); add an outcome advantage if wanted and
    train with `sao_policy_loss`."""
    mask = action_mask.astype(bool)
    return jnp.where(mask, -kl_coef * _log_ratio(sg(logp_student), sg(logp_teacher), mask), 0.0)

