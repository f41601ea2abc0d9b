"""The Pallas implementations of the model's attention ops, under the names and
signatures of the references in `reference.py` (what `ops.get(name, "pallas")` returns)."""

from __future__ import annotations

from pallas_kernels.absorbed_mla import mla_attention
from pallas_kernels.indexer import indexer_topk
from pallas_kernels.sparse_mla import sparse_mla_attention

OPS = {
    "mla_attention": mla_attention,
    "sparse_mla_attention": sparse_mla_attention,
    "indexer_topk": indexer_topk,
}
