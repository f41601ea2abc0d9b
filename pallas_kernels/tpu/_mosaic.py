"""What the Mosaic kernels share: `pallas_call` for "tpu" or "tpu-interpret"."""

from __future__ import annotations

from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu


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
