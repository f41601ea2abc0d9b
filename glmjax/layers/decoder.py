"""One transformer block: pre-norm MLA, then pre-norm MoE (or dense MLP), both residual."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from glmjax.cache import LayerCache
from glmjax.config import ModelConfig
from glmjax.layers.mla import MLA
from glmjax.layers.moe import MLP, MoE
from glmjax.layers.norms import RMSNorm


class LayerOut(NamedTuple):
    x: jax.Array  # [B, T, D]
    cache: LayerCache | None
    topk: jax.Array | None
    indexer_loss: jax.Array | None
    expert_load: jax.Array | None  # [E] on MoE layers
    routes: jax.Array | None  # [B, T, X] on MoE layers: the router's own choice of experts


class DecoderLayer(nnx.Module):
    def __init__(self, config: ModelConfig, layer: int | None, *, rngs: nnx.Rngs):
        """layer: the index in the main stack, or None for the MTP block (full indexer, MoE)."""
        c = config
        pdt = jnp.dtype(c.param_dtype)
        self.input_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, param_dtype=pdt)
        self.attn = MLA(c, layer, rngs=rngs)
        self.post_attn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, param_dtype=pdt)
        moe = c.mtp_is_moe if layer is None else c.is_moe(layer)
        self.mlp = MoE(c, rngs=rngs) if moe else MLP(
            c.hidden_size, c.intermediate_size, init_std=c.initializer_range, param_dtype=pdt, rngs=rngs)

    def __call__(self, x, cos, sin, q_pos, *, cache=None, shared_topk=None, indexer_loss=None,
                 context=None, route_replay=None) -> LayerOut:
        """route_replay [B, T, X]: the experts each token runs on a MoE layer (moe.Router)."""
        a = self.attn(self.input_norm(x), cos, sin, q_pos, cache=cache, shared_topk=shared_topk,
                      indexer_loss=indexer_loss, context=context)
        x = x + a.out
        h = self.post_attn_norm(x)
        if isinstance(self.mlp, MoE):
            y, load, routes = self.mlp(h, route_replay)
        else:
            y, load, routes = self.mlp(h), None, None
        return LayerOut(x + y, a.cache, a.topk, a.indexer_loss, load, routes)
