"""Top-k / top-p masks and sampled-policy log-probs (see docs/sampling.md)."""

from titan_rl.kernels.sampling.torch_impl import (
    apply_top_k_top_p,
    drop_mask,
    kept_mask,
    sampled_logprobs,
    scale_by_temperature,
)

__all__ = ["apply_top_k_top_p", "drop_mask", "kept_mask", "sampled_logprobs", "scale_by_temperature"]
