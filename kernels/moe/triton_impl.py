"""MoE routing and expert combination in Triton: torch_impl's algorithm and rules.

* router softmax: one program per token row over the E expert logits (fp32, the row in
  one block of next_power_of_2(E) lanes: max, exp, sum, divide); backward: eager softmax.
* top-k: one program per row, k rounds of (row max, then the LOWEST expert index holding
  it) over the probabilities, picks excluded: ties go to the lowest index, never to an
  implementation's choice.
* combine: one program per (token, block of H columns): sum_j w[t, j] * y[t, j] in fp32,
  slots in order 0..k-1, cast once.
* sigmoid router (GLM-5 / DeepSeek-V3): the choice scores (sigmoid scores + bias, elementwise)
  of a row as one [groups, experts per group] tile: group scores (top-2 sums), the topk_group
  best groups, then k rounds of (max, lowest expert index holding it) over the kept groups,
  picks excluded. Comparisons and torch_impl's one add per group, so the ids equal torch_impl's.
Each program sees one token only, so a token's bits do not depend on the batch. Grouping
tokens by expert and the replay / renormalisation rules are torch_impl's (gathers and
elementwise ops: `by_expert`, `routes`, `sigmoid_routes`).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import triton
import triton.language as tl

from titan_rl.kernels.autograd import with_eager_backward
from titan_rl.kernels.matmul.triton_impl import linear
from titan_rl.kernels.moe.torch_impl import (ExpertFn, LinearFn, by_expert, check_k, group_limited_choice, routes,
                                             sigmoid_routes)
from titan_rl.kernels.moe.torch_impl import topk_ties_low as _topk_ties_low_torch

BLOCK_H = 256  # combine: hidden columns per program; fixed


@triton.jit
def _softmax_kernel(x_ptr, y_ptr, E, sx, sy, BLOCK_E: tl.constexpr):
    row = tl.program_id(0)
    ee = tl.arange(0, BLOCK_E)
    x = tl.load(x_ptr + row * sx + ee, mask=ee < E, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    tl.store(y_ptr + row * sy + ee, p / tl.sum(p, axis=0), mask=ee < E)


def _softmax(logits: torch.Tensor) -> torch.Tensor:
    x = logits.contiguous()
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    if x.shape[0]:
        _softmax_kernel[(x.shape[0],)](x, y, x.shape[1], x.stride(0), y.stride(0),
                                       BLOCK_E=triton.next_power_of_2(x.shape[1]), enable_fp_fusion=False)
    return y


def _softmax_eager(logits):
    return torch.softmax(logits.float(), dim=-1)


softmax_fp32 = with_eager_backward(_softmax, _softmax_eager)


@triton.jit
def _topk_kernel(p_ptr, ids_ptr, E, K, sp, si, BLOCK_E: tl.constexpr):
    row = tl.program_id(0)
    ee = tl.arange(0, BLOCK_E)
    p = tl.load(p_ptr + row * sp + ee, mask=ee < E, other=-1.0)  # probabilities are >= 0
    for j in range(0, K):
        m = tl.max(p, axis=0)
        pick = tl.min(tl.where(p == m, ee, BLOCK_E), axis=0)
        tl.store(ids_ptr + row * si + j, pick.to(tl.int64))
        p = tl.where(ee == pick, -1.0, p)


def topk_lowest_index(probs: torch.Tensor, k: int) -> torch.Tensor:
    """ids int64 [T, k]: by probability descending, ties to the lowest expert index."""
    p = probs.detach().float().contiguous()
    T, E = p.shape
    ids = torch.empty(T, k, dtype=torch.long, device=p.device)
    if T:
        if bool(torch.isnan(p).any()):
            raise ValueError("router probabilities contain NaN; cannot choose experts")
        _topk_kernel[(T,)](p, ids, E, k, p.stride(0), ids.stride(0), BLOCK_E=triton.next_power_of_2(E))
    return ids


def router_topk(hidden: torch.Tensor, gate_weight: torch.Tensor, k: int, norm_topk_prob: bool,
                route_override: torch.Tensor | None = None, linear_fn: LinearFn = linear, return_probs: bool = False):
    """torch_impl.router_topk's contract."""
    check_k(k, gate_weight.shape[0])
    probs = softmax_fp32(linear_fn(hidden.float(), gate_weight.float()))
    return routes(probs, topk_lowest_index(probs, k), norm_topk_prob, route_override, return_probs)


@triton.jit
def _combine_kernel(y_ptr, w_ptr, o_ptr, K, H, sy_t, sy_k, sw_t, so_t, BLOCK_H: tl.constexpr):
    t = tl.program_id(0)
    hh = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = hh < H
    acc = tl.zeros((BLOCK_H,), tl.float32)
    for j in range(0, K):  # slot order 0..k-1
        w = tl.load(w_ptr + t * sw_t + j).to(tl.float32)
        y = tl.load(y_ptr + t * sy_t + j * sy_k + hh, mask=mask, other=0.0).to(tl.float32)
        acc = acc + y * w
    tl.store(o_ptr + t * so_t + hh, acc.to(o_ptr.dtype.element_ty), mask=mask)


def _combine(y: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    y, w = y.contiguous(), weights.float().contiguous()
    T, k, H = y.shape
    out = torch.empty(T, H, dtype=dtype, device=y.device)
    if T:
        _combine_kernel[(T, triton.cdiv(H, BLOCK_H))](y, w, out, k, H, y.stride(0), y.stride(1), w.stride(0),
                                                      out.stride(0), BLOCK_H=BLOCK_H, enable_fp_fusion=False)
    return out


def _combine_eager(y, weights, dtype):
    return (y.float() * weights.float()[..., None]).sum(1).to(dtype)


combine = with_eager_backward(_combine, _combine_eager)


def moe_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                experts: Sequence[ExpertFn]) -> torch.Tensor:
    """torch_impl.moe_experts's contract: x [T, H], ids [T, k], weights [T, k] -> [T, H]."""
    return combine(by_expert(x, ids, experts), weights, x.dtype)


# -- the sigmoid router (DeepSeek-V3 / GLM-5) ---------------------------------------------

@triton.jit
def _sigmoid_choice_kernel(c_ptr, ids_ptr, PER, N_GROUP, TOPK_GROUP, K, sc, si,
                           GROUPED: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_P: tl.constexpr):
    # The row's E choice scores as a [groups, experts per group] tile; expert e = g * PER + p.
    row = tl.program_id(0).to(tl.int64)
    gg = tl.arange(0, BLOCK_G)
    pp = tl.arange(0, BLOCK_P)
    valid = (gg[:, None] < N_GROUP) & (pp[None, :] < PER)
    e = gg[:, None] * PER + pp[None, :]
    choice = tl.load(c_ptr + row * sc + e, mask=valid, other=float("-inf"))
    if GROUPED:
        # a group's score: its two largest choices (a tied maximum counts twice, as torch.topk's
        # values do); max and a sum of two are exact in any order
        m1 = tl.max(choice, axis=1)
        first = tl.min(tl.where(choice == m1[:, None], pp[None, :], BLOCK_P), axis=1)
        m2 = tl.max(tl.where(pp[None, :] == first[:, None], float("-inf"), choice), axis=1)
        gscore = m1 + m2
        kept = gg < 0
        for _ in range(0, TOPK_GROUP):  # best groups, ties to the lowest group
            masked = tl.where(kept, float("-inf"), gscore)
            m = tl.max(masked, axis=0)
            pick = tl.min(tl.where((masked == m) & ~kept & (gg < N_GROUP), gg, BLOCK_G), axis=0)
            kept = kept | (gg == pick)
        choice = tl.where(kept[:, None], choice, float("-inf"))
    taken = e < 0
    big = BLOCK_G * BLOCK_P
    for j in range(0, K):  # k rounds: the maximum, then the lowest expert holding it
        masked = tl.where(taken, float("-inf"), choice)
        m = tl.max(tl.max(masked, axis=1), axis=0)
        pick = tl.min(tl.min(tl.where((masked == m) & ~taken & valid, e, big), axis=1), axis=0)
        tl.store(ids_ptr + row * si + j, pick.to(tl.int64))
        taken = taken | (e == pick)


def _sigmoid_choice(choice: torch.Tensor, k: int, n_group: int, topk_group: int) -> torch.Tensor:
    c = choice.detach().float().contiguous()
    T, E = c.shape
    if n_group < 1 or E % n_group:
        raise ValueError(f"n_group = {n_group} must divide the {E} experts")
    per = E // n_group
    if n_group > 1 and (per < 2 or not 1 <= topk_group <= n_group):
        raise ValueError(f"group-limited routing needs >= 2 experts per group and 1 <= topk_group <= n_group "
                         f"(E = {E}, n_group = {n_group}, topk_group = {topk_group})")
    ids = torch.empty(T, k, dtype=torch.long, device=c.device)
    if T:
        if bool(torch.isnan(c).any()):
            raise ValueError("router scores contain NaN; cannot choose experts")
        _sigmoid_choice_kernel[(T,)](c, ids, per, n_group, topk_group, k, c.stride(0), ids.stride(0),
                                     GROUPED=n_group > 1, BLOCK_G=triton.next_power_of_2(n_group),
                                     BLOCK_P=triton.next_power_of_2(per))
    return ids


def topk_ties_low(scores: torch.Tensor, k: int) -> torch.Tensor:
    """torch_impl.topk_ties_low's contract (ids [T, k] of the k largest scores, -inf excluded,
    ties to the lowest index) as one program per row."""
    return _sigmoid_choice(scores, k, 1, 1)


def router_sigmoid_topk(hidden: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor, k: int, n_group: int,
                        topk_group: int, norm_topk_prob: bool, scaling: float, sigmoid: Callable,
                        route_override: torch.Tensor | None = None, linear_fn: LinearFn = linear,
                        topk_fn: Callable[[torch.Tensor, int], torch.Tensor] = topk_ties_low):
    """torch_impl.router_sigmoid_topk's contract. With the lowest-index tie rule (this module's
    topk_ties_low or torch_impl's: the same rule), the group limit and the top-k run as one
    program per row; any other topk_fn (the stock mode's torch.topk) is used as given."""
    check_k(k, gate_weight.shape[0])
    scores = sigmoid(linear_fn(hidden.float(), gate_weight.float()))
    choice = scores + bias.float()
    if topk_fn is topk_ties_low or topk_fn is _topk_ties_low_torch:
        own = _sigmoid_choice(choice, k, n_group, topk_group)
    else:
        own = topk_fn(group_limited_choice(choice, n_group, topk_group, topk_fn), k)
    return sigmoid_routes(scores, own, norm_topk_prob, scaling, route_override)
