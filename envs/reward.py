"""The reward function the RL loop calls, with optional shaping by task difficulty.

    r = reward(raw, task, RewardConfig(shaping="difficulty", alpha=0.5))

``raw`` is the verifier's reward in [0, 1]. Shaping multiplies it by a weight, so a
failed run (0) stays 0 and the three checks keep their meaning after shaping:

- ``"none"``: ``raw``.
- ``"difficulty"``: weight ``1 + alpha * (d - 1) / 4`` for difficulty ``d`` in 1..5: a
  solved hard task is worth up to ``1 + alpha`` times a solved easy one.
- ``"pass_rate"``: weight ``1 + alpha * (1 - p)``, ``p`` the task's (or its difficulty
  level's) running pass rate, which the caller tracks and passes in; tasks the policy
  rarely solves are worth more, whatever their nominal difficulty.

``normalize=True`` divides by ``1 + alpha`` so shaped rewards stay in [0, 1] (useful for
value models trained on a fixed scale).
"""

from __future__ import annotations

import dataclasses

from envs.base import Task

SHAPINGS = ("none", "difficulty", "pass_rate")


@dataclasses.dataclass(frozen=True)
class RewardConfig:
    shaping: str = "none"
    alpha: float = 0.5
    normalize: bool = False

    def __post_init__(self):
        if self.shaping not in SHAPINGS:
            raise ValueError(f"RewardConfig.shaping must be one of {SHAPINGS}, got {self.shaping!r}")
        if self.alpha < 0:
            raise ValueError(f"RewardConfig.alpha must be >= 0, got {self.alpha}")


def weight(task: Task, config: RewardConfig, pass_rate: float | None = None) -> float:
    if config.shaping == "none":
        return 1.0
    if config.shaping == "difficulty":
        w = 1.0 + config.alpha * (task.difficulty - 1) / 4
    else:
        if pass_rate is None or not 0.0 <= pass_rate <= 1.0:
            raise ValueError(f"shaping 'pass_rate' needs a pass_rate in [0, 1] for {task.id}, got {pass_rate!r}")
        w = 1.0 + config.alpha * (1.0 - pass_rate)
    return w / (1.0 + config.alpha) if config.normalize else w


def reward(raw: float, task: Task, config: RewardConfig = RewardConfig(), pass_rate: float | None = None) -> float:
    if not 0.0 <= raw <= 1.0:
        raise ValueError(f"raw reward for {task.id} must be in [0, 1], got {raw}")
    return raw * weight(task, config, pass_rate)
