"""ModelConfig: the GLM-5 / DeepSeek-V3.2 architecture under its Hugging Face field names.

One frozen dataclass describes every model glmjax runs, from `configs/tiny.py` to the
744B GLM-5. Field names are the ones in the checkpoint's `config.json`, so
`ModelConfig.from_hf(path)` and `config.to_hf()` are plain renames plus derived lists.
The fields under "How to run it" are glmjax's own (`dtype`, `param_dtype`, `kernel_impl`,
`moe_capacity_factor`, `moe_chunk_tokens`, `scan_layers`, `remat`): how to run the model,
not what it is; `to_hf` leaves them out.

Per-layer structure is derived once, here:
  * `mlp_layer_types[i]`  "dense" (plain SwiGLU) or "sparse" (MoE);
  * `indexer_types[i]`    "full" (runs its own lightning indexer) or "shared" (IndexShare:
                          reuses the top-k of the nearest earlier full layer).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from typing import Any

MODEL_TYPES = ("glm_moe_dsa", "deepseek_v32")
DTYPES = ("float32", "bfloat16")
KERNEL_IMPLS = ("xla", "pallas")
REMAT_POLICIES = ("none", "full", "matmuls")  # glmjax/layers/stack.py: what a layer keeps for its backward
ROPE_TYPES = ("default", "yarn")

RUNTIME_FIELDS = ("dtype", "param_dtype", "kernel_impl", "moe_capacity_factor", "moe_chunk_tokens", "scan_layers",
                  "remat")

_HF_ARCHITECTURES = {
    "glm_moe_dsa": "GlmMoeDsaForCausalLM",
    "deepseek_v32": "DeepseekV32ForCausalLM",
}


def _fail(field: str, value: Any, allowed: str) -> None:
    raise ValueError(f"ModelConfig.{field}={value!r} is invalid: {allowed}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The architecture. Defaults are GLM-5 (`zai-org/GLM-5` config.json)."""

    model_type: str = "glm_moe_dsa"
    vocab_size: int = 154880
    hidden_size: int = 6144
    intermediate_size: int = 12288
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 78
    num_attention_heads: int = 64
    num_key_value_heads: int = 64
    # MLA
    q_lora_rank: int = 2048
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 192
    qk_rope_head_dim: int = 64
    v_head_dim: int = 256
    attention_bias: bool = False
    # MoE
    n_routed_experts: int = 256
    num_experts_per_tok: int = 8
    n_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    first_k_dense_replace: int = 3
    mlp_layer_types: tuple[str, ...] | None = None
    hidden_act: str = "silu"
    # DSA lightning indexer and IndexShare
    index_topk: int = 2048
    index_n_heads: int = 32
    index_head_dim: int = 128
    indexer_types: tuple[str, ...] | None = None
    index_topk_pattern: str | None = None
    index_topk_freq: int = 1
    index_skip_topk_offset: int = 2
    # Multi-token prediction
    num_nextn_predict_layers: int = 1
    # Positions and norms
    max_position_embeddings: int = 202752
    rope_parameters: tuple[tuple[str, Any], ...] = (("rope_theta", 1e6), ("rope_type", "default"))
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    bos_token_id: int | None = 0
    eos_token_id: int | tuple[int, ...] | None = 1
    pad_token_id: int | None = None
    # How to run it (glmjax's own; not written to config.json)
    dtype: str = "float32"
    param_dtype: str = "float32"
    kernel_impl: str = "xla"
    moe_capacity_factor: float | None = None  # expert-parallel buffer bound; None: never drop a token
    moe_chunk_tokens: int | None = None  # tokens per device per expert-parallel exchange; None: all at once
    scan_layers: bool = False  # stacked parameters per layer kind, the layers run under lax.scan
    remat: str = "none"  # per layer: "none", "full" (keep its input) or "matmuls" (keep matmul outputs)

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731  (frozen dataclass)
        if isinstance(self.rope_parameters, Mapping):
            set_("rope_parameters", tuple(sorted(self.rope_parameters.items())))
        if isinstance(self.eos_token_id, list):
            set_("eos_token_id", tuple(self.eos_token_id))
        if self.mlp_layer_types is None:
            n_dense = min(self.first_k_dense_replace, self.num_hidden_layers)
            set_("mlp_layer_types", ("dense",) * n_dense + ("sparse",) * (self.num_hidden_layers - n_dense))
        else:
            set_("mlp_layer_types", tuple(self.mlp_layer_types))
        if self.indexer_types is None:
            set_("indexer_types", self._derive_indexer_types())
        else:
            set_("indexer_types", tuple(self.indexer_types))
        self._validate()

    def _derive_indexer_types(self) -> tuple[str, ...]:
        """HF's rule: an explicit "FSSS..." pattern wins, else `full` iff
        `max(i - offset + 1, 0) % freq == 0`."""
        if self.index_topk_pattern is not None:
            bad = set(self.index_topk_pattern) - {"F", "S"}
            if bad:
                _fail("index_topk_pattern", self.index_topk_pattern, "use only the letters F (full) and S (shared)")
            if len(self.index_topk_pattern) != self.num_hidden_layers:
                _fail("index_topk_pattern", self.index_topk_pattern,
                      f"expected one letter per layer (num_hidden_layers={self.num_hidden_layers}), "
                      f"got {len(self.index_topk_pattern)}")
            return tuple({"F": "full", "S": "shared"}[c] for c in self.index_topk_pattern)
        freq, offset = max(self.index_topk_freq, 1), self.index_skip_topk_offset  # HF reads 0 as 1
        return tuple(
            "full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(self.num_hidden_layers)
        )

    def _validate(self) -> None:
        if self.model_type not in MODEL_TYPES:
            _fail("model_type", self.model_type, f"expected one of {MODEL_TYPES}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
                     "num_hidden_layers", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
                     "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts",
                     "num_experts_per_tok", "index_topk", "index_n_heads", "index_head_dim",
                     "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                _fail(name, value, "expected a positive integer")
        for name in ("qk_rope_head_dim", "index_head_dim"):
            if getattr(self, name) % 2:
                _fail(name, getattr(self, name), "RoPE rotates pairs, so it must be even")
        if self.index_head_dim < self.qk_rope_head_dim:
            _fail("index_head_dim", self.index_head_dim,
                  f"must be >= qk_rope_head_dim={self.qk_rope_head_dim} (the indexer ropes its first dims)")
        if self.num_key_value_heads != self.num_attention_heads:
            _fail("num_key_value_heads", self.num_key_value_heads,
                  f"MLA expands one latent into every head, so it must equal num_attention_heads="
                  f"{self.num_attention_heads}")
        if self.attention_bias:
            _fail("attention_bias", self.attention_bias, "GLM-5 and DeepSeek-V3.2 use no attention bias; expected False")
        if self.hidden_act != "silu":
            _fail("hidden_act", self.hidden_act, "only 'silu' (SwiGLU) is implemented")
        if self.num_experts_per_tok > self.n_routed_experts:
            _fail("num_experts_per_tok", self.num_experts_per_tok,
                  f"must be <= n_routed_experts={self.n_routed_experts}")
        if self.n_group <= 0 or self.n_routed_experts % self.n_group:
            _fail("n_group", self.n_group, f"must be positive and divide n_routed_experts={self.n_routed_experts}")
        if not 1 <= self.topk_group <= self.n_group:
            _fail("topk_group", self.topk_group, f"must be in [1, n_group={self.n_group}]")
        if self.n_group > 1 and self.n_routed_experts // self.n_group < 2:
            _fail("n_group", self.n_group, "group ranking sums each group's top-2 scores, so groups need >= 2 experts")
        if self.num_experts_per_tok > self.topk_group * (self.n_routed_experts // self.n_group):
            _fail("num_experts_per_tok", self.num_experts_per_tok,
                  "more experts per token than the kept groups (topk_group x group size) hold")
        for name in ("first_k_dense_replace", "n_shared_experts"):
            if getattr(self, name) < 0:
                _fail(name, getattr(self, name), "expected a non-negative integer")
        if not self.rms_norm_eps > 0:
            _fail("rms_norm_eps", self.rms_norm_eps, "expected a positive float")
        if self.model_type == "deepseek_v32" and "shared" in self.indexer_types:
            _fail("indexer_types", self.indexer_types,
                  "DeepSeek-V3.2 runs an indexer in every layer; IndexShare needs model_type='glm_moe_dsa'")
        if self.num_nextn_predict_layers not in (0, 1):
            _fail("num_nextn_predict_layers", self.num_nextn_predict_layers, "expected 0 or 1")
        for field, values, allowed in (("mlp_layer_types", self.mlp_layer_types, ("dense", "sparse")),
                                       ("indexer_types", self.indexer_types, ("full", "shared"))):
            if len(values) != self.num_hidden_layers:
                _fail(field, values, f"expected one entry per layer (num_hidden_layers={self.num_hidden_layers}), "
                                     f"got {len(values)}")
            if any(v not in allowed for v in values):
                _fail(field, values, f"entries must be one of {allowed}")
        if self.indexer_types and self.indexer_types[0] != "full":
            _fail("indexer_types", self.indexer_types, "layer 0 must be 'full': a shared layer reuses an earlier one")
        rope = self.rope
        if rope.get("rope_type", "default") not in ROPE_TYPES:
            _fail("rope_parameters", rope, f"rope_type must be one of {ROPE_TYPES}")
        if "rope_theta" not in rope:
            _fail("rope_parameters", rope, "needs a 'rope_theta'")
        if rope.get("rope_type") == "yarn":
            for key in ("factor", "original_max_position_embeddings"):
                if key not in rope:
                    _fail("rope_parameters", rope, f"yarn RoPE needs '{key}'")
        if self.moe_capacity_factor is not None and not self.moe_capacity_factor > 0:
            _fail("moe_capacity_factor", self.moe_capacity_factor, "expected None (no dropping) or a positive float")
        if self.moe_chunk_tokens is not None and not (isinstance(self.moe_chunk_tokens, int)
                                                      and self.moe_chunk_tokens > 0):
            _fail("moe_chunk_tokens", self.moe_chunk_tokens, "expected None (one exchange) or a positive int")
        for name, allowed in (("dtype", DTYPES), ("param_dtype", DTYPES), ("kernel_impl", KERNEL_IMPLS),
                              ("remat", REMAT_POLICIES)):
            if getattr(self, name) not in allowed:
                _fail(name, getattr(self, name), f"expected one of {allowed}")

    # Derived values -------------------------------------------------------------------
    @property
    def rope(self) -> dict[str, Any]:
        return dict(self.rope_parameters)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """`qk_head_dim ** -0.5`, times YaRN's mscale(factor, mscale_all_dim)^2 when RoPE is YaRN."""
        scale = self.qk_head_dim ** -0.5
        rope = self.rope
        if rope.get("rope_type") == "yarn" and rope.get("mscale_all_dim"):
            m = yarn_mscale(rope["factor"], rope["mscale_all_dim"])
            scale *= m * m
        return scale

    @property
    def indexer_rope_interleaved(self) -> bool:
        """GLM's indexer ropes interleaved pairs; DeepSeek-V3.2's ropes the two halves."""
        return self.model_type == "glm_moe_dsa"

    @property
    def shared_intermediate_size(self) -> int:
        return self.moe_intermediate_size * self.n_shared_experts

    @property
    def layer_segments(self) -> tuple[tuple[int, int, int], ...]:
        """(first layer, layers per group, repeats) of each run of identical layer groups
        (glmjax/layers/stack.py): a group is a full-indexer layer and the shared layers
        after it; groups match when they are dense or MoE at the same positions."""
        groups: list[list[int]] = []
        for i in range(self.num_hidden_layers):
            if self.has_indexer(i) or not groups:
                groups.append([i, 1])
            else:
                groups[-1][1] += 1
        kinds = lambda g: tuple(self.is_moe(i) for i in range(g[0], g[0] + g[1]))  # noqa: E731
        out: list[list[int]] = []
        for g in groups:
            last = out[-1] if out else None
            if last is not None and last[1] == g[1] and kinds((last[0], last[1])) == kinds(g):
                last[2] += 1
            else:
                out.append([g[0], g[1], 1])
        return tuple(tuple(s) for s in out)

    def is_moe(self, layer: int) -> bool:
        return self.mlp_layer_types[layer] == "sparse"

    def has_indexer(self, layer: int) -> bool:
        return self.indexer_types[layer] == "full"

    @property
    def mtp_is_moe(self) -> bool:
        return self.n_routed_experts > 0 and self.first_k_dense_replace < self.num_hidden_layers

    def replace(self, **changes) -> "ModelConfig":
        if "num_hidden_layers" in changes or "first_k_dense_replace" in changes:
            changes.setdefault("mlp_layer_types", None)
        if {"num_hidden_layers", "index_topk_freq", "index_skip_topk_offset", "index_topk_pattern"} & changes.keys():
            changes.setdefault("indexer_types", None)
        return dataclasses.replace(self, **changes)

    # Hugging Face config.json ---------------------------------------------------------
    @classmethod
    def from_hf(cls, path_or_dict: str | os.PathLike | Mapping[str, Any], **overrides) -> "ModelConfig":
        """Reads a checkpoint directory, a config.json path, or its parsed dict."""
        if isinstance(path_or_dict, Mapping):
            hf = dict(path_or_dict)
        else:
            path = os.fspath(path_or_dict)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            with open(path) as f:
                hf = json.load(f)
        model_type = hf.get("model_type", "glm_moe_dsa")
        if model_type not in MODEL_TYPES:
            raise ValueError(f"config.json model_type={model_type!r} is not supported: expected one of {MODEL_TYPES}")
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        if "type" in rope and "rope_type" not in rope:
            rope["rope_type"] = rope.pop("type")
        rope.setdefault("rope_type", "default")
        rope.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
        if rope["rope_type"] == "yarn":
            rope.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings"))
        names = {f.name for f in dataclasses.fields(cls)} - set(RUNTIME_FIELDS) - {"rope_parameters"}
        kwargs = {k: hf[k] for k in names if k in hf}
        kwargs["model_type"] = model_type
        kwargs["rope_parameters"] = rope
        kwargs.setdefault("num_nextn_predict_layers", 0)
        kwargs.update(overrides)
        return cls(**kwargs)

    def to_hf(self) -> dict[str, Any]:
        """The config.json dict transformers' GlmMoeDsaConfig / DeepseekV32Config read."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name not in RUNTIME_FIELDS + ("index_topk_pattern",)}
        out["rope_parameters"] = self.rope
        out["mlp_layer_types"] = list(self.mlp_layer_types)
        out["indexer_types"] = list(self.indexer_types)
        if isinstance(self.eos_token_id, tuple):
            out["eos_token_id"] = list(self.eos_token_id)
        if self.model_type == "deepseek_v32":
            del out["indexer_types"], out["index_topk_freq"], out["index_skip_topk_offset"]
        out["architectures"] = [_HF_ARCHITECTURES[self.model_type]]
        out["head_dim"] = self.qk_rope_head_dim
        out["qk_head_dim"] = self.qk_head_dim
        out["dtype"] = self.param_dtype
        return out


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature, `0.1 * mscale * ln(scale) + 1` (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0
