"""Reference linear: y = x @ W^T. No invariance claim. And the dpbf16 arithmetic, bit for bit."""

import torch


def linear_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x, weight)


_TINY = 2.0**-126  # fp32's smallest normal


def _flush(t: torch.Tensor) -> torch.Tensor:
    return torch.where(t.abs() < _TINY, torch.copysign(torch.zeros_like(t), t), t)


def _round_ftz(s: torch.Tensor) -> torch.Tensor:
    """The exact sum `s` (float64) as an fp32 add under FTZ gives it: rounded to 24 bits with
    an unbounded exponent (ties to even), then flushed to a zero of its sign when that result
    is below 2^-126. x86 decides tininess after rounding: a sum in [2^-126 - 2^-150,
    2^-126 - 2^-151) rounds to 2^-126 - 2^-150 and is flushed, where rounding into fp32's
    subnormal grid first (gradual underflow) would give 2^-126."""
    m, e = torch.frexp(s)  # s = m * 2^e, |m| in [0.5, 1)
    r = torch.ldexp(torch.round(m * 2.0**24), e - 24)  # 24 significant bits, exact in float64
    return _flush(r).float()


def weight_grad_bf16(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """g [M, N]^T @ x [M, K] for bf16 operands as the weight-gradient GEMM computes it
    (csrc/weight_grad.cpp; also the bf16 input gradient, on grad^T): per output one fp32 FMA
    chain over the rows in order from +0 under DAZ / FTZ, M rounded up to even with a zero row.
    Written as what vdpbf16ps computes on row pairs with row m in the odd (first-added) slot:
    dpbf16_dot on the rows with each pair swapped."""
    if g.shape[0] % 2:
        g, x = (torch.nn.functional.pad(t, (0, 0, 0, 1)) for t in (g, x))
    swap = torch.arange(g.shape[0]) ^ 1  # rows 1, 0, 3, 2, ...: row 2i lands in the odd slot
    return dpbf16_dot(g[swap].t(), x[swap].t())


def dpbf16_dot(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """D = a @ w^T for bf16-exact a [M, K], w [N, K] as AVX512-BF16's vdpbf16ps accumulates
    it (csrc/bf16_logits.cpp, quant_gemm.cpp; csrc/dpbf16_avx2.h its AVX2 form): one fp32
    accumulator from +0, per k-pair the odd product then the even one, each add one rounding
    of the exact sum (the product is exact and not rounded alone: fp64 holds the sum of an
    fp32 and a 16-bit product exactly wherever it matters), subnormal inputs read as zero and
    results below 2^-126 after rounding flushed to a zero of their sign (`_round_ftz`;
    measured against the instruction)."""
    a, w = _flush(a.float()), _flush(w.float())
    if a.shape[1] % 2:
        a, w = torch.nn.functional.pad(a, (0, 1)), torch.nn.functional.pad(w, (0, 1))
    a, w = a.double(), w.double()
    acc = torch.zeros(a.shape[0], w.shape[0])
    for p in range(0, a.shape[1], 2):
        for k in (p + 1, p):
            acc = _round_ftz(acc.double() + a[:, k, None] * w[None, :, k])
    return acc
