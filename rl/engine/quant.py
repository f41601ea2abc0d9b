"""Weight-only quantization of the routed experts for serving: int8 per output channel,
int4 per group of 32, or bf16.

    served = quantize(model, "int8")     # a copy; `model` is untouched
    engine = GlmEngine(served, ...)

Only the routed experts' matrices change: they hold most of the weights (85% of
configs/small.py, over 95% of GLM-5) and are what a decode step streams from memory,
while attention, the shared expert and the LM head are small and read whole every step
(on a CPU a whole-matrix dequantization per step costs more than it saves). Each expert
matrix W [E, In, Out] is stored as integers q and fp32 scales s over groups of g
consecutive entries along its input axis:

    s = max_group |W| / qmax,   q = round(W / s) in [-qmax, qmax],   W ~ q * s

int8: qmax 127, one group per output channel (g = In); int4: qmax 7, g = 32 (or the
largest power of two dividing In), groups small enough to keep a 4-bit code usable (GPTQ
and AWQ use 128; 32 costs 1 bit of scale per weight). "bfloat16" stores the same
matrices in bf16. The products still run in the compute dtype: `Quantized.astype`
dequantizes, and the CPU expert loop (glmjax/layers/gmm.py) does that one expert at a
time, so a decode step reads the narrow weights.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

MODES = ("float32", "bfloat16", "int8", "int4")
_QMAX = {"int8": 127, "int4": 7}
_STORAGE = {"int8": jnp.int8, "int4": jnp.int4}
INT4_GROUP = 32


@jax.tree_util.register_pytree_node_class
class Quantized:
    """A quantized array: values [..., A/g, g, ...] (the reduction axis split into groups)
    and fp32 scales [..., A/g, 1, ...]; `shape` is the original array's."""

    def __init__(self, values, scale, shape):
        self.values, self.scale, self.shape = values, scale, tuple(shape)

    def tree_flatten(self):
        return (self.values, self.scale), self.shape

    @classmethod
    def tree_unflatten(cls, shape, children):
        return cls(*children, shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        bits = jnp.iinfo(self.values.dtype).bits
        return self.values.size * bits // 8 + self.scale.size * self.scale.dtype.itemsize

    def __getitem__(self, index):
        """`w[...]` is w; `w[e]` the e-th slice of the leading axis (one expert)."""
        if index is Ellipsis:
            return self
        return Quantized(self.values[index], self.scale[index], self.shape[1:])

    def astype(self, dtype) -> jax.Array:
        """The dequantized array q * s in `dtype`."""
        return (self.values.astype(dtype) * self.scale.astype(dtype)).reshape(self.shape)


def quantize_array(w: jax.Array, mode: str, axis: int) -> Quantized:
    """w quantized along `axis` in groups (module docstring)."""
    w = jnp.asarray(w, jnp.float32)
    size = w.shape[axis]
    group = size if mode == "int8" else math.gcd(INT4_GROUP, size)  # 32 unless the axis is not a multiple
    grouped = w.reshape(w.shape[:axis] + (size // group, group) + w.shape[axis + 1:])
    scale = jnp.max(jnp.abs(grouped), axis=axis + 1, keepdims=True) / _QMAX[mode]
    scale = jnp.where(scale > 0, scale, 1.0)
    values = jnp.clip(jnp.round(grouped / scale), -_QMAX[mode], _QMAX[mode]).astype(_STORAGE[mode])
    return Quantized(values, scale, w.shape)


def _is_expert_matrix(path: tuple, value) -> bool:
    return "experts" in path and getattr(value, "ndim", 0) == 3  # [E, In, Out]


def quantize(model, mode: str):
    """A copy of `model` whose routed experts are stored in `mode` (MODES; "float32": a
    plain copy)."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is invalid: expected one of {MODES}")
    graphdef, params, rest = nnx.split(nnx.clone(model), nnx.Param, ...)
    flat = params.flat_state()

    def convert(path, var):
        value = var.get_value()
        if mode == "float32" or not _is_expert_matrix(tuple(str(p) for p in path), value):
            return var
        return var.replace(value.astype(jnp.bfloat16) if mode == "bfloat16" else quantize_array(value, mode, 1))

    params = nnx.State.from_flat_path([(path, convert(path, var)) for path, var in flat])
    return nnx.merge(graphdef, params, rest)


def weight_bytes(model) -> int:
    """Bytes of the stored parameters (quantized ones at their packed size)."""
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param), is_leaf=lambda x: isinstance(x, Quantized))
    return int(sum(x.nbytes for x in leaves))


def logit_error(reference: np.ndarray, other: np.ndarray) -> dict:
    """max |diff| and RMS diff relative to the reference logits' RMS."""
    ref, diff = np.asarray(reference, np.float64), np.asarray(other, np.float64) - np.asarray(reference, np.float64)
    rms = float(np.sqrt(np.mean(ref ** 2)))
    return {"max_abs": float(np.max(np.abs(diff))), "relative_rms": float(np.sqrt(np.mean(diff ** 2)) / rms)}
