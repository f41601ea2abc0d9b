"""Batched generation for library users: one prefill, then a compiled decode loop on the cache.

The rollout engine (rl/engine.py) is the serving path with slots and continuous
batching; this is the simple call for scripts and tests.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from glmjax.cache import KVCache
from glmjax.model import GlmForCausalLM


def sample_token(logits: jax.Array, rng: jax.Array, temperature: float, top_k: int | None) -> jax.Array:
    """logits [B, N] -> token ids [B]: argmax at temperature 0, else softmax(logits / T) sampling,
    optionally restricted to the top_k most likely tokens."""
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_k is not None:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(rng, logits, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "max_len", "temperature", "top_k"))
def _generate(graphdef, state, input_ids, rng, eos, *, max_new_tokens, max_len, temperature, top_k):
    model = nnx.merge(graphdef, state)
    b = input_ids.shape[0]
    cache = KVCache.init(model.config, b, max_len)
    out = model(input_ids, cache=cache)
    rng, sub = jax.random.split(rng)
    first = sample_token(out.logits[:, -1], sub, temperature, top_k)

    def step(carry, _):
        token, cache, rng, done = carry
        out = model(token[:, None], cache=cache)
        rng, sub = jax.random.split(rng)
        nxt = sample_token(out.logits[:, -1], sub, temperature, top_k)
        done = done | (token == eos)
        nxt = jnp.where(done, eos, nxt)
        return (nxt, out.cache, rng, done), token

    done = jnp.zeros((b,), bool)
    (last, _, _, _), tokens = jax.lax.scan(step, (first, out.cache, rng, done), None, length=max_new_tokens - 1)
    tokens = jnp.concatenate([tokens.T, last[:, None]], axis=1) if max_new_tokens > 1 else first[:, None]
    return jnp.concatenate([input_ids, tokens], axis=1)


def generate(
    model: GlmForCausalLM,
    input_ids,
    max_new_tokens: int,
    temperature: float = 0.0,
    *,
    top_k: int | None = None,
    seed: int = 0,
    eos_token_id: int | None = None,
) -> jax.Array:
    """input_ids [B, T] (equal-length prompts) -> [B, T + max_new_tokens] token ids.

    Greedy at temperature 0.0, else sampled. With eos_token_id, a sequence that emits it
    is padded with it from then on.
    """
    input_ids = jnp.asarray(input_ids, jnp.int32)
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be [B, T], got shape {input_ids.shape}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    max_len = input_ids.shape[1] + max_new_tokens
    if max_len > model.config.max_position_embeddings:
        raise ValueError(f"prompt + max_new_tokens = {max_len} exceeds max_position_embeddings="
                         f"{model.config.max_position_embeddings}")
    graphdef, state = nnx.split(model)
    eos = jnp.int32(-1 if eos_token_id is None else eos_token_id)
    return _generate(graphdef, state, input_ids, jax.random.key(seed), eos, max_new_tokens=max_new_tokens,
                     max_len=max_len, temperature=float(temperature), top_k=top_k)
