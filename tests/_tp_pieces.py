"""The tensor-parallel pieces' invariance checks, run on a form's functions: the torch forms
in tests/test_tp_leaves.py, the Triton forms under the interpreter in
tests/test_triton_kernels.py. TP ranks are simulated in one process: each holds a slice
(column blocks, K-leaves, heads) and the ranks' pieces are finished by one tree, as
titan_rl/parallel/tp_linear.py finishes them across processes. Shapes are odd on purpose
(row counts 1, 13, 37; N per block 3 to 10; H = 6 pads the head tree to 8)."""

from __future__ import annotations

import torch

SHAPES = ((1, 40, 8 * 6), (13, 72, 8 * 10), (37, 24, 8 * 3))  # rows, K, N: 8 column blocks / K-leaves


def column_blocks_backward_equals_the_ranks_subtrees(linear_n_blocks, tree_sum, dt, seed: int) -> None:
    """linear_n_blocks' forward and gradients from 8 blocks in one call equal those of t
    "ranks" each holding 8/t blocks (input gradient: each rank's subtree, finished by one
    tree), for fresh inputs and odd row counts."""
    g = torch.Generator().manual_seed(seed)
    blocks = 8
    for rows, k, n in SHAPES:
        x = torch.randn(rows, k, generator=g).to(dt).requires_grad_()
        w = torch.randn(n, k, generator=g).to(dt).requires_grad_()
        gy = torch.randn(rows, n, generator=g).to(dt)
        y_full = linear_n_blocks(x, w, blocks)
        gx, gw = torch.autograd.grad(y_full, (x, w), gy)
        for t in (2, 4):
            subs, gws = [], []

            def keep(sub):  # a rank's finish: hand its subtree out, finish below
                subs.append(sub)
                return sub

            ns = n // t
            for r in range(t):
                w_r = w.detach()[r * ns:(r + 1) * ns].clone().requires_grad_()
                x_r = x.detach().clone().requires_grad_()
                y = linear_n_blocks(x_r, w_r, blocks // t, finish=keep)
                assert torch.equal(y.detach(), y_full.detach()[:, r * ns:(r + 1) * ns]), (rows, t, r)
                gws.append(torch.autograd.grad(y, (x_r, w_r), gy[:, r * ns:(r + 1) * ns])[1])
            assert torch.equal(tree_sum(torch.stack(subs)).to(dt), gx)
            assert torch.equal(torch.cat(gws), gw)


def k_leaves_equal_the_ranks_subtrees(linear_k_leaves, leaf_partials, tree_sum, dt, seed: int) -> None:
    """linear_k_leaves over 8 K-leaves equals t "ranks" each holding K/t (8/t leaves, one
    subtree) finished by one tree, and a row alone equals the same row in the batch."""
    g = torch.Generator().manual_seed(seed)
    leaves = 8
    for rows, k, n in SHAPES:
        x = torch.randn(rows, k, generator=g).to(dt)
        w = torch.randn(n, k, generator=g).to(dt)
        full = linear_k_leaves(x, w, leaves)
        for t in (2, 4):
            ks = k // t
            subs = [tree_sum(leaf_partials(x[:, r * ks:(r + 1) * ks].contiguous(),
                                           w[:, r * ks:(r + 1) * ks].contiguous(), leaves // t)) for r in range(t)]
            assert torch.equal(tree_sum(torch.stack(subs)).to(dt), full), (rows, t)
        for i in {0, rows // 2, rows - 1}:
            assert torch.equal(linear_k_leaves(x[i:i + 1], w, leaves), full[i:i + 1]), (rows, i)


def head_norm_weight_gradient_equals_the_ranks_heads(rms_norm_heads, rms_norm, dt, seed: int) -> None:
    """rms_norm_heads (forward: rms_norm's bits): the gradients from all H heads in one
    call equal those of 2 "ranks" of H/2 heads each, whose per-head weight partials are
    gathered in rank order (H = 6: the tree over heads is padded to 8)."""
    g = torch.Generator().manual_seed(seed)
    t = 2
    for rows, h, d in ((1, 4, 64), (29, 8, 32), (7, 6, 16)):
        x = torch.randn(rows, h, d, generator=g).to(dt).requires_grad_()
        w = (1 + 0.1 * torch.randn(d, generator=g)).to(dt).requires_grad_()
        gy = torch.randn(rows, h, d, generator=g).to(dt)
        y = rms_norm_heads(x, w, 1e-6)
        assert torch.equal(y, rms_norm(x, w, 1e-6))
        gx, gw = torch.autograd.grad(y, (x, w), gy)
        hs = h // t
        parts: list[torch.Tensor] = []

        def rank_grads(r: int, gather):
            x_r = x.detach()[:, r * hs:(r + 1) * hs].clone().requires_grad_()
            w_r = w.detach().clone().requires_grad_()
            return torch.autograd.grad(rms_norm_heads(x_r, w_r, 1e-6, gather), (x_r, w_r),
                                       gy[:, r * hs:(r + 1) * hs].contiguous())

        for r in range(t):  # first pass: each rank's own partials
            rank_grads(r, lambda p: parts.append(p) or torch.cat([p] * t))
        for r in range(t):  # second pass: the gathered partials, as all_gather gives them
            gx_r, gw_r = rank_grads(r, lambda p, r=r: torch.cat(parts[:r] + [p] + parts[r + 1:]))
            assert torch.equal(gx_r, gx[:, r * hs:(r + 1) * hs])
            assert torch.equal(gw_r, gw)
