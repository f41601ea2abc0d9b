"""The two compiled pieces of decoding on a KV cache, shared by glmjax.generate and the
rollout engine (rl/engine/engine.py), so that a script's generation and the RL job's rollouts run
the same functions:

    prefill  ids [B, T] after the cache: each row's `true_length` first tokens are real;
             the cache's lengths advance by them and the next token is sampled at each
             row's last real position
    step     fed [B, K+1] (the pending token, then K speculative drafts) after the cache:
             its forward and the distribution every position samples from

Sampling is per row (glmjax/sampling.py): temperature [B] (0 greedy), top_k [B] (0 off,
at most the static max_top_k), a key per row.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from glmjax.cache import KVCache
from glmjax.model import GlmForCausalLM, ModelOutput
from glmjax.sampling import sample, sampling_logprobs, token_logprobs


class Prefilled(NamedTuple):
    out: ModelOutput  # the forward of ids, logits [B, 1, N] at the last real token; out.cache is
    # `cache` below before its lengths were set
    cache: KVCache  # lengths = the old lengths + true_length
    token: jax.Array  # [B] the sampled next token
    log_prob: jax.Array  # [B] its behaviour log-prob (glmjax/sampling.token_logprobs)


def prefill(model: GlmForCausalLM, cache: KVCache, ids: jax.Array, true_length: jax.Array,
            temperature: jax.Array, top_k: jax.Array, key: jax.Array, max_top_k: int) -> Prefilled:
    """ids [B, T] int32 after cache [B, S]; true_length, temperature, top_k, key [B]."""
    start = cache.lengths  # [B]
    out = model(ids, cache=cache, logits_at=(true_length - 1)[:, None])
    logits = out.logits[:, 0]  # [B, N] at each row's last real token
    logp = sampling_logprobs(logits, temperature, top_k, max_top_k)
    token = sample(key, logp)
    return Prefilled(out, out.cache._replace(lengths=start + true_length), token,
                     token_logprobs(logits, logp, token, temperature))


def step(model: GlmForCausalLM, cache: KVCache, fed: jax.Array, temperature: jax.Array, top_k: jax.Array,
         max_top_k: int) -> tuple[ModelOutput, jax.Array]:
    """fed [B, K+1] after cache [B, S] -> (the forward, whose cache has lengths + K + 1;
    log-probs [B, K+1, N] each position samples from). The caller decides how many of the
    K + 1 positions it keeps (speculative acceptance) and sets the lengths to match."""
    out = model(fed, cache=cache)
    return out, sampling_logprobs(out.logits, temperature, top_k, max_top_k)
