"""On-policy distillation (OPD) from domain teachers: the per-token signal and its loss.

The student samples; the teacher of each prompt's domain (rl/distill/teachers.py) scores the
student's own tokens; the student learns to match it (GKD, Agarwal et al. 2024; Qwen3;
Thinking Machines' "On-Policy Distillation"; Xiaomi MiMo's multi-teacher MOPD):

    kl_t = logp_student(a_t) - logp_teacher(a_t)           a_t sampled by the student
    A_t  = -kl_coef kl_t + outcome_weight A^outcome_t
    L    = SAO's importance-weighted loss with these advantages (rl/sao.py, sao_policy_loss)
         [+ dist_weight mean_t D(student_t, teacher_t)]    a distribution-level variant

D compares the two next-token distributions at every position the student visited:
`topk` (the teacher's k most likely tokens plus a bucket for the rest; any vocabulary)
or `full` (the whole vocabulary; small vocabularies), with
    D = beta KL(student || teacher) + (1 - beta) KL(teacher || student)
(beta = 1: reverse KL, GKD's on-policy objective; beta = 0: forward KL on the student's
states, whose gradient p_s - p_t keeps pulling up the teacher's token even where the
student gives it almost no mass, which the reverse KL's p_s (log p_s - log p_t - KL)
does not).

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
  * the distribution-level variants are differentiated directly, not by the policy
    gradient: at each visited state the full reverse KL is the expectation the sampled
    kl_t estimates (its Rao-Blackwellised form), so it needs no importance ratio and no
    kl_coef; the sampled states only choose where the distributions are compared.
Pure functions of arrays; `Distillation` is the distribution-level term the learner adds to
its loss (rl/learner.py: Learner(..., distill=Distillation(...)), step(..., teacher=...)).
Shapes: B rows, T tokens, K top-k entries, N vocabulary.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from rl import sao


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


def topk_kl(logp_student_all: jax.Array, teacher_ids: jax.Array, teacher_logp: jax.Array,
            action_mask: jax.Array, beta: float = 1.0) -> jax.Array:
    """Per-token beta KL(student || teacher) + (1 - beta) KL(teacher || student) over the
    teacher's top-k tokens and one bucket for the rest of the vocabulary, 0 off action
    tokens [B, T].

    logp_student_all [B, T, N]: the student's log-probs of token t (position t, as
    `rl.distill.teachers.score` aligns the teacher's); teacher_ids, teacher_logp [B, T, K] (true
    log-probs: their mass is at most 1). With s_k, t_k the two models' probabilities of the
    K ids and s_r = 1 - sum_k s_k, t_r = 1 - sum_k t_k the rest:
        KL(s || t) = sum_k s_k (log s_k - log t_k) + s_r (log s_r - log t_r)
    (and KL(t || s) with the roles swapped), a lower bound of the full KL (data
    processing) that is exact when the teacher's mass lies in its top k; mass the student
    puts outside them is penalised through s_r."""
    log_s = jnp.take_along_axis(logp_student_all.astype(jnp.float32), teacher_ids, axis=-1)  # [B, T, K]
    log_t = teacher_logp.astype(jnp.float32)

    def rest(logp):  # log(1 - sum_k p_k), kept finite when the top k hold (numerically) all the mass
        return jnp.log(jnp.clip(1.0 - jnp.exp(logp).sum(-1), 1e-6, 1.0))

    log_s = jnp.concatenate([log_s, rest(log_s)[..., None]], axis=-1)  # [B, T, K + 1]
    log_t = jnp.concatenate([log_t, rest(log_t)[..., None]], axis=-1)
    return _mixed_kl(log_s, log_t, action_mask, beta)


def full_kl(logp_student_all: jax.Array, logp_teacher_all: jax.Array, action_mask: jax.Array,
            beta: float = 1.0) -> jax.Array:
    """Per-token beta KL(student || teacher) + (1 - beta) KL(teacher || student) over the
    whole vocabulary, 0 off action tokens [B, T]. logp_*_all [B, T, N]: log-probs of
    token t at position t (as `rl.distill.teachers.score` aligns them)."""
    return _mixed_kl(logp_student_all.astype(jnp.float32), logp_teacher_all.astype(jnp.float32), action_mask, beta)


def _mixed_kl(log_s, log_t, action_mask, beta):
    """beta KL(s || t) + (1 - beta) KL(t || s) over the last axis [B, T], 0 off action tokens."""
    kl = 0.0
    if beta > 0:
        kl = kl + beta * jnp.sum(jnp.exp(log_s) * (log_s - log_t), axis=-1)
    if beta < 1:
        kl = kl + (1.0 - beta) * jnp.sum(jnp.exp(log_t) * (log_t - log_s), axis=-1)
    return jnp.where(action_mask.astype(bool), kl, 0.0)


DISTRIBUTIONS = ("topk", "full")


def student_logp_all(policy, tokens, temperature):
    """log p_student(. | tokens[:t]) at position t [B, T, N] (0 at t = 0) and the
    log-prob of tokens[t] in it [B, T]: `rl.learner.token_logprobs` from the same forward."""
    logits = policy(tokens).logits[:, :-1] / temperature
    logp_all = jnp.pad(jax.nn.log_softmax(logits, axis=-1), ((0, 0), (1, 0), (0, 0)))
    logp = jnp.take_along_axis(logp_all, tokens[:, :, None], axis=-1)[..., 0]
    return logp_all, logp  # position 0's row is all 0, so its log-prob is 0 as there


@dataclasses.dataclass(frozen=True)
class Distillation:
    """The distribution-level term: dist_weight x the mean over action tokens of D(student_t,
    teacher_t), D = beta KL(s || t) + (1 - beta) KL(t || s) over the teacher's top k
    (`distribution="topk"`) or the whole vocabulary ("full")."""

    distribution: str = "full"
    beta: float = 0.0
    dist_weight: float = 1.0

    def __post_init__(self):
        if self.distribution not in DISTRIBUTIONS:
            raise ValueError(f"opd.distribution={self.distribution!r} is invalid: expected one of {DISTRIBUTIONS}")
        if not 0.0 <= self.beta <= 1.0:
            raise ValueError(f"opd.beta={self.beta} is invalid: expected 0 <= beta <= 1 (the reverse KL's share)")

    def kl(self, logp_all: jax.Array, teacher: tuple[jax.Array, ...], action_mask: jax.Array) -> jax.Array:
        """The mean per-token D over action tokens. teacher: (top-k ids, top-k log-probs)
        [B, T, K] for "topk", or (log-probs of the whole vocabulary,) [B, T, N] for "full"
        (rl/distill/teachers.py: score)."""
        if self.distribution == "topk":
            kl = topk_kl(logp_all, *teacher, action_mask, self.beta)
        else:
            kl = full_kl(logp_all, *teacher, action_mask, self.beta)
        m = action_mask.astype(jnp.float32)
        return jnp.sum(kl * m) / jnp.maximum(m.sum(), 1.0)
