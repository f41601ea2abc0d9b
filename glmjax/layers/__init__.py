"""The model's mechanisms, one per file: norms, rope, indexer, mla, moe, decoder, mtp."""
