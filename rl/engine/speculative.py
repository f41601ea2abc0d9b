"""MTP speculative decoding: draft K tokens with the MTP layer, verify them in one forward.

One engine step for a slot holding its pending token x_0 and drafts d_1..d_K:

  1. The main model runs [x_0, d_1 .. d_K] (K + 1 tokens) at positions L .. L+K.
  2. Rejection sampling (Leviathan et al. 2023, "Fast Inference from Transformers via
     Speculative Decoding", Algorithm 1): draft d_j, drawn from q_j, is kept with
     probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection the token is drawn
     from norm(max(0, p_j - q_j)), and when all K are kept a bonus token from p_{K+1}.
     Output tokens follow p exactly. Greedy slots have one-hot p and q, so a draft is
     kept iff it is the target's argmax, and the output equals plain greedy decoding.
  3. The cache length rolls back to L + a + 1 (a drafts accepted): entries past a row's
     length are invisible (key s is seen from q_pos only if s <= q_pos) and are
     overwritten by later steps.
  4. New drafts for the next step, from the main hidden state at the last accepted
     position and the token that follows it.

The draft layer sees its context in one of two ways (`mode`):
  * "own": the MTP layer's own latent cache (released GLM-5 checkpoints, SGLang). Step 4
    first writes the MTP cache at the K + 1 verified positions from the true main hidden
    states, then drafts K - 1 more tokens one at a time, feeding the MTP output back.
  * "shared": no MTP cache and no MTP indexer run (the GLM-5.3 description): the MTP
    queries attend over the main model's last-layer latents (c_kv, k_rope) of the
    committed positions, with the top-k selection the main model's last layer made for
    the last committed position.
Training drafts as serving does, at every depth: glmjax/train.py's `mtp_draft_logits`
and the multi-depth `mtp_loss`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from glmjax.cache import KVCache
from glmjax.layers.mla import Context
from glmjax.sampling import sample, sampling_logprobs
from glmjax.train import MTP_MODES

MODES = MTP_MODES  # how the draft layer sees its context (module docstring)


def _sample_draft(key, logits, temperature, top_k, max_top_k):
    logp = sampling_logprobs(logits, temperature, top_k, max_top_k)  # [B, N]
    return sample(key, logp), logp


def draft_own(model, hidden, next_ids, mtp_cache, lengths, last, num_draft, temperature, top_k, keys, max_top_k):
    """Drafts with the MTP layer's own cache.

    hidden [B, T, D] main hidden states at positions lengths + (0..T-1), next_ids [B, T]
    the token after each; writes those T MTP cache entries. Drafting starts from index
    last [B] (the last committed position). keys [num_draft, B].
    Returns (drafts [B, K], draft log-probs [B, K, N], the MTP cache)."""
    out = model.mtp_forward(hidden, next_ids, cache=mtp_cache, lengths=lengths)
    rows = jnp.arange(hidden.shape[0])
    tok, logp = _sample_draft(keys[0], out.logits[rows, last], temperature, top_k, max_top_k)

    def step(carry, key):  # one more draft: it needs the previous one, so one token at a time
        tok, h, cache, pos = carry
        out = model.mtp_forward(h[:, None], tok[:, None], cache=cache, lengths=pos)
        nxt, logp = _sample_draft(key, out.logits[:, 0], temperature, top_k, max_top_k)
        return (nxt, out.hidden[:, 0], out.cache, pos + 1), (nxt, logp)

    init = (tok, out.hidden[rows, last], out.cache, lengths + last + 1)
    (_, _, cache, _), (toks, logps) = jax.lax.scan(step, init, keys[1:])
    drafts = jnp.concatenate([tok[:, None], toks.T], axis=1)
    return drafts, jnp.concatenate([logp[:, None], jnp.moveaxis(logps, 0, 1)], axis=1), cache


def draft_shared(model, hidden, next_tok, pos, main_cache: KVCache, topk, num_draft, temperature, top_k, keys,
                 max_top_k):
    """Drafts with the main model's last-layer latents and top-k ("shared" mode).

    hidden [B, D] main hidden at the last committed position pos [B]; next_tok [B] the
    token after it; topk [B, P] that position's selection or None. keys [num_draft, B].
    Returns (drafts [B, K], draft log-probs [B, K, N])."""
    vis = pos[:, None]
    context = Context(main_cache.layer(-1), vis, None if topk is None else topk[:, None])

    def step(carry, key):
        tok, h, q_pos = carry
        out = model.mtp_forward(h, tok[:, None], positions=q_pos, context=context)
        nxt, logp = _sample_draft(key, out.logits[:, 0], temperature, top_k, max_top_k)
        return (nxt, out.hidden, q_pos + 1), (nxt, logp)

    _, (drafts, logps) = jax.lax.scan(step, (next_tok, hidden[:, None], vis), keys)
    return drafts.T, jnp.moveaxis(logps, 0, 1)


def accept(target_logp, draft_logp, drafts, accept_keys, bonus_keys):
    """Speculative rejection sampling (module docstring, step 2).

    target_logp [B, K+1, N] the target's sampling log-probs at the K + 1 verified
    positions; draft_logp [B, K, N] and drafts [B, K] what the drafter sampled from;
    accept_keys, bonus_keys [B]. Returns (accepted [B] in 0..K, tokens [B, K+1]: the
    accepted drafts, then the correction or bonus token at index `accepted`)."""
    b, k1, n = target_logp.shape
    k = k1 - 1
    p = jnp.exp(target_logp)
    if k:
        q = jnp.exp(draft_logp)
        p_d = jnp.take_along_axis(p[:, :k], drafts[..., None], -1)[..., 0]  # [B, K]
        q_d = jnp.take_along_axis(q, drafts[..., None], -1)[..., 0]
        u = jax.vmap(lambda key: jax.random.uniform(key, (k,)))(accept_keys)
        kept = u * q_d < p_d
        accepted = jnp.sum(jnp.cumprod(kept, axis=1), axis=1).astype(jnp.int32)
        q_pad = jnp.concatenate([q, jnp.zeros((b, 1, n), q.dtype)], axis=1)  # no draft after the last
    else:
        accepted = jnp.zeros((b,), jnp.int32)
        q_pad = jnp.zeros_like(p)
    rows = jnp.arange(b)
    p_j, q_j = p[rows, accepted], q_pad[rows, accepted]  # [B, N]
    residual = jnp.maximum(p_j - q_j, 0.0)
    residual = jnp.where(residual.sum(-1, keepdims=True) > 0, residual, p_j)  # p == q: nothing rejected
    bonus = sample(bonus_keys, jnp.log(residual))
    padded = jnp.concatenate([drafts, jnp.zeros((b, 1), jnp.int32)], axis=1) if k else jnp.zeros((b, 1), jnp.int32)
    tokens = jnp.where(jnp.arange(k1) == accepted[:, None], bonus[:, None], padded)
    return accepted, tokens
