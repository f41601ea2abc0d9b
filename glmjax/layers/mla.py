"""Multi-head Latent Attention (DeepSeek-V2/V3) with DSA top-k selection.

    qr      = rmsnorm(x @ W_qa)                          [B, T, Q]
    q       = qr @ W_qb -> [q_nope | q_rope]             [B, T, H, K], [B, T, H, R]
    c_kv    = rmsnorm((x @ W_kva)[:C]),  k_rope = rope((x @ W_kva)[C:])   [B, S, C], [B, S, R]
    k_nope  = c_kv @ W_UK,   v = c_kv @ W_UV             (never formed: absorbed below)

Absorption: q_nope . k_nope = (q_nope @ W_UK^T) . c_kv, so attention runs as MQA with one
(C + R)-wide key whose first C dims are also the value:

    o = softmax(scale * (q_c . c_kv + q_rope . k_rope)) @ c_kv @ W_UV,   q_c = q_nope @ W_UK

W_UK [C, H, K] and W_UV [C, H, V] are separate parameters (HF's kv_b_proj split once at
import), so training and decoding read the same arrays. The cache holds only c_kv and
k_rope per token (plus the indexer key on layers that own an indexer).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from glmjax.cache import LayerCache
from glmjax.config import ModelConfig
from glmjax.layers.indexer import Indexer, indexer_kl
from glmjax.layers.norms import rms_norm
from glmjax.layers.rope import apply_rope
from glmjax.layers import kernels
from pallas_kernels import reference

LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm use the RMSNorm default, not rms_norm_eps


class Context(NamedTuple):
    """Another layer's cached keys, read and never written: the MTP layer drafting over the
    main model's last-layer latents (rl/engine/speculative.py, "shared" mode)."""

    cache: LayerCache  # [B, S, ...]: c_kv and k_rope are read
    visible: jax.Array  # [B, T] the last key position each query may see
    topk: jax.Array | None  # [B, T, P] the selection to attend over; None: every visible key


class AttentionOut(NamedTuple):
    out: jax.Array  # [B, T, D]
    cache: LayerCache | None
    topk: jax.Array | None  # [B, T, P] selection for the shared layers that follow; None if dense
    indexer_loss: jax.Array | None  # scalar KL, when asked for


class MLA(nnx.Module):
    def __init__(self, config: ModelConfig, layer: int | None, *, rngs: nnx.Rngs):
        """layer: index into config.indexer_types; None for the MTP layer (always full)."""
        c = config
        pdt = jnp.dtype(c.param_dtype)
        init = nnx.initializers.normal(c.initializer_range)
        keys = iter(jax.random.split(rngs.params(), 6))  # one draw from rngs per module
        h, k, r, v = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        self.q_a = nnx.Param(init(next(keys), (c.hidden_size, c.q_lora_rank), pdt), logical_axes=("embed", "q_lora"))  # [D, Q]
        self.q_a_norm = nnx.Param(jnp.ones((c.q_lora_rank,), pdt), logical_axes=("norm",))
        self.q_b = nnx.Param(init(next(keys), (c.q_lora_rank, h, k + r), pdt),
                             logical_axes=("q_lora", "heads", "head_dim"))  # [Q, H, K+R]
        self.kv_a = nnx.Param(init(next(keys), (c.hidden_size, c.kv_lora_rank + r), pdt),
                              logical_axes=("embed", "kv_lora"))  # [D, C+R]
        self.kv_a_norm = nnx.Param(jnp.ones((c.kv_lora_rank,), pdt), logical_axes=("norm",))
        self.w_uk = nnx.Param(init(next(keys), (c.kv_lora_rank, h, k), pdt),
                              logical_axes=("kv_lora", "heads", "head_dim"))  # [C, H, K]
        self.w_uv = nnx.Param(init(next(keys), (c.kv_lora_rank, h, v), pdt),
                              logical_axes=("kv_lora", "heads", "head_dim"))  # [C, H, V]
        self.o_proj = nnx.Param(init(next(keys), (h, v, c.hidden_size), pdt),
                                logical_axes=("heads", "head_dim", "embed"))  # [H, V, D]
        owns_indexer = layer is None or c.has_indexer(layer)
        self.indexer = Indexer(c, rngs=rngs) if owns_indexer else None
        self.config = config

    def __call__(
        self,
        x: jax.Array,
        cos: jax.Array,
        sin: jax.Array,
        q_pos: jax.Array,
        *,
        cache: LayerCache | None = None,
        shared_topk: jax.Array | None = None,
        indexer_loss: str | None = None,
        context: Context | None = None,
    ) -> AttentionOut:
        """x [B, T, D]; cos/sin [B, T, R/2]; q_pos [B, T] absolute positions.

        Without a cache the keys are the T tokens themselves. With one, the new latents are
        written at q_pos and the queries attend over the whole cache (key s at position s).
        shared_topk: the selection of the previous full layer, used when this layer has no
        indexer. indexer_loss: None, "dense" (warm-up: dense attention, KL over all causal
        keys) or "sparse" (KL over the selected keys); the indexer sees detached inputs.
        context: attend over another layer's cached keys instead (nothing of this layer's own
        is computed or written, no indexer runs; AttentionOut.cache is None).
        """
        c = self.config
        dt = x.dtype
        w = lambda p: p[...].astype(dt)  # noqa: E731
        cdim = c.kv_lora_rank

        qr = rms_norm(jnp.einsum("BTD,DQ->BTQ", x, w(self.q_a)), self.q_a_norm[...], LATENT_NORM_EPS)
        q = jnp.einsum("BTQ,QHE->BTHE", qr, w(self.q_b))
        q_nope, q_rope = q[..., : c.qk_nope_head_dim], q[..., c.qk_nope_head_dim :]
        q_rope = apply_rope(q_rope, cos, sin, interleaved=True)

        if context is not None:
            if indexer_loss:
                raise ValueError("indexer_loss needs the layer's own keys; it cannot be combined with a context")
            c_all, r_all = context.cache.c_kv.astype(dt), context.cache.k_rope.astype(dt)
            key_pos, topk = context.visible, context.topk
        else:
            kv = jnp.einsum("BTD,DE->BTE", x, w(self.kv_a))
            c_kv = rms_norm(kv[..., :cdim], self.kv_a_norm[...], LATENT_NORM_EPS)
            k_rope = apply_rope(kv[..., cdim:], cos, sin, interleaved=True)

            x_idx, qr_idx = (jax.lax.stop_gradient(x), jax.lax.stop_gradient(qr)) if indexer_loss else (x, qr)
            index_k = self.indexer.keys(x_idx, cos, sin) if self.indexer is not None else None

            if cache is not None:
                cache = cache.write(q_pos, c_kv, k_rope, index_k)
                c_all, r_all, k_all = cache.c_kv, cache.k_rope, cache.index_k
            else:
                c_all, r_all, k_all = c_kv, k_rope, index_k

            # DSA selection. When top-k covers every key it selects all visible keys, which is
            # dense causal attention: skip the indexer's scoring then (its keys are still cached).
            num_keys = c_all.shape[1]
            sparse = c.index_topk < num_keys and indexer_loss != "dense"
            topk = None
            if self.indexer is not None:
                if sparse:
                    topk = self.indexer.select(qr_idx, x_idx, cos, sin, k_all, q_pos, c.index_topk)
            elif sparse:
                if shared_topk is None:
                    raise ValueError("a shared-indexer layer needs the top-k of an earlier full layer")
                topk = shared_topk
            key_pos = q_pos

        q_c = jnp.einsum("BTHK,CHK->BTHC", q_nope, w(self.w_uk))
        scale = c.softmax_scale
        if topk is None:
            o_c = kernels.get("mla_attention", c.kernel_impl)(q_c, q_rope, c_all, r_all, key_pos, scale=scale)
        else:
            o_c = kernels.get("sparse_mla_attention", c.kernel_impl)(q_c, q_rope, c_all, r_all, key_pos, topk,
                                                                  scale=scale)
        o = jnp.einsum("BTHC,CHV->BTHV", o_c, w(self.w_uv))
        out = jnp.einsum("BTHV,HVD->BTD", o, w(self.o_proj))

        loss = None
        if indexer_loss and self.indexer is not None:
            loss = self._indexer_loss(qr_idx, x_idx, cos, sin, k_all, q_pos, q_c, q_rope, c_all, r_all, topk)
        return AttentionOut(out, cache, topk, loss)

    def _indexer_loss(self, qr, x, cos, sin, k_all, q_pos, q_c, q_rope, c_all, r_all, topk):
        """KL between the head-summed main attention and the indexer's distribution."""
        target = reference.mla_attention_probs(
            *(jax.lax.stop_gradient(a) for a in (q_c, q_rope, c_all, r_all)), q_pos, scale=self.config.softmax_scale
        )
        q, w = self.indexer.queries(qr, x, cos, sin)
        scores = reference.indexer_scores(q, w, k_all, q_pos)
        valid = jnp.isfinite(scores)
        if topk is not None:  # sparse stage: both distributions over the selected set only
            n = scores.shape[-1]
            mark = lambda idx: jnp.zeros(n, bool).at[jnp.where(idx >= 0, idx, n)].set(True, mode="drop")  # noqa: E731
            selected = jax.vmap(jax.vmap(mark))(topk)
            valid = valid & selected
        return indexer_kl(target, jnp.where(valid, scores, 0.0), valid)
