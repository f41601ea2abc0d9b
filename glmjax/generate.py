"""Batched generation for library users: one prefill, then a compiled decode loop on the cache.

The prefill and each step are glmjax/decoding.py's, the functions the rollout engine
(rl/engine/engine.py) runs; here the whole generation is one compiled call (a scan over the
steps), with no slots or scheduling, so a script gets at least the engine's speed.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from glmjax import decoding
from glmjax.cache import KVCache
from glmjax.model import GlmForCausalLM
from glmjax.sampling import sample, split_keys


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "max_len", "max_top_k"))
def _generate(graphdef, state, input_ids, keys, temperature, top_k, eos, *, max_new_tokens, max_len, max_top_k):
    model = nnx.merge(graphdef, state)
    b, t = input_ids.shape
    keys, sub = split_keys(keys, 1)
    first = decoding.prefill(model, KVCache.init(model.config, b, max_len), input_ids, jnp.full((b,), t, jnp.int32),
                             temperature, top_k, sub[0], max_top_k)

    def step(carry, _):
        token, cache, keys, done = carry
        out, logp = decoding.step(model, cache, token[:, None], temperature, top_k, max_top_k)
        keys, sub = split_keys(keys, 1)
        nxt = sample(sub[0], logp[:, 0])
        done = done | (token == eos)
        nxt = jnp.where(done, eos, nxt)
        return (nxt, out.cache, keys, done), token

    done = jnp.zeros((b,), bool)
    (last, _, _, _), tokens = jax.lax.scan(step, (first.token, first.cache, keys, done), None,
                                           length=max_new_tokens - 1)
    tokens = jnp.concatenate([tokens.T, last[:, None]], axis=1) if max_new_tokens > 1 else first.token[:, None]
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

    Greedy at temperature 0.0, else sampled from softmax(logits / temperature), restricted
    to the top_k most likely tokens when top_k is given; each row draws from its own key
    (split from `seed`). With eos_token_id, a sequence that emits it is padded with it
    from then on.
    """
    input_ids = jnp.asarray(input_ids, jnp.int32)
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be [B, T], got shape {input_ids.shape}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if top_k is not None and not 1 <= top_k <= model.config.vocab_size:
        raise ValueError(f"top_k={top_k} must lie in [1, vocab_size={model.config.vocab_size}]")
    max_len = input_ids.shape[1] + max_new_tokens
    if max_len > model.config.max_position_embeddings:
        raise ValueError(f"prompt + max_new_tokens = {max_len} exceeds max_position_embeddings="
                         f"{model.config.max_position_embeddings}")
    b = input_ids.shape[0]
    graphdef, state = nnx.split(model)
    eos = jnp.int32(-1 if eos_token_id is None else eos_token_id)
    keys = jax.random.split(jax.random.key(seed), b)
    return _generate(graphdef, state, input_ids, keys, jnp.full((b,), temperature, jnp.float32),
                     jnp.full((b,), top_k or 0, jnp.int32), eos, max_new_tokens=max_new_tokens, max_len=max_len,
                     max_top_k=top_k or 0)
