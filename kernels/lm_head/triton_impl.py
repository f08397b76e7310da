"""LM head in Triton: the same algorithm as torch_impl (fp32 logits, fp32 log-softmax).

Logits go through the tiled Triton linear in fp32 (fixed row tiles, fixed K order).
The log-softmax is one program per row: pass 1 walks the vocabulary in chunks of
BLOCK_V from 0 upwards with an online max / rescaled sum (a fixed order that depends on
V only), giving lse = m + log(sum); pass 2 writes x - lse. A program never sees another
row and there is no split over programs, so a row's bits do not depend on the row count.
Backward: eager log_softmax's gradient (kernels/autograd.py).
(Not bit-equal to eager torch's log_softmax, whose reduction tree differs; the rule is
that both engines call the same implementation on a platform.)
"""

import torch
import triton
import triton.language as tl

from titan_rl.kernels.autograd import with_eager_backward
from titan_rl.kernels.matmul.triton_impl import linear

BLOCK_V = 1024  # fixed vocab chunk; never chosen from the row count


@triton.jit
def _log_softmax_kernel(x_ptr, y_ptr, V, stride_x, stride_y, BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_V)
    m = tl.full((), float("-inf"), tl.float32)
    acc = tl.zeros((), tl.float32)
    for v0 in range(0, V, BLOCK_V):  # pass 1: online max / sum, chunks in order
        x = tl.load(x_ptr + row * stride_x + v0 + offs, mask=v0 + offs < V, other=float("-inf"))
        x = x.to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # an all -inf prefix: no NaN
        acc = acc * tl.exp(m - m_safe) + tl.sum(tl.exp(x - m_safe), axis=0)
        m = m_new
    lse = m + tl.log(acc)
    for v0 in range(0, V, BLOCK_V):  # pass 2: x - lse
        mask = v0 + offs < V
        x = tl.load(x_ptr + row * stride_x + v0 + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * stride_y + v0 + offs, x - lse, mask=mask)


def lm_head_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 logits through the fixed-tile Triton GEMM on fp32 operands (the weight in the
    model's dtype, or its fp32 copy from `lm_head_weight`)."""
    return linear(hidden.float(), weight if weight.dtype == torch.float32 else weight.float())


def lm_head_weight(weight: torch.Tensor) -> torch.Tensor:
    """The engine's LM head weight, prepared once per load: an fp32 copy."""
    return weight.detach().float().contiguous()


def _log_softmax_fp32(logits: torch.Tensor) -> torch.Tensor:
    V = logits.shape[-1]
    x2 = logits.reshape(-1, V).contiguous()
    y = torch.empty(x2.shape, dtype=torch.float32, device=logits.device)
    if x2.shape[0]:
        _log_softmax_kernel[(x2.shape[0],)](x2, y, V, x2.stride(0), y.stride(0), BLOCK_V=BLOCK_V, enable_fp_fusion=False)
    return y.reshape(logits.shape)


def _log_softmax_eager(logits):
    return logits.log_softmax(dim=-1, dtype=torch.float32)


log_softmax_fp32 = with_eager_backward(_log_softmax_fp32, _log_softmax_eager)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return log_softmax_fp32(logits).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
