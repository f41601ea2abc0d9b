"""On-policy distillation (OPD) from domain teachers: the per-token signal and its loss.

The student samples; the teacher of each prompt's domain (rl/teachers.py) scores the
student's own tokens; the student learns to match it (GKD, Agarwal et al. 2024; Qwen3;
Thinking Machines' "On-Policy Distillation"; Xiaomi MiMo's multi-teacher MOPD):

    kl_t = logp_student(a_t) - logp_teacher(a_t)           a_t sampled by the student
    A_t  = -kl_coef kl_t + outcome_weight A^outcome_t
    L    = SAO's importance-weighted loss with these advantages (rl/sao.py, sao_policy_loss)
         [+ topk_weight mean_t KL_k(student_t || teacher_t)]     the optional top-k variant

How it differs from textbook distillation (forward KL on the teacher's samples):
  * reverse KL on the student's own samples: mode-seeking, and no train/test mismatch in
    the prefixes the student is taught on;
  * one sample per state: the teacher scores only the token the student sampled; kl_t is
    an unbiased estimate of KL(student || teacher) at that state, whose expectation under
    the student is the full reverse KL;
  * the signal is an advantage, so it trains through the same policy-gradient loss as
    SAO: its importance ratio against the rollout log-probs corrects rollouts that are a
    few versions stale; logp_student is the rollout's own log-prob (recorded by the
    engine), so no extra student forward pass;
  * each token's advantage is its own kl_t (no discounting across tokens: "discount 0");
  * the outcome advantage (optional, MOPD-style) is the verifier's reward minus the mean
    reward of the prompt's domain in the batch, on every action token of the row: no
    value model;
  * the top-k variant compares the whole next-token distribution on the teacher's k most
    likely tokens plus one bucket for the rest, and is differentiated directly, not by the
    policy gradient.
Pure functions of arrays, except `distill_step` (one update of a Learner's policy).
Shapes: B rows, T tokens, K top-k entries, N vocabulary.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from rl import sao
from rl.learner import Learner, token_logprobs


def reverse_kl(logp_student: jax.Array, logp_teacher: jax.Array, action_mask: jax.Array) -> jax.Array:
    """logp_student - logp_teacher on the student's sampled action tokens, 0 elsewhere [B, T]."""
    return -sao.opd_advantages(logp_student, logp_teacher, action_mask, kl_coef=1.0)


def outcome_advantages(rewards: jax.Array, domain_ids: jax.Array, action_mask: jax.Array) -> jax.Array:
    """R - mean(R over the batch's rows of the same domain), on each row's action tokens
    [B, T]. rewards [B], domain_ids [B] int."""
    same = (domain_ids[:, None] == domain_ids[None, :]).astype(jnp.float32)  # [B, B]
    r = rewards.astype(jnp.float32)
    baseline = same @ r / same.sum(1)
    return jnp.where(action_mask.astype(bool), (r - baseline)[:, None], 0.0)


def advantages(logp_student: jax.Array, logp_teacher: jax.Array, action_mask: jax.Array, *, kl_coef: float = 1.0,
               outcome: jax.Array | None = None, outcome_weight: float = 0.0) -> jax.Array:
    """A_t = -kl_coef (logp_student - logp_teacher) + outcome_weight outcome_t [B, T]."""
    adv = sao.opd_advantages(logp_student, logp_teacher, action_mask, kl_coef=kl_coef)
    if outcome is not None and outcome_weight:
        adv = adv + outcome_weight * jnp.where(action_mask.astype(bool), outcome, 0.0)
    return adv


def topk_reverse_kl(logp_student_all: jax.Array, teacher_ids: jax.Array, teacher_logp: jax.Array,
                    action_mask: jax.Array) -> jax.Array:
    """Per-token KL(student || teacher) over the teacher's top-k tokens and one bucket for
    the rest of the vocabulary, 0 off action tokens [B, T].

    logp_student_all [B, T, N]: the student's log-probs of token t (position t, as
    `rl.teachers.score` aligns the teacher's); teacher_ids, teacher_logp [B, T, K] (true
    log-probs: their mass is at most 1). With s_k, t_k the two models' probabilities of the
    K ids and s_r = 1 - sum_k s_k, t_r = 1 - sum_k t_k the rest:
        KL = sum_k s_k (log s_k - log t_k) + s_r (log s_r - log t_r),
    a lower bound of the full KL (data processing) that is exact when the teacher's mass
    lies in its top k; mass the student puts outside them is penalised through s_r."""
    log_s = jnp.take_along_axis(logp_student_all.astype(jnp.float32), teacher_ids, axis=-1)  # [B, T, K]
    log_t = teacher_logp.astype(jnp.float32)

    def rest(logp):  # log(1 - sum_k p_k), kept finite when the top k hold (numerically) all the mass
        return jnp.log(jnp.clip(1.0 - jnp.exp(logp).sum(-1), 1e-6, 1.0))

    rest_s, rest_t = rest(log_s), rest(log_t)
    kl = jnp.sum(jnp.exp(log_s) * (log_s - log_t), axis=-1) + jnp.exp(rest_s) * (rest_s - rest_t)
    return jnp.where(action_mask.astype(bool), kl, 0.0)


def _student_logp_all(policy, tokens, temperature):
    logits = policy(tokens).logits[:, :-1] / temperature
    return jnp.pad(jax.nn.log_softmax(logits, axis=-1), ((0, 0), (1, 0), (0, 0)))  # [B, T, N]


def _distill_objective(policy, batch: sao.Batch, adv, weights, teacher_ids, teacher_logp, cfg):
    temperature = cfg.get("temperature", 1.0)
    logp, _ = token_logprobs(policy, batch.tokens, temperature)
    loss, aux = sao.sao_policy_loss(logp, batch.logp_rollout, adv, batch.action_mask, cfg["eps_low"],
                                    cfg["eps_high"], token_weights=weights)
    kl = topk_reverse_kl(_student_logp_all(policy, batch.tokens, temperature), teacher_ids, teacher_logp,
                         batch.action_mask)
    m = batch.action_mask.astype(jnp.float32)
    topk_kl = jnp.sum(kl * m) / jnp.maximum(m.sum(), 1.0)
    return loss + cfg["topk_weight"] * topk_kl, dict(aux, policy_loss=loss, topk_kl=topk_kl)


@functools.partial(nnx.jit, static_argnames=("cfg_items",))
def _distill_grads(policy, optimizer, batch, adv, weights, teacher_ids, teacher_logp, cfg_items):
    cfg = dict(cfg_items)
    (_, aux), grads = nnx.value_and_grad(
        lambda m: _distill_objective(m, batch, adv, weights, teacher_ids, teacher_logp, cfg),
        argnums=nnx.DiffState(0, optimizer.wrt), has_aux=True)(policy)
    finite = jnp.all(jnp.array([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
    finite &= jnp.isfinite(aux["policy_loss"]) & jnp.isfinite(aux["topk_kl"])
    return grads, dict(aux, grad_norm=optax.tree.norm(grads), finite=finite)


@nnx.jit
def _apply(policy, optimizer, grads):
    optimizer.update(policy, grads)


def distill_step(learner: Learner, batch: sao.Batch, adv: jax.Array, teacher_ids: jax.Array,
                 teacher_logp: jax.Array, cfg: Mapping[str, Any]) -> dict:
    """One update of `learner`'s policy with its optimizer on SAO's loss with the OPD
    advantages `adv` plus cfg["topk_weight"] x the top-k reverse KL (the variant). cfg:
    eps_low, eps_high, temperature, topk_weight. Returns host-side metrics (floats)."""
    keys = tuple(sorted((k, cfg[k]) for k in ("eps_low", "eps_high", "temperature", "topk_weight")))
    weights = sao.rollout_token_weights(batch.action_mask, batch.rollout_id)
    grads, aux = _distill_grads(learner.policy, learner.actor_opt, batch, adv, weights, teacher_ids, teacher_logp,
                                keys)
    learner.steps += 1
    if bool(aux.pop("finite")):
        _apply(learner.policy, learner.actor_opt, grads)
    else:  # a non-finite batch changes nothing, as in Learner.step
        learner.skipped += 1
        aux["skipped_nonfinite"] = 1.0
    return {k: float(np.asarray(v)) for k, v in aux.items()}
