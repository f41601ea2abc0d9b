"""The RL job's programs planned, each in the layout the job gives it: per-device bytes of
the learner step and of the engine's prefill and decode, from the abstract modules and
glmjax/plan.py's activation model; what `glmjax-aot` (rl/aot.py) compiles beside them.

    python -m rl.job_plan --config configs/glm53_sao.py:h200 --device-memory-gb 141

The learner's persistent state is exact (nnx.eval_shape of the policy, its Adam state, the
KL reference, the critic and its state as rl/learner.py builds them); a step adds the
updated parameters beside the old ones (the optimizer states are donated), the gradients
and the activations by `model.remat`; the engine holds the parameters in its rules, the
cache of its slots and one layer's working set.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import jax
import numpy as np
from flax import nnx

from glmjax import distributed, plan, presets, sharding
from glmjax.cache import KVCache
from glmjax.model import GlmForCausalLM
from rl import learner as rl_learner
from rl.config import JobConfig
from rl.learner import _MTP_PARAMS, _POLICY_PARAMS, LOGITS_CHUNK

ROLES = ("learner_step", "engine_prefill", "engine_decode")


def learner_objects(job):
    """The learner's modules as rl/trainer.py builds them, abstract (nnx.eval_shape): the
    policy, its optimizer (rl/learner.py: Adam over the policy's parameters less the
    indexer and MTP layer, moments in the parameters' dtype), the KL reference (a copy of
    the policy, rl.kl_coef > 0), the critic (ValueModel over a copy of the whole policy,
    rl.uses_critic) and its optimizer, the MTP layer's optimizer (rl.mtp_lr > 0)."""
    rl = job.rl

    def build():
        policy = GlmForCausalLM(job.model, rngs=nnx.Rngs(params=0))
        critic = rl_learner.ValueModel(nnx.clone(policy)) if rl.uses_critic else None
        learner = rl_learner.Learner(policy, critic, rl)
        return (policy, learner.actor_opt, learner.reference, learner.critic, learner.critic_opt, learner.mtp_opt)

    return nnx.eval_shape(build)


def _state_bytes(obj, sizes, mesh, rules, wrt=None) -> float:
    """Per-device bytes of an abstract module's variables (those `wrt` filters, if given)."""
    if obj is None:
        return 0.0
    state = nnx.state(obj, wrt) if wrt is not None else nnx.state(obj)
    return plan._per_device(state, sizes, mesh, rules)[1]


def role_bytes(job, mesh_sizes: dict[str, int], role: str, shape: dict, *, rules=None, objects=None,
               policy_in_place: bool = False) -> dict:
    """Planned per-device bytes of one role of the RL job (`job`: rl/config.py JobConfig)
    on a mesh of `mesh_sizes` under `rules`: its parts and their "total".

    learner_step (shape rows, length): the persistent state (exact, from the abstract
    modules: policy, Adam states, reference, critic), then the larger of the two steps'
    extra bytes (they run one after the other): the gradients, updated copies of the
    policy's trained parameters unless `policy_in_place` (the engine decodes from copies,
    so rl/learner.py donates them; the critic's and the optimizer states are always
    donated), and the activations (`learner_activations`; the critic's without the LM head).
    engine_prefill (rows, length): parameters in the engine's layout, the empty input cache
    on every device, the written cache split per slot, and the forward's working set.
    engine_decode (slots, cache_length, tokens_per_slot): parameters, the decode state
    (updated in place: donated), the logits and one layer's working set."""
    if role not in ROLES:
        raise ValueError(f"role={role!r}: expected one of {ROLES}")
    c = job.model
    sizes = {a: mesh_sizes.get(a, 1) for a in sharding.AXES}
    mesh = jax.sharding.AbstractMesh(tuple(sizes.values()), sharding.AXES)
    if role == "learner_step":
        policy, actor_opt, reference, critic, critic_opt, mtp_opt = objects or learner_objects(job)
        b = lambda obj, wrt=None: _state_bytes(obj, sizes, mesh, rules, wrt)  # noqa: E731
        parts = {"policy": b(policy), "actor_optimizer": b(actor_opt), "reference": b(reference),
                 "critic": b(critic), "critic_optimizer": b(critic_opt), "mtp_optimizer": b(mtp_opt)}
        persistent = sum(parts.values())
        rows, seq = shape["rows"], shape["length"]
        actor_trained = b(policy, _POLICY_PARAMS)
        actor_act = plan.learner_activations(c, rows, seq, sizes, logits_chunk=LOGITS_CHUNK)
        # a step's gradients, and its new parameters beside the old unless the old are donated
        # (the critic's always, the policy's with policy_in_place); the new optimizer states
        # take the donated old ones' place
        steps = {"actor_step": (1 if policy_in_place else 2) * actor_trained + sum(actor_act.values())}
        if critic is not None:
            critic_trained = b(critic, critic_opt.wrt)
            critic_act = plan.learner_activations(c, rows, seq, sizes, head=False)
            steps["critic_phase"] = critic_trained + sum(critic_act.values())  # and each critic_update
        if mtp_opt is not None:
            steps["mtp_step"] = 2 * b(policy, _MTP_PARAMS) + sum(actor_act.values())
        parts.update(activations=actor_act, step_extra=steps, total=persistent + max(steps.values()))
        return parts
    state = plan.abstract_state(c)
    params = plan._per_device(state, sizes, mesh, rules)[1]
    batch_shards = math.prod(sizes[a] for a in sharding.BATCH_AXES)
    act = np.dtype(c.dtype).itemsize
    per_token = jax.eval_shape(lambda: KVCache.init(c, 1, 1)).bytes_per_token()
    if role == "engine_prefill":
        rows, length = shape["rows"], shape["length"]
        cache_len = job.task.max_len + job.rl.num_draft
        empty = per_token * rows * cache_len  # rl/engine/engine.py: _empty_rows, on every device
        written = per_token * rows * cache_len / min(batch_shards, rows)
        tokens = rows * length / min(batch_shards, rows)
        layer = max(sum(plan.layer_activations(c, i, tokens, length, length, sizes).values())
                    for i in range(c.num_hidden_layers))
        head = 2 * rows * c.vocab_size / sizes["tensor"] * 4
        parts = {"params": params, "input_cache": empty, "output_cache": written,
                 "forward": 2 * tokens * c.hidden_size * act + layer, "logits": head}
    else:
        slots, cache_len, fed = shape["slots"], shape["cache_length"], shape["tokens_per_slot"]
        cache = per_token * slots * cache_len / min(batch_shards, slots)
        draft = slots * (fed - 1) * c.vocab_size * 4 / min(batch_shards, slots)
        tokens = slots * fed / min(batch_shards, slots)
        layer = max(sum(plan.layer_activations(c, i, tokens, fed, cache_len, sizes).values())
                    for i in range(c.num_hidden_layers))
        logits = 3 * tokens * c.vocab_size * 4
        parts = {"params": params, "decode_state": cache + draft, "forward": layer, "logits": logits}
    parts["total"] = sum(v for v in parts.values())
    return parts


def job_roles(cfg, devices_per_host: int) -> dict:
    """role_bytes of every role of an RL job config: the learner on the job's mesh; the
    engine there too (a job of one process), or over the whole slice when the job spans
    hosts (as glmjax-aot compiles it: one host's chips cannot hold a model of GLM-5's size)."""


    if distributed.DistributedConfig.of(cfg).num_processes == 1 and distributed.mesh_devices(cfg) > len(
            jax.devices()):
        cfg = cfg.copy_and_resolve_references()
        cfg.distributed.num_processes = -1  # planned for the job's devices, not this machine's
    job = JobConfig.from_config(cfg)
    sizes = {a: int(cfg.mesh.get(a, 1)) for a in sharding.AXES}
    rules = distributed.job_rules(cfg)
    engine_rules = sharding.DECODE_RULES if job.rl.engine_rules == "decode" else rules
    rl, task = job.rl, job.task
    rows = rl.batch_size * (rl.compaction.max_segments if rl.compaction.enabled else 1)
    slots = 1 << (rl.slots - 1).bit_length()
    prompt = 1 << (max(task.max_len - task.max_new_tokens, 1) - 1).bit_length()
    shapes = {"learner_step": {"rows": rows, "length": task.max_len},
              "engine_prefill": {"rows": slots, "length": min(max(prompt, 16), task.max_len + rl.num_draft)},
              "engine_decode": {"slots": rl.slots, "cache_length": task.max_len + rl.num_draft,
                                "tokens_per_slot": 1 + rl.num_draft}}
    del devices_per_host  # the engine spans the slice whatever a host holds
    # the engine decodes from a copy when its rules or devices are its own: the learner updates in place
    in_place = engine_rules is not rules or bool(rl.engine_mesh)
    return {role: dict(role_bytes(job, sizes, role, shapes[role],
                                  rules=rules if role == "learner_step" else engine_rules, policy_in_place=in_place),
                       mesh={a: n for a, n in sizes.items() if n > 1}, shape=shapes[role]) for role in ROLES}


def main(argv=None) -> int:


    ap = argparse.ArgumentParser(prog="python -m rl.job_plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="an RL job's config file, optionally `path:arg`")
    ap.add_argument("--device-memory-gb", type=float, required=True)
    ap.add_argument("--json", help="also write the plan here")
    args, overrides = ap.parse_known_args(argv)
    path, _, arg = args.config.partition(":")
    roles = job_roles(presets.load_config(path, overrides, arg or None), devices_per_host=1)
    budget = args.device_memory_gb * plan.GB
    for role, parts in roles.items():
        verdict = "fits" if parts["total"] <= budget else "does NOT fit"
        print(f"{role:<16s} {parts['total'] / plan.GB:9.2f} GB / device on {parts['mesh']}: {verdict} in "
              f"{args.device_memory_gb:.0f} GB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(roles, f, indent=2)
    return 0 if all(p["total"] <= budget for p in roles.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
