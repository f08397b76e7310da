"""LM head in fp32: logits = h @ W^T with both upcast to fp32, then the vocabulary
reduction (log-softmax / logsumexp) in fp32.

The GEMM goes through the tiled invariant `linear`. The log-softmax is eager
`Tensor.log_softmax(-1, dtype=float32)`: the exact expression vLLM's sampler uses for
its recorded log-probs (vllm/v1/sample/sampler.py `compute_logprobs`), and a row
reduction that is invariant to the row count (guard test)."""

import torch

from titan_rl.kernels.matmul.torch_impl import linear


def lm_head_logits(hidden: torch.Tensor, weight_fp32: torch.Tensor) -> torch.Tensor:
    """fp32 logits. `weight_fp32` is the LM head weight in fp32: the engine caches it as
    a PackedWeight; the trainer upcasts per step so gradients flow to the bf16 master."""
    return linear(hidden.float(), weight_fp32)


def log_softmax_fp32(logits: torch.Tensor) -> torch.Tensor:
    return logits.log_softmax(dim=-1, dtype=torch.float32)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Log-prob of `tokens` under fp32 `logits` ([..., V], tokens [...])."""
    return log_softmax_fp32(logits).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
