"""What every kernel file shares: choosing how a `pallas_call` runs, padding, small matmuls.

Backends (`backend=` on every kernel; None means `jax.default_backend()`):
  * "cpu": interpret mode (`interpret=True`): the kernel body runs as ordinary JAX ops,
    one grid step after another. Slow, exact, and the way the tests run the kernels.
  * "gpu": Triton. Triton needs every loaded or stored block to have a power-of-two size,
    so the wrappers pad rows, keys and feature widths to powers of two (>= 16 for the
    matmul dimensions) and slice the padding off afterwards.
  * "tpu": Mosaic. The Triton kernels' memory model (pointer gathers, atomics) does not
    lower there, so the ops dispatch to their Mosaic versions (`pallas_kernels/tpu/`).
  * "tpu-interpret": the Mosaic versions in JAX's TPU interpret mode on a CPU
    (`interpret=pltpu.InterpretParams()`): how the TPU kernels are tested here.

The environment variable GLMJAX_PALLAS_BACKEND names the backend for every call that
passes none (`GLMJAX_PALLAS_BACKEND=tpu-interpret` runs a `kernel_impl="pallas"` model
through the TPU kernels on a CPU); otherwise it is `jax.default_backend()`.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

# A finite "minus infinity" for masked scores: exp(NEG - m) is 0 and NEG - NEG is 0, so
# online-softmax rescaling never meets inf - inf.
NEG = -1e30
MIN_DOT = 16  # Triton's smallest matmul dimension
BACKENDS = ("cpu", "gpu", "tpu", "tpu-interpret")
MOSAIC = ("tpu", "tpu-interpret")  # the backends that run pallas_kernels/tpu/


def resolve(backend: str | None) -> str:
    backend = backend or os.environ.get("GLMJAX_PALLAS_BACKEND") or jax.default_backend()
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is invalid: expected one of {BACKENDS} or None "
                         "(GLMJAX_PALLAS_BACKEND names one for calls that pass none)")
    return backend


def call(kernel, *, backend: str, grid, in_specs, out_specs, out_shape, name: str,
         num_warps: int = 4, num_stages: int = 2, input_output_aliases=None):
    """`pl.pallas_call` for a resolved backend: interpret mode on a CPU, Triton on a GPU."""
    if backend in MOSAIC:
        raise ValueError(f"backend={backend!r}: this is a Triton kernel (GPU, or interpret mode on a CPU); "
                         "on a TPU call the op through pallas_kernels.ops, which runs pallas_kernels/tpu/")
    params = None if backend == "cpu" else pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=backend == "cpu",
        compiler_params=params,
        input_output_aliases=input_output_aliases or {},
        name=name,
    )


def pow2(n: int, floor: int = 1) -> int:
    """The smallest power of two >= max(n, floor)."""
    return max(floor, 1 << max(int(n) - 1, 0).bit_length())


def pad_axis(x: jax.Array, axis: int, size: int, value=0) -> jax.Array:
    """Pads axis of x at the end up to size (no-op when already that long)."""
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@functools.lru_cache(maxsize=None)
def _dims(contract_a: int, contract_b: int):
    return (((contract_a,), (contract_b,)), ((), ()))


def mm(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [M, K] @ b [K, N] in fp32."""
    return jax.lax.dot_general(a, b, _dims(1, 0), preferred_element_type=jnp.float32)


def mm_nt(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [M, K] @ b[N, K]^T in fp32."""
    return jax.lax.dot_general(a, b, _dims(1, 1), preferred_element_type=jnp.float32)


def mm_tn(a: jax.Array, b: jax.Array) -> jax.Array:
    """a[K, M]^T @ b [K, N] in fp32."""
    return jax.lax.dot_general(a, b, _dims(0, 0), preferred_element_type=jnp.float32)


def blocks_to(stop, block: int):
    """Number of blocks of `block` needed to cover [0, stop) for a traced int stop."""
    return jax.lax.div(stop + block - 1, block)
