"""Pallas kernels for MLA, the lightning indexer and sparse MLA, each beside its jnp reference."""
