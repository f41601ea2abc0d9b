"""Scanned decoder layers: parameters stacked per kind of layer group, run by `lax.scan`.

A model's layers fall into groups: a full-indexer layer and the IndexShare layers after it
that reuse its top-k (one layer per group without IndexShare). Consecutive groups of the
same structure (dense or MoE at each position) form a segment
(`ModelConfig.layer_segments`); a segment is one `LayerGroup` module whose every variable
has a leading [R] axis, one row per repeat, and `lax.scan` runs the repeats. A program then
holds each kind of group once, so its size and compile time do not grow with depth.

    GLM-5.3 (78 layers; indexer on 0, 1, 2, 6, 10, ..., 74; MoE from layer 3):
        [dense-full] x 2 | [dense-full, moe-shared x 3] x 1 | [moe-full, moe-shared x 3] x 18
    DeepSeek-V3.2 (61 layers, an indexer on each, MoE from layer 3):
        [dense-full] x 3 | [moe-full] x 58

Rematerialisation (`ModelConfig.remat`) is per layer, in the looped and the scanned model
alike: what a layer's backward finds saved from its forward is
  none     every intermediate;
  full     the layer's inputs only: the backward recomputes its forward (`jax.checkpoint`);
  matmuls  the outputs of the matmuls without batch dimensions (the projections, the
           experts' grouped matmuls are recomputed), `dots_with_no_batch_dims_saveable`.

Legend: R repeats of a segment, B batch, T tokens, D hidden, P selected keys, E experts,
X experts per token.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from glmjax.cache import LayerCache
from glmjax.config import ModelConfig
from glmjax.layers.decoder import DecoderLayer, LayerOut
from glmjax.layers.moe import MoE
from glmjax.sharding import constrain

REMAT_POLICIES = {
    "full": None,  # jax.checkpoint's default: nothing saved but the inputs
    "matmuls": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}
STACK_AXIS = "layer_stack"  # the logical name of the repeats axis (replicated: glmjax/sharding.py)


def run_layer(layer: DecoderLayer, x, cos, sin, q_pos, *, cache=None, shared_topk=None, indexer_loss=None,
              remat: str = "none", route_replay=None) -> LayerOut:
    """One decoder layer's forward under the remat policy (a no-op outside a gradient)."""
    def forward(layer, x, cos, sin, q_pos, cache, shared_topk, route_replay):
        return layer(x, cos, sin, q_pos, cache=cache, shared_topk=shared_topk, indexer_loss=indexer_loss,
                     route_replay=route_replay)

    if remat != "none":
        forward = nnx.remat(forward, policy=REMAT_POLICIES[remat])
    return forward(layer, x, cos, sin, q_pos, cache, shared_topk, route_replay)


class GroupOut(NamedTuple):
    x: jax.Array  # [B, T, D]
    topk: jax.Array | None  # [B, T, P] the last layer's selection
    caches: tuple[LayerCache, ...] | None  # one per layer of the group
    indexer_losses: jax.Array | None  # [full layers of the group]
    expert_loads: jax.Array | None  # [MoE layers of the group, E]
    routes: jax.Array | None = None  # [MoE layers of the group, B, T, X] each router's own choice


class LayerGroup(nnx.Module):
    """Layers first .. first + period - 1: a full-indexer layer and the shared ones after it."""

    def __init__(self, config: ModelConfig, first: int, period: int, *, rngs: nnx.Rngs):
        self.layers = nnx.List([DecoderLayer(config, first + j, rngs=nnx.Rngs(params=rngs.params()))
                                for j in range(period)])
        self.remat = config.remat

    def __call__(self, x, topk, cos, sin, q_pos, caches=None, indexer_loss=None, route_replay=None) -> GroupOut:
        """route_replay [MoE layers of the group, B, T, X] or None (moe.Router)."""
        new, losses, loads, routes = [], [], [], []
        for j, layer in enumerate(self.layers):
            replay = None if route_replay is None or not isinstance(layer.mlp, MoE) else route_replay[len(routes)]
            out = run_layer(layer, x, cos, sin, q_pos, cache=None if caches is None else caches[j], shared_topk=topk,
                            indexer_loss=indexer_loss, remat=self.remat, route_replay=replay)
            x, topk = constrain(out.x, ("batch", "length", "act_embed")), out.topk
            new.append(out.cache)
            if out.indexer_loss is not None:
                losses.append(out.indexer_loss)
            if out.expert_load is not None:
                loads.append(out.expert_load)
                routes.append(out.routes)
        stack = lambda xs: jnp.stack(xs) if xs else None  # noqa: E731
        return GroupOut(x, topk, None if caches is None else tuple(new), stack(losses), stack(loads), stack(routes))


def _stack_axis(module: nnx.Module) -> None:
    """Names the new leading axis of every stacked variable's logical axes."""
    for _, var in nnx.iter_graph(module):
        if isinstance(var, nnx.Variable):
            names = var.get_metadata("logical_axes", None)
            if names is not None and len(names) == var.ndim - 1:
                var.set_metadata("logical_axes", (STACK_AXIS, *names))


class Segment(nnx.Module):
    """R repeats of one LayerGroup: every variable stacked [R, ...], run by lax.scan."""

    def __init__(self, config: ModelConfig, first: int, period: int, repeats: int, *, rngs: nnx.Rngs):
        keys = jax.random.split(rngs.params(), repeats)
        make = lambda key: LayerGroup(config, first, period, rngs=nnx.Rngs(params=key))  # noqa: E731
        self.group = nnx.vmap(make, in_axes=0, out_axes=0)(keys)
        _stack_axis(self.group)
        self.first, self.period, self.repeats = first, period, repeats

    def __call__(self, x, topk, cos, sin, q_pos, caches=None, indexer_loss=None, route_replay=None) -> GroupOut:
        """x [B, T, D]; topk [B, T, P] or None (its structure is kept: the groups' first layer
        owns an indexer and ignores it); caches: one LayerCache per position of the group,
        stacked [R, ...]; route_replay [R * MoE layers, B, T, X] or None. Returns the last
        repeat's x and topk, the new caches stacked [R, ...], indexer losses [R * full
        layers], expert loads [R * MoE layers, E] and routes [R * MoE layers, B, T, X] in
        layer order."""
        # lax.scan over the split state (not nnx.scan): the forward mutates nothing, and a
        # plain scan runs at any trace level (inside an engine's or generate's own loops).
        graphdef, state = nnx.split(self.group)

        def body(carry, xs):
            state_r, caches_r, replay_r = xs
            out = nnx.merge(graphdef, state_r)(*carry, cos, sin, q_pos, caches_r, indexer_loss, replay_r)
            return (out.x, out.topk), (out.caches, out.indexer_losses, out.expert_loads, out.routes)

        if route_replay is not None:  # [R * n, ...] -> [R, n, ...]: each repeat's MoE layers
            route_replay = route_replay.reshape(self.repeats, -1, *route_replay.shape[1:])
        (x, topk), (caches, losses, loads, routes) = jax.lax.scan(body, (x, topk), (state, caches, route_replay))
        flat = lambda a: None if a is None else a.reshape(-1, *a.shape[2:])  # noqa: E731  [R, n, ...] -> [R * n, ...]
        return GroupOut(x, topk, caches, flat(losses), flat(loads), flat(routes))


def layer_params(segment: Segment, repeat: int, position: int) -> DecoderLayer:
    """Layer `segment.first + repeat * period + position` as a DecoderLayer of its own (its
    variables sliced out of the stack: a copy, for reading)."""
    graphdef, state = nnx.split(segment.group.layers[position])
    return nnx.merge(graphdef, jax.tree.map(lambda x: x[repeat], state))
