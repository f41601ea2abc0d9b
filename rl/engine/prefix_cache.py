"""Prefix reuse: the cache rows of a finished turn, kept per session for its next turn.

When a request of session s finishes, the driver stores its slot's cache (a batch-1
KVCache, still on the device; no host copy) with the token ids that cache holds. The
session's next request usually starts with exactly those tokens (the conversation so
far) plus new ones; `match` returns the stored cache with its length cut to the longest
common prefix, so only the new tokens are prefilled. Cutting the length is enough:
entries past a length are invisible to later queries and get overwritten.

Reused entries keep the weights version that computed them (as PipelineRL keeps the
KV cache across weight updates); the versions reported are those of generated tokens.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence

import jax
import numpy as np

from glmjax.cache import KVCache


class PrefixCache:
    def __init__(self, capacity: int = 32):
        self.capacity = capacity
        self._entries: collections.OrderedDict[str, tuple[tuple[int, ...], KVCache]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, session_id: str, tokens: Sequence[int], cache: KVCache) -> None:
        """tokens: the ids at cache positions 0 .. len(tokens) - 1."""
        if self.capacity <= 0:
            return
        with self._lock:
            self._entries[session_id] = (tuple(tokens), cache)
            self._entries.move_to_end(session_id)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)

    def match(self, session_id: str | None, prompt: Sequence[int]) -> tuple[KVCache | None, int]:
        """(cache with lengths = m, m) for the longest stored prefix m of `prompt`, at most
        len(prompt) - 1 (the last prompt token must be run to sample from); (None, 0) if
        nothing of the session's cache can be used."""
        if session_id is None:
            return None, 0
        with self._lock:
            entry = self._entries.get(session_id)
            if entry is None:
                return None, 0
            self._entries.move_to_end(session_id)
        tokens, cache = entry
        limit = min(len(tokens), len(prompt) - 1)
        m = 0
        while m < limit and tokens[m] == prompt[m]:
            m += 1
        if m == 0:
            return None, 0
        # on the cache's own devices, whatever mesh is ambient in the calling thread
        return cache._replace(lengths=jax.device_put(np.full((1,), m, np.int32), cache.lengths.sharding)), m
