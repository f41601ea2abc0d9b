"""What the Mosaic kernels share: `pallas_call` for "tpu" or "tpu-interpret"."""

from __future__ import annotations

import math

from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu


def causal_pairs(rows: int, queries: int, keys: int) -> float:
    """The (query, key) pairs a causal attention over `rows` sequences computes when its
    `queries` queries are the last of `keys` positions: each sees the keys up to its own
    (a prefill's queries are all its keys, a decode step's one query sees them all)."""
    queries = min(queries, keys)
    return rows * queries * (keys - (queries - 1) / 2)


def estimate(flops: float, transcendentals: float, *arrays) -> pl.CostEstimate:
    """The kernel's cost for XLA's scheduler and cost analysis: its matmul FLOPs, its exps,
    and the bytes of the operands and results it reads and writes once each."""
    moved = sum(math.prod(x.shape) * x.dtype.itemsize for x in arrays)
    return pl.CostEstimate(flops=int(flops), transcendentals=int(transcendentals), bytes_accessed=int(moved))


def call(kernel, *, backend: str, name: str, dimension_semantics=None, cost_estimate=None, **kwargs):
    """`pl.pallas_call` compiled by Mosaic on "tpu", run by the TPU interpreter on "tpu-interpret".

    kwargs are pallas_call's (grid or grid_spec, in_specs, out_specs, out_shape, scratch_shapes,
    input_output_aliases); dimension_semantics is one "parallel" | "arbitrary" per grid axis."""
    if backend not in ("tpu", "tpu-interpret"):
        raise ValueError(f"backend={backend!r}: the Mosaic kernels run on 'tpu' or 'tpu-interpret'")
    params = pltpu.CompilerParams(dimension_semantics=dimension_semantics) if dimension_semantics else None
    return pl.pallas_call(
        kernel,
        interpret=pltpu.InterpretParams() if backend == "tpu-interpret" else False,
        compiler_params=params,
        cost_estimate=cost_estimate,
        name=name,
        **kwargs,
    )
