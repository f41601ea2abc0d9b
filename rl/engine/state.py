"""What the rollout engine (rl/engine/engine.py) hands out and keeps: a generate step's
results (JetStream's ResultTokens and SlotData, with log-probs, versions, alternatives and
routes), a prefilled Prefix, and the DecodeState of its slots.

Legend: B slots, K drafts per step, N vocabulary, L_moe MoE layers, X experts per token.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
from flax import struct

from glmjax.cache import KVCache


@struct.dataclass
class SlotData:
    tokens: Any  # [samples, K+1]
    valid: Any
    lengths: Any  # [samples]
    log_probs: Any  # [samples, K+1]
    versions: Any
    top_ids: Any = None  # [samples, K+1, max_top_logprobs] when the step was asked for them
    top_logps: Any = None
    routes: Any = None  # [samples, K+1, L_moe, X] the fed positions' experts, with record_routes


@struct.dataclass
class ResultTokens:
    """JetStream 0.2.2's ResultTokens (tokens, validity and lengths in one int32 array
    `data` [B, 2(K+1) + 1]) plus per-token log_probs [B, K+1] and versions [B, K+1], and,
    from a step asked for them, the alternatives top_ids / top_logps [B, K+1, max_top_logprobs],
    and from an engine that records them, the experts of the positions the step fed, routes
    [B, K+1, L_moe, X] (the pending token's, then the accepted drafts'; `valid` as the tokens)."""

    data: Any
    log_probs: Any
    versions: Any
    tokens_idx: tuple[int, int] = struct.field(pytree_node=False)
    valid_idx: tuple[int, int] = struct.field(pytree_node=False)
    length_idx: tuple[int, int] = struct.field(pytree_node=False)
    samples_per_slot: int = struct.field(pytree_node=False)
    top_ids: Any = None
    top_logps: Any = None
    routes: Any = None

    _ARRAYS = ("data", "log_probs", "versions", "top_ids", "top_logps", "routes")

    def copy_to_host_async(self) -> None:
        for name in self._ARRAYS:
            x = getattr(self, name)
            if isinstance(x, jax.Array):
                x.copy_to_host_async()

    def convert_to_numpy(self) -> "ResultTokens":
        return self.replace(**dict(zip(self._ARRAYS, jax.device_get([getattr(self, n) for n in self._ARRAYS]))))

    def get_result_at_slot(self, slot: int) -> SlotData:
        rows = slice(slot * self.samples_per_slot, (slot + 1) * self.samples_per_slot)
        cols = lambda idx: self.data[rows, idx[0]:idx[1]]  # noqa: E731
        top = (None, None) if self.top_ids is None else (self.top_ids[rows], self.top_logps[rows])
        return SlotData(cols(self.tokens_idx), cols(self.valid_idx), cols(self.length_idx)[:, 0],
                        self.log_probs[rows], self.versions[rows], *top,
                        None if self.routes is None else self.routes[rows])


class Prefix(NamedTuple):
    """Prefilled sequences (n = 1 from `prefill`): the cache and what decoding needs next."""

    cache: KVCache  # [n, max_len]; lengths [n] = tokens written
    token: jax.Array  # [n] the first sampled token (pending: not in the cache)
    log_prob: jax.Array  # [n]
    version: jax.Array  # [n] int32: the weights that sampled `token`
    drafts: jax.Array  # [n, K]
    draft_logp: jax.Array  # [n, K, N]
    temperature: jax.Array  # [n]
    top_k: jax.Array  # [n]
    rng: jax.Array  # [n] keys
    top: Any = None  # (ids, log-probs) [n, max_top_logprobs] of `token`'s alternatives, when asked
    routes: Any = None  # [n, T, L_moe, X] int16 the experts of each prefilled position, with record_routes


class DecodeState(NamedTuple):
    """The slots. Per slot b: cache row b, pending token, drafts, settings, key."""

    cache: KVCache  # [B, max_len]
    tokens: jax.Array  # [B]
    drafts: jax.Array  # [B, K]
    draft_logp: jax.Array  # [B, K, N]
    temperature: jax.Array  # [B]
    top_k: jax.Array  # [B]
    rng: jax.Array  # [B] keys
    active: jax.Array  # [B] bool
    generated: jax.Array  # [B] int32: tokens produced so far (the first one included)
