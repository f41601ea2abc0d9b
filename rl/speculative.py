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
Training should draft as serving does, at every depth: `mtp_draft_logits`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from glmjax.cache import KVCache
from glmjax.layers.mla import LATENT_NORM_EPS
from glmjax.layers.moe import MoE
from glmjax.layers.norms import rms_norm
from glmjax.layers.rope import apply_rope, rope_tables
from pallas_kernels import ops
from rl.sampling import sample, sampling_logprobs

MODES = ("own", "shared")


def main_forward(model, ids: jax.Array, cache: KVCache):
    """`model(ids, cache=cache)` that also returns the last layer's top-k [B, T, P] (None
    when attention was dense): GlmForCausalLM.__call__'s cache path, which drops it.
    Returns (logits [B, T, N], hidden [B, T, D], cache, topk)."""
    q_pos = model.positions(ids, cache, None)
    cos, sin = rope_tables(model.config, q_pos)
    x, topk, layers = model.embed(ids), None, []
    for i, layer in enumerate(model.layers):
        out = layer(x, cos, sin, q_pos, cache=cache.layers[i], shared_topk=topk)
        x, topk = out.x, out.topk
        layers.append(out.cache)
    cache = cache._replace(layers=tuple(layers), lengths=cache.lengths + ids.shape[1])
    return model.head(model.norm(x)), x, cache, topk


def _shared_attention(attn, x, cos, sin, vis_pos, c_kv, k_rope, topk):
    """MLA's query path over given latents (no key of its own, no indexer): x [B, T, D]
    normed, vis_pos [B, T] the last key position each query may see, c_kv [B, S, C],
    k_rope [B, S, R], topk [B, T, P] or None. Returns [B, T, D]."""
    c, dt = attn.config, x.dtype
    w = lambda p: p[...].astype(dt)  # noqa: E731
    qr = rms_norm(jnp.einsum("BTD,DQ->BTQ", x, w(attn.q_a)), attn.q_a_norm[...], LATENT_NORM_EPS)
    q = jnp.einsum("BTQ,QHE->BTHE", qr, w(attn.q_b))
    q_nope, q_rope = q[..., : c.qk_nope_head_dim], q[..., c.qk_nope_head_dim:]
    q_rope = apply_rope(q_rope, cos, sin, interleaved=True)
    q_c = jnp.einsum("BTHK,CHK->BTHC", q_nope, w(attn.w_uk))
    c_kv, k_rope = c_kv.astype(dt), k_rope.astype(dt)
    if topk is None:
        o_c = ops.get("mla_attention", c.kernel_impl)(q_c, q_rope, c_kv, k_rope, vis_pos, scale=c.softmax_scale)
    else:
        o_c = ops.get("sparse_mla_attention", c.kernel_impl)(q_c, q_rope, c_kv, k_rope, vis_pos, topk,
                                                              scale=c.softmax_scale)
    o = jnp.einsum("BTHC,CHV->BTHV", o_c, w(attn.w_uv))
    return jnp.einsum("BTHV,HVD->BTD", o, w(attn.o_proj))


def mtp_shared(model, hidden, next_ids, q_pos, vis_pos, c_kv, k_rope, topk):
    """The MTP module in "shared" mode: hidden [B, T, D] at q_pos [B, T], next_ids [B, T];
    attention over the main last-layer latents up to vis_pos [B, T] with topk [B, T, P] or
    None. Returns (logits [B, T, N] of token t+2, MTP hidden [B, T, D])."""
    mtp = model.mtp
    cos, sin = rope_tables(model.config, q_pos)
    x = jnp.concatenate([mtp.enorm(model.embed(next_ids)), mtp.hnorm(hidden)], axis=-1)
    x = x @ mtp.eh_proj[...].astype(x.dtype)
    block = mtp.block
    x = x + _shared_attention(block.attn, block.input_norm(x), cos, sin, vis_pos, c_kv, k_rope, topk)
    h = block.post_attn_norm(x)
    x = x + (block.mlp(h)[0] if isinstance(block.mlp, MoE) else block.mlp(h))
    return model.head(mtp.head_norm(x)), x


def mtp_draft_logits(model, ids: jax.Array, num_draft: int, mode: str = "own") -> list[jax.Array]:
    """Training-time drafting at depths 1..num_draft, as the engine drafts: ids [B, T] ->
    logits_j [B, T-j, N] for j = 1..num_draft, row r (position r + j - 1) predicting
    ids[:, r + j + 1] (the last row has no target: train on logits_j[:, :-1] against
    ids[:, j + 1:]). Depth 1 reads the main hidden state; depth j > 1 the MTP output of
    depth j - 1 one position back, as drafts 2..K do at serving time. mode "own": MTP
    self-attention over its own latents of the same depth (no cache); "shared": the main
    last layer's latents and top-k at the last committed position (position - j + 1)."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is invalid: expected one of {MODES}")
    b, t = ids.shape
    pos = model.positions(ids, None, None)
    if mode == "own":
        hidden = model(ids).hidden
    else:
        _, hidden, cache, topk = main_forward(model, ids, KVCache.init(model.config, b, t))
        last = cache.layers[-1]
    h, out = hidden[:, :-1], []
    for j in range(1, num_draft + 1):
        q_pos, next_ids = pos[:, j - 1:t - 1], ids[:, j:]
        if mode == "own":
            o = model.mtp_forward(h, next_ids, positions=q_pos)
            logits, h_next = o.logits, o.hidden
        else:
            committed = pos[:, :t - j]
            logits, h_next = mtp_shared(model, h, next_ids, q_pos, committed, last.c_kv, last.k_rope,
                                        None if topk is None else topk[:, :t - j])
        out.append(logits)
        h = h_next[:, :-1]
    return out


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
    last = main_cache.layers[-1]
    vis = pos[:, None]
    sel = None if topk is None else topk[:, None]

    def step(carry, key):
        tok, h, q_pos = carry
        logits, h = mtp_shared(model, h, tok[:, None], q_pos, vis, last.c_kv, last.k_rope, sel)
        nxt, logp = _sample_draft(key, logits[:, 0], temperature, top_k, max_top_k)
        return (nxt, h, q_pos + 1), (nxt, logp)

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
