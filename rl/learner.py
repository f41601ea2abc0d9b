"""The learner: policy updates (SAO by default) and the value model that gives SAO its baseline.

One `Learner.step(batch)` (SAO, arXiv 2607.07508):
  1. values V(s_t) from the critic, a snapshot before any update;
  2. advantages (GAE, lambda_policy = 1 - 1/(alpha l)) and returns (lambda_critic = 1);
  3. K critic steps of masked MSE on those fixed returns (the first one's forward is step
     1's: values, advantages and returns come from it, detached, before its update);
  4. one actor step of the strict-band importance-sampling loss against the rollout
     log-probs (with `kl_coef` > 0, plus that times the KL to the starting policy), unless
     the critic is still warming up (the first `critic_warmup` steps);
     a batch whose loss or gradients are not finite is skipped and reported;
  5. with `mtp_lr` > 0, one step of the MTP layer's own loss (glmjax/train.mtp_loss) on
     the rollout's action tokens, so that its drafts keep up with the policy the engine
     speculates for (rl.num_draft). It reads the trunk's hidden states detached and has an
     optimizer of its own over the MTP layer only: the policy's update is unchanged.
The other algorithms of rl/algorithms.py replace steps 2 and 4 with their own advantages
(group baselines) or loss; distillation (rl/distill/) adds a teacher's KL to step 4.

The value model is the glmjax model with a scalar head on its last hidden state and
parameters of its own; with `freeze_critic_attention` only its MLP / MoE, norms,
embeddings and head train.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from glmjax import distributed
from glmjax import train as lm_train
from glmjax.model import GlmForCausalLM
from pallas_kernels.reference import map_query_blocks
from rl import sao
from rl.algorithms import ALGORITHMS
from rl.config import RLConfig
from rl.distill import losses as distill_losses
from rl.distill.losses import Distillation

LOGITS_CHUNK = 512  # positions per LM-head chunk in token_logprobs

_POLICY_PARAMS = nnx.All(nnx.Param, nnx.Not(nnx.PathContains("indexer")), nnx.Not(nnx.PathContains("mtp")))
_MTP_PARAMS = nnx.All(nnx.Param, nnx.PathContains("mtp"), nnx.Not(nnx.PathContains("indexer")))


class ValueModel(nnx.Module):
    """V(s_t) for every position: a scalar head on the backbone's normed last hidden state."""

    def __init__(self, backbone: GlmForCausalLM):
        self.backbone = backbone
        self.head = nnx.Param(jnp.zeros((backbone.config.hidden_size,), jnp.float32), logical_axes=("embed",))
        self.bias = nnx.Param(jnp.zeros((), jnp.float32), logical_axes=())

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """tokens [B, T] -> values [B, T]: values[t] estimates the return before token t is
        generated (read at position t - 1); values[0] is 0."""
        h = self.backbone.norm(self.backbone(tokens).hidden).astype(jnp.float32)
        v = jnp.einsum("BTD,D->BT", h, self.head[...]) + self.bias[...]
        return jnp.pad(v[:, :-1], ((0, 0), (1, 0)))


def token_logprobs(model: GlmForCausalLM, tokens: jax.Array, temperature: float = 1.0, route_replay=None,
                   with_routes: bool = False):
    """log p(tokens[t] | tokens[:t]) and the entropy of that distribution, [B, T]; 0 at t = 0.
    route_replay [B, T, L_moe, X] (the engine's experts per position, -1 where the routers
    choose): routing replay; with_routes: also the routers' own choice [B, T, L_moe, X].

    p is softmax(logits / temperature): the distribution the engine sampled from, so the
    importance ratio against its recorded log-probs is 1 for unchanged weights. The LM head
    runs over LOGITS_CHUNK positions at a time, each chunk rematerialised in the backward:
    the [B, T, N] logits (N = 154,880 for GLM-5: 5 GB per 8k-token sequence in fp32) never
    exist whole, only [B, LOGITS_CHUNK, N]."""
    b, t = tokens.shape
    replay = None if route_replay is None else jnp.transpose(route_replay, (2, 0, 1, 3))  # [L_moe, B, T, X]
    out = model(tokens, logits_at=jnp.zeros((b, 0), jnp.int32), route_replay=replay)  # the trunk: no head over T
    h = model.norm(out.hidden)[:, :-1]  # [B, T-1, D]: position t predicts token t + 1

    def chunk(h, targets):  # [B, C, D], [B, C] -> log-prob and entropy [B, C]
        logp_all = jax.nn.log_softmax(model.head(h) / temperature, axis=-1)  # [B, C, N]
        logp = jnp.take_along_axis(logp_all, targets[..., None], axis=-1)[..., 0]
        return logp, -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)

    logp, entropy = map_query_blocks(chunk, LOGITS_CHUNK, h, tokens[:, 1:])
    pad = lambda x: jnp.pad(x, ((0, 0), (1, 0)))  # noqa: E731
    if with_routes:
        return pad(logp), pad(entropy), jnp.transpose(out.routes, (1, 2, 0, 3))
    return pad(logp), pad(entropy)


def _buffers(x) -> set:
    """The device buffers of array `x`; an abstract or traced value (nnx.eval_shape) is its own."""
    if isinstance(x, jax.core.Tracer) or not isinstance(x, jax.Array):
        return {("object", id(x))}
    return {(s.device.id, s.data.unsafe_buffer_pointer()) for s in x.addressable_shards}


def _own_arrays(module, *others) -> None:
    """Gives `module` copies of the arrays whose device buffers it shares with `others`
    (nnx.clone shares the arrays; `jax.device_put` into an equivalent sharding gives a new
    array over the same buffers): a step that donates its arrays must not delete another
    module's."""
    shared = {b for other in others for x in jax.tree.leaves(nnx.state(other)) for b in _buffers(x)}
    state = nnx.state(module)
    if any(_buffers(x) & shared for x in jax.tree.leaves(state)):
        nnx.update(module, jax.tree.map(lambda x: jnp.copy(x) if _buffers(x) & shared else x, state))


def _optimizer(model, lr: float, clip: float, wrt, warmup: int = 0) -> nnx.Optimizer:
    """Adam with global-norm clipping; `warmup` > 0 ramps the rate linearly from 0 over that
    many updates (Adam's first steps move every parameter by about `lr`, whatever the
    gradient's scale, and a policy's first RL gradients are its noisiest)."""
    rate = optax.linear_schedule(0.0, lr, warmup) if warmup > 0 else lr
    tx = optax.chain(optax.clip_by_global_norm(clip), optax.adam(rate, b2=0.99))
    return nnx.Optimizer(model, tx, wrt=wrt)


def _policy_objective(policy, batch: sao.Batch, advantages, weights, rl, logp_ref=None, teacher=None, distill=None):
    """The algorithm's policy loss (rl/algorithms.py), plus rl.kl_coef x KL to the starting
    policy when a reference is given, plus the distillation term when a teacher is
    (`Distillation`)."""
    routes, mismatch = None, {}
    if teacher is None:
        replay = batch.routes if rl.routing_replay == "on" else None
        if batch.routes is None:
            logp, entropy = token_logprobs(policy, batch.tokens, rl.temperature)
        else:
            logp, entropy, routes = token_logprobs(policy, batch.tokens, rl.temperature, replay, with_routes=True)
        logp_all = None
    else:  # one forward for the sampled tokens' log-probs and the whole distribution
        logp_all, logp = distill_losses.student_logp_all(policy, batch.tokens, rl.temperature)
        entropy = None
    mask = batch.action_mask
    if routes is not None:
        mismatch = routing_mismatch(routes, batch.routes, mask, replayed=rl.routing_replay == "on")
    logp_old, weights, correction = rollout_correction(jax.lax.stop_gradient(logp), batch.logp_rollout, mask,
                                                       weights, rl)
    loss, aux = ALGORITHMS[rl.algorithm].loss(logp, logp_old, advantages, mask, weights, rl)
    m = mask.astype(jnp.float32)
    aux = dict(aux, **mismatch, **correction, policy_loss=loss)
    if entropy is not None:
        aux["entropy"] = jnp.sum(entropy * m) / jnp.maximum(m.sum(), 1.0)
    if logp_ref is not None:  # L + beta KL(pi_theta || pi_ref) (rl.kl_coef)
        kl = sao.reference_kl(logp, logp_ref, mask, token_weights=weights)
        loss = loss + rl.kl_coef * kl
        aux = dict(aux, kl_reference=kl)
    if teacher is not None:  # L + dist_weight x the mean per-token distribution-level KL to the teacher
        dist_kl = distill.kl(logp_all, teacher, mask)
        loss = loss + distill.dist_weight * dist_kl
        aux = dict(aux, dist_kl=dist_kl)
    return loss, aux


def routing_mismatch(own: jax.Array, engine: jax.Array, action_mask: jax.Array, replayed: bool) -> dict:
    """How the learner's routing compares with the engine's. own, engine [B, T, L_moe, X]
    (engine -1 where it ran nothing), action_mask [B, T]. Over the positions where the
    engine's experts are known:
      routing_mismatch_tokens  the fraction whose experts differ (as sets) in any MoE layer
      routing_mismatch_layers  the fraction of (position, layer) pairs that differ
    and routing_replayed: the fraction of the positions that score an action token (t - 1
    for action token t) at which the learner ran the engine's experts (1.0 with replay on
    and every such position recorded; 0.0 without replay)."""
    known = engine[..., 0, 0] >= 0  # [B, T]
    differs = jnp.any(jnp.sort(own, -1) != jnp.sort(engine.astype(own.dtype), -1), -1)  # [B, T, L_moe]
    k = known.astype(jnp.float32)
    n = jnp.maximum(k.sum(), 1.0)
    scoring = jnp.pad(action_mask[:, 1:] > 0, ((0, 0), (0, 1)))  # position t - 1 of each action token t
    replay = (known & scoring).sum() / jnp.maximum(scoring.sum(), 1) if replayed else jnp.float32(0.0)
    return {"routing_mismatch_tokens": jnp.sum(jnp.any(differs, -1) * k) / n,
            "routing_mismatch_layers": jnp.sum(differs.mean(-1) * k) / n, "routing_replayed": replay}


def rollout_correction(logp_learner, logp_rollout, action_mask, weights, rl):
    """The engine/learner gap and its correction (`rl.rollout_correction`; slime's --use-tis,
    verl's rollout correction). logp_learner [B, T] (this step's, before the update,
    detached), logp_rollout [B, T] the engine's. Returns (the log-probs the algorithm's
    ratio is taken against, the token weights, metrics):
      gap_t = log pi_learner(a_t) - log pi_engine(a_t)        on action tokens
      tis            w_t <- w_t min(exp(gap_t), C)
      sequence_mask  w_t <- w_t [exp(mean_t gap_t) in [1/C, C]]   per row
    both with the ratio pi_theta / pi_learner; "none" keeps pi_theta / pi_engine.
    logp_gap_mean / logp_gap_max: the mean and max |gap_t| over action tokens."""
    m = action_mask > 0
    gap = jnp.where(m, logp_learner.astype(jnp.float32) - logp_rollout.astype(jnp.float32), 0.0)
    metrics = {"logp_gap_mean": jnp.sum(jnp.abs(gap)) / jnp.maximum(m.sum(), 1),
               "logp_gap_max": jnp.max(jnp.abs(gap))}
    if rl.rollout_correction == "none":
        return logp_rollout, weights, metrics
    cap = rl.correction_cap
    if rl.rollout_correction == "tis":
        factor = jnp.minimum(jnp.exp(gap), cap)
        metrics["tis_weight_mean"] = jnp.sum(factor * m) / jnp.maximum(m.sum(), 1)
    else:
        mean = gap.sum(1) / jnp.maximum(m.sum(1), 1)  # [B] log of the geometric-mean ratio
        keep = jnp.abs(mean) <= jnp.log(cap)
        factor = jnp.broadcast_to(keep[:, None], gap.shape).astype(jnp.float32)
        rows = m.any(1)
        metrics["masked_rollouts"] = jnp.sum(rows & ~keep) / jnp.maximum(rows.sum(), 1)
    return logp_learner, weights * factor, metrics


def _actor_grads(policy, batch, advantages, weights, rl, reference=None, teacher=None, distill=None):
    logp_ref = None
    if reference is not None:
        logp_ref = jax.lax.stop_gradient(token_logprobs(reference, batch.tokens, rl.temperature)[0])
    (loss, aux), grads = nnx.value_and_grad(
        lambda m: _policy_objective(m, batch, advantages, weights, rl, logp_ref, teacher, distill),
        argnums=nnx.DiffState(0, _POLICY_PARAMS), has_aux=True)(policy)
    finite = jnp.isfinite(loss) & jnp.all(jnp.array([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
    return grads, dict(aux, grad_norm=optax.tree.norm(grads), finite=finite)


def _actor_update(policy, optimizer, reference, batch, advantages, weights, teacher, rl, distill):
    """Step 4 in one call: the objective's gradients (with a `reference` model, its KL term
    too; with a `teacher`, the distillation term), applied only when the loss and every
    gradient are finite (aux["finite"] says whether they were)."""
    def update(p, o, g):
        o.update(p, g)

    grads, aux = _actor_grads(policy, batch, advantages, weights, rl, reference, teacher, distill)
    nnx.cond(aux["finite"], update, lambda p, o, g: None, policy, optimizer, grads)
    return aux


# The optimizer states are donated: a step's new moments take the old ones' memory (at GLM-5's
# size, 2 bytes x 2 moments per parameter per device). The parameters are donated only where
# nothing else holds them (`Learner(donate_policy=True)`): where the engine decodes from the very
# arrays a step reads (publishing is a reference swap), they must outlive the step.
_actor_step = nnx.jit(_actor_update, static_argnames=("rl", "distill"), donate_argnames=("optimizer",))
_actor_step_in_place = nnx.jit(_actor_update, static_argnames=("rl", "distill"),
                               donate_argnames=("policy", "optimizer"))


def _critic_step(critic, optimizer, batch, returns, weights, clipped, targets=None):
    """One critic update toward `returns`; with `targets` (batch -> (advantages, returns)),
    the returns are computed inside from this forward's own values, detached: the values
    before any update, so the snapshot and the first update share one forward."""
    def loss_fn(c):
        values = c(batch.tokens)
        aux = {}
        rets = returns
        if targets is not None:
            snapshot = jax.lax.stop_gradient(values)
            adv, rets = targets(batch._replace(values=snapshot))
            aux = {"advantages": adv, "returns": rets, "values": snapshot}
        if clipped:
            loss = sao.ppo_value_loss(values, aux.get("values", batch.values), rets, batch.action_mask)
            return loss, dict(aux, value_loss=loss)
        loss, parts = sao.value_loss(values, rets, batch.action_mask, token_weights=weights)
        return loss, dict(aux, **parts, value_loss=loss)

    (_, aux), grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, optimizer.wrt), has_aux=True)(critic)
    optimizer.update(critic, grads)
    return aux


# The critic's parameters are the learner's alone: donated with its optimizer states. Each
# update is a program of its own, one forward and backward: the phase's peak is one update's.
@functools.partial(nnx.jit, static_argnames=("alpha", "gamma", "update", "clipped"),
                   donate_argnames=("critic", "optimizer"))
def _critic_phase(critic, optimizer, batch, weights, alpha, gamma, update, clipped):
    """Steps 1-2 and the first update of step 3 in one call: the critic's values (a
    snapshot before any update), the advantages and returns from them, then (`update`) one
    critic update toward those returns, whose forward is the snapshot's. Returns
    (advantages, values, returns, aux of the update)."""
    targets = lambda b: sao.sao_advantages(b, alpha=alpha, gamma=gamma)  # noqa: E731
    if not update:
        batch = batch._replace(values=critic(batch.tokens))
        adv, returns = targets(batch)
        return adv, batch.values, returns, {}
    aux = _critic_step(critic, optimizer, batch, None, weights, clipped, targets=targets)
    adv, returns, values = aux.pop("advantages"), aux.pop("returns"), aux.pop("values")
    return adv, values, returns, aux


@functools.partial(nnx.jit, static_argnames=("clipped",), donate_argnames=("critic", "optimizer"))
def _critic_update(critic, optimizer, batch, returns, weights, clipped):
    """Each further update of step 3, toward the phase's fixed returns."""
    return _critic_step(critic, optimizer, batch, returns, weights, clipped)


@functools.partial(nnx.jit, donate_argnames=("optimizer",))
def _mtp_step(policy, optimizer, tokens, action_mask):
    """Step 5: the MTP loss on the action tokens, its gradient on the MTP layer alone."""
    hidden = jax.lax.stop_gradient(policy(tokens).hidden)
    loss_fn = lambda m: lm_train.mtp_loss(m, hidden, tokens, action_mask)  # noqa: E731
    (loss, aux), grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, _MTP_PARAMS), has_aux=True)(policy)
    optimizer.update(policy, grads)
    return {"mtp_loss": loss, "mtp_accuracy": aux["accuracy"]}


# Dozens of small ops each (GAE scans, rollout sums): one compiled call.
_grpo_advantages = jax.jit(sao.grpo_advantages)
_token_weights = jax.jit(sao.rollout_token_weights)
_masked_mean = jax.jit(lambda x, mask: jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0))


class Learner:
    """Owns the actor's and the critic's optimizers; `step` is one update of the configured
    algorithm (rl/algorithms.py), reading its settings from `rl` (rl/config.py: RLConfig):
    eps_low, eps_high, alpha, gamma, actor_lr, critic_lr, critic_steps (K), critic_warmup,
    actor_warmup (linear ramp of actor_lr over that many actor updates),
    freeze_critic_attention, grad_clip, kl_coef (KL to the starting policy; 0 = off), mtp_lr
    (step 5; 0 = off), and the rollouts' sampling temperature (the policy's log-probs are
    taken at it).
    """

    def __init__(self, policy: GlmForCausalLM, critic: ValueModel | None, rl: RLConfig, *,
                 external_advantages: bool = False, distill: Distillation | None = None, actor_lr=None,
                 mesh: jax.sharding.Mesh | None = None, donate_policy: bool = False):
        """external_advantages: the caller passes `advantages` to every `step` (on-policy
        distillation, rl/distill/), so no value model is needed or trained. distill: the
        distribution-level KL to a teacher that every `step(..., teacher=...)` adds to the
        loss. actor_lr: an optax schedule in place of `rl.actor_lr`. mesh: the one the
        policy and critic are sharded on; each batch (host arrays, the same in every
        process) becomes global arrays split by rows over its batch axes. donate_policy:
        the actor step updates the policy's arrays in place (their memory reused for the
        new ones), for a caller that holds no other reference to them (rl/trainer.py: an
        engine that decodes from copies); by default the old arrays outlive the step."""
        if not isinstance(rl, RLConfig):
            raise TypeError(f"Learner takes an RLConfig (rl/config.py), got {type(rl).__name__}")
        self.algorithm = ALGORITHMS[rl.algorithm]
        needs_critic = self.algorithm.critic and not external_advantages
        if needs_critic and critic is None:
            raise ValueError(f"rl.algorithm={rl.algorithm!r} needs a value model")
        if distill is not None and not external_advantages:
            raise ValueError("distillation takes the caller's advantages: external_advantages=True")
        self.rl, self.distill = rl, distill
        self.policy, self.critic = policy, critic if needs_critic else None
        if self.critic is not None:  # donated at every update; a trunk cloned from the policy shares its arrays
            _own_arrays(self.critic, policy)
        clip = rl.grad_clip
        self.actor_opt = _optimizer(policy, rl.actor_lr if actor_lr is None else actor_lr, clip, _POLICY_PARAMS,
                                    rl.actor_warmup)
        self.critic_opt = None
        if self.critic is not None:
            wrt = nnx.All(nnx.Param, nnx.Not(nnx.PathContains("indexer")))
            if rl.freeze_critic_attention:
                wrt = nnx.All(wrt, nnx.Not(nnx.PathContains("attn")))
            self.critic_opt = _optimizer(self.critic, rl.critic_lr, clip, wrt)
        # rl.kl_coef > 0: a frozen copy of the starting policy (the base) for the KL term
        self.reference = nnx.clone(policy) if rl.kl_coef > 0 else None
        if self.reference is not None and donate_policy:
            _own_arrays(self.reference, policy)
        self.mtp_opt = None
        if rl.mtp_lr > 0:
            if policy.mtp is None:
                raise ValueError(f"rl.mtp_lr={rl.mtp_lr} trains the MTP layer; this model has none "
                                 "(model.num_nextn_predict_layers=0)")
            self.mtp_opt = _optimizer(policy, rl.mtp_lr, clip, _MTP_PARAMS)
        self.external_advantages = external_advantages
        self.mesh = mesh
        self.donate_policy = donate_policy
        self._bound = None
        self.steps = 0
        self.skipped = 0

    @property
    def _fns(self) -> dict:
        """The jitted steps with this learner's modules bound (nnx.cached_partial): the
        module graphs are walked once, not at every call, which on a small model costs more
        than the step's arithmetic. Variables are shared, so restores and updates show."""
        if self._bound is None:
            actor = _actor_step_in_place if self.donate_policy else _actor_step
            fns = {"actor_step": nnx.cached_partial(actor, self.policy, self.actor_opt, self.reference)}
            if self.critic is not None:
                fns["critic_phase"] = nnx.cached_partial(_critic_phase, self.critic, self.critic_opt)
                fns["critic_update"] = nnx.cached_partial(_critic_update, self.critic, self.critic_opt)
            if self.mtp_opt is not None:
                fns["mtp_step"] = nnx.cached_partial(_mtp_step, self.policy, self.mtp_opt)
            self._bound = fns
        return self._bound

    def step(self, batch: sao.Batch, group_ids=None, advantages=None, row_weights=None, teacher=None,
             share: distributed.RowShare | None = None) -> dict:
        """One update; returns host-side metrics (floats). A batch with non-finite rewards
        or rollout log-probs, or whose gradients are not finite, changes nothing.
        advantages [B, T]: the caller's own, in place of the configured algorithm's (only
        with `external_advantages`). row_weights [B]: a factor on each row's tokens in the
        loss (prioritized replay's importance weights). teacher: the teacher's distribution
        on the batch's tokens (rl/distill/teachers.py: score), with `distill`. The
        advantages used are kept in `last_advantages`. share: the batch holds only the rows
        this process's devices hold (glmjax/distributed.py: RowShare), and group ids are
        unique across processes."""
        if (advantages is not None) != self.external_advantages:
            raise ValueError(f"Learner.step: expected advantages={'[B, T]' if self.external_advantages else 'None'} "
                             f"(external_advantages={self.external_advantages}), got "
                             f"{'None' if advantages is None else 'an array'}")
        if (teacher is not None) != (self.distill is not None):
            raise ValueError("Learner.step: a teacher's distribution goes with a learner made with `distill`, "
                             "and only with one")
        mask = np.asarray(batch.action_mask)
        finite = bool(np.isfinite(np.asarray(batch.rewards)).all()
                      and np.isfinite(np.asarray(batch.logp_rollout)[mask > 0]).all())
        if share is not None and jax.process_count() > 1:  # each process saw its own rows: all skip, or none
            finite = all(distributed.gather_objects(finite))
        if not finite:
            self.skipped += 1
            return {"skipped_nonfinite": 1.0}
        rl, metrics = self.rl, {}
        if rl.routing_replay == "off" and batch.routes is not None:
            batch = batch._replace(routes=None)
        def place(x):
            return jnp.asarray(x) if self.mesh is None else distributed.global_batch(x, self.mesh, share=share)

        batch = distributed.global_batch(batch, self.mesh, share=share)
        weights = _token_weights(batch.action_mask, batch.rollout_id)
        if row_weights is not None:
            weights = weights * place(np.asarray(row_weights, np.float32)[:, None])
        if advantages is not None:
            adv = place(np.asarray(advantages, np.float32))
        elif self.critic is not None:
            clipped = self.algorithm.clipped_value
            adv, values, returns, aux = self._fns["critic_phase"](
                batch, weights, alpha=rl.alpha, gamma=rl.gamma, update=rl.critic_steps > 0, clipped=clipped)
            batch = batch._replace(values=values)
            for _ in range(rl.critic_steps - 1):
                aux = self._fns["critic_update"](batch, returns, weights, clipped=clipped)
            metrics.update(aux)
        else:
            if group_ids is None:
                raise ValueError(f"rl.algorithm={rl.algorithm!r} needs group_ids (G rollouts per prompt)")
            adv = _grpo_advantages(batch.rewards, place(np.asarray(group_ids)), batch.action_mask)
        self.last_advantages = adv
        warming = self.critic is not None and self.steps < rl.critic_warmup
        if not warming:
            if teacher is not None:
                teacher = tuple(place(np.asarray(x)) if self.mesh is not None else x for x in teacher)
            metrics.update(self._fns["actor_step"](batch, adv, weights, teacher, rl=rl, distill=self.distill))
        if self.mtp_opt is not None:
            metrics.update(self._fns["mtp_step"](batch.tokens, batch.action_mask))
        metrics = jax.device_get(metrics)  # one transfer
        if not warming and not metrics.pop("finite"):
            self.skipped += 1
            metrics["skipped_nonfinite"] = 1.0
        self.steps += 1
        metrics["critic_warmup"] = float(warming)
        metrics["advantage_mean"] = float(_masked_mean(adv, batch.action_mask.astype(jnp.float32)))
        return {k: float(v) for k, v in metrics.items()}
