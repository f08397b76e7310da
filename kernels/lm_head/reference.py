"""Reference LM head: fp64 logits and log-softmax, for tolerance tests only."""

import torch


def token_logprobs_reference(hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    logits = hidden.double() @ weight.double().t()
    return logits.log_softmax(-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
