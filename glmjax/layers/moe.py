"""Mixture of experts (DeepSeek-V3 routing) and the dense SwiGLU MLP.

Routing, per token (aux-loss-free load balancing, arXiv 2408.15664):
  1. s = sigmoid(x @ W_gate) in fp32: the unbiased affinities              [N, E]
  2. b = s + e_score_correction_bias: used only to choose, never to weigh
  3. n_group > 1: rank groups by the sum of their two best b, keep topk_group groups
  4. top-X experts by b among the kept groups; weights are their s, normalised to sum
     1 (norm_topk_prob), times routed_scaling_factor
  5. y = sum_x weight_x * SwiGLU_{e_x}(x) + SharedExpert(x)   (the shared expert has no gate)

The experts run as one grouped matmul (layers/gmm.py) over the token copies sorted by
expert: no capacity, no dropped tokens, and no [N, E] dense compute. On a mesh whose rules
split the experts over devices, the copies are exchanged with the experts' owners instead
(layers/expert_parallel.py); there `moe_capacity_factor` bounds each device's received
copies and drops the overflow, and `moe_chunk_tokens` exchanges a device's tokens in
chunks of that many.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from glmjax.config import ModelConfig
from glmjax.layers import expert_parallel
from glmjax.layers.gmm import swiglu_experts


class RouterBias(nnx.Variable):
    """The correction bias: updated by the load-balancing rule, never by gradients."""


class MLP(nnx.Module):
    """SwiGLU: down(silu(x @ gate) * (x @ up))."""

    def __init__(self, hidden: int, inner: int, *, init_std: float, param_dtype, rngs: nnx.Rngs):
        init = nnx.initializers.normal(init_std)
        keys = iter(jax.random.split(rngs.params(), 3))  # one draw from rngs per module
        self.gate = nnx.Param(init(next(keys), (hidden, inner), param_dtype), logical_axes=("embed", "mlp"))  # [D, F]
        self.up = nnx.Param(init(next(keys), (hidden, inner), param_dtype), logical_axes=("embed", "mlp"))  # [D, F]
        self.down = nnx.Param(init(next(keys), (inner, hidden), param_dtype), logical_axes=("mlp", "embed"))  # [F, D]

    def __call__(self, x: jax.Array) -> jax.Array:
        w = lambda p: p[...].astype(x.dtype)  # noqa: E731
        h = jax.nn.silu(x @ w(self.gate)) * (x @ w(self.up))
        return h @ w(self.down)


class Routing(NamedTuple):
    weights: jax.Array  # [N, X] fp32
    experts: jax.Array  # [N, X] int32: the experts each token runs (replayed ones where given)
    load: jax.Array  # [E] token copies routed to each expert
    own: jax.Array  # [N, X] int32: the router's own choice (step 4), whatever ran


class Router(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        c = config
        self.weight = nnx.Param(nnx.initializers.normal(c.initializer_range)(
            rngs.params(), (c.hidden_size, c.n_routed_experts), jnp.float32), logical_axes=("embed", "router"))  # [D, E]
        self.e_score_correction_bias = RouterBias(jnp.zeros((c.n_routed_experts,), jnp.float32),
                                                  logical_axes=("router",))
        self.config = config

    def __call__(self, x: jax.Array, replay: jax.Array | None = None) -> Routing:
        """x [N, D] -> the X experts of each token and their weights (steps 1-4).

        replay [N, X] int (routing replay, R3, arXiv 2510.11370): the experts another run of
        this layer chose for each token (the rollout engine's), which the token runs instead
        of its own top-X; a row of -1 keeps the router's choice. The weights are still this
        router's affinities s of the experts run, normalised over them, so the router keeps
        its gradient."""
        c = self.config
        scores = jax.nn.sigmoid(x.astype(jnp.float32) @ self.weight[...])  # [N, E]
        biased = scores + self.e_score_correction_bias[...]
        if c.n_group > 1:
            grouped = biased.reshape(-1, c.n_group, c.n_routed_experts // c.n_group)
            group_score = jax.lax.top_k(grouped, 2)[0].sum(-1)  # [N, n_group]
            kept = jax.lax.top_k(group_score, c.topk_group)[1]
            keep = jnp.zeros_like(group_score, bool).at[jnp.arange(kept.shape[0])[:, None], kept].set(True)
            biased = jnp.where(jnp.repeat(keep, c.n_routed_experts // c.n_group, axis=1), biased, -jnp.inf)
        own = jax.lax.top_k(biased, c.num_experts_per_tok)[1].astype(jnp.int32)
        experts = own if replay is None else jnp.where(replay[:, :1] >= 0, replay.astype(jnp.int32), own)
        weights = jnp.take_along_axis(scores, experts, axis=1)
        if c.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
        weights = weights * c.routed_scaling_factor
        load = jnp.zeros((c.n_routed_experts,), jnp.int32).at[experts.reshape(-1)].add(1)
        return Routing(weights, experts, load, own)


class Experts(nnx.Module):
    """E stacked SwiGLU experts."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        c = config
        pdt = jnp.dtype(c.param_dtype)
        init = nnx.initializers.normal(c.initializer_range)
        keys = iter(jax.random.split(rngs.params(), 3))  # one draw from rngs per module
        e, d, f = c.n_routed_experts, c.hidden_size, c.moe_intermediate_size
        self.gate = nnx.Param(init(next(keys), (e, d, f), pdt), logical_axes=("experts", "embed", "mlp"))  # [E, D, F]
        self.up = nnx.Param(init(next(keys), (e, d, f), pdt), logical_axes=("experts", "embed", "mlp"))  # [E, D, F]
        self.down = nnx.Param(init(next(keys), (e, f, d), pdt), logical_axes=("experts", "mlp", "embed"))  # [E, F, D]

    def __call__(self, x: jax.Array, routing: Routing) -> jax.Array:
        """x [N, D] -> sum over each token's experts of weight * expert(x), [N, D]."""
        return swiglu_experts(x, routing.experts, routing.weights, self.gate[...], self.up[...], self.down[...])


class MoE(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        c = config
        self.router = Router(c, rngs=rngs)
        self.experts = Experts(c, rngs=rngs)
        self.config = config
        self.shared = MLP(c.hidden_size, c.shared_intermediate_size, init_std=c.initializer_range,
                          param_dtype=jnp.dtype(c.param_dtype), rngs=rngs) if c.n_shared_experts else None

    @jax.named_scope("moe")  # profiles (and benchmarks/sharding_bench.py) find the layer's ops by it
    def __call__(self, x: jax.Array, replay: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [B, T, D], replay [B, T, X] or None (Router) -> (y [B, T, D], per-expert load [E],
        the router's own choice [B, T, X])."""
        flat = x.reshape(-1, x.shape[-1])
        routing = self.router(flat, None if replay is None else replay.reshape(flat.shape[0], -1))
        if expert_parallel.enabled(self.config.n_routed_experts):
            ex, dt = self.experts, x.dtype
            y, _ = expert_parallel.experts_forward(  # the kept mask: layers/expert_parallel.py
                flat, routing.experts, routing.weights, ex.gate[...].astype(dt), ex.up[...].astype(dt),
                ex.down[...].astype(dt), capacity_factor=self.config.moe_capacity_factor,
                chunk_tokens=self.config.moe_chunk_tokens)
        else:
            y = self.experts(flat, routing)
        y = y.reshape(x.shape)
        if self.shared is not None:
            y = y + self.shared(x)
        return y, routing.load, routing.own.reshape(*x.shape[:-1], -1)


def update_correction_biases(model, expert_load: jax.Array, rate: float) -> None:
    """Aux-loss-free load balancing (DeepSeek-V3, arXiv 2408.15664): after each step,

        b_e <- b_e + rate * sign(mean_e(load) - load_e)

    for every MoE layer: overloaded experts become less attractive to the router, idle ones
    more. expert_load [L_moe, E] is the model output's per-layer count of routed copies.
    Updates the RouterBias variables in place (outside any gradient).
    """
    biases = router_biases(model)
    rows = sum(len(r) for _, r in biases)
    if rows != expert_load.shape[0]:
        raise ValueError(f"expert_load has {expert_load.shape[0]} rows, the model has {rows} MoE layers")
    load = expert_load.astype(jnp.float32)
    step = rate * jnp.sign(load.mean(axis=-1, keepdims=True) - load)
    for bias, index in biases:
        delta = step[jnp.asarray(index)]  # [R, E]
        bias.set_value(bias[...] + (delta if bias.ndim == 2 else delta[0]))


def router_biases(model) -> list[tuple[RouterBias, list[int]]]:
    """Each MoE layer's correction bias with its rows of the model's expert_load [L_moe, E]:
    one row for a looped layer's bias [E]; R rows for a scanned group position's stacked
    bias [R, E] (the load's rows are in layer order: repeat-major, then position)."""
    if model.segments is None:
        routers = [layer.mlp.router for layer in model.layers if isinstance(layer.mlp, MoE)]
        return [(router.e_score_correction_bias, [i]) for i, router in enumerate(routers)]
    out, start = [], 0
    for segment in model.segments:
        moe = [layer.mlp.router for layer in segment.group.layers if isinstance(layer.mlp, MoE)]
        out += [(router.e_score_correction_bias, [start + r * len(moe) + j for r in range(segment.repeats)])
                for j, router in enumerate(moe)]
        start += segment.repeats * len(moe)
    return out
