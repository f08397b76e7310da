"""LayerNorm (the indexer key's k_norm), batch-invariant."""
