"""LM head: fp32 logits = h @ W^T (every product exact in fp32, fp32 accumulation), then
the vocabulary reduction (log-softmax / logsumexp) in fp32.

Two GEMM forms, chosen once per platform (`HEAD_FORM`, reported by the self-check and
named in the execution contract):
  "dpbf16": bf16 hidden and weight (a bf16 model) on a CPU with AVX512-BF16 or AVX2 + FMA:
            the compiled kernel csrc/bf16_logits.cpp reads the bf16 weight and accumulates
            the exact products in fp32 in a fixed order, vdpbf16ps's (a bf16 GEMM's speed
            and half the bytes of an fp32 copy; measured in docs/kernels.md). Without
            AVX512-BF16 the same bits come from FMAs (csrc/dpbf16_avx2.h), so a bf16 model's
            logits do not depend on the CPU kind. Its backward is the fp32 one below.
  "fp32":   everything else (fp32 models; CPUs without AVX2): both operands upcast to fp32
            (exact) through the tiled invariant `linear`.
Both are batch-invariant: an output's bits depend on its row of h and its row of W only.

The log-softmax is eager `Tensor.log_softmax(-1, dtype=float32)`: the exact expression
vLLM's sampler uses for its recorded log-probs (vllm/v1/sample/sampler.py
`compute_logprobs`), and a row reduction that is invariant to the row count (guard test).
"""

from __future__ import annotations

import torch

from titan_rl.kernels.cpu_ext import ops as _ops
from titan_rl.kernels.matmul.torch_impl import PackedWeight, grad_weight, linear


def _dpbf16_available() -> bool:
    try:
        return bool(_ops().bf16_logits_available())
    except (RuntimeError, OSError):
        return False


HEAD_FORM = "dpbf16" if _dpbf16_available() else "fp32"


class PackedHead:
    """A bf16 LM-head weight [V, K] in the dpbf16 kernel's layout (packed once per engine
    weight load; the trainer packs per call). Opaque: only `lm_head_logits` reads it."""

    __slots__ = ("data", "n", "k")

    def __init__(self, weight: torch.Tensor):
        self.n, self.k = weight.shape
        self.data = _ops().bf16_logits_pack(weight.detach())


class _Dpbf16Head(torch.autograd.Function):
    """Forward: the dpbf16 kernel. Backward in fp32 on the upcast operands, both gradients on
    the FMA-chain GEMM (kernels/csrc/weight_grad.cpp) reading the bf16 weight and hidden
    states as they lie: the input gradient grad @ W as one chain over the vocabulary per
    output. At a real vocabulary the fp32 head's input gradient (oneDNN) would first convert,
    transpose and reorder the whole weight every step: 151936 x 1024 is 622 MB in fp32."""

    @staticmethod
    def forward(ctx, h2, weight):
        ctx.save_for_backward(h2, weight)
        return _ops().bf16_logits(h2, PackedHead(weight).data, weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        h2, weight = ctx.saved_tensors
        grad = grad.float()
        gh = _ops().weight_grad(grad.t(), weight).to(h2.dtype) if ctx.needs_input_grad[0] else None
        gw = grad_weight(grad, h2).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return gh, gw


def _uses_dpbf16(hidden: torch.Tensor, weight) -> bool:
    if isinstance(weight, PackedHead):
        return True
    return HEAD_FORM == "dpbf16" and hidden.dtype == weight.dtype == torch.bfloat16


def lm_head_logits(hidden: torch.Tensor, weight) -> torch.Tensor:
    """fp32 logits [..., V]. `weight`: the LM head weight in the model's dtype (trainer:
    gradients flow to it), or what `lm_head_weight` prepared from it (engine)."""
    lead = hidden.shape[:-1]
    if _uses_dpbf16(hidden, weight):
        if hidden.dtype != torch.bfloat16:
            raise TypeError(f"a bf16 LM head (PackedHead) takes bf16 hidden states; got {hidden.dtype}")
        h2 = hidden.reshape(-1, hidden.shape[-1])
        if isinstance(weight, PackedHead):
            y = _ops().bf16_logits(h2, weight.data, weight.n)
        else:
            y = _Dpbf16Head.apply(h2, weight)
        return y.reshape(*lead, -1)
    if isinstance(weight, torch.Tensor) and weight.dtype != torch.float32:
        weight = weight.float()
    return linear(hidden.float(), weight)


def lm_head_weight(weight: torch.Tensor):
    """The engine's LM head weight, prepared once per load for `lm_head_logits`."""
    w = weight.detach()
    if HEAD_FORM == "dpbf16" and w.dtype == torch.bfloat16:
        return PackedHead(w)
    return PackedWeight(w.float())


def log_softmax_fp32(logits: torch.Tensor) -> torch.Tensor:
    return logits.log_softmax(dim=-1, dtype=torch.float32)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Log-prob of `tokens` under fp32 `logits` ([..., V], tokens [...])."""
    return log_softmax_fp32(logits).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
