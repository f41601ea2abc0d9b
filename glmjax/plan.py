"""Memory plan: per-device bytes of a configuration on a mesh, without allocating anything.

    python -m glmjax.plan --config configs/glm53.py --mesh fsdp=8,expert=8 --device-memory-gb 141
    python -m glmjax.plan --config configs/glm53.py --devices 256 --device-memory-gb 95 --search

An RL job's programs, each in the layout the job gives it, are planned by rl/job_plan.py
(`python -m rl.job_plan`) from the pieces here (`layer_activations`,
`learner_activations`), and compiled by `glmjax-aot` (rl/aot.py) beside that plan.

Parameters come from `jax.eval_shape` of the model and the sharding rules (exact).
Optimizer state is AdamW's two moments per parameter, in fp32 (plus an fp32 master copy
when parameters are stored in bf16) or, with --optimizer-dtype bfloat16, in bf16 with no
master copy; sharded like the parameters; gradients are one more
parameter-sized buffer. Training activations assume rematerialisation per decoder layer:
each layer's input is kept ([B/batch_shards, T/sequence, D] per layer) plus the working
set of the largest layer, estimated from the attention, indexer, MoE dispatch and LM-head
buffers. A KV cache (serving, rollouts) is what `glmjax.KVCache` holds per token: c_kv +
k_rope on every layer and the MTP layer, plus indexer keys on full-indexer layers, split
over the batch axes and the sequence axis.

RL puts every role on the same mesh, as one process (DESIGN: one parameter layout,
many roles):
  * the policy: parameters, optimizer state, gradients and activations as in training
    (optimizer state for every parameter: an upper bound, as the RL learner leaves the
    indexer and the MTP layer out);
  * the critic (value model, --critic): "separate" is what rl/learner.py builds, a copy of
    the trunk with a scalar head [D] and bias, with its own optimizer state; "shared" is
    the head alone on the policy's trunk; "none" for critic-free objectives (GRPO, OPD).
    The critic's and the actor's steps run one after the other, so they share one
    gradient buffer (the larger) and one activation working set;
  * the rollout engine: decodes from the policy's own arrays (publishing is a reference
    swap), so it adds only the KV cache of its slots (--slots x --rollout-len tokens);
  * teachers (--teachers, for on-policy distillation): the model in bf16, inference only;
    2 when the next teacher is prefetched onto the devices while one scores.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import sys

import jax
import numpy as np
from flax import nnx

from glmjax import sharding
from glmjax.cache import KVCache
from glmjax.config import ModelConfig
from glmjax.model import GlmForCausalLM
from pallas_kernels.reference import QUERY_BLOCK

GB = 1e9
CRITICS = ("separate", "shared", "none")


@dataclasses.dataclass
class Plan:
    mesh: dict[str, int]
    param_bytes_total: int
    params: float
    optimizer: float
    gradients: float
    activations: float
    kv_cache: float
    device_memory: float
    # RL: the roles beside the policy, whose share is params + optimizer + gradients + activations
    critic_params: float  # also the size of its gradients
    critic_optimizer: float
    rollout_kv_cache: float
    teacher: float
    settings: dict = dataclasses.field(default_factory=dict)

    @property
    def train_total(self) -> float:
        return self.params + self.optimizer + self.gradients + self.activations

    @property
    def serve_total(self) -> float:
        return self.params + self.kv_cache

    @property
    def rl_total(self) -> float:
        return (self.params + self.optimizer + max(self.gradients, self.critic_params) + self.activations
                + self.critic_params + self.critic_optimizer + self.rollout_kv_cache + self.teacher)

    @property
    def fits_training(self) -> bool:
        return self.train_total <= 0.9 * self.device_memory

    @property
    def fits_serving(self) -> bool:
        return self.serve_total <= 0.9 * self.device_memory

    @property
    def fits_rl(self) -> bool:
        return self.rl_total <= 0.9 * self.device_memory

    @property
    def fits(self) -> bool:
        return self.fits_training and self.fits_serving and self.fits_rl

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        out.update(train_total=self.train_total, serve_total=self.serve_total, rl_total=self.rl_total,
                   fits_training=self.fits_training, fits_serving=self.fits_serving, fits_rl=self.fits_rl)
        return out


def abstract_state(config: ModelConfig):
    return nnx.state(nnx.eval_shape(lambda: GlmForCausalLM(config, rngs=nnx.Rngs(params=0))))


def _bf16_state(config: ModelConfig, state):
    """The abstract state of the model in bf16 (a teacher's); `state` when it already is."""
    if config.param_dtype == "bfloat16":
        return state
    return abstract_state(config.replace(param_dtype="bfloat16", dtype="bfloat16"))


def _shards(spec, sizes) -> int:
    n = 1
    for entry in spec:
        for axis in () if entry is None else ((entry,) if isinstance(entry, str) else entry):
            n *= sizes[axis]
    return n


def _per_device(state, sizes, mesh, rules) -> tuple[float, float, float]:
    """(bytes in all, bytes per device, values per device) of a state's variables."""
    specs = sharding.param_specs(state, mesh=mesh, rules=rules)
    total = per_device = per_device_count = 0.0
    for var, spec in zip(jax.tree.leaves(state), jax.tree.leaves(specs, is_leaf=lambda x: isinstance(
            x, jax.sharding.PartitionSpec))):
        nbytes = var.size * var.dtype.itemsize
        total += nbytes
        per_device += nbytes / _shards(spec, sizes)
        per_device_count += var.size / _shards(spec, sizes)
    return total, per_device, per_device_count


def _optimizer_bytes(values: float, param_dtype: str, optimizer_dtype: str) -> float:
    if optimizer_dtype == "float32":  # two fp32 moments, and an fp32 master copy of bf16 weights
        return values * (8 + (4 if param_dtype != "float32" else 0))
    return values * 4  # two bf16 moments updating the weights in place


def kv_cache_bytes(config: ModelConfig, sequences: int, length: int, sizes: dict[str, int]) -> float:
    """Per-device bytes of a KVCache of `sequences` x `length` tokens (glmjax.cache)."""
    per_token = jax.eval_shape(lambda: KVCache.init(config, 1, 1)).bytes_per_token()
    batch_shards = math.prod(sizes[a] for a in sharding.BATCH_AXES)
    return per_token * sequences * length / batch_shards / sizes["sequence"]


def plan(config: ModelConfig, mesh_sizes: dict[str, int], *, device_memory: float, batch: int, seq: int,
         serve_batch: int, serve_len: int, optimizer_dtype: str = "float32", critic: str = "separate",
         teachers: int = 0, slots: int = 64, rollout_len: int | None = None, state=None, teacher_state=None,
         rules=None) -> Plan:
    """The per-device bytes of training, serving and RL (see the module docstring) of
    `config` on a mesh of `mesh_sizes`. state / teacher_state: the abstract states of the
    model and of its bf16 copy, when the caller has them."""
    if critic not in CRITICS:
        raise ValueError(f"critic={critic!r}: expected one of {CRITICS}")
    rollout_len = seq if rollout_len is None else rollout_len
    sizes = {a: mesh_sizes.get(a, 1) for a in sharding.AXES}
    mesh = jax.sharding.AbstractMesh(tuple(sizes.values()), sharding.AXES)
    state = abstract_state(config) if state is None else state
    total, per_device, per_device_count = _per_device(state, sizes, mesh, rules)
    optimizer = _optimizer_bytes(per_device_count, config.param_dtype, optimizer_dtype)
    gradients = per_device

    c = config
    act = np.dtype(c.dtype).itemsize
    batch_shards = math.prod(sizes[a] for a in sharding.BATCH_AXES)
    b, t = max(batch / batch_shards, 1), seq / sizes["sequence"]
    h_loc = c.num_attention_heads / sizes["tensor"]
    p = min(c.index_topk, seq)
    layer_inputs = c.num_hidden_layers * b * t * c.hidden_size * act
    attention = b * t * h_loc * (c.qk_head_dim + c.kv_lora_rank + c.v_head_dim) * act + \
        b * min(t, QUERY_BLOCK) * (p * (c.kv_lora_rank + c.qk_rope_head_dim) + h_loc * p) * 4
    indexer = b * min(t, QUERY_BLOCK) * seq * (c.index_n_heads / sizes["tensor"]) * 4
    moe = b * t * c.num_experts_per_tok * (c.hidden_size + 3 * c.moe_intermediate_size / sizes["tensor"]) * act
    head = 3 * b * t * c.vocab_size / sizes["tensor"] * 4
    activations = layer_inputs + max(attention + indexer, moe, head)

    # The value head [D] ("embed") and its bias [], fp32 (rl/learner.py: ValueModel).
    head_spec = sharding.logical_spec(("embed",), (c.hidden_size,), mesh=mesh, rules=rules)
    head_values = c.hidden_size / _shards(head_spec, sizes) + 1
    head_optimizer = _optimizer_bytes(head_values, "float32", optimizer_dtype)
    critic_params = critic_optimizer = 0.0
    if critic == "separate":
        critic_params, critic_optimizer = per_device + 4 * head_values, optimizer + head_optimizer
    elif critic == "shared":
        critic_params, critic_optimizer = 4 * head_values, head_optimizer

    teacher = 0.0
    if teachers:
        teacher_state = _bf16_state(c, state) if teacher_state is None else teacher_state
        teacher = teachers * _per_device(teacher_state, sizes, mesh, rules)[1]

    settings = dict(batch=batch, seq=seq, serve_batch=serve_batch, serve_len=serve_len, optimizer_dtype=optimizer_dtype,
                    critic=critic, teachers=teachers, slots=slots, rollout_len=rollout_len)
    return Plan(mesh=sizes, param_bytes_total=int(total), params=per_device, optimizer=optimizer,
                gradients=gradients, activations=activations,
                kv_cache=kv_cache_bytes(c, serve_batch, serve_len, sizes), device_memory=device_memory,
                critic_params=critic_params, critic_optimizer=critic_optimizer,
                rollout_kv_cache=kv_cache_bytes(c, slots, rollout_len, sizes), teacher=teacher, settings=settings)


# Training activations by remat policy (rl/job_plan.py plans the RL job's programs from these) --
def layer_activations(c: ModelConfig, layer: int | None, tokens: float, seq: int, keys: int, sizes) -> dict:
    """Per-device bytes of one decoder layer's forward intermediates on `tokens` local
    tokens (rows of `seq`, attending over `keys` keys): the matmul outputs a backward needs,
    the attention's query block and the expert-parallel exchange buffers."""
    act = np.dtype(c.dtype).itemsize
    h = c.num_attention_heads / sizes["tensor"]
    p = min(c.index_topk, keys)
    matmuls = c.q_lora_rank + h * c.qk_head_dim + c.kv_lora_rank + c.qk_rope_head_dim + 2 * h * c.kv_lora_rank + \
        h * c.v_head_dim + c.hidden_size
    block = min(seq, QUERY_BLOCK) * tokens / seq  # queries of one block in every local row
    attention = block * (p * (c.kv_lora_rank + c.qk_rope_head_dim) * act + h * p * 4)
    indexer = 0.0
    if layer is None or c.has_indexer(layer):
        matmuls += c.index_n_heads / sizes["tensor"] * c.index_head_dim + c.index_head_dim
        if c.index_topk < keys:
            indexer = block * keys * (c.index_n_heads / sizes["tensor"] + 1) * 4
    moe = c.mtp_is_moe if layer is None else c.is_moe(layer)
    ep = 0.0
    if moe:
        x, f = c.num_experts_per_tok, c.moe_intermediate_size / sizes["tensor"]
        copies = min(tokens, c.moe_chunk_tokens or tokens) * x  # one exchange's (moe_chunk_tokens)
        matmuls += 2 * c.shared_intermediate_size / sizes["tensor"] + c.n_routed_experts * 4 / act
        # layers/expert_parallel.py: experts split over expert x fsdp (over expert alone when E
        # does not divide); a device receives at most capacity x its copies, or without a
        # capacity factor every copy of every device (n_ep x copies rows): send, receive, the
        # experts' output and its return D wide, the grouped matmul's gate and up F wide
        n_ep = sizes["expert"] * sizes["fsdp"]
        if c.n_routed_experts % n_ep:
            n_ep = sizes["expert"]
        rows = copies * n_ep if n_ep > 1 and c.moe_capacity_factor is None else copies * (
            c.moe_capacity_factor or 1.0)
        ep = rows * (4 * c.hidden_size + 3 * f) * act if n_ep > 1 else rows * (c.hidden_size + 3 * f) * act
    else:
        matmuls += 3 * c.intermediate_size / sizes["tensor"]
    return {"saved_matmuls": tokens * matmuls * act, "attention": attention, "indexer": indexer, "moe": ep}


def gathered_layer_bytes(c: ModelConfig, layer: int, sizes) -> float:
    """Per-device bytes of one decoder layer's weights other than the routed experts, whole
    over fsdp as a step gathers them (split over `tensor` only): attention, indexer, the
    dense MLP or the shared expert, the router. The experts are not gathered
    (layers/expert_parallel.py)."""
    d, h, q, kv = c.hidden_size, c.num_attention_heads, c.q_lora_rank, c.kv_lora_rank
    mla = d * q + q * h * c.qk_head_dim + d * (kv + c.qk_rope_head_dim) + kv * h * (c.qk_nope_head_dim + c.v_head_dim) \
        + h * c.v_head_dim * d
    indexer = d * c.index_head_dim + q * c.index_n_heads * c.index_head_dim + d * c.index_n_heads \
        if c.has_indexer(layer) else 0
    mlp = 3 * d * (c.shared_intermediate_size if c.is_moe(layer) else c.intermediate_size)
    router = d * c.n_routed_experts * 4 if c.is_moe(layer) else 0  # fp32
    return (mla + indexer + mlp) / sizes["tensor"] * np.dtype(c.param_dtype).itemsize + router


def learner_activations(c: ModelConfig, rows: int, seq: int, sizes, head: bool = True,
                        logits_chunk: int | None = None) -> dict:
    """Per-device activation bytes of a training forward + backward over rows x seq, by
    `model.remat`: "full" keeps each layer's input and recomputes the layer in the
    backward, "matmuls" keeps the matmul outputs, "none" keeps every layer's working set.
    logits_chunk: positions per LM-head chunk (rl/learner.py: token_logprobs), or None for
    the head over the whole sequence at once. Beside the activations, the weights an FSDP
    step gathers whole with their whole gradients before the reduce-scatter: one layer's
    ("gathered_layer", `gathered_layer_bytes`) and, with the head, the LM head's [D, N]."""
    act = np.dtype(c.dtype).itemsize
    batch_shards = math.prod(sizes[a] for a in sharding.BATCH_AXES)
    tokens = max(rows / batch_shards, 1) * seq / sizes["sequence"]
    remat = getattr(c, "remat", "none")
    layers = [layer_activations(c, i, tokens, seq, seq, sizes) for i in range(c.num_hidden_layers)]
    working = max(sum(v for k, v in a.items()) for a in layers)
    if remat == "full":
        saved = c.num_hidden_layers * tokens * c.hidden_size * act
    elif remat == "matmuls":
        saved = sum(a["saved_matmuls"] for a in layers)
    else:
        saved = sum(sum(a.values()) for a in layers)
    chunk = max(rows / batch_shards, 1) * min(logits_chunk or seq, seq) / sizes["sequence"]
    logits = 3 * chunk * c.vocab_size / sizes["tensor"] * 4 if head else 0.0  # logits, log-softmax, its grad
    split = math.prod(sizes.values()) > sizes["tensor"]  # the weights are split beyond `tensor`: gathered
    gathered = 2 * max(gathered_layer_bytes(c, i, sizes) for i in range(c.num_hidden_layers)) if split else 0.0
    if head and split:
        logits += 2 * c.hidden_size * c.vocab_size / sizes["tensor"] * np.dtype(c.param_dtype).itemsize
    return {"saved": saved, "layer_working_set": 2 * working, "gathered_layer": gathered, "lm_head": logits}


def candidate_meshes(devices: int):
    """Meshes over fsdp / expert / tensor / data (stage and sequence 1) whose sizes are powers of two."""
    powers = [2 ** i for i in range(int(math.log2(devices)) + 1)]
    for tensor, expert, data in itertools.product(powers[:4], powers, powers):
        if devices % (tensor * expert * data) == 0:
            yield {"data": data, "fsdp": devices // (tensor * expert * data), "expert": expert, "tensor": tensor}


def search(config, devices, **kwargs):
    """The first mesh on which training, serving and RL fit, preferring the smallest RL
    total, then less tensor parallelism."""
    state = abstract_state(config)
    teacher_state = _bf16_state(config, state) if kwargs.get("teachers") else None
    plans = [plan(config, m, state=state, teacher_state=teacher_state, **kwargs) for m in candidate_meshes(devices)]
    fitting = [p for p in plans if p.fits]
    key = lambda p: (p.rl_total, p.mesh["tensor"])  # noqa: E731
    return (min(fitting, key=key) if fitting else min(plans, key=key)), plans


def format_plan(p: Plan) -> str:
    mesh = ", ".join(f"{k}={v}" for k, v in p.mesh.items() if v > 1) or "1 device"
    s = p.settings
    critic = {"separate": "own trunk + head", "shared": "head on the policy's trunk", "none": "none"}[s["critic"]]
    rows = [("parameters", p.params), ("optimizer (AdamW)", p.optimizer), ("gradients", p.gradients),
            ("activations (remat per layer)", p.activations), ("training total", p.train_total),
            ("serving KV cache", p.kv_cache), ("serving total", p.serve_total),
            (f"RL: critic ({critic})", p.critic_params), ("RL: critic optimizer", p.critic_optimizer),
            (f"RL: rollout KV cache ({s['slots']} x {s['rollout_len']})", p.rollout_kv_cache),
            (f"RL: teachers ({s['teachers']}, bf16)", p.teacher), ("RL total", p.rl_total)]
    lines = [f"mesh: {mesh}   (model {p.param_bytes_total / GB:,.1f} GB of parameters in all)"]
    lines += [f"  {name:<40s} {value / GB:10.2f} GB / device" for name, value in rows]
    verdict = lambda ok: "fits" if ok else "does NOT fit"  # noqa: E731
    lines.append(f"  device memory {p.device_memory / GB:.0f} GB: training {verdict(p.fits_training)}, serving "
                 f"{verdict(p.fits_serving)}, RL {verdict(p.fits_rl)} (90% budget)")
    return "\n".join(lines)


def main(argv=None):
    from glmjax import presets

    ap = argparse.ArgumentParser(prog="python -m glmjax.plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--mesh", default="", help="e.g. fsdp=8,expert=8,tensor=1")
    ap.add_argument("--devices", type=int, help="with --search: the device count")
    ap.add_argument("--search", action="store_true", help="try meshes and report the best that fits")
    ap.add_argument("--device-memory-gb", type=float, required=True)
    ap.add_argument("--param-dtype", default="bfloat16")
    ap.add_argument("--optimizer-dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--batch", type=int, default=64, help="training sequences per step (global)")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--serve-batch", type=int, default=64)
    ap.add_argument("--serve-len", type=int, default=131072)
    ap.add_argument("--critic", default="separate", choices=CRITICS,
                    help="RL value model: its own trunk, a head on the policy's, or none")
    ap.add_argument("--teachers", type=int, default=0,
                    help="RL: bf16 teachers on the devices at once (on-policy distillation)")
    ap.add_argument("--slots", type=int, default=64, help="RL: the rollout engine's concurrent sequences")
    ap.add_argument("--rollout-len", type=int, help="RL: tokens per rollout slot (default --seq)")
    ap.add_argument("--json", help="also write the plan(s) here")
    args, overrides = ap.parse_known_args(argv)
    config = presets.model_config_from(presets.load_config(args.config, overrides)).replace(
        param_dtype=args.param_dtype, dtype=args.param_dtype)
    kwargs = dict(device_memory=args.device_memory_gb * GB, batch=args.batch, seq=args.seq,
                  serve_batch=args.serve_batch, serve_len=args.serve_len, optimizer_dtype=args.optimizer_dtype,
                  critic=args.critic, teachers=args.teachers, slots=args.slots, rollout_len=args.rollout_len)
    if args.search:
        if not args.devices:
            ap.error("--search needs --devices")
        best, _ = search(config, args.devices, **kwargs)
        result = best
    else:
        try:
            mesh = sharding.parse_axes(args.mesh)
        except ValueError as err:
            ap.error(f"--mesh: {err}")
        result = plan(config, mesh, **kwargs)
    print(format_plan(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result.to_json(), f, indent=2)
    return 0 if result.fits else 1


if __name__ == "__main__":
    sys.exit(main())
