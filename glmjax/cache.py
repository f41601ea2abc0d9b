"""The KV cache: per layer the normalised latent c_kv [B, S, C], the roped shared key
k_rope [B, S, R], and on layers that own an indexer its keys index_k [B, S, I]; per
sequence its length. Nothing per head is cached (MLA), and IndexShare's shared layers
cache no indexer keys.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from glmjax.config import ModelConfig
from glmjax.sharding import logical_spec

# logical axes (glmjax/sharding.py) of a layer's cached arrays
LATENT_AXES = ("slots", "cache_length", "cache_latent")  # c_kv [B, S, C]
KEY_AXES = ("slots", "cache_length", None)  # k_rope [B, S, R], index_k [B, S, I]


class LayerCache(NamedTuple):
    c_kv: jax.Array  # [B, S, C]
    k_rope: jax.Array  # [B, S, R]
    index_k: jax.Array | None  # [B, S, I], None on shared-indexer layers

    @classmethod
    def zeros(cls, config: ModelConfig, batch: int, max_len: int, dtype, with_indexer: bool) -> "LayerCache":
        c = config
        return cls(
            jnp.zeros((batch, max_len, c.kv_lora_rank), dtype),
            jnp.zeros((batch, max_len, c.qk_rope_head_dim), dtype),
            jnp.zeros((batch, max_len, c.index_head_dim), dtype) if with_indexer else None,
        )

    def write(self, q_pos: jax.Array, c_kv, k_rope, index_k) -> "LayerCache":
        """Stores the new tokens' entries [B, T, ...] at their positions q_pos [B, T].
        Positions past the end are dropped."""
        b = jnp.arange(q_pos.shape[0])[:, None]
        put = lambda buf, new: buf.at[b, q_pos].set(new.astype(buf.dtype), mode="drop")  # noqa: E731
        return LayerCache(
            put(self.c_kv, c_kv),
            put(self.k_rope, k_rope),
            None if self.index_k is None else put(self.index_k, index_k),
        )


class KVCache(NamedTuple):
    layers: tuple[LayerCache, ...]
    lengths: jax.Array  # [B] int32: tokens already written per sequence
    mtp: LayerCache | None = None  # the MTP layer's own cache, when the model has one

    @classmethod
    def init(cls, config: ModelConfig, batch: int, max_len: int, dtype=None) -> "KVCache":
        dtype = jnp.dtype(dtype or config.dtype)
        layers = tuple(
            LayerCache.zeros(config, batch, max_len, dtype, config.has_indexer(i))
            for i in range(config.num_hidden_layers)
        )
        mtp = LayerCache.zeros(config, batch, max_len, dtype, True) if config.num_nextn_predict_layers else None
        return cls(layers, jnp.zeros((batch,), jnp.int32), mtp)

    def shardings(self, mesh: jax.sharding.Mesh, rules=None) -> "KVCache":
        """The cache's NamedShardings on `mesh` (the same tree, a sharding per array) from
        the logical axes above and the rules (the ambient ones by default). Works on a
        cache of jax.ShapeDtypeStruct as well."""
        def place(x, names):
            return None if x is None else jax.sharding.NamedSharding(
                mesh, logical_spec(names, x.shape, mesh=mesh, rules=rules))

        def layer(c: LayerCache) -> LayerCache:
            return LayerCache(place(c.c_kv, LATENT_AXES), place(c.k_rope, KEY_AXES), place(c.index_k, KEY_AXES))

        return KVCache(tuple(layer(c) for c in self.layers), place(self.lengths, ("slots",)),
                       None if self.mtp is None else layer(self.mtp))

    @property
    def max_len(self) -> int:
        return self.layers[0].c_kv.shape[1]

    def bytes_per_token(self) -> int:
        leaves = jax.tree.leaves(self.layers + ((self.mtp,) if self.mtp is not None else ()))
        return sum(x.dtype.itemsize * x.shape[-1] for x in leaves)
