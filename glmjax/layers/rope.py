"""Rotary position embeddings: default and YaRN frequencies; interleaved and half-split pairs.

GLM-5 and DeepSeek-V3.2 rope interleaved pairs `(x0, x1), (x2, x3), ...` in MLA; the
DeepSeek-V3.2 indexer ropes the two halves `(x_i, x_{i+R/2})`. Both are written here the
way transformers writes them: the rotated evens (or first halves) followed by the rotated
odds (or second halves), so a rotated query and key stay in one shared layout.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from glmjax.config import ModelConfig, yarn_mscale


def inverse_frequencies(config: ModelConfig) -> tuple[np.ndarray, float]:
    """`(inv_freq [R/2], attention_factor)` for the config's RoPE (YaRN, arXiv 2309.00071)."""
    rope, dim = config.rope, config.qk_rope_head_dim
    base = float(rope["rope_theta"])
    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
    if rope.get("rope_type", "default") == "default":
        return (1.0 / pos_freqs).astype(np.float32), 1.0

    factor = float(rope["factor"])
    original = rope["original_max_position_embeddings"]
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all = rope.get("mscale"), rope.get("mscale_all_dim")
        if mscale and mscale_all:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def correction_dim(rotations):
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq.astype(np.float32), float(attention_factor)


def rope_tables(config: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin [B, T, R/2] (fp32) for integer positions [B, T]."""
    inv_freq, attention_factor = inverse_frequencies(config)
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    return jnp.cos(angles) * attention_factor, jnp.sin(angles) * attention_factor


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, *, interleaved: bool) -> jax.Array:
    """Rotates x [B, T, ..., R] by cos/sin [B, T, R/2], broadcasting over the middle axes."""
    extra = x.ndim - cos.ndim
    cos = cos.reshape(cos.shape[:2] + (1,) * extra + cos.shape[2:]).astype(x.dtype)
    sin = sin.reshape(sin.shape[:2] + (1,) * extra + sin.shape[2:]).astype(x.dtype)
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
