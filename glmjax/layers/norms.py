"""RMSNorm (every norm of the transformer) and LayerNorm (the indexer's key norm)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """`w * x / sqrt(mean(x^2) + eps)`, the statistics in fp32, the result in x's dtype."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight.astype(x.dtype) * x32.astype(x.dtype)


def layer_norm(x: jax.Array, weight: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + eps) * weight.astype(jnp.float32) + bias.astype(jnp.float32)
    return y.astype(x.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, param_dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype), logical_axes=("norm",))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight[...], self.eps)


class LayerNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, param_dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype), logical_axes=("norm",))
        self.bias = nnx.Param(jnp.zeros((dim,), param_dtype), logical_axes=("norm",))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return layer_norm(x, self.weight[...], self.bias[...], self.eps)
