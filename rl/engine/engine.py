"""GlmEngine: the JetStream 0.2.2 Engine API over glmjax, with MTP speculative decoding.

    engine = GlmEngine(model, max_concurrent_decodes=8, max_len=1024, num_draft=5)
    params = engine.load_params()                  # the WeightStore: read at every call
    state = engine.init_decode_state()
    prefix = engine.prefill(params=params, padded_tokens=ids, true_length=n)
    state = engine.insert(prefix, state, slot=0)
    state, result = engine.generate(params, state)  # result.get_result_at_slot(0).tokens

Method for method `jetstream.engine.engine_api.Engine` of google-jetstream 0.2.2 (whose
ABC it subclasses when that package imports; otherwise `_Engine` below, the same
methods). Differences that callers see:
  * `params` may be a `Weights` snapshot, a `WeightStore` (its newest version is read at
    each call: JetStream's orchestrator reads `params` once, so `load_params` returns the
    store) or a bare parameter pytree (version -1).
  * `prefill` samples the first token and, with MTP, the first drafts; they travel in the
    Prefix (`prefix.token`), and `prefill` takes the request's `sampling` settings.
  * `ResultTokens` also carries `log_probs` and `versions` per token; with speculation a
    step returns up to K + 1 tokens per slot, `valid` marking how many.
  * With `top_logprobs=True`, `generate_rows` and `prefill_batch` also return each token's
    most likely alternatives (`ResultTokens.top_ids / top_logps`, `Prefix.top`; glmjax/
    sampling.top_logprobs) from separate programs: a caller that never asks runs as before.
  * With `record_routes=True` (an engine for routing replay), every forward also returns
    the experts each MoE layer chose for each position it ran (`ResultTokens.routes`
    [B, K+1, L_moe, X] for the positions a step fed, valid as its tokens are; `Prefix.routes`
    [n, T, L_moe, X] for the prompt), int16.
  * Additions: `prefill_batch` / `insert_batch` (several requests in one call),
    `generate_rows` (a step over the first n slots), `extract` (a slot's cache as a
    batch-1 KVCache, for prefix reuse), `free` (stop a slot), `move` (a slot into another).
The types it hands out and keeps (ResultTokens, Prefix, DecodeState) are rl/engine/state.py's.
Scheduling (queue, slots, stop conditions, prefix reuse) is rl/engine/driver.py's. The forward
and sampling of a prefill and of a step are glmjax/decoding.py's, the functions
glmjax.generate runs.

Decode state: one batch of `max_concurrent_decodes` slots with the latent cache
[B, max_len, C], rope keys, indexer keys and lengths (glmjax.KVCache), each slot's pending
token (sampled, not yet in the cache), drafts, sampling settings and random key. Prefill
lengths are bucketed (powers of two up to max_prefill_length), so each bucket compiles
once. A decode step can run the first n slots only (`generate_rows`, n one of
`decode_rows`: powers of two from 8 up to max_concurrent_decodes), so that a step with few
requests in flight costs what those need; the driver keeps its requests in the lowest
slots (`move`). Each row count compiles once.
"""

from __future__ import annotations

import abc
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from glmjax import decoding, sharding
from glmjax.cache import KVCache
from glmjax.sampling import SamplingParams, sampling_logprobs, split_keys, token_logprobs, top_logprobs
from rl.engine import speculative
from rl.engine.state import DecodeState, Prefix, ResultTokens
from rl.engine.weights import Weights, WeightStore, has_shardings

try:  # google-jetstream 0.2.2; its engine_api imports seqio (TensorFlow), so usually absent
    from jetstream.engine.engine_api import Engine as _Engine
except ImportError:
    class _Engine(abc.ABC):
        """The abstract methods of jetstream.engine.engine_api.Engine (0.2.2)."""

        @abc.abstractmethod
        def prefill(self, *, params, existing_prefix=None, padded_tokens, true_length): ...

        @abc.abstractmethod
        def generate(self, params, decode_state): ...

        @abc.abstractmethod
        def insert(self, prefix, decode_state, slot): ...

        @abc.abstractmethod
        def load_params(self, *args, **kwargs): ...

        @abc.abstractmethod
        def get_prefix_destination_sharding(self): ...

        @abc.abstractmethod
        def get_tokenizer(self): ...

        def build_tokenizer(self, metadata):
            raise NotImplementedError("glmjax engines are token-in/token-out")

        @abc.abstractmethod
        def init_decode_state(self, *args, **kwargs): ...

        @property
        @abc.abstractmethod
        def max_concurrent_decodes(self): ...

        @property
        @abc.abstractmethod
        def samples_per_slot(self): ...

        @property
        @abc.abstractmethod
        def max_prefill_length(self): ...

        @property
        @abc.abstractmethod
        def mesh(self): ...

        @property
        @abc.abstractmethod
        def colocated_cpus(self): ...


TOP_LOGPROBS = 20  # the most alternatives per token a request may ask for (OpenAI's top_logprobs limit)


def default_buckets(max_prefill_length: int, smallest: int = 16) -> tuple[int, ...]:
    """Powers of two from `smallest` up to max_prefill_length (which is always included)."""
    out, b = [], smallest
    while b < max_prefill_length:
        out.append(b)
        b *= 2
    return tuple(out) + (max_prefill_length,)


class GlmEngine(_Engine):
    def __init__(self, model, *, weights: WeightStore | None = None, max_concurrent_decodes: int = 8,
                 max_len: int = 1024, max_prefill_length: int | None = None, prefill_buckets=None,
                 num_draft: int = 0, mtp_mode: str = "own", max_top_k: int = 64,
                 mesh: jax.sharding.Mesh | None = None, rules: sharding.Rules | None = None,
                 record_routes: bool = False):
        """model: a GlmForCausalLM (its state becomes version 0 of a new WeightStore unless
        `weights` is given). num_draft: MTP drafts per step (0 = plain decoding);
        mtp_mode: "own" or "shared" (rl/engine/speculative.py).

        mesh, rules: where the engine runs (glmjax.make_mesh; default one device) and the
        logical rules (default the ambient ones). The parameters are split as the rules
        say (`param_shardings`; a store of the engine's own is placed in them), the decode
        state's slots over the batch axes (rule "slots"), its cache per the cache rules
        (glmjax/cache.py); with an `expert` axis the MoE layers dispatch all-to-all. A
        `weights` store given by the caller should hold states in `param_shardings`
        (WeightStore(..., shardings=engine.param_shardings)). record_routes: every prefill and
        step also returns the experts each MoE layer chose (module docstring), for routing
        replay."""
        self.graphdef, state = nnx.split(model)
        self.config = model.config
        moe = any(self.config.is_moe(i) for i in range(self.config.num_hidden_layers))
        if record_routes and not moe:
            raise ValueError("record_routes=True: this model has no MoE layer whose experts could be recorded")
        self.record_routes = record_routes
        self._mesh = mesh if mesh is not None else sharding.make_mesh(devices=jax.devices()[:1])
        self.rules = sharding.rules_from(rules) if rules is not None else sharding.current_rules()
        self.param_shardings = sharding.param_shardings(state, self._mesh, self.rules)
        if weights is None:  # the model's own arrays, placed once in the engine's layout
            if not has_shardings(state, self.param_shardings):
                state = jax.device_put(state, self.param_shardings)
            weights = WeightStore(state, shardings=self.param_shardings)
        self.weights = weights
        if num_draft and model.mtp is None:
            raise ValueError(f"num_draft={num_draft} needs an MTP layer; this model has none")
        if mtp_mode not in speculative.MODES:
            raise ValueError(f"mtp_mode={mtp_mode!r} is invalid: expected one of {speculative.MODES}")
        if max_len > self.config.max_position_embeddings:
            raise ValueError(f"max_len={max_len} exceeds max_position_embeddings={self.config.max_position_embeddings}")
        self.max_len, self.num_draft, self.mtp_mode = max_len, num_draft, mtp_mode
        self.max_top_k = min(max_top_k, self.config.vocab_size)
        self.max_top_logprobs = min(TOP_LOGPROBS, self.config.vocab_size)
        self._slots = max_concurrent_decodes
        self._max_prefill = min(max_prefill_length or max_len, max_len)
        self.buckets = tuple(sorted(prefill_buckets)) if prefill_buckets else default_buckets(self._max_prefill)
        self._own_mtp = num_draft > 0 and mtp_mode == "own"
        # The jitted functions take the weights as a flat list of arrays, flattened once per
        # version: flattening an nnx.State costs more than a small model's decode step.
        self._treedef = jax.tree.structure(state)
        self._flat: tuple[Any, list] | None = None  # (state, its leaves) of the last version read
        self._empties: dict[int, KVCache] = {}
        self.decode_rows = default_buckets(self._slots, smallest=min(8, self._slots))
        # Explicit layouts: the decode state stays in `state_shardings` through every call
        # (donated, so a step updates it in place); a prefill's outputs are constrained to
        # the same logical axes inside the call (their row count varies).
        with self._on_mesh():
            self.state_shardings = self._state_shardings(jax.eval_shape(self._zero_state))
        st, rep = self.state_shardings, sharding.NamedSharding(self._mesh, sharding.PartitionSpec())
        self._prefill_fn = jax.jit(self._prefill_impl, static_argnames=("top",))
        self._init_fn = jax.jit(self._zero_state, out_shardings=st)
        # with the alternatives asked for: a program of its own, so the usual step stays as it was;
        # a step's results ({name: [B, K+1, ...]}) on every device, read by the host each step
        self._generate_fn = {top: jax.jit(functools.partial(self._generate_rows, top=top), in_shardings=(None, st, rep),
                                          out_shardings=(st, rep), donate_argnums=(1,), static_argnums=(3,))
                             for top in (False, True)}
        self._move_fn = jax.jit(self._move_impl, in_shardings=(st, rep, rep), out_shardings=st, donate_argnums=(0,))
        self._insert_fn = jax.jit(self._insert_impl, in_shardings=(None, st, rep), out_shardings=st,
                                  donate_argnums=(1,))
        self._free_fn = jax.jit(lambda state, slot: state._replace(active=state.active.at[slot].set(False)),
                                in_shardings=(st, rep), out_shardings=st, donate_argnums=(0,))
        self._extract_fn = jax.jit(lambda state, slot: state.cache.rows(slot, 1), in_shardings=(st, rep))
        self._replicate_fn = None  # fetch: made on first use, on a mesh that spans processes

    # Properties ------------------------------------------------------------------------
    @property
    def max_concurrent_decodes(self) -> int:
        return self._slots

    @property
    def samples_per_slot(self) -> int:
        return 1

    @property
    def max_prefill_length(self) -> int:
        return self._max_prefill

    @property
    def mesh(self) -> jax.sharding.Mesh:
        return self._mesh

    def _on_mesh(self):
        """The engine's mesh and rules as the ambient ones: every call traces and runs
        under them, whatever the caller's thread has set."""
        return sharding.use_mesh(self._mesh, self.rules)

    def _per_slot(self, x, *rest) -> jax.sharding.NamedSharding:
        """x [slots, ...] split per slot (the "slots" rule), its other dimensions by `rest`."""
        spec = sharding.logical_spec(("slots",) + rest, x.shape, mesh=self._mesh, rules=self.rules)
        return sharding.NamedSharding(self._mesh, spec)

    def _state_shardings(self, state: "DecodeState") -> "DecodeState":
        """The decode state's NamedShardings: per slot over the "slots" rule, the cache per
        glmjax/cache.py, drafts' log-probs over the vocabulary rule."""
        slots = self._per_slot
        return DecodeState(
            cache=state.cache.shardings(self._mesh, self.rules), tokens=slots(state.tokens),
            drafts=slots(state.drafts, None), draft_logp=slots(state.draft_logp, None, "act_vocab"),
            temperature=slots(state.temperature), top_k=slots(state.top_k), rng=slots(state.rng),
            active=slots(state.active), generated=slots(state.generated))

    @property
    def colocated_cpus(self):
        return None

    # Parameters ------------------------------------------------------------------------
    def load_params(self, *args, **kwargs) -> WeightStore:
        """The WeightStore itself, so that callers that read params once still see every
        published version."""
        return self.weights

    def _weights(self, params) -> Weights:
        if params is None:
            return self.weights.latest()
        if isinstance(params, WeightStore):
            return params.latest()
        if isinstance(params, Weights):
            return params
        return Weights(params, -1)

    def _leaves(self, w: Weights) -> list:
        """The arrays of `w`, in the layout the jitted functions unflatten (a reference
        list, no copy)."""
        flat = self._flat
        if flat is None or flat[0] is not w.state:
            leaves, treedef = jax.tree.flatten(w.state)
            if treedef != self._treedef:
                raise ValueError("the published weights do not have the engine model's structure: publish "
                                 "nnx.state of the same model (or of rl/quant.quantize of it)")
            flat = self._flat = (w.state, leaves)
        return flat[1]

    def _model(self, leaves):
        return nnx.merge(self.graphdef, jax.tree.unflatten(self._treedef, leaves))

    def get_prefix_destination_sharding(self) -> Any:
        return jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())

    def get_tokenizer(self):
        raise NotImplementedError("GlmEngine is token-in/token-out: it has no tokenizer")

    def bucket(self, n: int) -> int:
        """The prefill length that n tokens are padded to."""
        for b in self.buckets:
            if n <= b:
                return b
        raise ValueError(f"{n} prefill tokens exceed max_prefill_length={self._max_prefill}; chunk the prompt")

    # Prefill ---------------------------------------------------------------------------
    @property
    def _empty(self) -> KVCache:
        """A batch-1 cache of nothing: the start of every new sequence."""
        return self._empty_rows(1)

    def _empty_rows(self, rows: int) -> KVCache:
        """`rows` empty caches in one batch on every device of the engine, made once per row
        count from host zeros (the caller's ambient mesh may hold other devices)."""
        if rows not in self._empties:
            shapes = jax.eval_shape(lambda: KVCache.init(self.config, rows, self.max_len))
            everywhere = sharding.NamedSharding(self._mesh, sharding.PartitionSpec())
            cache = jax.tree.map(lambda x: jax.device_put(np.zeros(x.shape, x.dtype), everywhere), shapes)
            self._empties[rows] = cache if self._own_mtp else cache._replace(mtp=None)
        return self._empties[rows]

    def prefill(self, *, params, existing_prefix: Prefix | KVCache | None = None, padded_tokens,
                true_length: int, sampling: SamplingParams | None = None) -> Prefix:
        """padded_tokens [T] appended after existing_prefix's cache, the first
        `true_length` real (T is padded up to a bucket). Samples the next token."""
        tokens = np.asarray(padded_tokens, np.int32).reshape(-1)
        if not 1 <= true_length <= tokens.shape[0]:
            raise ValueError(f"true_length={true_length} must be in [1, len(padded_tokens)={tokens.shape[0]}]")
        return self.prefill_batch(params=params, tokens=[tokens[:true_length]], existing=[existing_prefix],
                                  sampling=[sampling])

    def prefill_batch(self, *, params, tokens, existing=None, sampling=None, top_logprobs: bool = False) -> Prefix:
        """Several prefills in one call: tokens, a list of n id arrays, each appended after
        its existing cache (a list of Prefix / KVCache / None) with its SamplingParams. The
        batch is padded to a power of two (padding rows are marked by `insert_batch`'s
        slots), the length to a bucket. Returns a Prefix of that batch; with
        `top_logprobs`, its `top` holds the first token's alternatives."""
        n = len(tokens)
        rows = 1 << (n - 1).bit_length()
        existing = list(existing or [None] * n) + [None] * (rows - n)
        sampling = [s or SamplingParams() for s in (sampling or [None] * n)] + [SamplingParams()] * (rows - n)
        for s in sampling:
            if s.top_k > self.max_top_k:
                raise ValueError(f"top_k={s.top_k} exceeds the engine's max_top_k={self.max_top_k}")
        lengths = [len(t) for t in tokens] + [1] * (rows - n)
        if min(lengths) < 1:
            raise ValueError("prefill needs at least one token per sequence")
        bucket = self.bucket(max(lengths))
        ids = np.zeros((rows, bucket), np.int32)
        for i, t in enumerate(tokens):
            ids[i, :len(t)] = t
        caches = [self._empty if e is None else getattr(e, "cache", e) for e in existing]
        if all(c is self._empty for c in caches):  # new sequences only: no per-call concatenation
            cache = self._empty_rows(rows)
        else:
            with self._on_mesh():
                cache = caches[0] if rows == 1 else KVCache.concatenate(caches)
        w = self._weights(params)
        with self._on_mesh():
            prefix, top = self._prefill_fn(self._leaves(w), cache, jnp.asarray(ids), jnp.asarray(lengths, jnp.int32),
                                           jnp.asarray([s.temperature for s in sampling], jnp.float32),
                                           jnp.asarray([s.top_k for s in sampling], jnp.int32),
                                           jnp.stack([jax.random.key(s.seed) for s in sampling]), np.int32(w.version),
                                           top=bool(top_logprobs))
        return prefix if top is None else prefix._replace(top=top)

    def _prefill_impl(self, leaves, cache, ids, true_length, temperature, top_k, keys, version, top: bool):
        """ids [n, T] after cache [n, S]; true_length, temperature, top_k, keys [n]. Returns
        (the Prefix, the first token's alternatives or None)."""
        model = self._model(leaves)
        start = cache.lengths  # [n]
        keys, subs = split_keys(keys, 1 + self.num_draft)
        out, cache, token, log_prob = decoding.prefill(model, cache, ids, true_length, temperature, top_k, subs[0],
                                                       self.max_top_k)
        drafts, draft_logp, cache = self._draft(model, cache, out.hidden, ids, token, out.topk, start,
                                                true_length - 1, temperature, top_k, subs[1:])
        prefix = Prefix(cache, token, log_prob, jnp.full(token.shape, version), drafts, draft_logp, temperature,
                        top_k, keys)
        alternatives = None
        if top:
            logits = out.logits[:, 0]  # [n, N] at each row's last real token
            logp = sampling_logprobs(logits, temperature, top_k, self.max_top_k)
            alternatives = top_logprobs(logits, logp, temperature, self.max_top_logprobs)
        prefix = jax.lax.with_sharding_constraint(prefix, self._prefix_shardings(prefix))
        if self.record_routes:
            prefix = prefix._replace(routes=_positions_first(out.routes))
        return prefix, alternatives

    def fetch(self, tree):
        """`tree`'s arrays on the host. On a mesh that spans processes each process holds only
        its own devices' shards, so the arrays are first copied onto every device (they are
        a prefill's few per-row values)."""
        if not self._mesh.is_multi_process:
            return jax.device_get(tree)
        if self._replicate_fn is None:
            self._replicate_fn = jax.jit(lambda t: t, out_shardings=sharding.NamedSharding(self._mesh,
                                                                                         sharding.PartitionSpec()))
        with self._on_mesh():
            return jax.device_get(self._replicate_fn(tree))

    def _prefix_shardings(self, prefix: Prefix) -> Prefix:
        """A Prefix of n rows laid out as n slots of the decode state."""
        slots = self._per_slot
        return Prefix(prefix.cache.shardings(self._mesh, self.rules), slots(prefix.token), slots(prefix.log_prob),
                      slots(prefix.version), slots(prefix.drafts, None), slots(prefix.draft_logp, None, "act_vocab"),
                      slots(prefix.temperature), slots(prefix.top_k), slots(prefix.rng))

    def _draft(self, model, cache, hidden, fed, next_token, topk, start, last, temp, top_k, keys):
        """Drafts after a forward of `fed` [B, T] at positions start + (0..T-1), of which
        index `last` [B] is the last committed one, followed by next_token [B]."""
        b, k = fed.shape[0], self.num_draft
        if not k:
            return jnp.zeros((b, 0), jnp.int32), jnp.zeros((b, 0, self.config.vocab_size)), cache
        rows = jnp.arange(b)
        if self.mtp_mode == "own":
            t = jnp.arange(fed.shape[1])[None]
            following = jnp.concatenate([fed[:, 1:], fed[:, -1:]], axis=1)  # the token after each position
            next_ids = jnp.where(t == last[:, None], next_token[:, None], following)
            drafts, logp, mtp = speculative.draft_own(model, hidden, next_ids, cache.mtp, start, last, k, temp,
                                                      top_k, keys, self.max_top_k)
            return drafts, logp, cache._replace(mtp=mtp)
        drafts, logp = speculative.draft_shared(model, hidden[rows, last], next_token, start + last, cache,
                                                None if topk is None else topk[rows, last], k, temp, top_k, keys,
                                                self.max_top_k)
        return drafts, logp, cache

    def warmup(self, buckets=None, top_logprobs: bool = False) -> None:
        """Compiles every prefill shape (batches of 1, 2, 4 .. max_concurrent_decodes
        rows, times each bucket length) and the decode step, by running them once on dummy
        tokens, so that no request waits for a compile; with `top_logprobs`, their programs
        that also return the alternatives too (what a server whose clients ask for them runs)."""
        state, rows, variants = self.init_decode_state(), [1], (False, True) if top_logprobs else (False,)
        while rows[-1] < self._slots:
            rows.append(rows[-1] * 2)
        for bucket in buckets or self.buckets:
            for n in rows:
                for top in variants:
                    prefix = self.prefill_batch(params=None, tokens=[np.zeros(bucket, np.int32)] * n, top_logprobs=top)
                    state = self.insert_batch(prefix, state, list(range(min(n, self._slots))))
        for rows in self.decode_rows:
            for top in variants:
                state, result = self.generate_rows(None, state, rows, top_logprobs=top)
        state = self.free(self.move(state, 1 % self._slots, 0), 0)
        jax.block_until_ready((self.extract(state, 0), result))

    # Slots -----------------------------------------------------------------------------
    def init_decode_state(self, *args, **kwargs) -> DecodeState:
        """Every slot empty, in `state_shardings`."""
        with self._on_mesh():
            return self._init_fn()

    def _zero_state(self) -> DecodeState:
        b, k = self._slots, self.num_draft
        cache = KVCache.init(self.config, b, self.max_len)
        return DecodeState(
            cache=cache if self._own_mtp else cache._replace(mtp=None),
            tokens=jnp.zeros((b,), jnp.int32),
            drafts=jnp.zeros((b, k), jnp.int32),
            draft_logp=jnp.zeros((b, k, self.config.vocab_size), jnp.float32),
            temperature=jnp.zeros((b,), jnp.float32),
            top_k=jnp.zeros((b,), jnp.int32),
            rng=jax.random.split(jax.random.key(0), b),
            active=jnp.zeros((b,), bool),
            generated=jnp.zeros((b,), jnp.int32),
        )

    def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int) -> DecodeState:
        """Puts `prefix` into `slot` (the old contents of the slot are dropped)."""
        return self.insert_batch(prefix, decode_state, [slot])

    def insert_batch(self, prefix: Prefix, decode_state: DecodeState, slots) -> DecodeState:
        """Row i of a prefill_batch Prefix into slots[i]; rows past len(slots) are padding."""
        if any(not 0 <= s < self._slots for s in slots):
            raise ValueError(f"slots={list(slots)} must lie in [0, max_concurrent_decodes={self._slots})")
        rows = prefix.token.shape[0]
        targets = np.full((rows,), self._slots, np.int32)  # out of range: dropped
        targets[:len(slots)] = slots
        with self._on_mesh():
            return self._insert_fn(prefix._replace(top=None, routes=None), decode_state, jnp.asarray(targets))

    @staticmethod
    def _insert_impl(prefix: Prefix, state: DecodeState, slots):
        put = lambda dst, src: dst.at[slots].set(src.astype(dst.dtype), mode="drop")  # noqa: E731
        return DecodeState(
            cache=state.cache.put_rows(slots, prefix.cache),
            tokens=put(state.tokens, prefix.token),
            drafts=put(state.drafts, prefix.drafts),
            draft_logp=put(state.draft_logp, prefix.draft_logp),
            temperature=put(state.temperature, prefix.temperature),
            top_k=put(state.top_k, prefix.top_k),
            rng=state.rng.at[slots].set(prefix.rng, mode="drop"),
            active=state.active.at[slots].set(True, mode="drop"),
            generated=state.generated.at[slots].set(1, mode="drop"),
        )

    def free(self, decode_state: DecodeState, slot: int) -> DecodeState:
        """Marks `slot` empty: its length stops advancing until the next insert."""
        with self._on_mesh():
            return self._free_fn(decode_state, jnp.int32(slot))

    def move(self, decode_state: DecodeState, src: int, dst: int) -> DecodeState:
        """Slot `src`'s contents (cache row, pending token, settings, key) into slot `dst`,
        whose old contents are dropped; `src` is free afterwards."""
        with self._on_mesh():
            return self._move_fn(decode_state, jnp.int32(src), jnp.int32(dst))

    @staticmethod
    def _move_impl(state: DecodeState, src, dst):
        moved = jax.tree.map(lambda x: x.at[dst].set(x[src]), state._replace(cache=None))
        return moved._replace(active=moved.active.at[src].set(moved.active[src] & (src == dst)),
                              cache=state.cache.with_rows(dst, state.cache.rows(src, 1)))

    def rows_for(self, slots_in_use: int) -> int:
        """The decode row count that covers slots [0, slots_in_use)."""
        return next(r for r in self.decode_rows if r >= slots_in_use)

    def extract(self, decode_state: DecodeState, slot: int) -> KVCache:
        """The cache of `slot` as a batch-1 KVCache, usable as `existing_prefix`."""
        with self._on_mesh():
            return self._extract_fn(decode_state, jnp.int32(slot))

    # Generate --------------------------------------------------------------------------
    def generate(self, params, decode_state: DecodeState) -> tuple[DecodeState, ResultTokens]:
        """One step for every slot: up to num_draft + 1 tokens each (inactive slots emit
        tokens marked invalid)."""
        return self.generate_rows(params, decode_state, self._slots)

    def generate_rows(self, params, decode_state: DecodeState, rows: int,
                      top_logprobs: bool = False) -> tuple[DecodeState, ResultTokens]:
        """`generate` for slots [0, rows) only (rows one of decode_rows); the other slots
        keep their state and emit nothing. `top_logprobs`: also each token's alternatives."""
        if rows not in self.decode_rows:
            raise ValueError(f"rows={rows} is not one of the engine's decode_rows {self.decode_rows}")
        w = self._weights(params)
        with self._on_mesh():
            state, out = self._generate_fn[bool(top_logprobs)](self._leaves(w), decode_state, np.int32(w.version),
                                                               rows)
        k1 = self.num_draft + 1
        return state, ResultTokens(tokens_idx=(0, k1), valid_idx=(k1, 2 * k1), length_idx=(2 * k1, 2 * k1 + 1),
                                   samples_per_slot=1, **out)

    def _generate_rows(self, leaves, state: DecodeState, version, rows: int, top: bool):
        """The step on slots [0, rows), written back in place; results padded to every slot."""
        if rows == self._slots:
            return self._generate_impl(leaves, state, version, top)
        rest = state._replace(cache=None)  # the cache's rows sit on its own axis (glmjax/cache.py)
        new, out = self._generate_impl(leaves, jax.tree.map(lambda x: x[:rows], rest)._replace(
            cache=state.cache.rows(0, rows)), version, top)
        state = jax.tree.map(lambda full, part: full.at[:rows].set(part), rest, new._replace(cache=None))._replace(
            cache=state.cache.with_rows(0, new.cache))
        return state, jax.tree.map(lambda x: jnp.pad(x, [(0, self._slots - rows)] + [(0, 0)] * (x.ndim - 1)), out)

    def _generate_impl(self, leaves, state: DecodeState, version, top: bool):
        model = self._model(leaves)
        k = self.num_draft
        fed = jnp.concatenate([state.tokens[:, None], state.drafts], axis=1)  # [B, K+1]
        start = state.cache.lengths
        out, target_logp = decoding.step(model, state.cache, fed, state.temperature, state.top_k, self.max_top_k)
        logits, hidden, cache, topk = out.logits, out.hidden, out.cache, out.topk
        rng, subs = split_keys(state.rng, 2 + k)
        accepted, tokens = speculative.accept(target_logp, state.draft_logp, state.drafts, subs[0], subs[1])
        active = state.active
        accepted = jnp.where(active, accepted, 0)
        cache = cache._replace(lengths=jnp.where(active, start + accepted + 1, start))
        rows = jnp.arange(fed.shape[0])
        pending = tokens[rows, accepted]
        drafts, draft_logp, cache = self._draft(model, cache, hidden, fed, pending, topk, start, accepted,
                                                state.temperature, state.top_k, subs[2:])
        log_probs = token_logprobs(logits, target_logp, tokens, state.temperature)
        valid = (jnp.arange(k + 1)[None] <= accepted[:, None]) & active[:, None]
        generated = state.generated + jnp.where(active, accepted + 1, 0)
        new = state._replace(cache=cache, tokens=pending, drafts=drafts, draft_logp=draft_logp, rng=rng,
                             generated=generated)
        versions = jnp.full(tokens.shape, version, jnp.int32)
        data = jnp.concatenate([tokens, valid.astype(jnp.int32), generated[:, None]], axis=1)  # ResultTokens.data
        results = {"data": data, "log_probs": log_probs, "versions": versions}
        if top:
            results["top_ids"], results["top_logps"] = top_logprobs(logits, target_logp, state.temperature,
                                                                    self.max_top_logprobs)
        if self.record_routes:  # the experts of fed[:, j], kept where the cache keeps it (j <= accepted)
            results["routes"] = _positions_first(out.routes)
        return new, results


def _positions_first(routes: jax.Array) -> jax.Array:
    """A forward's routes [L_moe, B, T, X] as [B, T, L_moe, X] int16 (experts number < 2^15)."""
    return jnp.transpose(routes, (1, 2, 0, 3)).astype(jnp.int16)
