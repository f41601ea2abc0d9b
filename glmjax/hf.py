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

Loading places every parameter straight into its sharding (`jax.make_array_from_callback`
with the logical rules' spec, or one device without a mesh): the callback for a shard
reads only that shard's slice of the HF tensor, and an expert stack's callback for a range
of the E axis reads only those experts' tensors, and a scanned model's stack [R, ...]
reads only the layers of its R range, so each process reads what its devices hold and the host holds about one tensor's local shards at a time. Saving gathers one
variable at a time (across processes when it spans several) and streams the HF tensors
made from it to disk (glmjax/safetensors_io.py); process 0 writes.
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
from jax.experimental import multihost_utils

from glmjax import sharding
from glmjax.config import ModelConfig
from glmjax.layers.decoder import DecoderLayer
from glmjax.layers.moe import MoE
from glmjax.model import GlmForCausalLM
from glmjax.safetensors_io import Entry, Reader, write

log = logging.getLogger(__name__)

_NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
SHARD_BYTES = 5 * 2**30


# Conversions between a glmjax array and its HF tensor ----------------------------------
# Export: the full glmjax array -> the HF array. Import: `read(reader, index)`, the glmjax
# array's values at `index` (one slice(start, stop) per glmjax dimension), read from the
# HF tensor's matching slice.
Read = Callable[[Reader, tuple[slice, ...]], np.ndarray]


def _same(x):
    return x


def _t(x):
    return np.swapaxes(x, -1, -2)


def _heads_out_to_hf(x):  # [Q, H, E] -> [H*E, Q]
    return x.reshape(x.shape[0], -1).T


def _heads_in_to_hf(x):  # [H, V, D] -> [D, H*V]
    return x.reshape(-1, x.shape[-1]).T


def _rows(heads: slice, per_head: int) -> slice:
    """The rows of a flattened [H*per_head] HF dimension that hold a range of heads."""
    return slice(heads.start * per_head, heads.stop * per_head)


def _read_same(name: str) -> Read:
    return lambda r, i: r.read(name, i)


def _read_t(name: str) -> Read:  # HF [..., out, in] -> [..., in, out]
    return lambda r, i: _t(r.read(name, (*i[:-2], i[-1], i[-2])))


def _read_heads_out(name: str, per_head: int) -> Read:  # HF [H*E, Q] -> [Q, H, E]
    def read(r, i):
        q, h, e = i
        w = r.read(name, (_rows(h, per_head), q))  # [h*E, q]
        return w.T.reshape(w.shape[1], -1, per_head)[:, :, e]
    return read


def _read_heads_in(name: str, per_head: int) -> Read:  # HF [D, H*V] -> [H, V, D]
    def read(r, i):
        h, v, d = i
        w = r.read(name, (d, _rows(h, per_head)))  # [d, h*V]
        return w.T.reshape(-1, per_head, w.shape[0])[:, v]
    return read


def _read_kv_b(name: str, per_head: int, offset: int) -> Read:
    """HF kv_b_proj [H*(K+V), C] -> W_UK [C, H, K] (offset 0) or W_UV [C, H, V] (offset K)."""
    def read(r, i):
        c, h, k = i
        w = r.read(name, (_rows(h, per_head), c))  # [h*(K+V), c]
        return w.T.reshape(w.shape[1], -1, per_head)[:, :, offset + k.start:offset + k.stop]
    return read


def _read_gate_up(name: str, offset: int) -> Read:
    """Fused HF gate_up_proj [E, 2F, D] -> gate [E, D, F] (offset 0) or up (offset F)."""
    return lambda r, i: _t(r.read(name, (i[0], slice(offset + i[2].start, offset + i[2].stop), i[1])))


def _read_experts(names: list[str]) -> Read:
    """Per-expert HF tensors [out, in] -> the stack [E, in, out], reading only the experts
    of the index's E range."""
    return lambda r, i: np.stack([_t(r.read(names[e], (i[2], i[1]))) for e in range(i[0].start, i[0].stop)])


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One HF tensor <-> one glmjax Variable, or one row of a scanned layer's stacked one."""

    name: str
    var: nnx.Variable
    to_hf: Callable[[np.ndarray], np.ndarray]
    read: Read
    row: int | None = None  # the repeat, when var is stacked [R, ...] (glmjax/layers/stack.py)

    @property
    def shape(self) -> tuple[int, ...]:
        """The glmjax array's shape (one row's, for a stacked variable)."""
        return tuple(self.var.shape if self.row is None else self.var.shape[1:])

    @property
    def hf_shape(self) -> tuple[int, ...]:
        return tuple(jax.eval_shape(self.to_hf, jax.ShapeDtypeStruct(self.shape, np.float32)).shape)


def _linear(name, var):
    return Tensor(name, var, _t, _read_t(name))


def _vector(name, var):
    return Tensor(name, var, _same, _read_same(name))


def _heads_out(name, var):
    return Tensor(name, var, _heads_out_to_hf, _read_heads_out(name, var.shape[-1]))


def _heads_in(name, var):
    return Tensor(name, var, _heads_in_to_hf, _read_heads_in(name, var.shape[-2]))


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


def _blocks(model: GlmForCausalLM) -> Iterator[tuple[str, DecoderLayer, int | None]]:
    """(HF prefix, block, row) of every decoder block: a scanned layer is row r of its
    group position's stacked block."""
    if model.segments is None:
        for i, layer in enumerate(model.layers):
            yield f"model.layers.{i}.", layer, None
    else:
        for segment in model.segments:
            for r in range(segment.repeats):
                for j, block in enumerate(segment.group.layers):
                    yield f"model.layers.{segment.first + r * segment.period + j}.", block, r
    if model.mtp is not None:
        yield f"model.layers.{model.config.num_hidden_layers}.", model.mtp.block, None


def _simple_tensors(model: GlmForCausalLM) -> Iterator[Tensor]:
    yield _vector("model.embed_tokens.weight", model.embed_tokens)
    yield _vector("model.norm.weight", model.norm.weight)
    if model.lm_head is not None:
        yield _linear("lm_head.weight", model.lm_head)
    for prefix, block, row in _blocks(model):
        for t in _layer_tensors(prefix, block):
            yield dataclasses.replace(t, row=row)
    if model.mtp is not None:
        p = f"model.layers.{model.config.num_hidden_layers}."
        yield _vector(p + "enorm.weight", model.mtp.enorm.weight)
        yield _vector(p + "hnorm.weight", model.mtp.hnorm.weight)
        yield _linear(p + "eh_proj.weight", model.mtp.eh_proj)
        yield _vector(p + "shared_head.norm.weight", model.mtp.head_norm.weight)


def _mtp_prefix(config: ModelConfig) -> str:
    return f"model.layers.{config.num_hidden_layers}."


# Export ----------------------------------------------------------------------------------
class _Gathered:
    """The full value of one variable (one row of a stacked one) at a time on this host
    (process_allgather when its shards span processes, every process taking part); kept
    while consecutive HF tensors are made from it (an expert stack gives one per expert),
    dropped before the next."""

    def __init__(self):
        self._key, self._value = None, None

    def __call__(self, var: nnx.Variable, row: int | None = None) -> np.ndarray:
        if self._key is None or self._key[0] is not var or self._key[1] != row:
            self._key = self._value = None
            x = var[...] if row is None else var[...][row]
            self._value = np.asarray(x) if x.is_fully_addressable else multihost_utils.process_allgather(x, tiled=True)
            self._key = (var, row)
        return self._value


def _kv_b_to_hf(w_uk, w_uv):  # [C, H, K], [C, H, V] -> [H*(K+V), C]
    kv_b = np.concatenate([w_uk, w_uv], axis=-1)  # [C, H, K+V]
    return kv_b.reshape(kv_b.shape[0], -1).T


def hf_tensors(model: GlmForCausalLM) -> list[tuple[Entry, Callable[[], np.ndarray]]]:
    """The HF tensors of a model (per-expert layout), each as its name, shape and dtype and
    a function that makes its host array; in an order that gathers each variable (each row
    of a stacked one) once."""
    c = model.config
    full = _Gathered()
    out, order = [], {}

    def add(name, shape, var, row, make):
        key = (order.setdefault(id(var), len(order)), -1 if row is None else row)
        out.append((key, Entry(name, tuple(shape), np.dtype(var.dtype)), make))

    for t in _simple_tensors(model):
        add(t.name, t.hf_shape, t.var, t.row, lambda t=t: t.to_hf(full(t.var, t.row)))
    h, k, v, cdim = c.num_attention_heads, c.qk_nope_head_dim, c.v_head_dim, c.kv_lora_rank
    for prefix, block, row in _blocks(model):
        a = block.attn
        add(prefix + "self_attn.kv_b_proj.weight", (h * (k + v), cdim), a.w_uk, row,
            lambda a=a, row=row: _kv_b_to_hf(full(a.w_uk, row), full(a.w_uv, row)))
        if isinstance(block.mlp, MoE):
            for proj in ("gate", "up", "down"):
                var = getattr(block.mlp.experts, proj)  # [E, D, F] (gate, up) or [E, F, D] (down), [R, ...] stacked
                for e in range(c.n_routed_experts):
                    add(f"{prefix}mlp.experts.{e}.{proj}_proj.weight", var.shape[:-3:-1], var, row,
                        lambda var=var, e=e, row=row: full(var, row)[e].T)
    out.sort(key=lambda item: item[0])  # stable: within a (variable, row), the order above
    return [(entry, make) for _, entry, make in out]


def save_pretrained(model: GlmForCausalLM, path: str | os.PathLike, *, max_shard_bytes: int = SHARD_BYTES) -> None:
    """Writes config.json and safetensors (sharded with an index above max_shard_bytes).

    The tensors are gathered and written one at a time, so a sharded model is never whole
    on one host. With several processes every process calls this (each gather is a
    collective) and process 0 writes."""
    path = os.fspath(path)
    tensors = hf_tensors(model)
    values = (make() for _, make in tensors)
    if jax.process_index() == 0:
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(model.config.to_hf(), f, indent=2)
        write(path, [entry for entry, _ in tensors], values, max_file_bytes=max_shard_bytes)
    else:
        for _ in values:
            pass
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("glmjax.save_pretrained")


# Import ----------------------------------------------------------------------------------
class CheckpointMismatch(ValueError):
    """The checkpoint's tensors do not match the model its config.json describes."""


def _check_shape(reader: Reader, name: str, expected: tuple[int, ...]) -> None:
    found = reader.shape(name)
    if found != tuple(expected):
        raise CheckpointMismatch(f"tensor {name!r} has shape {found}, expected {tuple(expected)}")


def _placed(shape: tuple[int, ...], placement: jax.sharding.Sharding | None, read: Callable) -> jax.Array:
    """The array `read` describes, built shard by shard in `placement`: read(index) is
    called once per distinct shard this process's devices hold, with one slice(start,
    stop) per dimension. Placement None: the whole array on the default device,
    uncommitted, as `init_model` makes it, so that a loaded model's programs are the
    ones a created model compiled (a committed argument changes the program, and its key
    in the persistent compile cache)."""
    if placement is None:
        return jnp.asarray(read(tuple(slice(0, n) for n in shape)))
    shards = {}

    def shard(index):
        index = tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape))
        key = tuple((s.start, s.stop) for s in index)
        if key not in shards:  # devices that replicate a shard share one read
            shards[key] = read(index)
        return shards[key]

    return jax.make_array_from_callback(shape, placement, shard)


def _load_into(model: GlmForCausalLM, reader: Reader,
               placement: Callable[[nnx.Variable], jax.sharding.Sharding | None]) -> set[str]:
    """Fills every Variable of the (abstract) model from the checkpoint, each in the
    sharding `placement` gives it; returns the names of the HF tensors it used. A stacked
    variable [R, ...] is built once, its callback reading the rows of its index's R range."""
    c = model.config
    dtype = _NP_DTYPES[c.param_dtype]
    names = reader.names()
    used = set()
    pending: dict[int, tuple[nnx.Variable, dict, dict[int | None, Read], np.dtype]] = {}

    def source(var, row, sources: dict[str, tuple[int, ...]], read: Read, target=dtype):
        for name, expected in sources.items():
            if name not in names:
                raise CheckpointMismatch(f"tensor {name!r} (shape {tuple(expected)}) is missing from the checkpoint")
            _check_shape(reader, name, expected)
            used.add(name)
        pending.setdefault(id(var), (var, {}, {}, target))[2][row] = read

    for t in _simple_tensors(model):
        keep = t.var.dtype == jnp.float32 and (t.name.endswith(("gate.weight", "e_score_correction_bias",
                                                                "weights_proj.weight")))
        source(t.var, t.row, {t.name: t.hf_shape}, t.read, t.var.dtype if keep else dtype)
    h, k, v, cdim = c.num_attention_heads, c.qk_nope_head_dim, c.v_head_dim, c.kv_lora_rank
    for prefix, block, row in _blocks(model):
        kv_b = prefix + "self_attn.kv_b_proj.weight"
        source(block.attn.w_uk, row, {kv_b: (h * (k + v), cdim)}, _read_kv_b(kv_b, k + v, 0))
        source(block.attn.w_uv, row, {kv_b: (h * (k + v), cdim)}, _read_kv_b(kv_b, k + v, k))
        if not isinstance(block.mlp, MoE):
            continue
        ex = block.mlp.experts
        e_, d, f = c.n_routed_experts, c.hidden_size, c.moe_intermediate_size
        fused, down = prefix + "mlp.experts.gate_up_proj", prefix + "mlp.experts.down_proj"
        if fused in names:
            source(ex.gate, row, {fused: (e_, 2 * f, d)}, _read_gate_up(fused, 0))
            source(ex.up, row, {fused: (e_, 2 * f, d)}, _read_gate_up(fused, f))
            source(ex.down, row, {down: (e_, d, f)}, _read_t(down))
            continue
        for proj, shape in (("gate", (f, d)), ("up", (f, d)), ("down", (d, f))):
            per_expert = [f"{prefix}mlp.experts.{e}.{proj}_proj.weight" for e in range(e_)]
            source(getattr(ex, proj), row, dict.fromkeys(per_expert, shape), _read_experts(per_expert))

    for var, _, reads, target in pending.values():
        if None in reads:
            read = reads[None]
        else:  # stacked: rows i[0] of [R, ...], each read from its own layer's tensors
            read = lambda r, i, reads=reads: np.stack([reads[row](r, i[1:]) for row in range(i[0].start, i[0].stop)])
        var.set_value(_placed(var.shape, placement(var), lambda i, read=read, target=target: np.asarray(
            read(reader, i)).astype(target)))
    return used


def from_pretrained(
    path: str | os.PathLike,
    *,
    dtype: str = "float32",
    mesh: jax.sharding.Mesh | None = None,
    kernel_impl: str = "xla",
    scan_layers: bool = False,
    remat: str = "none",
    moe_capacity_factor: float | None = None,
    moe_chunk_tokens: int | None = None,
) -> GlmForCausalLM:
    """Loads an HF GLM-5 / DeepSeek-V3.2 checkpoint directory (config.json + safetensors).

    dtype sets both the stored parameters and the compute ("float32" or "bfloat16"; the
    router and the indexer head weights stay fp32). The MTP layer is loaded when the
    checkpoint has `model.layers.{num_hidden_layers}.*`; a checkpoint without it (as
    transformers writes them) gives a model without MTP. With a mesh, each parameter is
    placed in the sharding the logical rules give it (`sharding.current_rules()`), and
    each process reads only the slices its devices hold. scan_layers, remat,
    moe_capacity_factor, moe_chunk_tokens: how the model runs (ModelConfig); scanned, each
    layer's tensors fill one row of its group's stacks.
    """
    path = os.fspath(path)
    reader = Reader(path)
    config = ModelConfig.from_hf(path, dtype=dtype, param_dtype=dtype, kernel_impl=kernel_impl,
                                 scan_layers=scan_layers, remat=remat, moe_capacity_factor=moe_capacity_factor,
                                 moe_chunk_tokens=moe_chunk_tokens)
    mtp_names = {n for n in reader.names() if n.startswith(_mtp_prefix(config))}
    if not mtp_names and config.num_nextn_predict_layers:
        log.warning("%s has no MTP tensors (%s*): loading the model without its MTP layer", path,
                    _mtp_prefix(config))
        config = config.replace(num_nextn_predict_layers=0)
    elif mtp_names and not config.num_nextn_predict_layers:
        config = config.replace(num_nextn_predict_layers=1)

    model = nnx.eval_shape(lambda: GlmForCausalLM(config, rngs=nnx.Rngs(params=0)))
    if mesh is None:
        placement = lambda var: None  # noqa: E731
    else:
        placement = lambda var: jax.sharding.NamedSharding(mesh, sharding.variable_spec(var, mesh=mesh))  # noqa: E731
    used = _load_into(model, reader, placement)

    # Duplicates some exporters keep in the MTP layer; glmjax shares them with the main model.
    ignorable = {_mtp_prefix(config) + "embed_tokens.weight", _mtp_prefix(config) + "shared_head.head.weight"}
    unexpected = sorted(reader.names() - used - ignorable)
    unexpected = [n for n in unexpected if not n.endswith("rotary_emb.inv_freq")]
    if unexpected:
        more = f" (and {len(unexpected) - 5} more)" if len(unexpected) > 5 else ""
        raise CheckpointMismatch(
            f"unexpected tensors in {path}: {unexpected[:5]}{more}; the config.json describes a model without them")
    return model
