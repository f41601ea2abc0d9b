"""The KV cache: per layer the normalised latent c_kv [B, S, C], the roped shared key
k_rope [B, S, R], and on layers that own an indexer its keys index_k [B, S, I]; per
sequence its length. Nothing per head is cached (MLA), and IndexShare's shared layers
cache no indexer keys.

A scanned model (`config.scan_layers`, glmjax/layers/stack.py) keeps its cache the way it
keeps its parameters: `layers` holds per segment one LayerCache per position of the
segment's layer group, each array stacked over the repeats, [R, B, S, .]. In either layout
a cached array's batch axis is its third from last (`ROW_AXIS`), so rows are moved
between caches (`concatenate`, `rows`, `with_rows`, `put_rows`) the same way.
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
ROW_AXIS = -3  # of every cached array ([B, S, .] or stacked [R, B, S, .]); lengths [B] has only one


def _row_axis(x: jax.Array) -> int:
    return x.ndim + ROW_AXIS if x.ndim >= 3 else 0


class LayerCache(NamedTuple):
    c_kv: jax.Array  # [B, S, C]
    k_rope: jax.Array  # [B, S, R]
    index_k: jax.Array | None  # [B, S, I], None on shared-indexer layers

    @classmethod
    def zeros(cls, config: ModelConfig, batch: int, max_len: int, dtype, with_indexer: bool,
              repeats: int | None = None) -> "LayerCache":
        """repeats: a stacked cache [R, B, S, .] for R repeats of a scanned layer."""
        c = config
        lead = (batch, max_len) if repeats is None else (repeats, batch, max_len)
        return cls(
            jnp.zeros((*lead, c.kv_lora_rank), dtype),
            jnp.zeros((*lead, c.qk_rope_head_dim), dtype),
            jnp.zeros((*lead, c.index_head_dim), dtype) if with_indexer else None,
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
    layers: tuple  # a LayerCache per layer, or per segment a tuple of stacked LayerCaches
    lengths: jax.Array  # [B] int32: tokens already written per sequence
    mtp: LayerCache | None = None  # the MTP layer's own cache, when the model has one

    @classmethod
    def init(cls, config: ModelConfig, batch: int, max_len: int, dtype=None) -> "KVCache":
        dtype = jnp.dtype(dtype or config.dtype)
        if config.scan_layers:
            layers = tuple(
                tuple(LayerCache.zeros(config, batch, max_len, dtype, config.has_indexer(first + j), repeats)
                      for j in range(period))
                for first, period, repeats in config.layer_segments
            )
        else:
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
            names = (None,) * (len(x.shape) - len(names)) + tuple(names)  # a stacked cache's repeats: whole
            return None if x is None else jax.sharding.NamedSharding(
                mesh, logical_spec(names, x.shape, mesh=mesh, rules=rules))

        def layer(c: LayerCache) -> LayerCache:
            return LayerCache(place(c.c_kv, LATENT_AXES), place(c.k_rope, KEY_AXES),
                              None if c.index_k is None else place(c.index_k, KEY_AXES))

        layers = jax.tree.map(layer, self.layers, is_leaf=lambda x: isinstance(x, LayerCache))
        return KVCache(layers, place(self.lengths, ("slots",)), None if self.mtp is None else layer(self.mtp))

    @property
    def max_len(self) -> int:
        return jax.tree.leaves(self.layers)[0].shape[-2]

    def layer(self, i: int) -> LayerCache:
        """Layer i's cache ([B, S, .]; -1 is the last layer), sliced out of a stacked one."""
        if not self.layers or isinstance(self.layers[0], LayerCache):
            return self.layers[i]
        per_layer = [(s, r, j) for s, seg in enumerate(self.layers) for r in range(seg[0].c_kv.shape[0])
                     for j in range(len(seg))]
        s, r, j = per_layer[i]
        return jax.tree.map(lambda x: x[r], self.layers[s][j])

    def bytes_per_token(self) -> int:
        leaves = jax.tree.leaves(self.layers + ((self.mtp,) if self.mtp is not None else ()))
        return sum(x.dtype.itemsize * x.size // (x.shape[-3] * x.shape[-2]) for x in leaves)

    @staticmethod
    def concatenate(caches: list["KVCache"]) -> "KVCache":
        """The rows of several caches of one layout, in order."""
        return jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=_row_axis(xs[0])), *caches)

    def rows(self, start, size: int) -> "KVCache":
        """Rows [start, start + size) (start may be traced)."""
        return jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, start, size, _row_axis(x)), self)

    def with_rows(self, start, part: "KVCache") -> "KVCache":
        """This cache with rows [start, start + part's rows) replaced by part's."""
        return jax.tree.map(lambda x, p: jax.lax.dynamic_update_slice_in_dim(x, p.astype(x.dtype), start, _row_axis(x)),
                            self, part)

    def put_rows(self, rows: jax.Array, src: "KVCache") -> "KVCache":
        """This cache with src's row i written into row rows[i] (rows out of range: dropped)."""
        def put(dst, new):
            index = (slice(None),) * _row_axis(dst) + (rows,)
            return dst.at[index].set(new.astype(dst.dtype), mode="drop")

        return jax.tree.map(put, self, src)
