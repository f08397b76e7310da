"""Top-k / top-p masking and the sampled-policy log-prob, shared by both engines.

`apply_top_k_top_p` has vLLM's semantics (vllm/v1/sample/ops/topk_topp_sampler.py,
`apply_top_k_top_p_pytorch`): sort each row ascending; top-k masks every logit strictly
below the k-th largest (ties at the threshold are kept); top-p takes the softmax of the
(top-k masked) sorted row, its cumsum, masks positions with cumsum <= 1 - p, and always
keeps the last (largest) position. Masked logits become -inf; kept ones are the input's
bits unchanged.

Two deliberate differences, both to make the result a function of the row alone:
  * the sort is stable, so ties are broken by token id (vLLM's unstable sort leaves
    that to the sort implementation); `stable_sort` is a compiled radix sort with
    exactly torch's stable order;
  * a row whose k is disabled (k <= 0 or k >= V) or whose p is disabled (p >= 1) is not
    touched by that filter, whether the batch passes a tensor or None. vLLM passes
    k = V / p = 1.0 for such rows only when another row in the batch uses the filter,
    and p = 1.0 masks tokens whose fp32 probability underflows to exactly 0, so with
    vLLM's own function a row's mask depends on its batch.

Every op is a per-row reduction (sort, softmax, cumsum, gather), so a row's bits do
not depend on the other rows (tests/test_sampling_masks.py checks this with
torch.equal). The mask is computed without autograd; the returned logits keep the
gradient of the kept entries.
"""

from __future__ import annotations

import torch

from titan_rl.kernels import dispatch
from titan_rl.kernels.cpu_ext import ops as _ops

NEG_INF = float("-inf")
GREEDY_EPS = 1e-5  # vllm/v1/sample/sampler.py _SAMPLING_EPS


def per_row(x, n: int, dtype: torch.dtype, device) -> torch.Tensor | None:
    if x is None:
        return None
    t = torch.as_tensor(x, dtype=dtype, device=device).reshape(-1)
    if t.numel() == 1 and n != 1:
        t = t.expand(n)
    if t.numel() != n:
        raise ValueError(f"expected 1 or {n} per-row values, got {t.numel()}")
    return t


def stable_sort(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, V] fp32 sorted ascending along V with ties in token-id order: exactly
    `x.sort(dim=-1, stable=True)`, by the compiled radix sort (csrc/stable_sort.cpp; 4-5x
    faster than torch's on rows of 152k on one core: docs/kernels.md)."""
    return _ops().stable_sort_rows(x)


@torch.no_grad()
def drop_mask(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    """bool [N, V]: entries removed by top-k / top-p (not counting entries already -inf)."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V], got {tuple(logits.shape)}")
    N, V = logits.shape
    k = per_row(k, N, torch.long, logits.device)
    p = per_row(p, N, torch.float32, logits.device)
    use_k = None if k is None else (k > 0) & (k < V)
    use_p = None if p is None else p < 1
    if (use_k is None or not bool(use_k.any())) and (use_p is None or not bool(use_p.any())):
        return torch.zeros(N, V, dtype=torch.bool, device=logits.device)
    x = logits.detach().float()
    vals, idx = stable_sort(x)  # ascending
    drop_sorted = torch.zeros(N, V, dtype=torch.bool, device=logits.device)
    if use_k is not None:
        kk = torch.where(use_k, k, torch.full_like(k, V))  # k = V: threshold = row min, nothing dropped
        thr = vals.gather(1, (V - kk).unsqueeze(1))
        drop_k = vals < thr
        vals = vals.masked_fill(drop_k, NEG_INF)
        drop_sorted |= drop_k
    if use_p is not None:
        cum = vals.softmax(dim=-1).cumsum(dim=-1)
        drop_p = cum <= (1 - p).unsqueeze(1)
        drop_p[:, -1] = False  # the largest is always kept
        drop_p &= use_p.unsqueeze(1)
        drop_sorted |= drop_p
    return torch.zeros_like(drop_sorted).scatter_(1, idx, drop_sorted)


def apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    """logits [N, V] fp32 -> the same logits with the top-k / top-p rejects set to -inf.

    Drop-in for vLLM's module-level `apply_top_k_top_p(logits, k, p)` (returns a new
    tensor; vLLM's callers use the return value). The mask is the dispatched `drop_mask`
    (kernels/dispatch.py: this module's on CPU, sampling/triton_impl.py's on CUDA)."""
    if k is None and p is None:
        return logits
    return logits.masked_fill(dispatch.drop_mask(logits, k, p), NEG_INF)


def kept_mask(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    """bool [N, V]: the tokens the sampler may draw (finite after top-k / top-p)."""
    with torch.no_grad():
        return apply_top_k_top_p(logits.detach(), k, p) != NEG_INF


def scale_by_temperature(logits: torch.Tensor, temperature) -> torch.Tensor:
    """vLLM's Sampler.apply_temperature for all-random batches: logits / temp[:, None]
    with temp an fp32 tensor (the same division, out of place)."""
    N = logits.shape[0]
    t = per_row(temperature, N, torch.float32, logits.device)
    if bool((t < GREEDY_EPS).any()):
        rows = torch.nonzero(t < GREEDY_EPS).flatten().tolist()
        raise ValueError(f"rows {rows}: temperature < {GREEDY_EPS} (greedy) is not supported; "
                         "vLLM records greedy rows without temperature or masking only in all-greedy batches")
    return logits / t.unsqueeze(1)


def sampled_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature, top_k=None, top_p=None,
                     kept: torch.Tensor | None = None) -> torch.Tensor:
    """Log-prob of `tokens` [N] under the distribution the sampler drew from.

    logits: fp32 [N, V] (the unscaled model logits). temperature, top_k, top_p: a scalar
    or one value per row (top_k <= 0 or >= V, top_p >= 1 or None: filter off). kept:
    None recomputes the kept sets from `logits` (mode "recompute"); a bool [N, V] uses
    the sampler's captured kept sets (mode "replay"). Equals vLLM's
    logprobs_mode="processed_logprobs" bitwise when the logits are bitwise equal.
    Raises ValueError if a token lies outside its row's kept set."""
    if logits.dtype != torch.float32 or logits.dim() != 2:
        raise ValueError(f"logits must be fp32 [N, V], got {logits.dtype} {tuple(logits.shape)}")
    N, V = logits.shape
    tokens = torch.as_tensor(tokens, device=logits.device).long().reshape(-1)
    if tokens.numel() != N:
        raise ValueError(f"{tokens.numel()} tokens for {N} rows")
    if bool(((tokens < 0) | (tokens >= V)).any()):
        raise ValueError(f"token ids outside [0, {V}): {tokens[(tokens < 0) | (tokens >= V)].tolist()}")
    scaled = scale_by_temperature(logits, temperature)
    if kept is None:
        masked = apply_top_k_top_p(scaled, per_row(top_k, N, torch.long, logits.device),
                                   per_row(top_p, N, torch.float32, logits.device))
    else:
        if kept.dtype != torch.bool or tuple(kept.shape) != (N, V):
            raise ValueError(f"kept must be bool [{N}, {V}], got {kept.dtype} {tuple(kept.shape)}")
        masked = scaled.masked_fill(~kept.to(logits.device), NEG_INF)
    ok = (masked.detach() != NEG_INF).gather(1, tokens.unsqueeze(1)).squeeze(1)
    if not bool(ok.all()):
        bad = torch.nonzero(~ok).flatten().tolist()
        raise ValueError("sampled token outside its kept set: "
                         + ", ".join(f"row {i} token {int(tokens[i])}" for i in bad[:8])
                         + (f" (+{len(bad) - 8} more)" if len(bad) > 8 else ""))
    # the function vLLM's sampler records its log-probs with (titan_rl.vllm.sampling.install_logprobs)
    return dispatch.log_softmax_fp32(masked).gather(1, tokens.unsqueeze(1)).squeeze(1)
