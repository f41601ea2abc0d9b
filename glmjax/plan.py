"""Memory plan: per-device bytes of a configuration on a mesh, without allocating anything.

    python -m glmjax.plan --config configs/glm53.py --mesh fsdp=8,expert=8 --device-memory-gb 141
    python -m glmjax.plan --config configs/glm53.py --devices 256 --device-memory-gb 95 --search

Parameters come from `jax.eval_shape` of the model and the sharding rules (exact).
Optimizer state is AdamW's two moments per parameter, in fp32 (plus an fp32 master copy
when parameters are stored in bf16) or, with --optimizer-dtype bfloat16, in bf16 with no
master copy; sharded like the parameters; gradients are one more
parameter-sized buffer. Training activations assume rematerialisation per decoder layer:
each layer's input is kept ([B/batch_shards, T/sequence, D] per layer) plus the working
set of the largest layer, estimated from the attention, indexer, MoE dispatch and LM-head
buffers. The serving KV cache is c_kv + k_rope per token per layer plus indexer keys on
full-indexer layers, split over the batch axes and the sequence axis.
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
from glmjax.config import ModelConfig
from glmjax.model import GlmForCausalLM
from pallas_kernels.reference import QUERY_BLOCK

GB = 1e9


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

    @property
    def train_total(self) -> float:
        return self.params + self.optimizer + self.gradients + self.activations

    @property
    def serve_total(self) -> float:
        return self.params + self.kv_cache

    @property
    def fits_training(self) -> bool:
        return self.train_total <= 0.9 * self.device_memory

    @property
    def fits_serving(self) -> bool:
        return self.serve_total <= 0.9 * self.device_memory

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        out.update(train_total=self.train_total, serve_total=self.serve_total, fits_training=self.fits_training,
                   fits_serving=self.fits_serving)
        return out


def abstract_state(config: ModelConfig):
    return nnx.state(nnx.eval_shape(lambda: GlmForCausalLM(config, rngs=nnx.Rngs(params=0))))


def _shards(spec, sizes) -> int:
    n = 1
    for entry in spec:
        for axis in () if entry is None else ((entry,) if isinstance(entry, str) else entry):
            n *= sizes[axis]
    return n


def plan(config: ModelConfig, mesh_sizes: dict[str, int], *, device_memory: float, batch: int, seq: int,
         serve_batch: int, serve_len: int, optimizer_dtype: str = "float32", state=None, rules=None) -> Plan:
    sizes = {a: mesh_sizes.get(a, 1) for a in sharding.AXES}
    mesh = jax.sharding.AbstractMesh(tuple(sizes.values()), sharding.AXES)
    state = abstract_state(config) if state is None else state
    specs = sharding.param_specs(state, mesh=mesh, rules=rules)
    total = per_device = per_device_count = 0.0
    for var, spec in zip(jax.tree.leaves(state), jax.tree.leaves(specs, is_leaf=lambda x: isinstance(
            x, jax.sharding.PartitionSpec))):
        nbytes = var.size * var.dtype.itemsize
        total += nbytes
        per_device += nbytes / _shards(spec, sizes)
        per_device_count += var.size / _shards(spec, sizes)
    if optimizer_dtype == "float32":  # two fp32 moments, and an fp32 master copy of bf16 weights
        optimizer = per_device_count * (8 + (4 if config.param_dtype != "float32" else 0))
    else:  # two bf16 moments updating the weights in place
        optimizer = per_device_count * 4
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

    kv_per_token = sum((c.kv_lora_rank + c.qk_rope_head_dim + (c.index_head_dim if c.has_indexer(i) else 0)) * act
                       for i in range(c.num_hidden_layers))
    kv_cache = kv_per_token * serve_batch * serve_len / batch_shards / sizes["sequence"]
    return Plan(mesh=sizes, param_bytes_total=int(total), params=per_device, optimizer=optimizer,
                gradients=gradients, activations=activations, kv_cache=kv_cache, device_memory=device_memory)


def candidate_meshes(devices: int):
    """Meshes over fsdp / expert / tensor / data (stage and sequence 1) whose sizes are powers of two."""
    powers = [2 ** i for i in range(int(math.log2(devices)) + 1)]
    for tensor, expert, data in itertools.product(powers[:4], powers, powers):
        if devices % (tensor * expert * data) == 0:
            yield {"data": data, "fsdp": devices // (tensor * expert * data), "expert": expert, "tensor": tensor}


def search(config, devices, **kwargs):
    """The first fitting mesh, preferring more FSDP, then less tensor parallelism."""
    state = abstract_state(config)
    plans = [plan(config, m, state=state, **kwargs) for m in candidate_meshes(devices)]
    fitting = [p for p in plans if p.fits_training and p.fits_serving]
    key = lambda p: (p.train_total, p.mesh["tensor"])  # noqa: E731
    return (min(fitting, key=key) if fitting else min(plans, key=key)), plans


def format_plan(p: Plan) -> str:
    mesh = ", ".join(f"{k}={v}" for k, v in p.mesh.items() if v > 1) or "1 device"
    rows = [("parameters", p.params), ("optimizer (AdamW)", p.optimizer), ("gradients", p.gradients),
            ("activations (remat per layer)", p.activations), ("training total", p.train_total),
            ("serving KV cache", p.kv_cache), ("serving total", p.serve_total)]
    lines = [f"mesh: {mesh}   (model {p.param_bytes_total / GB:,.1f} GB of parameters in all)"]
    lines += [f"  {name:<32s} {value / GB:10.2f} GB / device" for name, value in rows]
    lines.append(f"  device memory {p.device_memory / GB:.0f} GB: training {'fits' if p.fits_training else 'does NOT fit'}"
                 f", serving {'fits' if p.fits_serving else 'does NOT fit'} (90% budget)")
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
    ap.add_argument("--json", help="also write the plan(s) here")
    args, overrides = ap.parse_known_args(argv)
    config = presets.model_config_from(presets.load_config(args.config, overrides)).replace(
        param_dtype=args.param_dtype, dtype=args.param_dtype)
    kwargs = dict(device_memory=args.device_memory_gb * GB, batch=args.batch, seq=args.seq,
                  serve_batch=args.serve_batch, serve_len=args.serve_len, optimizer_dtype=args.optimizer_dtype)
    if args.search:
        if not args.devices:
            ap.error("--search needs --devices")
        best, _ = search(config, args.devices, **kwargs)
        result = best
    else:
        mesh = {k: int(v) for k, v in (item.split("=") for item in args.mesh.split(",") if item)}
        unknown = set(mesh) - set(sharding.AXES)
        if unknown:
            ap.error(f"unknown mesh axes {sorted(unknown)}; axes are {sharding.AXES}")
        result = plan(config, mesh, **kwargs)
    print(format_plan(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result.to_json(), f, indent=2)
    return 0 if result.fits_training and result.fits_serving else 1


if __name__ == "__main__":
    sys.exit(main())
