"""Teachers for multi-teacher on-policy distillation: registry, routing, switching with prefetch.

    registry = TeacherRegistry([TeacherSpec("sorter", "/ckpt/sorter", ("sorting",)), ...])
    switcher = TeacherSwitcher(registry)
    switcher.prefetch("speller")                        # background: disk -> host -> device
    logp = switcher.score("sorter", tokens)             # [B, T] log p_teacher(tokens[t] | tokens[:t])
    switcher.close()

A teacher is an orbax checkpoint on local storage (`save_teacher`: config.json plus the
model's variables) mapped to the domains it teaches; `route` sends every prompt to the
teacher of its domain (MiMo's MOPD: one teacher per domain, all frozen).

Switching (`TeacherSwitcher`):
  1. only the active teacher's parameters are meant to be on the accelerator; `prefetch(name)`
     stages at most one more there, loaded by one background thread;
  2. a load reads the checkpoint into host memory (numpy), then `device_put`s it; host
     memory holds at most `host_capacity` (2) teachers: the least recently used one is
     dropped before a third is read, and a switch back to one still held skips the disk;
  3. `activate(name)` makes a teacher active: at once when it is staged (waiting only for
     the part of its load still running: the visible stall), else by a cold load in the
     caller's thread; the previous teacher's device arrays are released;
  4. the caller orders its work by domain (`order_by_teacher`) and prefetches the next
     domain's teacher before it needs it, so a switch costs little.
Scoring runs the same model forward as the learner (`rl.learner.token_logprobs`), so a
teacher's log-probs are computed exactly as the student's are.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import json
import os
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

import glmjax
from glmjax import sharding
from glmjax.config import ModelConfig
from rl.learner import token_logprobs

_PARAMS = "params"


@dataclasses.dataclass(frozen=True)
class TeacherSpec:
    name: str
    path: str  # a `save_teacher` directory
    domains: tuple[str, ...]

    def __post_init__(self):
        if not self.domains:
            raise ValueError(f"teacher {self.name!r} teaches no domain: expected at least one")


class TeacherRegistry:
    """Teachers by name, and the one teacher of each domain."""

    def __init__(self, specs: Iterable[TeacherSpec]):
        self.specs: dict[str, TeacherSpec] = {}
        self._by_domain: dict[str, str] = {}
        for spec in specs:
            if spec.name in self.specs:
                raise ValueError(f"two teachers are named {spec.name!r}")
            self.specs[spec.name] = spec
            for domain in spec.domains:
                if domain in self._by_domain:
                    raise ValueError(f"domain {domain!r} has two teachers: {self._by_domain[domain]!r} and "
                                     f"{spec.name!r}; expected one")
                self._by_domain[domain] = spec.name

    @property
    def domains(self) -> list[str]:
        return sorted(self._by_domain)

    def route(self, domain: str) -> str:
        """The name of the teacher of `domain`."""
        if domain not in self._by_domain:
            raise KeyError(f"no teacher for domain {domain!r}; the registry covers {self.domains}")
        return self._by_domain[domain]

    def __getitem__(self, name: str) -> TeacherSpec:
        return self.specs[name]


def order_by_teacher(teachers: Sequence[str], active: str | None = None) -> list[tuple[str, list[int]]]:
    """Work items grouped by teacher: [(teacher, indices into `teachers`)], the active
    teacher's group first (no switch), the rest in order of first appearance. A batch of
    mixed prompts then costs one switch per further teacher, not one per prompt."""
    groups: dict[str, list[int]] = {}
    for i, name in enumerate(teachers):
        groups.setdefault(name, []).append(i)
    order = sorted(groups, key=lambda name: name != active)  # stable: first appearance otherwise
    return [(name, groups[name]) for name in order]


# Checkpoints ------------------------------------------------------------------------------
def save_teacher(model: glmjax.GlmForCausalLM, path: str) -> None:
    """config.json (Hugging Face fields) and the model's variables as an orbax checkpoint."""
    path = os.path.abspath(path)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(model.config.to_hf(), f, indent=2)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(os.path.join(path, _PARAMS), nnx.state(model).to_pure_dict(), force=True)


@dataclasses.dataclass
class HostTeacher:
    """A teacher in host memory: its config and its variables as numpy arrays."""

    name: str
    config: ModelConfig
    state: Any  # pure dict of np.ndarray

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in jax.tree.leaves(self.state))


def load_host(spec: TeacherSpec) -> HostTeacher:
    """Reads a `save_teacher` checkpoint into host memory."""
    config = ModelConfig.from_hf(spec.path)
    abstract = nnx.state(nnx.eval_shape(lambda: glmjax.init_model(config))).to_pure_dict()
    target = jax.tree.map(lambda x: np.empty(x.shape, x.dtype), abstract)
    with ocp.StandardCheckpointer() as ckpt:
        state = ckpt.restore(os.path.join(spec.path, _PARAMS), target)
    return HostTeacher(spec.name, config, jax.tree.map(np.asarray, state))


def to_device(host: HostTeacher, device=None, rules: sharding.Rules | None = None) -> glmjax.GlmForCausalLM:
    """The teacher as a model whose arrays are on `device` (default: the first), or, when
    `device` is a mesh, split over it as `rules` (default DEFAULT_RULES) say: each device
    receives only its shards."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: glmjax.init_model(host.config)))
    if isinstance(device, jax.sharding.Mesh):
        placement = sharding.param_shardings(state, device, rules or sharding.DEFAULT_RULES)
        nnx.replace_by_pure_dict(state, host.state)
        state = jax.device_put(state, placement)
        jax.block_until_ready(state)
        return nnx.merge(graphdef, state)
    arrays = jax.device_put(host.state, device or jax.devices()[0])
    jax.block_until_ready(arrays)
    nnx.replace_by_pure_dict(state, arrays)
    return nnx.merge(graphdef, state)


# Scoring --------------------------------------------------------------------------------
@nnx.jit
def _score(model, tokens, temperature):
    return token_logprobs(model, tokens, temperature)[0]


@functools.partial(nnx.jit, static_argnames="k")
def _score_topk(model, tokens, temperature, k):
    logp, _ = token_logprobs(model, tokens, temperature)  # the same forward below: XLA computes it once
    logits = model(tokens).logits[:, :-1] / temperature
    top_logp, top_ids = jax.lax.top_k(jax.nn.log_softmax(logits, axis=-1), k)  # [B, T - 1, K]
    pad = lambda x: jnp.pad(x, ((0, 0), (1, 0), (0, 0)))  # noqa: E731  position t: the distribution of token t
    return logp, pad(top_ids), pad(top_logp)


@nnx.jit
def _score_full(model, tokens, temperature):
    logp, _ = token_logprobs(model, tokens, temperature)
    logits = model(tokens).logits[:, :-1] / temperature
    return logp, jnp.pad(jax.nn.log_softmax(logits, axis=-1), ((0, 0), (1, 0), (0, 0)))


def score(model: glmjax.GlmForCausalLM, tokens, temperature: float = 1.0, topk: int = 0, full: bool = False):
    """log p_teacher(tokens[t] | tokens[:t]) [B, T] (0 at t = 0), at `temperature`; with
    topk > 0 also the teacher's top-k next-token ids and log-probs at each position
    [B, T, K], with `full` instead its log-probs of the whole vocabulary [B, T, N]
    (position t: the distribution of token t given tokens[:t], as for the log-probs; 0
    at t = 0; `full` is for small vocabularies: N floats per token)."""
    if topk and full:
        raise ValueError(f"score: topk={topk} and full=True both asked for; expected one distribution form")
    if topk:
        return _score_topk(model, tokens, float(temperature), topk)
    if full:
        return _score_full(model, tokens, float(temperature))
    return _score(model, tokens, float(temperature))


# Switching ------------------------------------------------------------------------------
@dataclasses.dataclass
class SwitchStats:
    switches: int = 0
    cold_loads: int = 0
    stall_seconds: float = 0.0  # time callers waited for a teacher to become active
    cold_load_seconds: float = 0.0  # the part of the stall spent in cold loads
    load_seconds: float = 0.0  # background loading (hidden when it ends in time)
    host_hits: int = 0  # loads served from host memory, not disk
    peak_host_teachers: int = 0
    stalls: list[float] = dataclasses.field(default_factory=list)  # per switch


class TeacherSwitcher:
    """One active teacher on the device, the next one staged in the background (see the
    module docstring). Use from one thread; the loader thread is internal."""

    def __init__(self, registry: TeacherRegistry, *, prefetch: bool = True, host_capacity: int = 2,
                 device=None, rules: sharding.Rules | None = None):
        """device: a device, or a mesh over which each teacher is split by `rules` (the
        loader thread does not see the caller's ambient rules, so they are passed)."""
        if host_capacity < 1:
            raise ValueError(f"host_capacity={host_capacity} is invalid: expected >= 1")
        self.registry, self.prefetch_enabled, self.host_capacity = registry, prefetch, host_capacity
        self.device = device or jax.devices()[0]
        self.rules = rules
        self.stats = SwitchStats()
        self.active: str | None = None
        self._model: glmjax.GlmForCausalLM | None = None
        self._staged: tuple[str, concurrent.futures.Future] | None = None
        self._host: collections.OrderedDict[str, HostTeacher] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="teacher-prefetch")

    # host memory, shared with the loader thread
    def host_resident(self) -> list[str]:
        with self._lock:
            return list(self._host)

    def _host_copy(self, name: str) -> HostTeacher:
        with self._lock:
            if name in self._host:
                self._host.move_to_end(name)
                self.stats.host_hits += 1
                return self._host[name]
            while len(self._host) >= self.host_capacity:  # make room before reading, not after
                self._host.popitem(last=False)
        host = load_host(self.registry[name])
        with self._lock:
            while len(self._host) >= self.host_capacity:
                self._host.popitem(last=False)
            self._host[name] = host
            self.stats.peak_host_teachers = max(self.stats.peak_host_teachers, len(self._host))
        return host

    def _load(self, name: str) -> glmjax.GlmForCausalLM:
        t0 = time.perf_counter()
        model = to_device(self._host_copy(name), self.device, self.rules)
        self.stats.load_seconds += time.perf_counter() - t0
        return model

    def prefetch(self, name: str | None) -> None:
        """Starts bringing `name` to the device in the background (no-op when it is active or
        already staged, when prefetching is off, or for None). A staged teacher that is not
        `name` is dropped."""
        if not self.prefetch_enabled or name is None or name == self.active:
            return
        if self._staged is not None:
            if self._staged[0] == name:
                return
            self._staged[1].result()  # one load at a time: the host budget stays exact
            self._staged = None
        self.registry[name]  # an unknown name fails here, not in the loader thread
        self._staged = (name, self._pool.submit(self._load, name))

    def activate(self, name: str) -> glmjax.GlmForCausalLM:
        """Makes `name` the active teacher and returns it; the wait is recorded as the stall."""
        if name == self.active:
            return self._model
        t0 = time.perf_counter()
        staged, self._staged = self._staged, None
        self._model = None  # release the previous teacher's device arrays first
        if staged is not None and staged[0] == name:
            model = staged[1].result()
        else:
            if staged is not None:
                staged[1].result()
            model = self._load(name)
            self.stats.cold_loads += 1
            self.stats.cold_load_seconds += time.perf_counter() - t0
        stall = time.perf_counter() - t0
        self.stats.stall_seconds += stall
        self.stats.stalls.append(stall)
        self.stats.switches += self.active is not None
        self.active, self._model = name, model
        return model

    def score(self, name: str, tokens, temperature: float = 1.0, topk: int = 0, full: bool = False):
        """`score` under teacher `name` (activated first if needed)."""
        return score(self.activate(name), tokens, temperature, topk, full)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._staged, self._model = None, None
        with self._lock:
            self._host.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
