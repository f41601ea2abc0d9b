"""Hugging Face checkpoints in and out: the one place the parameter layout is converted.

`from_pretrained` reads config.json and safetensors (one file, or shards with
`model.safetensors.index.json`), with experts per tensor as on disk
(`mlp.experts.K.gate_proj.weight`) or fused as transformers holds them in memory
(`mlp.experts.gate_up_proj` [E, 2F, D], `mlp.experts.down_proj` [E, D, F]), and the MTP layer
stored as `model.layers.{num_hidden_layers}`. `save_pretrained` writes the per-expert layout
that transformers >= 5.24 loads.

Layout changes (HF -> glmjax): linear weights [out, in] -> [in, out]; q_b_proj / wq_b
[H*E, Q] -> [Q, H, E]; o_proj [D, H*V] -> [H, V, D]; kv_b_proj [H*(K+V), C] split into
W_UK [C, H, K] and W_UV [C, H, V]; experts stacked to [E, D, F] / [E, F, D].
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from glmjax.config import ModelConfig
from glmjax.layers.decoder import DecoderLayer
from glmjax.layers.moe import MoE
from glmjax.model import GlmForCausalLM

log = logging.getLogger(__name__)

_NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
SHARD_BYTES = 5 * 2**30


# Conversions between a glmjax array and its HF tensor ----------------------------------
def _same(x):
    return x


def _t(x):
    return np.swapaxes(x, -1, -2)


def _heads_out_to_hf(x):  # [Q, H, E] -> [H*E, Q]
    return x.reshape(x.shape[0], -1).T


def _heads_in_to_hf(x):  # [H, V, D] -> [D, H*V]
    return x.reshape(-1, x.shape[-1]).T


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One HF tensor <-> one glmjax Variable."""

    name: str
    var: nnx.Variable
    to_hf: Callable[[np.ndarray], np.ndarray]
    from_hf: Callable[[np.ndarray], np.ndarray]

    @property
    def hf_shape(self) -> tuple[int, ...]:
        return tuple(jax.eval_shape(self.to_hf, jax.ShapeDtypeStruct(self.var.shape, np.float32)).shape)


def _linear(name, var):
    return Tensor(name, var, _t, _t)


def _vector(name, var):
    return Tensor(name, var, _same, _same)


def _heads_out(name, var):
    shape = var.shape
    return Tensor(name, var, _heads_out_to_hf, lambda w: w.T.reshape(shape))


def _heads_in(name, var):
    shape = var.shape
    return Tensor(name, var, _heads_in_to_hf, lambda w: w.T.reshape(shape))


def _layer_tensors(prefix: str, layer: DecoderLayer) -> Iterator[Tensor]:
    """Every tensor of a decoder block except kv_b_proj and the experts (handled apart)."""
    a = layer.attn
    yield _vector(prefix + "input_layernorm.weight", layer.input_norm.weight)
    yield _vector(prefix + "post_attention_layernorm.weight", layer.post_attn_norm.weight)
    s = prefix + "self_attn."
    yield _linear(s + "q_a_proj.weight", a.q_a)
    yield _vector(s + "q_a_layernorm.weight", a.q_a_norm)
    yield _heads_out(s + "q_b_proj.weight", a.q_b)
    yield _linear(s + "kv_a_proj_with_mqa.weight", a.kv_a)
    yield _vector(s + "kv_a_layernorm.weight", a.kv_a_norm)
    yield _heads_in(s + "o_proj.weight", a.o_proj)
    if a.indexer is not None:
        i = a.indexer
        yield _heads_out(s + "indexer.wq_b.weight", i.wq_b)
        yield _linear(s + "indexer.wk.weight", i.wk)
        yield _vector(s + "indexer.k_norm.weight", i.k_norm_weight)
        yield _vector(s + "indexer.k_norm.bias", i.k_norm_bias)
        yield _linear(s + "indexer.weights_proj.weight", i.weights_proj)
    m = prefix + "mlp."
    if isinstance(layer.mlp, MoE):
        yield _linear(m + "gate.weight", layer.mlp.router.weight)
        yield _vector(m + "gate.e_score_correction_bias", layer.mlp.router.e_score_correction_bias)
        if layer.mlp.shared is not None:
            for proj in ("gate", "up", "down"):
                yield _linear(f"{m}shared_experts.{proj}_proj.weight", getattr(layer.mlp.shared, proj))
    else:
        for proj in ("gate", "up", "down"):
            yield _linear(f"{m}{proj}_proj.weight", getattr(layer.mlp, proj))


def _blocks(model: GlmForCausalLM) -> Iterator[tuple[str, DecoderLayer]]:
    for i, layer in enumerate(model.layers):
        yield f"model.layers.{i}.", layer
    if model.mtp is not None:
        yield f"model.layers.{model.config.num_hidden_layers}.", model.mtp.block


def _simple_tensors(model: GlmForCausalLM) -> Iterator[Tensor]:
    yield _vector("model.embed_tokens.weight", model.embed_tokens)
    yield _vector("model.norm.weight", model.norm.weight)
    if model.lm_head is not None:
        yield _linear("lm_head.weight", model.lm_head)
    for prefix, block in _blocks(model):
        yield from _layer_tensors(prefix, block)
    if model.mtp is not None:
        p = f"model.layers.{model.config.num_hidden_layers}."
        yield _vector(p + "enorm.weight", model.mtp.enorm.weight)
        yield _vector(p + "hnorm.weight", model.mtp.hnorm.weight)
        yield _linear(p + "eh_proj.weight", model.mtp.eh_proj)
        yield _vector(p + "shared_head.norm.weight", model.mtp.head_norm.weight)


def _mtp_prefix(config: ModelConfig) -> str:
    return f"model.layers.{config.num_hidden_layers}."


# Export ----------------------------------------------------------------------------------
def hf_state_dict(model: GlmForCausalLM) -> dict[str, np.ndarray]:
    """The HF tensors of a model, per-expert layout, as host numpy arrays."""
    c = model.config
    out = {t.name: t.to_hf(np.asarray(t.var[...])) for t in _simple_tensors(model)}
    for prefix, block in _blocks(model):
        a = block.attn
        w_uk, w_uv = np.asarray(a.w_uk[...]), np.asarray(a.w_uv[...])  # [C, H, K], [C, H, V]
        kv_b = np.concatenate([w_uk, w_uv], axis=-1)  # [C, H, K+V]
        out[prefix + "self_attn.kv_b_proj.weight"] = kv_b.reshape(kv_b.shape[0], -1).T
        if isinstance(block.mlp, MoE):
            ex = block.mlp.experts
            gate, up, down = (np.asarray(p[...]) for p in (ex.gate, ex.up, ex.down))
            for e in range(c.n_routed_experts):
                out[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = gate[e].T
                out[f"{prefix}mlp.experts.{e}.up_proj.weight"] = up[e].T
                out[f"{prefix}mlp.experts.{e}.down_proj.weight"] = down[e].T
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def save_pretrained(model: GlmForCausalLM, path: str | os.PathLike, *, max_shard_bytes: int = SHARD_BYTES) -> None:
    """Writes config.json and safetensors (sharded with an index above max_shard_bytes)."""
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(model.config.to_hf(), f, indent=2)
    tensors = hf_state_dict(model)
    shards, current, size = [], {}, 0
    for name in sorted(tensors):
        nbytes = tensors[name].nbytes
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = tensors[name]
        size += nbytes
    shards.append(current)
    if len(shards) == 1:
        save_file(shards[0], os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(path, fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in shard})
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)


# Import ----------------------------------------------------------------------------------
class _Reader:
    """Random access to the tensors of a checkpoint directory."""

    def __init__(self, path: str):
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                files = {name: os.path.join(path, fn) for name, fn in json.load(f)["weight_map"].items()}
        else:
            shards = sorted(fn for fn in os.listdir(path) if fn.endswith(".safetensors"))
            if not shards:
                raise FileNotFoundError(f"no *.safetensors files in {path}")
            files = {}
            for fn in shards:
                with safe_open(os.path.join(path, fn), "np") as f:
                    files.update({name: os.path.join(path, fn) for name in f.keys()})
        self.files = files
        self._open = {}

    def names(self) -> set[str]:
        return set(self.files)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def get(self, name: str) -> np.ndarray:
        return self._handle(name).get_tensor(name)

    def _handle(self, name):
        fn = self.files[name]
        if fn not in self._open:
            self._open[fn] = safe_open(fn, "np")
        return self._open[fn]


class CheckpointMismatch(ValueError):
    """The checkpoint's tensors do not match the model its config.json describes."""


def _check_shape(reader: _Reader, name: str, expected: tuple[int, ...]) -> None:
    found = reader.shape(name)
    if found != tuple(expected):
        raise CheckpointMismatch(f"tensor {name!r} has shape {found}, expected {tuple(expected)}")


def _expert_names(prefix: str, n: int) -> list[str]:
    return [f"{prefix}mlp.experts.{e}.{p}_proj.weight" for e in range(n) for p in ("gate", "up", "down")]


def _load_into(model: GlmForCausalLM, reader: _Reader, put: Callable[[np.ndarray], jax.Array]) -> set[str]:
    """Fills every Variable of the (abstract) model from the checkpoint; returns the names read."""
    c = model.config
    dtype = _NP_DTYPES[c.param_dtype]
    used = set()

    def read(name, expected):
        if name not in reader.files:
            raise CheckpointMismatch(f"tensor {name!r} (shape {tuple(expected)}) is missing from the checkpoint")
        _check_shape(reader, name, expected)
        used.add(name)
        return reader.get(name)

    def assign(var, value, keep_fp32=False):
        target = var.dtype if keep_fp32 else dtype
        var.set_value(put(np.asarray(value).astype(target)))

    for t in _simple_tensors(model):
        keep = t.var.dtype == jnp.float32 and (t.name.endswith(("gate.weight", "e_score_correction_bias",
                                                                "weights_proj.weight")))
        assign(t.var, t.from_hf(read(t.name, t.hf_shape)), keep_fp32=keep)
    h, k, v, cdim = c.num_attention_heads, c.qk_nope_head_dim, c.v_head_dim, c.kv_lora_rank
    for prefix, block in _blocks(model):
        kv_b = read(prefix + "self_attn.kv_b_proj.weight", (h * (k + v), cdim))
        kv_b = kv_b.T.reshape(cdim, h, k + v)
        assign(block.attn.w_uk, kv_b[..., :k])
        assign(block.attn.w_uv, kv_b[..., k:])
        if isinstance(block.mlp, MoE):
            ex = block.mlp.experts
            e_, d, f = c.n_routed_experts, c.hidden_size, c.moe_intermediate_size
            fused = prefix + "mlp.experts.gate_up_proj"
            if fused in reader.files:
                gate_up = read(fused, (e_, 2 * f, d))
                down = read(prefix + "mlp.experts.down_proj", (e_, d, f))
                assign(ex.gate, _t(gate_up[:, :f]))
                assign(ex.up, _t(gate_up[:, f:]))
                assign(ex.down, _t(down))
            else:
                stack = lambda p, shape: np.stack(  # noqa: E731
                    [read(f"{prefix}mlp.experts.{e}.{p}_proj.weight", shape).T for e in range(e_)])
                assign(ex.gate, stack("gate", (f, d)))
                assign(ex.up, stack("up", (f, d)))
                assign(ex.down, stack("down", (d, f)))
    return used


def from_pretrained(
    path: str | os.PathLike,
    *,
    dtype: str = "float32",
    mesh: jax.sharding.Mesh | None = None,
    kernel_impl: str = "xla",
) -> GlmForCausalLM:
    """Loads an HF GLM-5 / DeepSeek-V3.2 checkpoint directory (config.json + safetensors).

    dtype sets both the stored parameters and the compute ("float32" or "bfloat16"; the
    router and the indexer head weights stay fp32). The MTP layer is loaded when the
    checkpoint has `model.layers.{num_hidden_layers}.*`; a checkpoint without it (as
    transformers writes them) gives a model without MTP. With a mesh, parameters are
    placed on it, replicated.
    """
    path = os.fspath(path)
    reader = _Reader(path)
    config = ModelConfig.from_hf(path, dtype=dtype, param_dtype=dtype, kernel_impl=kernel_impl)
    mtp_names = {n for n in reader.names() if n.startswith(_mtp_prefix(config))}
    if not mtp_names and config.num_nextn_predict_layers:
        log.warning("%s has no MTP tensors (%s*): loading the model without its MTP layer", path,
                    _mtp_prefix(config))
        config = config.replace(num_nextn_predict_layers=0)
    elif mtp_names and not config.num_nextn_predict_layers:
        config = config.replace(num_nextn_predict_layers=1)

    model = nnx.eval_shape(lambda: GlmForCausalLM(config, rngs=nnx.Rngs(params=0)))
    if mesh is None:
        put = jnp.asarray
    else:
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        put = lambda x: jax.device_put(x, replicated)  # noqa: E731
    used = _load_into(model, reader, put)

    # Duplicates some exporters keep in the MTP layer; glmjax shares them with the main model.
    ignorable = {_mtp_prefix(config) + "embed_tokens.weight", _mtp_prefix(config) + "shared_head.head.weight"}
    unexpected = sorted(reader.names() - used - ignorable)
    unexpected = [n for n in unexpected if not n.endswith("rotary_emb.inv_freq")]
    if unexpected:
        more = f" (and {len(unexpected) - 5} more)" if len(unexpected) > 5 else ""
        raise CheckpointMismatch(
            f"unexpected tensors in {path}: {unexpected[:5]}{more}; the config.json describes a model without them")
    return model
