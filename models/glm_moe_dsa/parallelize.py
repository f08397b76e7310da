"""GLM-5's tensor parallelism: not written. A rank would hold whole attention heads of
q_b_proj / kv_b_proj and their absorbed per-head pieces, while the latent cache row, the
indexer (its own heads, summed into one score per key before the top-k) and the router stay
replicated; the per-head absorbed GEMMs and the indexer's head sum would need the fixed leaf
tree across ranks. Until then TP > 1 is refused with this reason."""

NO_TP_REASON = ("GLM-5's TP plan is not written (MLA's absorbed per-head projections and the indexer's head-summed "
                "scores would need the fixed leaf tree across ranks); use tensor_parallel_degree = 1 (FSDP is fine)")
