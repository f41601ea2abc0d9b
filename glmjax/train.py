"""Training GLM-5 in pure functions: losses, one jitted step, a synthetic corpus and a loop.

    loss = CE(next token) + mtp_weight * CE(token t+2 from MTP)      (stage None)
           (with mtp_depth > 1: the mean CE of the MTP layer's recursive drafts t+2 .. t+depth+1)
    loss = KL(p_attn || softmax(I))                                  (stage "warmup")
    loss = CE + mtp_weight * CE_mtp + KL over the top-k set          (stage "sparse")

The DSA recipe (DeepSeek-V3.2, "DeepSeek Sparse Attention") trains a dense model's new
indexer in two stages: a dense warm-up in which only the indexer trains, distilling the
main attention (summed over heads, L1-normalised) into the indexer's distribution; then
sparse training of everything, the indexer's KL now taken over its own top-k. The
indexer's inputs are detached, so the KL trains only the indexer and the LM losses only
the rest. How this file differs from the papers:
  * the MoE correction bias (`RouterBias`, not an `nnx.Param`) is never differentiated;
    the aux-loss-free update moves it only when `bias_update_rate` > 0; the metrics report
    the busiest expert's load (`expert_load_max`, 1.0 is balanced);
  * the MTP layer's indexer gets no KL (`mtp_forward` has no `indexer_loss`), so no stage
    trains it (see `TRAINABLE`);
  * the corpus is synthetic, a two-token-lag Markov chain, so learning shows in seconds.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm.auto import tqdm

from glmjax.cache import KVCache
from glmjax.layers.indexer import indexer_kl
from glmjax.layers.mla import LATENT_NORM_EPS, Context
from glmjax.layers.moe import update_correction_biases
from glmjax.layers.norms import rms_norm
from glmjax.layers.rope import apply_rope, rope_tables
from glmjax.model import GlmForCausalLM, ModelOutput
from pallas_kernels import reference

INDEXER_STAGES = (None, "warmup", "sparse")

# Which parameters each stage trains. Without its KL the indexer gets no gradient (top-k
# is not differentiable), so leaving it in would only let weight decay shrink it.
_INDEXER = nnx.PathContains("indexer")
_MTP_INDEXER = nnx.All(nnx.PathContains("mtp"), _INDEXER)
TRAINABLE = {
    None: nnx.All(nnx.Param, nnx.Not(_INDEXER)),
    "warmup": nnx.All(nnx.Param, _INDEXER, nnx.Not(_MTP_INDEXER)),
    "sparse": nnx.All(nnx.Param, nnx.Not(_MTP_INDEXER)),
}


# Losses -------------------------------------------------------------------------------
def lm_loss(logits: jax.Array, targets: jax.Array, mask: jax.Array) -> tuple[jax.Array, dict]:
    """Token-mean cross entropy in fp32. logits [B, T, N], targets [B, T] int, mask [B, T]."""
    mask = mask.astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)  # [B, T]
    n = jnp.maximum(mask.sum(), 1.0)
    correct = (jnp.argmax(logits, -1) == targets).astype(jnp.float32)
    return jnp.sum(ce * mask) / n, {"accuracy": jnp.sum(correct * mask) / n, "tokens": mask.sum()}


MTP_MODES = ("own", "shared")


def mtp_draft_logits(model: GlmForCausalLM, ids: jax.Array, depth: int, mode: str = "own", *,
                     main: ModelOutput | None = None) -> list[jax.Array]:
    """The MTP layer drafting recursively as the engine does (rl/engine/speculative.py), at depths
    1..depth: ids [B, T] -> logits_j [B, T-j, N] for j = 1..depth, row r (position
    r + j - 1) predicting ids[:, r + j + 1] (the last row has no target).

    Depth 1 reads the main hidden state; depth j > 1 the MTP output of depth j - 1 one
    position back, as drafts 2..K do at serving time. mode "own": the MTP layer attends
    over its own latents of the same depth (causally); "shared": over the main model's
    last-layer latents up to the last committed position (r), with the top-k the main
    model's last layer chose there. main: the main model's output on ids (for "shared",
    computed with a cache, whose last layer is read); computed here when None.
    """
    if mode not in MTP_MODES:
        raise ValueError(f"mode={mode!r} is invalid: expected one of {MTP_MODES}")
    b, t = ids.shape
    if main is None:
        main = model(ids, cache=KVCache.init(model.config, b, t) if mode == "shared" else None)
    if mode == "shared" and main.cache is None:
        raise ValueError("mode 'shared' needs the main model's output computed with a cache")
    pos = model.positions(ids, None, None)
    h, out = main.hidden[:, :-1], []
    for j in range(1, depth + 1):
        context = None
        if mode == "shared":
            committed = pos[:, :t - j]
            context = Context(main.cache.layer(-1), committed, None if main.topk is None else main.topk[:, :t - j])
        o = model.mtp_forward(h, ids[:, j:], positions=pos[:, j - 1:t - 1], context=context)
        out.append(o.logits)
        h = o.hidden[:, :-1]
    return out


def mtp_loss(model: GlmForCausalLM, hidden: jax.Array, input_ids: jax.Array, mask: jax.Array, *, depth: int = 1,
             mode: str = "own", main: ModelOutput | None = None):
    """The MTP loss: the mean over depths j = 1..depth of the cross entropy of the drafts
    of `mtp_draft_logits` (depth 1: from the main hidden at t [B, T, D] and token t+1,
    predict t+2; depth j predicts t+j+1), each scored where mask [B, T] marks its target.
    With depth 1, mode "own" (training's default): DeepSeek-V3's one-layer MTP loss.
    main: the main model's output (needed for "shared"; `hidden` is its hidden state)."""
    main = main if main is not None else ModelOutput(None, hidden, None, None, None)
    logits = mtp_draft_logits(model, input_ids, depth, mode, main=main)
    parts = [lm_loss(lg[:, :-1], input_ids[:, j + 2:], mask[:, j + 2:]) for j, lg in enumerate(logits)]
    loss = sum(p[0] for p in parts) / depth
    return loss, {"accuracy": parts[0][1]["accuracy"], "tokens": parts[0][1]["tokens"]}


def loss_fn(model: GlmForCausalLM, batch: Mapping[str, jax.Array], *, mtp_weight: float,
            indexer_stage: str | None = None, mtp_depth: int = 1, mtp_mode: str = "own") -> tuple[jax.Array, dict]:
    """(loss, metrics) for one batch: `input_ids` [B, T] int32 and `loss_mask` [B, T]
    (1 where the token is a target). In the warm-up mtp_weight is unused; in the sparse
    stage the KL is added at weight 1 (it reaches only the indexer, the CE never does).
    mtp_depth, mtp_mode: the MTP loss's drafting depths and draft mode (mtp_loss)."""
    if indexer_stage not in INDEXER_STAGES:
        raise ValueError(f"indexer_stage={indexer_stage!r} is invalid: expected one of {INDEXER_STAGES}")
    ids, mask = batch["input_ids"], batch["loss_mask"]
    # "shared" drafting reads the main model's last-layer latents, which only a cache keeps.
    cache = KVCache.init(model.config, *ids.shape) if mtp_weight and mtp_mode == "shared" else None
    out = model(ids, cache=cache, indexer_loss={None: None, "warmup": "dense", "sparse": "sparse"}[indexer_stage])
    if indexer_stage == "warmup":  # dense attention; only the indexer's distillation counts
        return out.indexer_loss, {"loss": out.indexer_loss, "indexer_kl": out.indexer_loss}
    loss, lm_aux = lm_loss(out.logits[:, :-1], ids[:, 1:], mask[:, 1:])
    aux = {"lm_loss": loss, "accuracy": lm_aux["accuracy"]}
    if mtp_weight:
        mtp, mtp_aux = mtp_loss(model, out.hidden, ids, mask, depth=mtp_depth, mode=mtp_mode, main=out)
        loss = loss + mtp_weight * mtp
        aux.update(mtp_loss=mtp, mtp_accuracy=mtp_aux["accuracy"])
    if indexer_stage == "sparse":
        loss = loss + out.indexer_loss
        aux["indexer_kl"] = out.indexer_loss
    if out.expert_load is not None:  # [L_moe, E]; 1.0 is perfect balance
        aux["expert_load_max"] = jnp.max(out.expert_load / jnp.mean(out.expert_load, -1, keepdims=True))
        aux["expert_load"] = out.expert_load
    aux["loss"] = loss
    return loss, aux


# Optimiser and step -------------------------------------------------------------------
def make_optimizer(cfg: Mapping[str, Any], model: GlmForCausalLM, *, trainable=TRAINABLE[None]) -> nnx.Optimizer:
    """AdamW on a linear-warmup cosine schedule, after global-norm clipping, for the
    variables `trainable` selects. cfg (the config's `train` dict): learning_rate, warmup,
    steps; optional weight_decay (0.1, matrices only), grad_clip (1.0), b2 (0.95)."""
    lr, warmup = cfg["learning_rate"], cfg["warmup"]
    # Warm-up starts at lr / warmup rather than 0, so that the first step is not a no-op.
    schedule = optax.warmup_cosine_decay_schedule(lr / max(warmup, 1), lr, warmup, max(cfg["steps"], warmup + 1),
                                                  end_value=0.1 * lr)
    tx = optax.chain(
        optax.clip_by_global_norm(cfg.get("grad_clip", 1.0)),
        optax.adamw(schedule, b1=0.9, b2=cfg.get("b2", 0.95), weight_decay=cfg.get("weight_decay", 0.1),
                    mask=lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)),
    )
    return nnx.Optimizer(model, tx, wrt=trainable)


@functools.partial(nnx.jit, static_argnames=("mtp_weight", "indexer_stage", "bias_update_rate", "mtp_depth",
                                             "mtp_mode"))
def train_step(model: GlmForCausalLM, optimizer: nnx.Optimizer, batch, *, mtp_weight: float = 0.3,
               indexer_stage: str | None = None, bias_update_rate: float = 0.0, mtp_depth: int = 1,
               mtp_mode: str = "own") -> dict:
    """One AdamW step on the variables the optimizer was built for (`optimizer.wrt`);
    everything else is a constant of the gradient. With bias_update_rate > 0 the MoE
    correction biases then take DeepSeek-V3's aux-loss-free step on this batch's expert
    load (layers/moe.py, update_correction_biases). mtp_depth > 1 trains the MTP layer to
    draft recursively, as speculative decoding uses it (mtp_loss). Returns the metrics."""
    grad_fn = nnx.value_and_grad(
        lambda m: loss_fn(m, batch, mtp_weight=mtp_weight, indexer_stage=indexer_stage, mtp_depth=mtp_depth,
                          mtp_mode=mtp_mode),
        argnums=nnx.DiffState(0, optimizer.wrt), has_aux=True)
    (_, aux), grads = grad_fn(model)
    optimizer.update(model, grads)
    load = aux.pop("expert_load", None)
    if bias_update_rate and load is not None:
        update_correction_biases(model, load, bias_update_rate)
    return {**aux, "grad_norm": optax.tree.norm(grads)}


@functools.partial(nnx.jit, static_argnames=("mtp_weight", "indexer_stage"))
def eval_step(model: GlmForCausalLM, batch, *, mtp_weight: float = 0.3, indexer_stage: str | None = None) -> dict:
    """loss_fn's metrics, without a step."""
    aux = loss_fn(model, batch, mtp_weight=mtp_weight, indexer_stage=indexer_stage)[1]
    aux.pop("expert_load", None)
    return aux


def fit(model: GlmForCausalLM, optimizer: nnx.Optimizer, stream: Iterator[dict], steps: int, *,
        mtp_weight: float = 0.3, indexer_stage: str | None = None, desc: str = "train", **step_kw) -> list[float]:
    """Runs `steps` train steps with a progress bar; returns the loss of each step.
    step_kw: train_step's other settings (mtp_depth, mtp_mode)."""
    history = []
    with tqdm(range(steps), desc=desc, mininterval=1.0) as bar:
        for _ in bar:
            metrics = train_step(model, optimizer, next(stream), mtp_weight=mtp_weight, indexer_stage=indexer_stage,
                                 **step_kw)
            history.append(float(metrics["loss"]))
            bar.set_postfix(loss=f"{history[-1]:.3f}", refresh=False)
    return history


# Synthetic corpus ---------------------------------------------------------------------
class Corpus(NamedTuple):
    tokens: np.ndarray  # [n, seq_len] int32
    successors: np.ndarray  # [vocab, branching] int32: the tokens allowed two steps after each token
    entropy: float  # nats per target token (targets 1..T-1): the lowest reachable LM loss


def synthetic_corpus(vocab: int, seq_len: int, n: int, seed: int, *, branching: int = 2) -> Corpus:
    """A two-token-lag Markov chain: token t is `successors[token t-2]`, choice j with
    probability proportional to 3^-j (0.75 / 0.25 for branching 2); tokens 0 and 1 are
    uniform. Token t-1 says nothing about token t, so the model has to attend two tokens
    back: a model without attention stays at chance, ln(vocab)."""
    rng = np.random.default_rng(seed)
    successors = np.stack([rng.choice(vocab, branching, replace=False) for _ in range(vocab)]).astype(np.int32)
    probs = 3.0 ** -np.arange(branching)
    probs /= probs.sum()
    tokens = rng.integers(0, vocab, (n, seq_len)).astype(np.int32)
    choice = rng.choice(branching, size=(n, seq_len), p=probs)
    for t in range(2, seq_len):
        tokens[:, t] = successors[tokens[:, t - 2], choice[:, t]]
    per_token = float(-(probs * np.log(probs)).sum())
    entropy = (np.log(vocab) + per_token * max(seq_len - 2, 0)) / max(seq_len - 1, 1)
    return Corpus(tokens, successors, float(entropy))


def rule_accuracy(corpus: Corpus, tokens: np.ndarray, start: int = 2) -> float:
    """The share of tokens[:, start:] that the corpus's rule allows after the token two back."""
    tokens = np.asarray(tokens)
    t = np.arange(max(start, 2), tokens.shape[1])
    ok = (corpus.successors[tokens[:, t - 2]] == tokens[:, t, None]).any(-1)
    return float(ok.mean())


def batches(tokens: np.ndarray, batch_size: int, seed: int) -> Iterator[dict]:
    """Endless shuffled batches {input_ids [B, T] int32, loss_mask [B, T] float32}."""
    rng = np.random.default_rng(seed)
    while True:
        order = rng.permutation(len(tokens))
        for i in range(0, len(order) - batch_size + 1, batch_size):
            ids = tokens[order[i:i + batch_size]]
            yield {"input_ids": jnp.asarray(ids), "loss_mask": jnp.ones(ids.shape, jnp.float32)}


# DSA diagnostics ----------------------------------------------------------------------
def _attention_and_index_scores(attn, x, cos, sin, q_pos):
    """The dense head-summed attention p [B, T, S] of an MLA module and its indexer's
    scores I [B, T, S], from the layer's normed input x: MLA.__call__'s first steps."""
    c, dt = attn.config, x.dtype
    w = lambda p: p[...].astype(dt)  # noqa: E731
    qr = rms_norm(jnp.einsum("BTD,DQ->BTQ", x, w(attn.q_a)), attn.q_a_norm[...], LATENT_NORM_EPS)
    q = jnp.einsum("BTQ,QHE->BTHE", qr, w(attn.q_b))
    q_nope, q_rope = q[..., : c.qk_nope_head_dim], apply_rope(q[..., c.qk_nope_head_dim:], cos, sin, interleaved=True)
    kv = jnp.einsum("BTD,DE->BTE", x, w(attn.kv_a))
    c_kv = rms_norm(kv[..., : c.kv_lora_rank], attn.kv_a_norm[...], LATENT_NORM_EPS)
    k_rope = apply_rope(kv[..., c.kv_lora_rank:], cos, sin, interleaved=True)
    q_c = jnp.einsum("BTHK,CHK->BTHC", q_nope, w(attn.w_uk))
    p = reference.mla_attention_probs(q_c, q_rope, c_kv, k_rope, q_pos, scale=c.softmax_scale)
    q_i, w_i = attn.indexer.queries(qr, x, cos, sin)
    return p, reference.indexer_scores(q_i, w_i, attn.indexer.keys(x, cos, sin), q_pos)


class TopkRecall(NamedTuple):
    recall: jax.Array  # mean attention mass on the indexer's top-k
    best: jax.Array  # the same for the top-k of the attention itself: the most any k keys hold
    kl: jax.Array  # mean KL(p || softmax(I)) over all causal keys: the warm-up loss


@nnx.jit
def indexer_topk_recall(model: GlmForCausalLM, input_ids: jax.Array) -> TopkRecall:
    """The share of the dense attention mass that the indexers' top-k captures.

    Runs the main stack with dense attention (as in the warm-up) and, at every layer that
    owns an indexer, sums the head-summed attention p [B, T, S] over the indexer's
    top-`index_topk` keys. Queries that see no more than k keys (recall 1 by construction)
    are left out; the result is the mean over those queries and the indexer layers.
    """
    c = model.config
    q_pos = model.positions(input_ids, None, None)
    cos, sin = rope_tables(c, q_pos)
    x = model.embed(input_ids)
    rows = (q_pos + 1 > c.index_topk).astype(jnp.float32)  # [B, T]
    mean = lambda v: jnp.sum(v * rows) / jnp.maximum(rows.sum(), 1.0)  # noqa: E731
    out = []
    for layer in model.decoder_layers():
        if layer.attn.indexer is not None:
            p, scores = _attention_and_index_scores(layer.attn, layer.input_norm(x), cos, sin, q_pos)
            idx = reference.select_topk(scores, c.index_topk)  # [B, T, P]
            mass = jnp.sum(jnp.where(idx >= 0, jnp.take_along_axis(p, jnp.maximum(idx, 0), -1), 0.0), -1)
            valid = jnp.isfinite(scores)
            out.append((mean(mass), mean(jax.lax.top_k(p, c.index_topk)[0].sum(-1)),
                        indexer_kl(p, jnp.where(valid, scores, 0.0), valid)))
        x = layer(x, cos, sin, q_pos, indexer_loss="dense").x  # "dense": full attention everywhere
    return TopkRecall(*(jnp.mean(jnp.stack(v)) for v in zip(*out)))
