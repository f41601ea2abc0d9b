"""`glmjax-aot`: the SAO job's programs compiled ahead of time for a TPU slice, with their memory and FLOPs.

    glmjax-aot --config configs/glm53_sao.py --topology v5p:8x8x4 --json /tmp/glm53_aot.json
    glmjax-aot --config configs/glm53_sao.py --topology v5p:8x8x4 --json /tmp/aot4.json \\
        --config.model.num_hidden_layers=4
    glmjax-aot --config configs/sao_tiny.py --topology v5p:2x2x1 --config.mesh.fsdp=4 --json /tmp/tiny.json

No TPU is needed: libtpu describes the slice (`jax.experimental.topologies`), and each
program is lowered from abstract arguments (`jax.ShapeDtypeStruct`s in the job's
shardings; nothing of the model's size is allocated) and compiled for those chips, as
MaxText's train_compile does. The roles, each built the way rl/trainer.py builds it:

  learner_step    rl/learner.py's jitted steps of one `Learner.step` on a batch of
                  rl.batch_size x task.max_len: the critic phase (values, advantages and
                  the first critic update), each further critic update (rl.critic_steps > 1,
                  one program run again), the actor step (with the KL reference model
                  when rl.kl_coef > 0; updating the policy in place where the engine
                  decodes from a copy of it) and, with rl.mtp_lr > 0, the MTP step. They run one
                  after another on the same devices, so the role's bytes are
                  max over steps (the step's argument + output + temp - alias bytes, plus
                  the persistent state it does not take) where the persistent state is the
                  parameters and optimizer states of the policy, critic and reference.
  engine_prefill  GlmEngine's prefill of --prefill-rows new sequences of --prefill-len
                  tokens (default: rl.slots rows of the prompt budget's bucket, the
                  largest program `GlmEngine.warmup` compiles for the job).
  engine_decode   GlmEngine's decode step over all rl.slots slots.
  publish         the learner's policy resharded into the engine's layout, one program
                  (rl/engine/weights.py: reshard_program), beside the learner's persistent
                  state; `collective_bytes_per_device` (rl/hlo_collectives.py: what its
                  collectives bring each device) against `engine_share_bytes` (the
                  largest share of the engine's parameters a device holds).
The engine runs on the learner's mesh in one process, or on `rl.engine_mesh`'s devices
after the learner's; when the job spans hosts, over the whole slice (one host's chips
cannot hold a model of GLM-5's size); in the rules `rl.engine_rules` names.

Per role the JSON holds `bytes_per_device` (compiled memory analysis),
`planned_bytes_per_device` (rl/job_plan.py: role_bytes, the same layout),
`flops_per_device` (the compiled program's matmul FLOPs, each loop body counted once per
trip: rl/hlo_flops.py; XLA's own cost analysis, which counts a loop body once, is kept as
`xla_cost_analysis_flops_per_device`), `bytes_accessed_per_device` (cost analysis),
`analytic_flops_per_device` (rl/model_flops.py: the model's matmul FLOPs), the roofline
seconds on the chip's figures, and the compile seconds. `spmd_warnings` counts XLA's
"Involuntary full rematerialization" lines (a sharding the partitioner could only meet by
gathering a whole array). The exit status is 0 when every role fits the chip's HBM.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from glmjax import cli, distributed, sharding
from glmjax.model import GlmForCausalLM
from rl import hlo_collectives, hlo_flops, job_plan
from rl.model_flops import analytic_flops, learner_rows

GiB = 2 ** 30
REMAT_WARNING = "Involuntary full rematerialization"


@dataclasses.dataclass(frozen=True)
class Chip:
    peak_flops: float  # bf16 FLOP/s
    hbm_bandwidth: float  # bytes/s
    hbm_bytes: float


# Per chip, from the Cloud TPU system-architecture pages.
CHIPS = {
    "v5p": Chip(peak_flops=459e12, hbm_bandwidth=2765e9, hbm_bytes=95 * GiB),
    "v5e": Chip(peak_flops=197e12, hbm_bandwidth=819e9, hbm_bytes=16 * GiB),
    "v6e": Chip(peak_flops=918e12, hbm_bandwidth=1640e9, hbm_bytes=32 * GiB),
    "v4": Chip(peak_flops=275e12, hbm_bandwidth=1200e9, hbm_bytes=32 * GiB),
}


def chip_of(topology: str) -> Chip:
    name = topology.split(":")[0]
    if name not in CHIPS:
        raise ValueError(f"topology {topology!r}: no figures for chip {name!r}; known chips: {sorted(CHIPS)}")
    return CHIPS[name]


# The layouts ------------------------------------------------------------------------------
@dataclasses.dataclass
class Layout:
    """Where the job's pieces run on the slice: the learner's mesh and rules, the engine's."""

    mesh: jax.sharding.Mesh
    rules: sharding.Rules
    engine_mesh: jax.sharding.Mesh
    engine_rules: sharding.Rules
    engine_placement: str  # "learner's mesh", "the whole slice", "devices of its own"


def job_layout(job, devices) -> Layout:
    """The job's meshes over the topology's devices, as rl/trainer.py and
    glmjax/distributed.py build them over jax.devices()."""
    from rl.trainer import ENGINE_RULES

    cfg = job.raw
    sizes = {a: int(cfg.mesh.get(a, 1)) for a in sharding.AXES} if "mesh" in cfg else dict.fromkeys(sharding.AXES, 1)
    needed = math.prod(sizes.values())
    extra = 2 if job.rl.engine_mesh else 1
    if needed * extra > len(devices):
        raise ValueError(f"config.mesh ({_shown(sizes)}) needs {needed * extra} devices with the engine's; the "
                         f"topology has {len(devices)}")
    rules = distributed.job_rules(cfg)
    mesh = sharding.make_mesh(**sizes, devices=devices[:needed])
    engine_rules = sharding.rules_from(ENGINE_RULES[job.rl.engine_rules] or rules)
    hosts = len({d.process_index for d in mesh.devices.flat})
    processes = distributed.DistributedConfig.of(cfg).num_processes
    if job.rl.engine_mesh:
        own = sharding.parse_axes(job.rl.engine_mesh)
        return Layout(mesh, rules, sharding.make_mesh(**own, devices=devices[needed:2 * needed]), engine_rules,
                      "devices of its own")
    if hosts > 1:
        if processes == 1:
            raise ValueError(f"config.mesh ({_shown(sizes)}) spans {hosts} hosts of the topology and "
                             "distributed.num_processes=1: set it to the host count, or -1 (detected)")
        # A model of GLM-5's size does not fit one host's chips: the engine is one program over
        # the whole slice in its own rules (the learner's parameters resharded inside XLA), every
        # host running its share of each step.
        return Layout(mesh, rules, mesh, engine_rules, "the whole slice")
    return Layout(mesh, rules, mesh, engine_rules, "learner's mesh")


def _shown(sizes: dict) -> str:
    return ",".join(f"{a}={n}" for a, n in sizes.items() if n > 1) or "1 device"


def _abstract(tree, shardings):
    """ShapeDtypeStructs of `tree` (arrays, their shapes, or nnx Variables of them) laid out
    as `shardings` (a tree of NamedSharding whose leaves stand where `tree` has those)."""
    def one(s, x):
        if isinstance(x, nnx.Variable):
            return x.replace(value=jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s))
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)

    return jax.tree.map(one, shardings, tree)


def _place(objects, mesh, rules):
    """Abstract nnx objects (from nnx.eval_shape) whose variables hold ShapeDtypeStructs in
    the rules' shardings; their per-device bytes."""
    graphdef, state = nnx.split(objects)
    shardings = sharding.param_shardings(state, mesh, rules)
    placed = _abstract(state, shardings)
    return nnx.merge(graphdef, placed), per_device_bytes(placed)


def per_device_bytes(tree) -> int:
    """Bytes one device holds of a tree of sharded ShapeDtypeStructs (the largest shard)."""
    total = 0
    for x in jax.tree.leaves(tree):
        shard = x.sharding.shard_shape(x.shape)
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):  # a key is its key_data's uint32s
            shard = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(shard, x.dtype)).shape
            total += math.prod(shard) * 4
        else:
            total += math.prod(shard) * jnp.dtype(x.dtype).itemsize
    return total


# The learner's step -------------------------------------------------------------------------
@dataclasses.dataclass
class Program:
    name: str
    lower: callable  # () -> jax.stages.Lowered
    persistent_args: int  # per-device bytes of the persistent state among its arguments
    runs: int = 1  # times the role runs it (its FLOPs count that many times)
    collectives: bool = False  # report the bytes its collectives bring each device (a loop-free program)


def learner_programs(job, layout: Layout):
    """The jitted steps of one Learner.step (rl/learner.py), lowered from abstract policy,
    critic, reference and optimizer states; the persistent bytes per device; and whether
    the actor step updates the policy in place."""
    from rl import learner as rl_learner

    rl = job.rl
    mesh, rules = layout.mesh, layout.rules
    with sharding.use_mesh(mesh, rules):
        (policy, actor_opt, reference, critic, critic_opt, mtp_opt), persistent = _place(job_plan.learner_objects(job),
                                                                                          mesh, rules)
    batch = learner_batch(learner_rows(job), job.task.max_len, mesh, rules)
    weights = batch.logp_rollout
    bytes_of = lambda *objs: per_device_bytes([nnx.state(o) for o in objs if o is not None])  # noqa: E731
    programs = []
    if critic is not None:
        clipped = rl_learner.ALGORITHMS[rl.algorithm].clipped_value
        programs.append(Program("critic_phase", lambda: rl_learner._critic_phase.lower(
            critic, critic_opt, batch, weights, alpha=rl.alpha, gamma=rl.gamma, update=rl.critic_steps > 0,
            clipped=clipped), bytes_of(critic, critic_opt)))
        if rl.critic_steps > 1:
            programs.append(Program("critic_update", lambda: rl_learner._critic_update.lower(
                critic, critic_opt, batch, weights, weights, clipped=clipped), bytes_of(critic, critic_opt),
                runs=rl.critic_steps - 1))
    # as rl/trainer.py builds it: the policy updated in place where the engine decodes from copies
    in_place = engine_copies(policy, layout)
    actor = rl_learner._actor_step_in_place if in_place else rl_learner._actor_step
    programs.append(Program("actor_step", lambda: actor.lower(
        policy, actor_opt, reference, batch, weights, weights, None, rl=rl, distill=None),
        bytes_of(policy, actor_opt, reference)))
    if mtp_opt is not None:
        programs.append(Program("mtp_step", lambda: rl_learner._mtp_step.lower(
            policy, mtp_opt, batch.tokens, batch.action_mask), bytes_of(policy, mtp_opt)))
    return programs, persistent, in_place


def engine_copies(policy, layout: Layout) -> bool:
    """Whether the engine's parameters are a copy of the learner's (rl/engine/weights.py:
    WeightStore.copies): its split or devices differ."""
    state = nnx.state(policy)
    learner = sharding.param_shardings(state, layout.mesh, layout.rules)
    engine = sharding.param_shardings(state, layout.engine_mesh, layout.engine_rules)
    return any(not a.is_equivalent_to(b, x.ndim) for a, b, x in zip(jax.tree.leaves(learner), jax.tree.leaves(engine),
                                                                      jax.tree.leaves(state)))


def learner_batch(rows: int, length: int, mesh, rules):
    """An abstract rl/sao.py Batch of `rows` x `length`, split by rows over the batch axes
    (distributed.global_batch)."""
    from rl.sao import Batch

    def spec(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=distributed.batch_sharding(mesh, shape, rules))

    bt, b = (rows, length), (rows,)
    return Batch(tokens=spec(bt, jnp.int32), action_mask=spec(bt, jnp.float32), logp_rollout=spec(bt, jnp.float32),
                 versions=spec(bt, jnp.int32), rewards=spec(b, jnp.float32), values=spec(bt, jnp.float32),
                 rollout_id=spec(b, jnp.int32), segment_index=spec(b, jnp.int32))


# The engine ---------------------------------------------------------------------------------
def abstract_engine(job, layout: Layout):
    """GlmEngine (rl/engine/engine.py) over an abstract policy in its own layout, as
    rl/trainer.py's _engine builds it: slots, cache length and drafts from the job."""
    from rl.engine.engine import GlmEngine
    from rl.engine.weights import WeightStore

    rl = job.rl
    with sharding.use_mesh(layout.engine_mesh, layout.engine_rules):
        policy = nnx.eval_shape(lambda: GlmForCausalLM(job.model, rngs=nnx.Rngs(params=0)))
        state = nnx.state(policy)
        return GlmEngine(policy, weights=WeightStore(state), max_concurrent_decodes=rl.slots,
                         max_len=job.task.max_len + rl.num_draft, mesh=layout.engine_mesh, rules=layout.engine_rules,
                         num_draft=rl.num_draft)


def _engine_leaves(engine):
    state = engine.weights.latest().state
    return jax.tree.leaves(_abstract(state, engine.param_shardings))


def engine_decode_program(engine) -> Program:
    """The decode step over every slot (GlmEngine.generate)."""
    state = _abstract(jax.eval_shape(engine._zero_state), engine.state_shardings)
    version = jax.ShapeDtypeStruct((), jnp.int32)
    leaves = _engine_leaves(engine)

    def lower():
        with engine._on_mesh():
            return engine._generate_fn[False].lower(leaves, state, version, engine.max_concurrent_decodes)

    return Program("generate", lower, per_device_bytes(leaves) + per_device_bytes(state))


def engine_prefill_program(engine, rows: int, length: int) -> Program:
    """The prefill of `rows` new sequences padded to `length` (GlmEngine.prefill_batch):
    its input cache is `_empty_rows(rows)`, on every device of the engine."""
    from glmjax.cache import KVCache

    everywhere = NamedSharding(engine.mesh, PartitionSpec())
    cache = jax.eval_shape(lambda: KVCache.init(engine.config, rows, engine.max_len))
    if not engine._own_mtp:
        cache = cache._replace(mtp=None)
    cache = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=everywhere), cache)
    row = lambda dtype: jax.ShapeDtypeStruct((rows,), dtype, sharding=everywhere)  # noqa: E731
    keys = jax.eval_shape(lambda: jax.random.split(jax.random.key(0), rows))
    leaves = _engine_leaves(engine)
    args = (leaves, cache, jax.ShapeDtypeStruct((rows, length), jnp.int32, sharding=everywhere), row(jnp.int32),
            row(jnp.float32), row(jnp.int32), jax.ShapeDtypeStruct(keys.shape, keys.dtype, sharding=everywhere),
            jax.ShapeDtypeStruct((), jnp.int32))

    def lower():
        with engine._on_mesh():
            return engine._prefill_fn.lower(*args, top=False)

    return Program("prefill", lower, per_device_bytes(leaves))


def prefill_shape(job, engine, rows: int | None, length: int | None) -> tuple[int, int]:
    """(rows, bucket) of the prefill role: by default rl.slots rows of the bucket that
    holds the prompt budget (task.max_len - task.max_new_tokens)."""
    rows = rows or engine.max_concurrent_decodes
    rows = 1 << (rows - 1).bit_length()  # prefill_batch pads the batch to a power of two
    return rows, engine.bucket(length or max(job.task.max_len - job.task.max_new_tokens, 1))


# Compiling ----------------------------------------------------------------------------------
@contextlib.contextmanager
def captured_stderr():
    """fd 2 (XLA's C++ log as well as Python's) into a temporary file; yields a list that
    holds the captured text once the block ends."""
    out = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as f:
        os.dup2(f.fileno(), 2)
        try:
            yield out
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            f.seek(0)
            out.append(f.read().decode("utf-8", "replace"))


def compile_program(program: Program) -> dict:
    """Lowers and compiles one program; its memory and cost analyses per device."""
    start = time.perf_counter()
    try:
        with captured_stderr() as log:
            compiled = program.lower().compile()
    except jax.errors.JaxRuntimeError as err:  # libtpu refuses a program over the chip's HBM
        if "RESOURCE_EXHAUSTED" not in str(err):
            raise
        return _refused(program, str(err), time.perf_counter() - start, log[0] if log else "")
    seconds = time.perf_counter() - start
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    text = compiled.as_text()
    matmuls = hlo_flops.matmul_flops(text)
    moved = hlo_collectives.received_bytes(text, len(jax.tree.leaves(compiled.input_shardings)[0].device_set))["bytes"] \
        if program.collectives else None
    # a full-size program's compile holds gigabytes of host memory: let it go before the next
    del compiled
    jax.clear_caches()
    gc.collect()
    nbytes = (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
              - mem.alias_size_in_bytes)
    return {"name": program.name, "bytes_per_device": int(nbytes), "argument_bytes": int(mem.argument_size_in_bytes),
            "output_bytes": int(mem.output_size_in_bytes), "temp_bytes": int(mem.temp_size_in_bytes),
            "alias_bytes": int(mem.alias_size_in_bytes), "persistent_argument_bytes": int(program.persistent_args),
            "runs": program.runs, "flops_per_device": matmuls.flops,
            "xla_cost_analysis_flops_per_device": float(cost.get("flops", 0.0)),
            "unknown_trip_counts": len(matmuls.unknown_trip_counts),
            "bytes_accessed_per_device": float(cost.get("bytes accessed", 0.0)), "compile_seconds": seconds,
            "spmd_warnings": log[0].count(REMAT_WARNING),
            **({} if moved is None else {"collective_bytes_per_device": moved})}


_UNITS = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}


def _refused(program: Program, message: str, seconds: float, log: str) -> dict:
    """A program the compiler refused for want of HBM: its temporaries as the message gives
    them (e.g. "HLO temporaries (3.58T)"), no cost analysis."""
    import re

    found = re.search(r"temporaries \(([0-9.]+)([KMGT])\)", message)
    temp = int(float(found.group(1)) * _UNITS[found.group(2)]) if found else 0
    return {"name": program.name, "bytes_per_device": temp + int(program.persistent_args), "argument_bytes": 0,
            "output_bytes": 0, "temp_bytes": temp, "alias_bytes": 0,
            "persistent_argument_bytes": int(program.persistent_args), "runs": program.runs, "flops_per_device": 0.0,
            "xla_cost_analysis_flops_per_device": 0.0, "unknown_trip_counts": 0, "bytes_accessed_per_device": 0.0,
            "compile_seconds": seconds, "spmd_warnings": log.count(REMAT_WARNING),
            "compile_error": message.strip().splitlines()[0][:500]}


def combine(steps: list[dict], persistent: int) -> dict:
    """One role of programs run one after another on the same devices: the peak is the
    largest step's bytes plus the persistent state it does not take as arguments."""
    peak = max(s["bytes_per_device"] + persistent - s["persistent_argument_bytes"] for s in steps)
    return {"bytes_per_device": int(peak),
            "bytes_combined_as": "max over steps of (argument + output + temp - alias) + persistent bytes not "
                                 "among that step's arguments; steps run one after another",
            "persistent_bytes_per_device": int(persistent),
            "flops_per_device": sum(s["flops_per_device"] * s["runs"] for s in steps),
            "xla_cost_analysis_flops_per_device": sum(s["xla_cost_analysis_flops_per_device"] * s["runs"]
                                                      for s in steps),
            "bytes_accessed_per_device": sum(s["bytes_accessed_per_device"] * s["runs"] for s in steps),
            "compile_seconds": sum(s["compile_seconds"] for s in steps),
            "spmd_warnings": sum(s["spmd_warnings"] for s in steps), "steps": steps}


def _learner_role(job, layout, args):
    programs, persistent, in_place = learner_programs(job, layout)
    return programs, persistent, layout.mesh, {"rows": learner_rows(job), "length": job.task.max_len}, {
        "policy_in_place": in_place}


def _prefill_role(job, layout, args):
    engine = abstract_engine(job, layout)
    rows, length = prefill_shape(job, engine, args.prefill_rows, args.prefill_len)
    program = engine_prefill_program(engine, rows, length)
    return [program], program.persistent_args, layout.engine_mesh, {"rows": rows, "length": length}, {}


def _decode_role(job, layout, args):
    engine = abstract_engine(job, layout)
    program = engine_decode_program(engine)
    return [program], program.persistent_args, layout.engine_mesh, {"slots": job.rl.slots,
                                                                    "cache_length": engine.max_len,
                                                                    "tokens_per_slot": 1 + job.rl.num_draft}, {}


def publish_program(job, layout: Layout) -> tuple[Program, int, int]:
    """The publish (rl/trainer.py: Loop.publish): the policy in the learner's layout copied
    into the engine's split on the learner's devices (then, for an engine on devices of its
    own, moved shard for shard, which no program shows). Returns the program, the
    learner's persistent bytes per device and the engine's share per device."""
    from rl.engine.weights import _on_devices, reshard_program

    with sharding.use_mesh(layout.mesh, layout.rules):
        (policy, *others), persistent = _place(job_plan.learner_objects(job), layout.mesh, layout.rules)
    state = nnx.state(policy)
    devices = list(layout.mesh.devices.flat)
    target = sharding.param_shardings(state, layout.engine_mesh, layout.engine_rules)
    staged = jax.tree.map(lambda t: _on_devices(t, devices), target)
    share = per_device_bytes(_abstract(state, target))
    # an engine over every process's devices is stepped by the publisher's thread: the copy goes into
    # the previous one's buffers (rl/trainer.py: _engine), which the program takes as an argument
    if job.rl.engine_span == "job" and jax.tree.leaves(staged) == jax.tree.leaves(target):
        program, previous = reshard_program(state, staged, donate=True), _abstract(state, target)
        lower = lambda: program.lower(state, previous)  # noqa: E731
    else:
        program = reshard_program(state, staged)
        lower = lambda: program.lower(state)  # noqa: E731
    return Program("publish", lower, per_device_bytes(state), collectives=True), persistent, share


def _publish_role(job, layout, args):
    program, persistent, share = publish_program(job, layout)
    return [program], persistent, layout.mesh, {"engine_share_bytes": share}, {}


# role -> (job, layout, args) -> (programs, persistent bytes per device, mesh, the batch shape, the
# planner's keyword arguments for it)
ROLES = {"learner_step": _learner_role, "engine_prefill": _prefill_role, "engine_decode": _decode_role,
         "publish": _publish_role}


def run_role(name: str, job, layout: Layout, chip: Chip, args) -> dict:
    programs, persistent, mesh, shape, plan_args = ROLES[name](job, layout, args)
    rules = layout.rules if name == "learner_step" else layout.engine_rules
    # traced as the job traces them: under the ambient mesh and rules (the MoE layers'
    # expert-parallel dispatch, the activations' constraints), at the default matmul
    # precision a TPU job runs with
    with sharding.use_mesh(mesh, rules), jax.default_matmul_precision("default"):
        result = combine([compile_program(p) for p in programs], persistent)
    devices = mesh.size
    if name == "publish":  # the persistent state and the engine's new copy (the pieces are one block's share)
        share = shape["engine_share_bytes"]
        planned = {"persistent": persistent, "engine_copy": share, "total": persistent + share}
        result.update(engine_share_bytes=share,
                      collective_bytes_over_share=result["steps"][0]["collective_bytes_per_device"] / share)
    else:
        planned = job_plan.role_bytes(job, dict(mesh.shape), name, shape, rules=rules, **plan_args)
    analytic = 0.0 if name == "publish" else analytic_flops(job, name, devices, prefill=(shape.get("rows", 1),
                                                                                          shape.get("length", 1)))
    result.update(
        planned_bytes_per_device=int(planned["total"]), planned=planned,
        analytic_flops_per_device=analytic,
        roofline_seconds=max(result["flops_per_device"] / chip.peak_flops,
                             result["bytes_accessed_per_device"] / chip.hbm_bandwidth),
        devices=devices, mesh={a: n for a, n in mesh.shape.items() if n > 1}, shape=shape,
        fits=result["bytes_per_device"] <= chip.hbm_bytes)
    return result


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="glmjax-aot", description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--config", required=True, help="an RL job's config file, optionally `path:arg`")
    parser.add_argument("--topology", required=True, help="a TPU slice, e.g. v5p:8x8x4 (256 chips)")
    parser.add_argument("--json", required=True, help="where the report is written")
    parser.add_argument("--roles", default=",".join(ROLES), help=f"a comma-separated subset of {', '.join(ROLES)}")
    parser.add_argument("--prefill-rows", type=int, help="engine_prefill's sequences (default rl.slots)")
    parser.add_argument("--prefill-len", type=int, help="engine_prefill's tokens, padded to a bucket "
                                                        "(default the prompt budget, task.max_len - task.max_new_tokens)")
    return parser


def _check_job(cfg):
    """The RL job's typed config, without the checks that need the job's own devices."""
    from rl.config import JobConfig

    if "rl" not in cfg:
        raise ValueError("glmjax-aot compiles the RL job's programs: the config has no `rl` section (see "
                         "configs/glm53_sao.py)")
    n = cfg.distributed.num_processes if "distributed" in cfg else 1
    if n == 1 and distributed.mesh_devices(cfg) > len(jax.devices()):  # the slice's devices, not this machine's
        cfg = cfg.copy_and_resolve_references()
        cfg.distributed.num_processes = -1
    return JobConfig.from_config(cfg)


def main(argv=None) -> int:
    started = time.perf_counter()
    parser = make_parser()
    cfg, args = cli.load_job(parser, argv, check=_check_job)
    job = _check_job(cfg)
    job = dataclasses.replace(job, raw=cfg)
    roles = [r.strip() for r in args.roles.split(",") if r.strip()]
    unknown = sorted(set(roles) - set(ROLES))
    if unknown:
        parser.error(f"--roles names {unknown}: expected some of {', '.join(ROLES)}")
    from jax.experimental import topologies

    # kernel_impl="pallas" compiles the Mosaic kernels (pallas_kernels/tpu) for the slice's chips
    os.environ.setdefault("GLMJAX_PALLAS_BACKEND", "tpu")
    # the slice is described, not driven: another libtpu user on this machine is no conflict
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        chip = chip_of(args.topology)
        with captured_stderr():
            topo = topologies.get_topology_desc(args.topology, "tpu")
        layout = job_layout(job, list(topo.devices))
    except (ValueError, RuntimeError) as err:
        parser.error(f"--topology {args.topology}: {err}")
    report = {"config": args.config, "overrides": list(args.overrides), "topology": args.topology,
              "chips": len(topo.devices), "chip": dataclasses.asdict(chip) | {"name": args.topology.split(":")[0]},
              "mesh": {a: n for a, n in layout.mesh.shape.items() if n > 1},
              "engine_mesh": {a: n for a, n in layout.engine_mesh.shape.items() if n > 1},
              "engine_placement": layout.engine_placement, "engine_rules": job.rl.engine_rules,
              "remat": getattr(job.model, "remat", "none"), "scan_layers": getattr(job.model, "scan_layers", False),
              "hbm_bytes_per_device": int(chip.hbm_bytes), "roles": {}}
    for name in roles:
        t0 = time.perf_counter()
        result = run_role(name, job, layout, chip, args)
        report["roles"][name] = result
        print(f"glmjax-aot: {name}: {result['bytes_per_device'] / GiB:.2f} GiB/device compiled, "
              f"{result['planned_bytes_per_device'] / GiB:.2f} planned; {result['flops_per_device']:.3g} FLOPs/device "
              f"({result['analytic_flops_per_device']:.3g} analytic); {result['spmd_warnings']} SPMD warnings; "
              f"{time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    report["fits"] = all(r["fits"] for r in report["roles"].values())
    report["spmd_warnings"] = sum(r["spmd_warnings"] for r in report["roles"].values())
    report["wall_seconds"] = time.perf_counter() - started
    with open(args.json, "w") as f:
        json.dump(report, f, indent=2)
    return 0 if report["fits"] else 1


if __name__ == "__main__":
    sys.exit(main())
