"""The DSA lightning indexer (DeepSeek-V3.2) and its training loss.

For each query it scores every visible key cheaply and keeps the top k; MLA then attends
only to those keys. With IndexShare (arXiv 2603.12201) only "full" layers own an indexer,
and the next "shared" layers reuse its selection.

    q_I = wq_b(qr)                 [B, T, G, I]   qr: MLA's normalised query latent
    k_I = layernorm(wk(x))         [B, S, I]      one key per token, cached beside c_kv
    w   = weights_proj(x) * G^-0.5 [B, T, G]      fp32
    I[t, s] = sum_g w[t, g] relu(q_I[t, g] . k_I[s] / sqrt(I)),  causal, then top-k.

RoPE covers the first R dims of q_I and k_I (interleaved for GLM, halves for DeepSeek).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from glmjax.config import ModelConfig
from glmjax.layers.norms import layer_norm
from glmjax.layers.rope import apply_rope
from glmjax.layers import kernels

INDEXER_KEY_NORM_EPS = 1e-6


class Indexer(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        c = config
        pdt = jnp.dtype(c.param_dtype)
        init = nnx.initializers.normal(c.initializer_range)
        keys = iter(jax.random.split(rngs.params(), 3))  # one draw from rngs per module
        g, i = c.index_n_heads, c.index_head_dim
        self.wq_b = nnx.Param(init(next(keys), (c.q_lora_rank, g, i), pdt),
                              logical_axes=("q_lora", "index_heads", "index_dim"))  # [Q, G, I]
        self.wk = nnx.Param(init(next(keys), (c.hidden_size, i), pdt), logical_axes=("embed", "index_dim"))  # [D, I]
        self.k_norm_weight = nnx.Param(jnp.ones((i,), pdt), logical_axes=("norm",))
        self.k_norm_bias = nnx.Param(jnp.zeros((i,), pdt), logical_axes=("norm",))
        # fp32 always, as in the reference: the head weights decide the ranking.
        self.weights_proj = nnx.Param(init(next(keys), (c.hidden_size, g), jnp.float32),
                                      logical_axes=("embed", "index_heads"))  # [D, G]
        self.config = config

    def _rope(self, x, cos, sin):
        r = self.config.qk_rope_head_dim
        rot = apply_rope(x[..., :r], cos, sin, interleaved=self.config.indexer_rope_interleaved)
        return jnp.concatenate([rot, x[..., r:]], axis=-1)

    def keys(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        """x [B, T, D] -> k_I [B, T, I]."""
        k = jnp.einsum("BTD,DI->BTI", x, self.wk[...].astype(x.dtype))
        k = layer_norm(k, self.k_norm_weight[...], self.k_norm_bias[...], INDEXER_KEY_NORM_EPS)
        return self._rope(k, cos, sin)

    def queries(self, qr: jax.Array, x: jax.Array, cos: jax.Array, sin: jax.Array):
        """qr [B, T, Q], x [B, T, D] -> q_I [B, T, G, I], w [B, T, G] (fp32)."""
        q = self._rope(jnp.einsum("BTQ,QGI->BTGI", qr, self.wq_b[...].astype(qr.dtype)), cos, sin)
        w = jnp.einsum("BTD,DG->BTG", x.astype(jnp.float32), self.weights_proj[...])
        return q, w * self.config.index_n_heads ** -0.5

    def select(self, qr, x, cos, sin, k_all, q_pos, topk: int) -> jax.Array:
        """Top-k key positions [B, T, P] over the keys k_all [B, S, I]; -1 marks empty slots."""
        q, w = self.queries(qr, x, cos, sin)
        return kernels.get("indexer_topk", self.config.kernel_impl)(q, w, k_all, q_pos, topk=topk)


def indexer_kl(p_attn: jax.Array, index_scores: jax.Array, valid: jax.Array) -> jax.Array:
    """KL(p || softmax(I)) averaged over queries: the indexer's distillation loss (DSA).

    p_attn [B, T, S] is the main attention summed over heads and L1-normalised (no
    gradient); index_scores [B, T, S] the indexer's scores over the same key set (the
    causal keys in the dense warm-up, the selected keys in the sparse stage); valid marks
    the keys in that set. Returns a scalar.
    """
    p = jax.lax.stop_gradient(jnp.where(valid, p_attn, 0.0))
    p = p / jnp.maximum(p.sum(-1, keepdims=True), 1e-30)
    log_q = jax.nn.log_softmax(jnp.where(valid, index_scores, -1e30), axis=-1)
    kl = jnp.sum(jnp.where(valid & (p > 0), p * (jnp.log(jnp.maximum(p, 1e-30)) - log_q), 0.0), axis=-1)
    return jnp.mean(kl)
