"""Pallas kernels for MLA, the lightning indexer and sparse MLA, each beside its jnp reference.

    reference.py     the jnp definitions (the model's XLA path) every kernel is tested against
    ops.py           dispatch by ModelConfig.kernel_impl: "xla" | "pallas"
    pallas_ops.py    the Pallas ops under the references' names and signatures
    flash.py         blockwise online-softmax core shared by the dense MLA kernels (fwd + bwd)
    flash_mla.py     flash MLA prefill, expanded heads, optional top-k mask (fwd + bwd)
    absorbed_mla.py  absorbed MLA over the latent cache: prefill and split-key decode (fwd + bwd)
    indexer.py       lightning-indexer scoring (blockwise, causal, optional FP8) + top-k
    sparse_mla.py    absorbed MLA over the gathered top-k rows: prefill and decode (fwd + bwd)
    _backend.py      interpret mode on CPU, Triton on GPU; padding and matmul helpers
"""
