"""The RL algorithms the learner runs: one table entry each, a policy loss and where its
advantages come from.

    ALGORITHMS["sao"] = Algorithm(loss=sao_loss, critic=True)

An entry's `loss(logp, logp_rollout, advantages, action_mask, token_weights, rl)` maps the
policy's log-probs of the rollout's tokens [B, T] to (scalar loss, aux metrics); `rl` is the
job's `RLConfig` (rl/config.py), from which it reads its coefficients. Advantages [B, T]
come from the value model (`critic=True`: GAE, rl/sao.py: sao_advantages) or from each
prompt's group of `rl.group_size` rollouts (`groups=True`: rl/sao.py: grpo_advantages).
A new algorithm is one loss function and one entry; `rl.algorithm=<name>` trains with it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax

from rl import sao

Loss = Callable[..., tuple[jax.Array, dict]]


@dataclasses.dataclass(frozen=True)
class Algorithm:
    loss: Loss
    critic: bool = False  # advantages from a value model, trained beside the policy
    groups: bool = False  # advantages from G rollouts of one prompt (rl.group_size >= 2)
    clipped_value: bool = False  # the critic's loss clipped around its pre-update values (PPO)

    def __post_init__(self):
        if self.critic == self.groups:
            raise ValueError("an algorithm takes its advantages from a value model (critic=True) or from groups "
                             "of rollouts (groups=True): exactly one")


def sao_loss(logp, logp_rollout, advantages, action_mask, token_weights, rl):
    """SAO's strict-band importance-sampling loss (rl/sao.py: sao_policy_loss)."""
    return sao.sao_policy_loss(logp, logp_rollout, advantages, action_mask, rl.eps_low, rl.eps_high,
                               token_weights=token_weights)


def ppo_loss(logp, logp_rollout, advantages, action_mask, token_weights, rl):
    """PPO's clipped surrogate, -min(r A, clip(r, 1 - eps, 1 + eps) A), token mean, eps =
    rl.eps_low; its critic's loss is clipped too (Schulman et al. 2017)."""
    return sao.clipped_surrogate_loss(logp, logp_rollout, advantages, action_mask, eps_low=rl.eps_low,
                                      eps_high=rl.eps_low)


def grpo_loss(logp, logp_rollout, advantages, action_mask, token_weights, rl):
    """GRPO's clipped surrogate, token mean per sequence then mean over sequences."""
    return sao.grpo_loss(logp, logp_rollout, advantages, action_mask, eps=rl.eps_low)


def dapo_loss(logp, logp_rollout, advantages, action_mask, token_weights, rl):
    """DAPO's token-level clipped surrogate with clip-higher (eps_high > eps_low)."""
    return sao.clipped_surrogate_loss(logp, logp_rollout, advantages, action_mask, eps_low=rl.eps_low,
                                      eps_high=rl.eps_high)


def gspo_loss(logp, logp_rollout, advantages, action_mask, token_weights, rl):
    """GSPO's sequence-ratio clipped surrogate."""
    return sao.gspo_loss(logp, logp_rollout, advantages, action_mask)


ALGORITHMS: dict[str, Algorithm] = {
    "sao": Algorithm(sao_loss, critic=True),
    "ppo": Algorithm(ppo_loss, critic=True, clipped_value=True),
    "grpo": Algorithm(grpo_loss, groups=True),
    "dapo": Algorithm(dapo_loss, groups=True),
    "gspo": Algorithm(gspo_loss, groups=True),
}
