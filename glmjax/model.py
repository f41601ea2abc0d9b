"""The GLM-5 / DeepSeek-V3.2 causal LM: embed -> decoder layers -> norm -> LM head, plus MTP.

One forward serves training, prefill and decode:
  * `model(ids)`: the whole sequence attends to itself (training, scoring).
  * `model(ids, cache=cache)`: the T new tokens of each sequence are written into the
    cache after its `lengths` and attend over everything cached: prefill when the cache is
    empty, decode of one token, or verification of several speculative drafts at once.
The top-k selection of each full-indexer layer flows to the shared layers after it; the
last layer's is returned (`ModelOutput.topk`) for MTP drafting over the main cache.

Layers are a Python loop over `model.layers` by default, or with `config.scan_layers` a
few `model.segments`, each one group of layers stacked over its repeats and run by
`lax.scan` (glmjax/layers/stack.py); both rematerialise per layer as `config.remat` says.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from glmjax.cache import KVCache
from glmjax.config import ModelConfig
from glmjax.layers.decoder import DecoderLayer
from glmjax.layers.mla import Context
from glmjax.layers.mtp import MTP
from glmjax.layers.norms import RMSNorm
from glmjax.layers.rope import rope_tables
from glmjax.layers.stack import Segment, layer_params, run_layer
from glmjax.sharding import Rules, constrain, param_shardings


class ModelOutput(NamedTuple):
    logits: jax.Array  # [B, T, N] fp32 ([B, K, N] with logits_at)
    hidden: jax.Array  # [B, T, D] last hidden state before the final norm (MTP, value heads)
    cache: KVCache | None
    indexer_loss: jax.Array | None  # mean KL over the full-indexer layers, when asked for
    expert_load: jax.Array | None  # [L_moe, E] token copies per expert
    topk: jax.Array | None = None  # [B, T, P] the last layer's key selection; None where it attended densely
    routes: jax.Array | None = None  # [L_moe, B, T, X] int32 each MoE router's own choice of experts


class MTPOutput(NamedTuple):
    logits: jax.Array  # [B, T, N]: the prediction of token t+2
    hidden: jax.Array  # [B, T, D]: fed back as h to draft one more token
    cache: object  # the MTP layer's LayerCache, or None


class GlmForCausalLM(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        c = config
        pdt = jnp.dtype(c.param_dtype)
        init = nnx.initializers.normal(c.initializer_range)
        self.embed_tokens = nnx.Param(init(rngs.params(), (c.vocab_size, c.hidden_size), pdt),
                                      logical_axes=("vocab", "embed"))  # [N, D]
        # A fresh key stream per layer keeps init independent of depth (and cheap to trace).
        if c.scan_layers:
            self.layers = None
            self.segments = nnx.List([Segment(c, *s, rngs=nnx.Rngs(params=rngs.params())) for s in c.layer_segments])
        else:
            self.layers = nnx.List([DecoderLayer(c, i, rngs=nnx.Rngs(params=rngs.params()))
                                    for i in range(c.num_hidden_layers)])
            self.segments = None
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, param_dtype=pdt)
        self.lm_head = None if c.tie_word_embeddings else nnx.Param(
            init(rngs.params(), (c.hidden_size, c.vocab_size), pdt), logical_axes=("embed", "vocab"))  # [D, N]
        self.mtp = MTP(c, rngs=nnx.Rngs(params=rngs.params())) if c.num_nextn_predict_layers else None
        self.config = config

    def embed(self, ids: jax.Array) -> jax.Array:
        """ids [B, T] -> [B, T, D] in the compute dtype."""
        return jnp.take(self.embed_tokens[...], ids, axis=0).astype(jnp.dtype(self.config.dtype))

    def head(self, h: jax.Array) -> jax.Array:
        """Normed hidden [B, T, D] -> logits [B, T, N] fp32."""
        w = self.embed_tokens[...].T if self.lm_head is None else self.lm_head[...]
        return jnp.einsum("BTD,DN->BTN", h, w.astype(h.dtype)).astype(jnp.float32)

    def positions(self, ids: jax.Array, cache: KVCache | None, positions: jax.Array | None) -> jax.Array:
        if cache is not None:
            return cache.lengths[:, None] + jnp.arange(ids.shape[1], dtype=jnp.int32)[None, :]
        if positions is not None:
            return positions.astype(jnp.int32)
        return jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)

    def __call__(
        self,
        input_ids: jax.Array,
        *,
        positions: jax.Array | None = None,
        cache: KVCache | None = None,
        indexer_loss: str | None = None,
        logits_at: jax.Array | None = None,
        route_replay: jax.Array | None = None,
    ) -> ModelOutput:
        """input_ids [B, T] int. positions [B, T] (no-cache calls only; default arange).
        indexer_loss: None | "dense" | "sparse" (see MLA.__call__). logits_at [B, K] int:
        the indices into T whose logits are computed, so that logits is [B, K, N] (a
        prefill needs one per row: the LM head is then K / T of its cost); default all T.
        route_replay [L_moe, B, T, X] int: the experts each token runs in each MoE layer
        (routing replay: the engine's recorded choice, glmjax/layers/moe.py: Router), -1
        where the router chooses; `ModelOutput.routes` is always the routers' own choice."""
        c = self.config
        q_pos = self.positions(input_ids, cache, positions)
        cos, sin = rope_tables(c, q_pos)
        x = constrain(self.embed(input_ids), ("batch", "length", "act_embed"))
        if self.segments is not None:
            x, topk, new_layers, losses, loads, routes = self._scanned(x, cos, sin, q_pos, cache, indexer_loss,
                                                                       route_replay)
        else:
            x, topk, new_layers, losses, loads, routes = self._looped(x, cos, sin, q_pos, cache, indexer_loss,
                                                                      route_replay)
        new_cache = None
        if cache is not None:
            new_cache = cache._replace(layers=tuple(new_layers), lengths=cache.lengths + input_ids.shape[1])
        h = self.norm(x)
        if logits_at is not None:
            h = jnp.take_along_axis(h, logits_at[..., None].astype(jnp.int32), axis=1)  # [B, K, D]
        return ModelOutput(
            logits=constrain(self.head(h), ("batch", "length", "act_vocab")),
            hidden=x,
            cache=new_cache,
            indexer_loss=jnp.mean(jnp.concatenate(losses)) if losses else None,
            expert_load=jnp.concatenate(loads) if loads else None,
            topk=topk,
            routes=jnp.concatenate(routes) if routes else None,
        )

    def _looped(self, x, cos, sin, q_pos, cache, indexer_loss, route_replay):
        topk, losses, loads, routes, new_layers = None, [], [], [], []
        for i, layer in enumerate(self.layers):
            replay = None if route_replay is None or not self.config.is_moe(i) else route_replay[len(routes)]
            out = run_layer(layer, x, cos, sin, q_pos, cache=None if cache is None else cache.layers[i],
                            shared_topk=topk, indexer_loss=indexer_loss, remat=self.config.remat,
                            route_replay=replay)
            x, topk = constrain(out.x, ("batch", "length", "act_embed")), out.topk
            new_layers.append(out.cache)
            if out.indexer_loss is not None:
                losses.append(out.indexer_loss[None])
            if out.expert_load is not None:
                loads.append(out.expert_load[None])
                routes.append(out.routes[None])
        return x, topk, new_layers, losses, loads, routes

    def _scanned(self, x, cos, sin, q_pos, cache, indexer_loss, route_replay):
        """The segments in order; the top-k carried through each scan keeps one structure,
        an array [B, T, P] when the layers select (as MLA decides: fewer top-k than keys,
        not the dense indexer warm-up), else None."""
        c = self.config
        num_keys = x.shape[1] if cache is None else cache.max_len
        selects = c.index_topk < num_keys and indexer_loss != "dense"
        topk = jnp.zeros((*x.shape[:2], c.index_topk), jnp.int32) if selects else None
        losses, loads, routes, new_layers = [], [], [], []
        used = 0  # MoE layers of route_replay consumed by the segments before
        for s, segment in enumerate(self.segments):
            n = segment.repeats * sum(c.is_moe(segment.first + j) for j in range(segment.period))
            replay = None if route_replay is None or not n else route_replay[used:used + n]
            used += n
            out = segment(x, topk, cos, sin, q_pos, None if cache is None else cache.layers[s], indexer_loss, replay)
            x, topk = out.x, out.topk
            new_layers.append(out.caches)
            if out.indexer_losses is not None:
                losses.append(out.indexer_losses)
            if out.expert_loads is not None:
                loads.append(out.expert_loads)
                routes.append(out.routes)
        return x, topk, new_layers, losses, loads, routes

    def decoder_layers(self) -> list[DecoderLayer]:
        """Every decoder layer in order; a scanned model's as copies sliced out of its stacks
        (for reading: evaluation, inspection)."""
        if self.segments is None:
            return list(self.layers)
        return [layer_params(s, r, j) for s in self.segments for r in range(s.repeats) for j in range(s.period)]

    def mtp_forward(self, hidden, next_ids, *, positions=None, cache=None, lengths=None,
                    context: Context | None = None) -> MTPOutput:
        """The MTP prediction of token t+2 from hidden [B, T, D] at t and next_ids [B, T] (t+1).

        positions [B, T] (default arange(T)): where the rows are, for RoPE. The keys:
          * no cache, no context: the T rows themselves, row s visible from row t iff s <= t
            (by index, so that rows starting at any position stay causal);
          * cache, the MTP layer's own LayerCache: the new entries go after `lengths` [B]
            (positions are then lengths + arange(T));
          * context (mla.Context): another layer's cache, read only, with its visibility and
            top-k ("shared" drafting, rl/engine/speculative.py).
        """
        if self.mtp is None:
            raise ValueError("this model has no MTP layer (config.num_nextn_predict_layers=0)")
        rows = self.positions(next_ids, None, None)  # arange(T)
        if cache is not None:
            q_pos = lengths[:, None] + rows
            key_pos = q_pos
        else:
            q_pos = rows if positions is None else positions.astype(jnp.int32)
            key_pos = rows
        cos, sin = rope_tables(self.config, q_pos)
        h, out = self.mtp(hidden, self.embed(next_ids), cos, sin, key_pos, cache=cache, context=context)
        return MTPOutput(self.head(h), out.x, out.cache)


def init_model(config: ModelConfig, seed: int = 0, *, mesh: jax.sharding.Mesh | None = None,
               rules: Rules | None = None) -> GlmForCausalLM:
    """A randomly initialised model. With a mesh, its parameters are created directly in the
    shardings the logical rules give (`jax.jit(init, out_shardings=...)`, no host copy)."""
    make = lambda: GlmForCausalLM(config, rngs=nnx.Rngs(params=seed))  # noqa: E731
    if mesh is None:
        return make()
    graphdef, abstract = nnx.split(nnx.eval_shape(make))
    state = jax.jit(lambda: nnx.state(make()), out_shardings=param_shardings(abstract, mesh, rules))()
    return nnx.merge(graphdef, state)


def count_params(config: ModelConfig, include_mtp: bool = True) -> int:
    """Stored values (weights and correction biases) of the model, via jax.eval_shape:
    nothing is allocated, so this works for the full 744B configuration. Without MTP: the
    same model less its `mtp` layers."""
    return sum(n for top, n in _stored_sizes(config) if include_mtp or top != "mtp")


@functools.lru_cache(maxsize=8)
def _stored_sizes(config: ModelConfig) -> tuple[tuple[str, int], ...]:
    """(top-level attribute, size) of every stored array (tracing a full-size init takes
    tens of seconds: once per config)."""
    abstract = nnx.eval_shape(lambda: init_model(config))
    leaves = jax.tree_util.tree_flatten_with_path(nnx.state(abstract))[0]
    return tuple((str(path[0].key), int(x.size)) for path, x in leaves)
