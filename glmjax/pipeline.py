"""Pipeline parallelism over the mesh's `stage` axis (GPipe schedule).

The decoder layers are split into S contiguous stages; stage s lives on the slice
`mesh.devices[:, s]` (itself a mesh over data / fsdp / expert / tensor / sequence, so every
other parallelism still applies inside a stage). Stages differ (dense or MoE layers, full
or shared indexers), so each is its own compiled program rather than one SPMD program
over `stage`; activations move between stage slices with `jax.device_put`, and JAX's
asynchronous dispatch lets stage s work on microbatch m + 1 while stage s + 1 works on m.

Schedule (GPipe, arXiv 1811.06965): the batch is cut into M microbatches; all forwards run
(stage order, microbatch order), then all backwards in reverse. With equal stage times
the bubble, the idle share of each stage, is (S - 1) / (M + S - 1). `measure_bubble`
times every stage's forward and backward per microbatch and replays the schedule to give
the bubble these costs produce.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from glmjax import sharding
from glmjax.layers.rope import rope_tables
from glmjax.model import GlmForCausalLM


class Stage(nnx.Module):
    """A contiguous run of decoder layers; the first stage also embeds, the last norms,
    projects and scores. Holds references to the model's own variables."""

    def __init__(self, model: GlmForCausalLM, layers: range, first: bool, last: bool):
        if model.lm_head is None and not (first and last):
            raise ValueError("tied embeddings would live on two stages; pipeline a model with "
                             "tie_word_embeddings=False")
        self.layers = nnx.List([model.layers[i] for i in layers])
        self.embed_tokens = model.embed_tokens if first else None
        self.norm = model.norm if last else None
        self.lm_head = (model.lm_head if model.lm_head is not None else model.embed_tokens) if last else None
        self.config = model.config

    def __call__(self, inputs, ids):
        """inputs: ids [B, T] on the first stage, else (x [B, T, D], topk or None).
        Returns (x, topk) or, on the last stage, the mean next-token loss."""
        c = self.config
        q_pos = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
        cos, sin = rope_tables(c, q_pos)
        if self.embed_tokens is not None:
            x, topk = jnp.take(self.embed_tokens[...], ids, axis=0).astype(jnp.dtype(c.dtype)), None
        else:
            x, topk = inputs
        for layer in self.layers:
            out = layer(x, cos, sin, q_pos, shared_topk=topk)
            x, topk = out.x, out.topk
        if self.norm is None:
            return x, topk
        w = self.lm_head[...]
        w = w if w.shape[0] == c.hidden_size else w.T
        logits = jnp.einsum("BTD,DN->BTN", self.norm(x), w.astype(x.dtype)).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], ids[:, 1:]).mean()


def stage_meshes(mesh: Mesh) -> list[Mesh]:
    """One mesh per stage: the devices of that stage, the stage axis of size 1."""
    i = sharding.AXES.index("stage")
    return [Mesh(np.take(mesh.devices, [s], axis=i), sharding.AXES, axis_types=mesh.axis_types)
            for s in range(mesh.shape["stage"])]


class Pipeline:
    """Loss and parameter gradients of a model's next-token loss, pipelined over `stage`."""

    def __init__(self, model: GlmForCausalLM, mesh: Mesh, num_microbatches: int):
        n = mesh.shape["stage"]
        if model.segments is not None:
            raise ValueError("pipeline stages split the looped layers: build the model with "
                             "ModelConfig.scan_layers=False")
        bounds = np.array_split(np.arange(model.config.num_hidden_layers), n)
        if any(len(b) == 0 for b in bounds):
            raise ValueError(f"{n} stages need at least {n} layers, the model has {model.config.num_hidden_layers}")
        self.num_microbatches = num_microbatches
        self.meshes = stage_meshes(mesh)
        self.params, self._rest, self._forward = [], [], []
        for s, b in enumerate(bounds):
            stage = Stage(model, range(b[0], b[-1] + 1), first=s == 0, last=s == n - 1)
            graphdef, params, rest = nnx.split(stage, nnx.Param, ...)
            self.params.append(jax.device_put(params, sharding.param_shardings(params, self.meshes[s])))
            self._rest.append(jax.device_put(rest, sharding.param_shardings(rest, self.meshes[s])))
            self._forward.append(jax.jit(lambda p, r, i, ids, g=graphdef: nnx.merge(g, p, r)(i, ids)))

    @property
    def num_stages(self) -> int:
        return len(self.params)

    def _to_stage(self, tree, s):
        replicated = NamedSharding(self.meshes[s], jax.sharding.PartitionSpec())
        return jax.tree.map(lambda a: jax.device_put(a, replicated), tree)

    def _stage_vjp(self, s, inputs, ids):
        """Stage s forward on its devices; returns (outputs, pullback)."""
        with sharding.use_mesh(self.meshes[s]):
            return jax.vjp(lambda p, i: self._forward[s](p, self._rest[s], i, ids), self.params[s], inputs)

    def loss_and_grads(self, ids: jax.Array):
        """ids [B, T] -> (mean loss over microbatches, per-stage parameter gradients)."""
        m = self.num_microbatches
        if ids.shape[0] % m:
            raise ValueError(f"batch {ids.shape[0]} does not split into {m} microbatches")
        pullbacks, losses = {}, []
        for i, mb in enumerate(jnp.split(ids, m)):  # all forwards
            outputs = None
            for s in range(self.num_stages):
                mb_s = self._to_stage(mb, s)
                outputs, pullbacks[i, s] = self._stage_vjp(s, self._to_stage(outputs, s) if s else mb_s, mb_s)
            losses.append(outputs)
        grads = [jax.tree.map(jnp.zeros_like, p) for p in self.params]
        for i in reversed(range(m)):  # all backwards
            cotangent = jnp.asarray(1.0 / m, jnp.float32)
            for s in reversed(range(self.num_stages)):
                with sharding.use_mesh(self.meshes[s]):
                    g_params, g_inputs = pullbacks.pop((i, s))(self._to_stage(cotangent, s))
                grads[s] = jax.tree.map(jnp.add, grads[s], g_params)
                cotangent = g_inputs
        return sum(float(x) for x in losses) / m, grads

    def measure_bubble(self, ids: jax.Array, repeats: int = 2) -> dict:
        """Times each stage's forward and backward on one microbatch (blocking), then replays
        the GPipe schedule with those costs."""
        mb = jnp.split(ids, self.num_microbatches)[0]
        fwd_t, bwd_t, outputs = [], [], None
        for s in range(self.num_stages):
            mb_s = self._to_stage(mb, s)
            inputs = self._to_stage(outputs, s) if s else mb_s
            outputs, pullback = self._stage_vjp(s, inputs, mb_s)
            cot = jax.tree.map(jnp.ones_like, outputs)
            jax.block_until_ready(pullback(cot))
            fwd_t.append(_median_time(lambda: jax.block_until_ready(self._stage_vjp(s, inputs, mb_s)[0]), repeats))
            bwd_t.append(_median_time(lambda: jax.block_until_ready(pullback(cot)), repeats))
        return gpipe_bubble(fwd_t, bwd_t, self.num_microbatches) | {"forward_s": fwd_t, "backward_s": bwd_t}


def _median_time(fn, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def gpipe_bubble(forward_s, backward_s, microbatches: int) -> dict:
    """Replays GPipe with per-stage forward/backward times: each (microbatch, stage) task
    starts when its stage is free and its input is ready. Returns the stated bubble
    (S - 1) / (M + S - 1) and the one these times give, 1 - busy / (S * makespan)."""
    n = len(forward_s)
    free = [0.0] * n
    done_f = {}
    for i in range(microbatches):
        for s in range(n):
            start = max(free[s], done_f.get((i, s - 1), 0.0))
            free[s] = done_f[i, s] = start + forward_s[s]
    done_b = {}
    for i in reversed(range(microbatches)):
        for s in reversed(range(n)):
            ready = done_b.get((i, s + 1), done_f[microbatches - 1, n - 1] if s == n - 1 else 0.0)
            start = max(free[s], ready)
            free[s] = done_b[i, s] = start + backward_s[s]
    makespan = max(free)
    busy = microbatches * (sum(forward_s) + sum(backward_s))
    return {"stated": (n - 1) / (microbatches + n - 1), "measured": 1 - busy / (n * makespan),
            "makespan_s": makespan}
