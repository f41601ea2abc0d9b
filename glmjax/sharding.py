"""Meshes, logical axis names and the rules that map them to mesh axes.

Every parameter carries `logical_axes` metadata (e.g. experts' gate: ("experts", "embed",
"mlp")), and activations are constrained by logical names ("batch", "length", ...).
A rule table maps each logical name to a mesh axis, a tuple of axes, or None
(replicated); it lives in config and can be overridden, as in MaxText / levanter.

Mesh axes:
  data      pure data parallelism (replicated parameters)
  stage     pipeline stages (glmjax/pipeline.py)
  fsdp      parameters and optimizer state split over the hidden dimension (the experts
            over their E, with `expert`), and data
  expert    experts split across devices (explicit all-to-all dispatch over expert x fsdp,
            layers/expert_parallel.py)
  tensor    attention / indexer heads, MLP hidden, vocabulary
  sequence  context parallelism: long sequences split across devices

Usage:
    mesh = glmjax.make_mesh(data=2, expert=2, tensor=2)
    with glmjax.sharding.use_mesh(mesh):
        model = glmjax.init_model(config, mesh=mesh)             # created already sharded
        out = jax.jit(forward)(nnx.state(model), ids)
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterable, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

AXES = ("data", "stage", "fsdp", "expert", "tensor", "sequence")
BATCH_AXES = ("data", "fsdp", "expert")  # the axes a batch of tokens is split over

Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]

DEFAULT_RULES: Rules = (
    # parameters
    ("vocab", "tensor"),
    # FSDP spans fsdp x expert: every weight's hidden dimension is split over both, except the
    # experts', which are whole experts split over both (the EP group of
    # layers/expert_parallel.py, which then gathers no expert weight); where E does not divide
    # over expert x fsdp they fall back to `expert` and their hidden dimension takes fsdp.
    ("embed", ("fsdp", "expert")),
    ("heads", "tensor"),
    ("index_heads", "tensor"),
    ("mlp", "tensor"),
    ("experts", ("expert", "fsdp")),
    ("q_lora", ("fsdp", "expert")),
    ("kv_lora", ("fsdp", "expert")),
    ("head_dim", None),
    ("index_dim", None),
    ("router", None),
    ("norm", None),
    ("layers", "stage"),
    ("layer_stack", None),  # the repeats of a scanned layer group (glmjax/layers/stack.py): each device all
    # the decode state (rl/engine/engine.py) and its KV cache (glmjax/cache.py): the slots split
    # like a batch; every slot's whole latent and length on the devices that hold it (MLA
    # decode reads all of a token's latent)
    ("slots", BATCH_AXES),
    ("cache_length", None),
    ("cache_latent", None),
    # activations
    ("batch", BATCH_AXES),
    ("length", "sequence"),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_vocab", "tensor"),
)

# Serving: only the experts (over `expert` x `fsdp`) and the per-head / hidden / vocabulary
# dimensions (over `tensor`) are split; a decode step then gathers no weight, where
# FSDP's split of every hidden dimension would gather each layer's weights every step.
DECODE_RULES: Rules = tuple((name, None if name in ("embed", "q_lora", "kv_lora") else target)
                            for name, target in DEFAULT_RULES)

_RULES: contextvars.ContextVar[Rules] = contextvars.ContextVar("glmjax_sharding_rules", default=DEFAULT_RULES)


def make_mesh(*, data: int = 1, stage: int = 1, fsdp: int = 1, expert: int = 1, tensor: int = 1,
              sequence: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh over all six axes (sizes multiply to the device count)."""
    shape = (data, stage, fsdp, expert, tensor, sequence)
    devices = list(jax.devices() if devices is None else devices)
    if math.prod(shape) != len(devices):
        raise ValueError(f"mesh {dict(zip(AXES, shape))} needs {math.prod(shape)} devices, "
                         f"but {len(devices)} are available")
    return Mesh(np.asarray(devices).reshape(shape), AXES,
                axis_types=(jax.sharding.AxisType.Auto,) * len(AXES))


def parse_axes(text: str) -> dict[str, int]:
    """Mesh axis sizes from a command line: "tensor=2,expert=2" -> {"tensor": 2, "expert": 2}
    ("" -> {}). A ValueError names an unknown axis or a size that is not a positive int."""
    sizes = {}
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        name, eq, value = item.partition("=")
        if name not in AXES:
            raise ValueError(f"mesh {text!r}: unknown axis {name!r}; axes are {', '.join(AXES)}")
        if not eq or not value.isdigit() or int(value) < 1:
            raise ValueError(f"mesh {text!r}: {item!r} must be AXIS=SIZE with a positive size, e.g. tensor=2")
        sizes[name] = int(value)
    return sizes


def rules_from(pairs: Iterable[Sequence]) -> Rules:
    """Normalises rules read from config (lists from ml-collections become tuples)."""
    out = []
    for name, target in pairs:
        if isinstance(target, list):
            target = tuple(target)
        if target is not None:
            for axis in (target,) if isinstance(target, str) else target:
                if axis not in AXES:
                    raise ValueError(f"sharding rule {name!r} -> {target!r}: unknown mesh axis {axis!r}; "
                                     f"mesh axes are {AXES}")
        out.append((name, target))
    return tuple(out)


@contextlib.contextmanager
def use_rules(rules: Rules):
    token = _RULES.set(rules_from(rules))
    try:
        yield
    finally:
        _RULES.reset(token)


@contextlib.contextmanager
def use_mesh(mesh: Mesh, rules: Rules | None = None):
    """Sets the ambient mesh (jax.set_mesh) and, optionally, the logical rules."""
    with jax.set_mesh(mesh), use_rules(rules if rules is not None else current_rules()):
        yield


def current_rules() -> Rules:
    return _RULES.get()


def logical_spec(names: Sequence[str | None], shape: Sequence[int] | None = None, *,
                 mesh: Mesh | None = None, rules: Rules | None = None) -> PartitionSpec:
    """PartitionSpec for logical names. A dimension a mesh axis does not divide (or whose
    axis is already used by an earlier dimension) stays replicated."""
    table = dict(rules if rules is not None else current_rules())
    sizes = dict(mesh.shape) if mesh is not None else None
    used, out = set(), []
    for i, name in enumerate(names):
        if name is None:
            out.append(None)
            continue
        if name not in table:
            raise KeyError(f"no sharding rule for logical axis {name!r}; rules cover {sorted(table)}")
        target = table[name]
        axes = () if target is None else ((target,) if isinstance(target, str) else tuple(target))
        axes = tuple(a for a in axes if a not in used and (sizes is None or sizes[a] > 1))
        if shape is not None and sizes is not None:
            while axes and shape[i] % math.prod(sizes[a] for a in axes):
                axes = axes[:-1]
        used.update(axes)
        out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*out)


def variable_spec(var: nnx.Variable, *, mesh: Mesh | None = None, rules: Rules | None = None) -> PartitionSpec:
    """The PartitionSpec of one variable, from its logical_axes (replicated without them)."""
    names = var.get_metadata("logical_axes", None) or (None,) * len(var.shape)
    return logical_spec(names, var.shape, mesh=mesh, rules=rules)


def param_specs(state, *, mesh: Mesh | None = None, rules: Rules | None = None):
    """A tree of PartitionSpecs matching an nnx.State, from each variable's logical_axes."""
    return jax.tree.map(lambda var: variable_spec(var, mesh=mesh, rules=rules), state,
                        is_leaf=lambda x: isinstance(x, nnx.Variable))


def param_shardings(state, mesh: Mesh, rules: Rules | None = None):
    specs = param_specs(state, mesh=mesh, rules=rules)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec))


def shard_model(model, mesh: Mesh, rules: Rules | None = None):
    """Places an existing model's parameters on the mesh."""
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, jax.device_put(state, param_shardings(state, mesh, rules)))


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """with_sharding_constraint by logical names under the ambient mesh; a no-op without one."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, logical_spec(names, x.shape, mesh=mesh))


def per_device_bytes(tree) -> dict:
    """Bytes each device holds for the arrays of a tree: {device: bytes}."""
    out = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
    return out
