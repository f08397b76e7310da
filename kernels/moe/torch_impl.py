"""MoE routing and expert combination on CPU, batch-invariant (docs/moe.md).

router_topk: fp32 router logits through the invariant `linear` (hidden and gate weight
upcast), fp32 softmax (an eager row reduction), top-k chosen by an explicit rule: the
largest probability first, and among equal probabilities the LOWEST expert index. It
does not rely on torch.topk, whose order among ties is an implementation detail.
Optional renormalisation of the k weights (Qwen3-MoE's norm_topk_prob) sums the slots in
slot order 0..k-1.

moe_experts: tokens are grouped by expert (experts visited 0..E-1) and each group goes
through the expert (a row-wise callable: the model's expert MLP, whose linears are the
invariant row-tiled `linear` in exact mode, so a row's bits do not depend on how many
rows share the call, i.e. on which other tokens picked the same expert). Each (token, slot)
result is put back in place (a gather, no accumulation), then every token combines its
k slots in slot order 0..k-1 in fp32 and casts once. Everything after the GEMMs is
elementwise, so a token's output is a function of that token's row alone.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from titan_rl.kernels.elementwise.torch_impl import silu_mul
from titan_rl.kernels.matmul.torch_impl import linear

LinearFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
ExpertFn = Callable[[torch.Tensor], torch.Tensor]


def _topk_lowest_index(probs: torch.Tensor, k: int) -> torch.Tensor:
    """ids [T, k]: by probability descending, ties to the lowest expert index.
    k rounds of (row max, then the smallest index holding that max), excluding picks."""
    T, E = probs.shape
    p = probs.detach()
    idx = torch.arange(E, device=p.device).expand(T, E)
    taken = torch.zeros(T, E, dtype=torch.bool, device=p.device)
    ids = torch.empty(T, k, dtype=torch.long, device=p.device)
    for j in range(k):
        masked = p.masked_fill(taken, -1.0)  # probabilities are >= 0; -1 is below all of them
        m = masked.amax(-1, keepdim=True)
        pick = torch.where(masked == m, idx, E).amin(-1)
        if T and bool((pick >= E).any()):
            raise ValueError("router probabilities contain NaN; cannot choose experts")
        ids[:, j] = pick
        taken.scatter_(1, pick[:, None], True)
    return ids


def _slot_sum(w: torch.Tensor) -> torch.Tensor:
    """sum over the last dim in slot order 0..k-1 (elementwise adds)."""
    s = w[..., 0]
    for j in range(1, w.shape[-1]):
        s = s + w[..., j]
    return s


def router_topk(
    hidden: torch.Tensor,
    gate_weight: torch.Tensor,
    k: int,
    norm_topk_prob: bool,
    route_override: torch.Tensor | None = None,
    linear_fn: LinearFn = linear,
    return_probs: bool = False,
):
    """hidden [T, H], gate_weight [E, H] -> (weights fp32 [T, k], ids int64 [T, k])
    (+ probs fp32 [T, E] and the router's own choice [T, k] when return_probs).

    route_override [T, k] (any integer dtype, e.g. the compact routes of a rollout):
    use exactly these experts (router replay; a row whose first id is negative keeps
    the router's own choice); the weights are still the current
    router's probabilities of those experts (renormalised when norm_topk_prob), so the
    gate keeps its gradient."""
    check_k(k, gate_weight.shape[0])
    probs = torch.softmax(linear_fn(hidden.float(), gate_weight.float()), dim=-1)
    return routes(probs, _topk_lowest_index(probs, k), norm_topk_prob, route_override, return_probs)


def check_k(k: int, n_experts: int) -> None:
    if not 1 <= k <= n_experts:
        raise ValueError(f"top-k = {k} must be in 1..num_experts ({n_experts})")


def routes(probs: torch.Tensor, own: torch.Tensor, norm_topk_prob: bool, route_override: torch.Tensor | None,
           return_probs: bool):
    """router_topk's result from the fp32 probabilities [T, E] and the router's own top-k
    ids [T, k] (shared by both implementations: gathers and elementwise ops only)."""
    E, k = probs.shape[1], own.shape[1]
    ids = own
    if route_override is not None:
        T = probs.shape[0]
        if tuple(route_override.shape) != (T, k):
            raise ValueError(f"route_override has shape {tuple(route_override.shape)}, expected {(T, k)}")
        forced = route_override.to(device=probs.device, dtype=torch.long)
        used = forced[forced[:, 0] >= 0]
        if used.numel() and (int(used.min()) < 0 or int(used.max()) >= E):
            raise ValueError(f"route_override holds expert ids outside 0..{E - 1}")
        # rows whose first id is negative route normally (e.g. positions no sampler computed)
        ids = torch.where(forced[:, :1] >= 0, forced, own)
    weights = probs.gather(1, ids)
    if norm_topk_prob:
        # clamp: a replayed expert set can have underflowed probabilities (sum 0 -> NaN);
        # on the router's own choice the sum is >= k/E and the clamp is a no-op.
        weights = weights / _slot_sum(weights).clamp_min(torch.finfo(torch.float32).tiny)[:, None]
    return (weights, ids, probs, own) if return_probs else (weights, ids)


def compact_routes(ids: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Routes for storage/transfer: uint8 up to 256 experts, int16 up to 32768, else int32."""
    if n_experts <= 256:
        dtype = torch.uint8
    elif n_experts <= 32768:
        dtype = torch.int16
    else:
        dtype = torch.int32
    return ids.detach().to(dtype)


def swiglu_expert(w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                  linear_fn: LinearFn = linear, linear_down: LinearFn | None = None) -> ExpertFn:
    """An expert from raw weights: down(silu(gate(x)) * up(x)) through the given linears
    (the model passes its expert MLP modules instead, so TP-sharded layers just work)."""
    down = linear_fn if linear_down is None else linear_down
    return lambda xe: down(silu_mul(linear_fn(xe, w_gate), linear_fn(xe, w_up)), w_down)


def moe_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                experts: Sequence[ExpertFn]) -> torch.Tensor:
    """x [T, H], ids [T, k], weights [T, k] -> [T, H] in x's dtype.

    experts[e] maps the rows routed to expert e ([n_e, H]) to their outputs; it must be
    row-wise (the invariant `linear` is). Token t's result is
    sum_{j = 0..k-1} weights[t, j] * experts[ids[t, j]](x[t]), summed in fp32 in slot order."""
    return combine(by_expert(x, ids, experts), weights, x.dtype)


def by_expert(x: torch.Tensor, ids: torch.Tensor, experts: Sequence[ExpertFn]) -> torch.Tensor:
    """[T, k, H]: slot j of token t holds experts[ids[t, j]](x[t]); tokens grouped by
    expert (experts visited 0..E-1, each group in token order), each result put back in
    place (a gather, no sums). The gradient of x sums each token's k slots in slot order
    (pair_rows), so expert parallelism (titan_rl/titan/expert_parallel.py), which computes the
    same groups on other ranks, gives the same bits."""
    T, H = x.shape
    order, counts = expert_order(ids, len(experts))
    xs = pair_rows(x, ids.shape[1]).index_select(0, order)
    pieces = [expert(chunk) for expert, chunk, n in zip(experts, xs.split(counts), counts) if n]
    if not pieces:
        return x.new_zeros(T, ids.shape[1], H)
    return unsort_pairs(torch.cat(pieces), order).view(T, ids.shape[1], -1)


def expert_order(ids: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, list[int]]:
    """The (token, slot) pairs (pair p = t * k + j) grouped by expert, each group in pair
    order (a stable sort: comparisons only), and the group sizes [n_experts]."""
    flat = ids.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    return order, torch.bincount(flat, minlength=n_experts).tolist()


def unsort_pairs(y: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Rows in expert order back to pair order (a permutation: exact both ways)."""
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return y.index_select(0, inverse)


class _PairRows(torch.autograd.Function):
    """x [T, H] -> [T * k, H], row t repeated k times (one row per (token, slot) pair). The
    backward adds a token's k rows in slot order 0..k-1 in fp32 and casts once, a fixed
    order wherever the pairs were computed (autograd's own accumulation over separate
    gathers would follow its graph)."""

    @staticmethod
    def forward(ctx, x, k):
        ctx.k = k
        return x.repeat_interleave(k, dim=0)

    @staticmethod
    def backward(ctx, g):
        g = g.view(-1, ctx.k, g.shape[-1])
        acc = g[:, 0].float()
        for j in range(1, ctx.k):
            acc = acc + g[:, j].float()
        return acc.to(g.dtype), None


def pair_rows(x: torch.Tensor, k: int) -> torch.Tensor:
    return _PairRows.apply(x, k)


def combine(y: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """sum_j weights[:, j] * y[:, j] in fp32, slots in order 0..k-1, cast once to dtype."""
    y, w = y.float(), weights.float()
    acc = y[:, 0] * w[:, 0, None]
    for j in range(1, y.shape[1]):
        acc = acc + y[:, j] * w[:, j, None]
    return acc.to(dtype)


def load_balancing_loss(probs: Sequence[torch.Tensor], ids: Sequence[torch.Tensor], n_experts: int) -> torch.Tensor:
    """Switch-Transformer auxiliary loss over all layers, transformers' definition
    (load_balancing_loss_func, no attention mask):
    E * sum_e f_e * P_e, f_e = (top-k assignments to e) / rows, P_e = sum of prob_e / rows,
    rows = tokens x layers. Gradient flows through the probabilities only."""
    if not probs:
        raise ValueError("load_balancing_loss needs at least one layer")
    dev = probs[0].device
    counts = torch.zeros(n_experts, dtype=torch.float32, device=dev)
    psum = torch.zeros(n_experts, dtype=torch.float32, device=dev)
    rows = 0
    for p, i in zip(probs, ids):
        counts = counts + torch.bincount(i.reshape(-1).long(), minlength=n_experts).float()
        psum = psum + p.float().sum(0)
        rows += p.shape[0]
    rows = max(rows, 1)
    return (counts / rows * (psum / rows)).sum() * n_experts


# -- the sigmoid router (DeepSeek-V3 / GLM-5) ---------------------------------------------

def topk_ties_low(scores: torch.Tensor, k: int) -> torch.Tensor:
    """ids [T, k] of the k largest scores per row (any finite values, -inf for excluded
    entries), ties to the LOWEST index: k rounds of (row max, then the smallest index holding
    it), picks excluded. Comparisons only, so exact and row-independent."""
    T, E = scores.shape
    s = scores.detach()
    if T and bool(torch.isnan(s).any()):
        raise ValueError("router scores contain NaN; cannot choose experts")
    idx = torch.arange(E, device=s.device).expand(T, E)
    taken = torch.zeros(T, E, dtype=torch.bool, device=s.device)
    ids = torch.empty(T, k, dtype=torch.long, device=s.device)
    for j in range(k):
        masked = s.masked_fill(taken, float("-inf"))
        m = masked.amax(-1, keepdim=True)
        pick = torch.where((masked == m) & ~taken, idx, E).amin(-1)
        ids[:, j] = pick
        taken.scatter_(1, pick[:, None], True)
    return ids


def group_limited_choice(choice: torch.Tensor, n_group: int, topk_group: int,
                         topk_fn: Callable[[torch.Tensor, int], torch.Tensor] = topk_ties_low) -> torch.Tensor:
    """DeepSeek-V3's group-limited routing: a group's score is the sum of its two largest
    choice scores; the experts outside the topk_group best groups get -inf. n_group = 1 (GLM-5)
    returns `choice` as is."""
    if n_group == 1:
        return choice
    T, E = choice.shape
    top2 = choice.view(T, n_group, E // n_group).topk(2, dim=-1).values  # the two largest: their sum is tie-free
    groups = topk_fn(top2[..., 0] + top2[..., 1], topk_group)
    keep = torch.zeros(T, n_group, dtype=torch.bool, device=choice.device).scatter_(1, groups, True)
    return choice.masked_fill(~keep.repeat_interleave(E // n_group, dim=1), float("-inf"))


def router_sigmoid_topk(hidden: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor, k: int, n_group: int,
                        topk_group: int, norm_topk_prob: bool, scaling: float, sigmoid: Callable,
                        route_override: torch.Tensor | None = None, linear_fn: LinearFn = linear,
                        topk_fn: Callable[[torch.Tensor, int], torch.Tensor] = topk_ties_low):
    """GLM-5's / DeepSeek-V3's router: fp32 logits of hidden [T, H] by gate_weight [E, H],
    scores = sigmoid(logits) (`sigmoid`: the caller's row-stable form), experts chosen by
    scores + bias (e_score_correction_bias; group-limited when n_group > 1; ties to the lowest
    index), combine weights = the chosen scores (without the bias), renormalised over the k
    slots in slot order when norm_topk_prob (+ 1e-20, as transformers), times `scaling`
    (routed_scaling_factor). Returns (weights fp32 [T, k], ids [T, k], the router's own ids).

    route_override [T, k]: use exactly these experts (router replay; a row whose first id is
    negative keeps the router's own choice); the weights stay the current scores of them."""
    check_k(k, gate_weight.shape[0])
    scores = sigmoid(linear_fn(hidden.float(), gate_weight.float()))
    choice = group_limited_choice(scores + bias.float(), n_group, topk_group, topk_fn)
    return sigmoid_routes(scores, topk_fn(choice, k), norm_topk_prob, scaling, route_override)


def sigmoid_routes(scores: torch.Tensor, own: torch.Tensor, norm_topk_prob: bool, scaling: float,
                   route_override: torch.Tensor | None):
    """router_sigmoid_topk's result from the fp32 scores [T, E] and the router's own ids [T, k]
    (shared by both implementations: gathers and elementwise ops only)."""
    E, k = scores.shape[1], own.shape[1]
    ids = own
    if route_override is not None:
        T = scores.shape[0]
        if tuple(route_override.shape) != (T, k):
            raise ValueError(f"route_override has shape {tuple(route_override.shape)}, expected {(T, k)}")
        forced = route_override.to(device=scores.device, dtype=torch.long)
        used = forced[forced[:, 0] >= 0]
        if used.numel() and (int(used.min()) < 0 or int(used.max()) >= E):
            raise ValueError(f"route_override holds expert ids outside 0..{E - 1}")
        ids = torch.where(forced[:, :1] >= 0, forced, own)
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (_slot_sum(weights) + 1e-20)[:, None]
    return weights * scaling, ids, own
