"""The multi-token-prediction module (DeepSeek-V3 MTP; `layers.{num_hidden_layers}` on disk).

    h' = eh_proj(concat[enorm(embed(token_{t+1})), hnorm(h_t)])       [B, T, D]
    h'' = DecoderLayer(h')                  (MLA with its own indexer, MoE)
    logits_{t+2} = lm_head(shared_head.norm(h''))

h_t is the main model's last hidden state before its final norm; the embedding and the
LM head are the main model's. Drafting k tokens reuses the module k times, feeding h''
back as h. Its attention reads its own cache, or (GLM-5.3) the main model's last-layer
cache and top-k selection, passed as an `mla.Context`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from glmjax.config import ModelConfig
from glmjax.layers.decoder import DecoderLayer, LayerOut
from glmjax.layers.norms import RMSNorm


class MTP(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        c = config
        pdt = jnp.dtype(c.param_dtype)
        d = c.hidden_size
        self.enorm = RMSNorm(d, c.rms_norm_eps, param_dtype=pdt)
        self.hnorm = RMSNorm(d, c.rms_norm_eps, param_dtype=pdt)
        self.eh_proj = nnx.Param(nnx.initializers.normal(c.initializer_range)(rngs.params(), (2 * d, d), pdt),
                                 logical_axes=(None, "embed"))
        self.block = DecoderLayer(c, None, rngs=rngs)
        self.head_norm = RMSNorm(d, c.rms_norm_eps, param_dtype=pdt)

    def __call__(self, h, next_embeds, cos, sin, q_pos, *, cache=None, context=None) -> tuple[jax.Array, LayerOut]:
        """h [B, T, D] main hidden at t, next_embeds [B, T, D] embeddings of token t+1.
        cache: the layer's own LayerCache (written); context: an mla.Context, another
        layer's cache to attend over instead (the main model's last layer; read only).
        Returns (normed hidden for the LM head [B, T, D], the block's output)."""
        x = jnp.concatenate([self.enorm(next_embeds), self.hnorm(h)], axis=-1)
        x = x @ self.eh_proj[...].astype(x.dtype)
        out = self.block(x, cos, sin, q_pos, cache=cache, context=context)
        return self.head_norm(out.x), out
