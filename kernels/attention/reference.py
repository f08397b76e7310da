"""Reference causal GQA attention (fp64 softmax), no invariance claim."""

import torch


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, L, H, D], k/v [B, L, Hkv, D]; causal from position 0. Returns [B, L, H, D]."""
    h, hkv = q.shape[2], k.shape[2]
    k = k.repeat_interleave(h // hkv, dim=2)
    v = v.repeat_interleave(h // hkv, dim=2)
    s = torch.einsum("blhd,bmhd->bhlm", q.double(), k.double()) * scale
    L = q.shape[1]
    mask = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
    s = s.masked_fill(~mask, float("-inf"))
    o = torch.einsum("bhlm,bmhd->blhd", s.softmax(-1), v.double())
    return o.to(q.dtype)


def exp_f(x: torch.Tensor) -> torch.Tensor:
    """csrc/common.h's exp_f on an fp32 tensor: the same IEEE operations in the same order
    (each a separate fp32 op: eager CPU torch fuses nothing)."""
    f = lambda c: torch.tensor(c, dtype=torch.float32)  # noqa: E731 (fp32 constants, not doubles)
    x = x.clamp(-87.0, 88.0)
    n = (x * f(1.44269504088896341) + f(12582912.0)) - f(12582912.0)
    r = x - n * f(0.693359375)
    r = r - n * f(-2.12194440e-4)
    z = r * r
    y = f(1.9875691500e-4).expand_as(r)
    for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        y = y * r + f(c)
    y = y * z + r
    y = y + f(1.0)
    return y * ((n.to(torch.int32) + 127) << 23).view(torch.float32)


def _lane_sum(p: torch.Tensor) -> torch.Tensor:
    """Sums over the last dim as the kernel does: 16 lanes (position mod 16) in position order,
    then a halving tree. p [..., n] with +0 past each row's positions."""
    n = p.shape[-1]
    p = torch.nn.functional.pad(p, (0, -n % 16)).unflatten(-1, (-1, 16))
    lanes = torch.zeros_like(p[..., 0, :])
    for b in range(p.shape[-2]):
        lanes = lanes + p[..., b, :]
    for w in (8, 4, 2, 1):
        lanes = lanes[..., :w] + lanes[..., w:2 * w]
    return lanes[..., 0]


def _pair_chunks(a: torch.Tensor, b: torch.Tensor, width: int) -> torch.Tensor:
    """sum over the last dim of a [M, K] x b [K, N] as tdpbf16ps sums it: K in chunks of `width`
    (pairs of elements: `width` // 2 per instruction), per chunk the even products in one fp32
    chain from +0 and the odd ones in another, C + (even + odd) in chunk order. Operands hold
    bf16 values, so each product is exact in fp32 (the test's operands keep them normal)."""
    if a.shape[1] % 2:  # an unpaired last position: paired with a zero (the kernel's zeroed slot)
        a, b = torch.nn.functional.pad(a, (0, 1)), torch.nn.functional.pad(b, (0, 0, 0, 1))
    c = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float32)
    for k0 in range(0, a.shape[1], width):
        even, odd = torch.zeros_like(c), torch.zeros_like(c)
        for k in range(k0, min(k0 + width, a.shape[1]), 2):
            even = even + a[:, k, None] * b[None, k]
            odd = odd + a[:, k + 1, None] * b[None, k + 1]
        c = c + (even + odd)
    return c


def attention_amx_form(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """The amx form's arithmetic written out (csrc/paged_attention.cpp, docs/kernels.md "The amx
    form"), one bf16 sequence: q [L, H, D], k/v [L, Hkv, D]; causal. Returns the output [L, H, D]
    and each row's score max and weight sum [L, H] (fp32: the kernel's log-sum-exp is
    max + logf(sum)). Slow; for tests at small sizes, where it must give the kernel's bits."""
    L, H, D = q.shape
    G = H // k.shape[1]
    keep = torch.ones(L, L, dtype=torch.bool).tril()
    out = torch.empty_like(q)
    rmax, rsum = (torch.empty(L, H, dtype=torch.float32) for _ in range(2))
    for h in range(H):
        qf, kf, vf = q[:, h].float(), k[:, h // G].float(), v[:, h // G].float()
        s = _pair_chunks(qf, kf.T, 32) * torch.tensor(scale, dtype=torch.float32)
        m = s.masked_fill(~keep, float("-inf")).amax(-1, keepdim=True)
        p = exp_f(s - m).masked_fill(~keep, 0.0)
        lsum = _lane_sum(p)
        pb = p.bfloat16().float()
        out[:, h] = (_pair_chunks(pb, vf, 16) / lsum[:, None]).to(q.dtype)
        rmax[:, h], rsum[:, h] = m[:, 0], lsum
    return out, rmax, rsum
