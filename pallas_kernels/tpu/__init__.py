"""Mosaic (TPU) versions of the attention kernels, under the references' signatures.

    _mosaic.py     pallas_call on "tpu" (Mosaic) or "tpu-interpret" (TPU interpret mode on a CPU)
    mla.py         absorbed MLA (reference.mla_attention): flash prefill / split-key decode, custom-VJP backward
    indexer.py     lightning indexer (reference.indexer_topk): blockwise causal scores, top-k per query chunk
    sparse_mla.py  sparse MLA (reference.sparse_mla_attention): DMA row gathers, custom-VJP backward
"""
