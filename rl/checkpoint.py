"""Checkpoints of the RL loop: everything a killed run needs to continue exactly.

One orbax `CheckpointManager` (asynchronous saves, the newest `keep` retained) holds, per
step: the policy and critic parameters (and router biases), both optimizers' states, the
learner's step and skip counters, the task stream's position (grain iterator state), the
admission counters, the weight version and the base model's pass rate. Arrays go through
`StandardSave`; the small loop state through `JsonSave`.
"""

from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp
from flax import nnx


def _modules(policy, critic, learner) -> dict:
    out = {"policy": policy, "actor_opt": learner.actor_opt}
    if critic is not None:
        out.update(critic=critic, critic_opt=learner.critic_opt)
    return out


class LoopCheckpointer:
    def __init__(self, directory: str, keep: int = 2):
        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def save(self, step: int, *, policy, critic, learner, stream, admission, version: int, **extra) -> None:
        arrays = {k: nnx.state(m).to_pure_dict() for k, m in _modules(policy, critic, learner).items()}
        meta = {"step": step, "version": version, "learner_steps": learner.steps, "skipped": learner.skipped,
                "stream": stream.get_state(), "admission": admission.state_dict(), **extra}
        self.manager.save(step, args=ocp.args.Composite(arrays=ocp.args.StandardSave(arrays),
                                                         meta=ocp.args.JsonSave(meta)))

    def restore(self, *, policy, critic, learner, stream, admission) -> dict | None:
        """Loads the newest checkpoint into the given objects; returns its metadata, or None
        when there is none."""
        step = self.manager.latest_step()
        if step is None:
            return None
        modules = _modules(policy, critic, learner)
        abstract = {k: jax.tree.map(ocp.utils.to_shape_dtype_struct, nnx.state(m).to_pure_dict())
                    for k, m in modules.items()}
        restored = self.manager.restore(step, args=ocp.args.Composite(
            arrays=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
        for k, m in modules.items():
            state = nnx.state(m)
            nnx.replace_by_pure_dict(state, restored["arrays"][k])
            nnx.update(m, state)
        meta = restored["meta"]
        learner.steps, learner.skipped = meta["learner_steps"], meta["skipped"]
        stream.set_state(meta["stream"])
        admission.load_state_dict(meta["admission"])
        return meta

    def wait(self) -> None:
        self.manager.wait_until_finished()
