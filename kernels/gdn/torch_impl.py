"""Gated delta rule (GDN, Qwen3-Next / Qwen3.5 linear attention) on CPU: the EXACT path.

Per head, state S in R^{dk x dv} (fp32), for token t of one sequence:
    S <- exp(g_t) * S                 g_t <= 0 (log decay), one scalar per (token, head)
    u_t = beta_t * (v_t - S^T k_t)    beta_t in (0, 1), one scalar per (token, head)
    S <- S + k_t u_t^T
    o_t = scale * S^T q_t
GQA: v head h reads q/k head h // (Hv // Hk) (repeat_interleave, as HF Qwen3-Next).

Both engines run this same recurrent step for every token (trainer prefill, engine
prefill, chunked prefill, decode), so a token's bits never depend on how the stream was
cut into calls. Why each piece is invariant (docs/gdn.md):
  * Inside the time loop there are only elementwise IEEE ops (mul, add, sub, div, sqrt,
    torch.where): each is correctly rounded, so an element's result depends only on its
    operands, never on its lane, the tensor's size, its layout or the thread split.
  * The dk-reductions S^T k and S^T q are NOT torch.sum/matmul/einsum (their blocking and
    thread split depend on sizes). The products S * k are reduced over dk by a fixed
    pairwise halving tree of elementwise adds: with the state in its API layout
    [.., dk, dv], each level adds two halves of whole contiguous dv-rows
    (x[..., :h, :] + x[..., h:, :]); an output element is the same tree of adds over the
    same operands whatever the layout, so no transposed copy of the state is needed (it
    cost ~25% of a decode step). dk is zero-padded to a power of two (padding rows hold
    exact +0 forever: +0 * a = +0, +0 + 0 * u = +0), so the tree depends on dk only.
  * exp(g) is computed ONCE for all tokens before the loop, through `lane_stable`:
    ATen's CPU loop runs full SIMD vectors through the vectorised (Sleef) function and the
    tail of a buffer through the scalar std:: one, which can differ by an ulp, so a plain
    call's bits can depend on an element's position and the tensor's size (measured for
    sigmoid/silu/softplus on this CPU; not observed for exp, which goes through MKL VML,
    but routed the same way so that no assumption about the build is needed).
  * Sequences of different lengths are padded to [N, Lmax] and advanced together; once a
    sequence has ended its state is kept by torch.where (an exact select), so its bits
    never depend on its neighbours or on Lmax.
  * On CPU with an fp32 state the step runs compiled (csrc/gdn_recurrent.cpp): the same
    operations in the same order, one (sequence, head) pair at a time with its state in
    cache (the torch form below passes over every pair's state ~25 times a token). The torch
    form, vectorised over sequences and heads with a Python loop over time steps, is the
    definition the compiled one is pinned to, and runs fp64 and non-CPU tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from titan_rl.kernels import cpu_ext
from titan_rl.kernels.gdn.chunked import gdn_chunked
from titan_rl.kernels.gdn.cache_rows import CacheRows
from titan_rl.kernels.gdn.inputs import check_shapes, compute_dtype, sequence_lengths
from titan_rl.kernels.reduction import broadcast_rows

LANES = 64  # lane_stable pads rows to a multiple of this (a multiple of every SIMD width)
PIECE = 4096  # lane_stable calls fn on pieces of exactly this many elements (see there)
# ... and for these functions, pieces of twice ATen's grain (its elementwise loops' parallel_for
# grain, 32768: `cpu_kernel_vec`'s default), 16x fewer calls: silu over Qwen3.5-0.8B's 832 x 6144
# conv outputs 15.3 -> 6.0 ms, with the backward 32.6 -> 19.9 ms (1 thread, Intel Xeon, 2026-12-06)
GRAIN_PIECE = 65536
GRAIN_FNS = (F.silu, torch.sigmoid, F.softplus)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def lane_stable(fn, x: torch.Tensor) -> torch.Tensor:
    """fn(x) (an elementwise function) with each element's bits independent of its position,
    of the tensor's size and of the thread count. Returns fp32 (fp64 for fp64 input).

    How: fn runs on an fp32 copy whose last dim is zero-padded to a multiple of LANES (so
    every row starts at a lane-aligned offset), flattened and zero-padded to a multiple of
    PIECE, one call of fn per piece of exactly PIECE contiguous elements. Each call is then
    the same shape every time: it has no tail (every element goes through the vector
    path), and ATen's parallel_for (grain 2048 for the VML ops, 32768 otherwise) either
    keeps it on one thread or cuts it at PIECE/2 = 2048, again lane-aligned. The functions
    known to run on the 32768 grain (GRAIN_FNS) take pieces of GRAIN_PIECE = 65536, which
    parallel_for keeps on one thread or cuts at 32768 whatever the thread count (it runs
    min(threads, 65536 / 32768) chunks of 65536 / chunks). Differentiable (autograd through
    the pieces); fn(0) must be finite-or-harmless (it is sliced off)."""
    if x.dtype == torch.float64:  # not an exactness path (used by fp64 gradchecks)
        return fn(x)
    xf = x.float()
    shape = xf.shape
    if xf.numel() == 0:
        return fn(xf)
    last = shape[-1] if xf.dim() else 1
    x2 = xf.reshape(-1, last)
    width = -(-last // LANES) * LANES
    if width != last:
        x2 = F.pad(x2, (0, width - last))
    flat = x2.reshape(-1)
    n = flat.numel()
    piece = GRAIN_PIECE if fn in GRAIN_FNS else PIECE
    pad = (-n) % piece
    if pad:
        flat = F.pad(flat, (0, pad))
    # split, not slices: the same pieces, but one backward that concatenates their gradients (a
    # slice's backward fills a zero tensor of the whole size per piece, and autograd adds them up:
    # quadratic in the length, 6 s of a 23 s Qwen3.5-0.8B step at 256 tokens)
    outs = [fn(p) for p in flat.split(piece)]
    y = torch.cat(outs) if len(outs) > 1 else outs[0]
    return y[:n].reshape(-1, width)[:, :last].reshape(shape)


def tree_sum_last(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim (a power of two) by a fixed pairwise halving tree of
    elementwise adds: the bits depend on the values and the length only."""
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"tree_sum_last needs a power-of-two last dim, got {n}")
    while x.shape[-1] > 1:
        h = x.shape[-1] // 2
        x = x[..., :h] + x[..., h:]
    return x[..., 0]


def tree_sum_rows(x: torch.Tensor) -> torch.Tensor:
    """Sum over dim -2 (a power of two) by the same fixed halving tree, keepdim: each level
    adds two halves elementwise (x[..., :h, :] + x[..., h:, :], whole contiguous rows), so
    it is as exact-by-construction as tree_sum_last and needs no transposed copy of the
    [.., dk, dv] state."""
    n = x.shape[-2]
    if n & (n - 1):
        raise ValueError(f"tree_sum_rows needs a power-of-two dim -2, got {n}")
    while x.shape[-2] > 1:
        h = x.shape[-2] // 2
        x = x[..., :h, :] + x[..., h:, :]
    return x


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, in fp32 (fp64 stays fp64). Row-wise
    invariant by construction: squares, the halving-tree sum (last dim zero-padded to a
    power of two; zeros add exactly) and sqrt/div are elementwise IEEE ops."""
    xf = x if x.dtype == torch.float64 else x.float()
    d = xf.shape[-1]
    sq = xf * xf
    p = _next_pow2(d)
    if p != d:
        sq = F.pad(sq, (0, p - d))
    return xf / torch.sqrt(tree_sum_last(sq) + eps)[..., None]


def _recurrent_forward(q, k, v, g, beta, cu_seqlens, initial_state, scale):
    """The compiled step (csrc/gdn_recurrent.cpp) where the state is fp32 on CPU, else the torch
    form: the same operations in the same order, so the same bits (tests/test_gdn_kernels.py)."""
    if v.device.type != "cpu" or compute_dtype(v) != torch.float32:
        return _recurrent_forward_torch(q, k, v, g, beta, cu_seqlens, initial_state, scale)
    check_shapes(q, k, v, g, beta)
    T, Hv, dv = v.shape
    cu, lens_l = sequence_lengths(cu_seqlens, T)
    N, dk = len(lens_l), q.shape[2]
    if initial_state is not None and initial_state.shape != (N, Hv, dk, dv):
        raise ValueError(f"initial_state must be {(N, Hv, dk, dv)}, got {tuple(initial_state.shape)}")
    init = torch.empty(0) if initial_state is None else initial_state.float().contiguous()  # read, never written
    if T == 0:
        return v.new_empty(T, Hv, dv), (init.clone() if initial_state is not None else torch.zeros(N, Hv, dk, dv))
    o, final = cpu_ext.ops().gdn_recurrent_f32(*_step_operands(q, k, v, g, beta, cu), init, float(scale))
    return o.to(v.dtype), final


def _step_operands(q, k, v, g, beta, cu):
    """The compiled step's operands: q, k, v, exp(g) (ONCE, before the loop: see the module
    docstring), beta, fp32 and contiguous, and cu_seqlens int64."""
    a = lane_stable(torch.exp, g.float())
    return (*(x.float().contiguous() for x in (q, k, v)), a.contiguous(), beta.float().contiguous(),
            cu.long().contiguous())


def _recurrent_forward_torch(q, k, v, g, beta, cu_seqlens, initial_state, scale):
    """The definition in torch ops: one time step for all sequences and heads at once (the form
    for fp64 and non-CPU tensors, and the reference the compiled step is pinned to)."""
    check_shapes(q, k, v, g, beta)
    T, Hk, dk = q.shape
    Hv, dv = v.shape[1], v.shape[2]
    cdt = compute_dtype(v)
    cu, lens_l = sequence_lengths(cu_seqlens, T)
    N = len(lens_l)
    dkp = _next_pow2(dk)
    # State [N, Hv, dkp, dv] (the API layout, dk zero-padded to a power of two).
    if initial_state is None:
        S = torch.zeros(N, Hv, dkp, dv, dtype=cdt, device=v.device)
    else:
        if initial_state.shape != (N, Hv, dk, dv):
            raise ValueError(f"initial_state must be {(N, Hv, dk, dv)}, got {tuple(initial_state.shape)}")
        S = initial_state.to(cdt)  # never written in place
        if dkp != dk:
            S = F.pad(S, (0, 0, 0, dkp - dk))
    Lmax = max(lens_l, default=0)
    if Lmax == 0:
        return v.new_empty(T, Hv, dv), S[..., :dk, :].clone()
    Lmin = min(lens_l)
    lens = torch.tensor(lens_l, device=v.device)
    a = lane_stable(torch.exp, g.to(cdt))  # ONCE, before the loop (see module docstring)

    pos = torch.arange(Lmax, device=v.device)
    valid = pos[None, :] < lens[:, None]  # [N, Lmax]
    idx = (cu[:-1, None] + pos[None, :]).clamp(max=T - 1).t()  # [Lmax, N], time-major
    head = torch.arange(Hv, device=v.device) // (Hv // Hk)

    def per_head_padded(x):  # [T, Hk, dk] -> [T, Hv, dkp, 1] in cdt
        x = x.to(cdt)[:, head]
        return (F.pad(x, (0, dkp - dk)) if dkp != dk else x)[..., None]

    Q = per_head_padded(q)[idx]  # [Lmax, N, Hv, dkp, 1]
    K = per_head_padded(k)[idx]
    V = v.to(cdt)[idx][:, :, :, None, :]  # [Lmax, N, Hv, 1, dv]
    A = a[idx][..., None, None]  # [Lmax, N, Hv, 1, 1]
    B = beta.to(cdt)[idx][..., None, None]  # [Lmax, N, Hv, 1, 1]
    keep = valid.t()[:, :, None, None, None]  # [Lmax, N, 1, 1, 1]
    outs = []
    for t in range(Lmax):
        kt = K[t]
        Sd = S * A[t]  # decay
        kS = tree_sum_rows(Sd * kt)  # S^T k: [N, Hv, 1, dv]
        u = B[t] * (V[t] - kS)
        Sn = Sd + kt * u  # S + k u^T (mul then add: no FMA)
        outs.append(tree_sum_rows(Sn * Q[t]) * scale)  # scale * S^T q
        # A sequence that has ended keeps its state (exact select); skipped while all run.
        S = Sn if t < Lmin else torch.where(keep[t], Sn, S)
    O = torch.stack(outs, 1)[:, :, :, 0]  # [N, Lmax, Hv, dv]
    return O[valid].to(v.dtype), (S[..., :dk, :].contiguous() if dkp != dk else S)


class _GDNRecurrent(torch.autograd.Function):
    """Forward: the exact recurrent kernel (bits unchanged). Backward: recompute the op
    with the chunkwise-parallel form (gdn_chunked) under autograd and backpropagate
    through it, as the attention backward recomputes with SDPA. Only the forward has to
    be invariant; the gradient is the same function's, up to rounding."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, cu_seqlens, initial_state, scale, chunk_size):
        ctx.save_for_backward(q, k, v, g, beta, cu_seqlens, initial_state)
        ctx.scale, ctx.chunk_size = scale, chunk_size
        return _recurrent_forward(q, k, v, g, beta, cu_seqlens, initial_state, scale)

    @staticmethod
    def backward(ctx, go, gs):
        q, k, v, g, beta, cu, init = ctx.saved_tensors
        need = ctx.needs_input_grad
        with torch.enable_grad():
            xs = [t.detach().requires_grad_(bool(need[i])) if t is not None else None
                  for i, t in enumerate((q, k, v, g, beta, None, init))]
            o, fs = gdn_chunked(xs[0], xs[1], xs[2], xs[3], xs[4], cu, xs[6], ctx.scale, ctx.chunk_size)
            outs, grads = [], []
            for y, gy in ((o, go), (fs, gs)):
                if gy is not None:
                    outs.append(y)
                    grads.append(gy.to(y.dtype))
            wrt = [x for i, x in enumerate(xs) if x is not None and need[i]]
            got = iter(torch.autograd.grad(outs, wrt, grads, allow_unused=True)) if wrt and outs else iter(())
            res = []
            for i, x in enumerate(xs):
                gr = next(got) if (x is not None and need[i] and outs) else None
                if gr is None and x is not None and need[i]:
                    gr = torch.zeros_like(x)
                res.append(gr)
        return (*res, None, None)


def gdn_recurrent(q, k, v, g, beta, cu_seqlens, initial_state=None, scale=None, chunk_size=64):
    """The exact GDN op over a flat varlen stream (both engines, prefill and decode).

    q, k [T, Hk, dk]; v [T, Hv, dv] (Hv a multiple of Hk); g (log decay, <= 0), beta
    [T, Hv] (any float dtype, used in fp32); cu_seqlens int [N+1] rising from 0 to T
    (sequences of length 0 are allowed: their final state is their initial state);
    initial_state [N, Hv, dk, dv] (any float dtype, used in fp32) or None (zeros), or a
    CacheRows (the states in rows of an engine's cache: updated in place and returned as the
    final state; not differentiable). Returns (o [T, Hv, dv] in v's dtype, final_state
    [N, Hv, dk, dv] fp32). scale
    defaults to dk**-0.5. fp64 inputs compute in fp64 (for gradchecks; not an exactness
    path). Differentiable w.r.t. q, k, v, g, beta and initial_state; the backward is
    gdn_chunked's (chunk_size is used only there)."""
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if isinstance(initial_state, CacheRows):
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, g, beta))
        if not grad and initial_state.in_place(v):
            return _recurrent_in_cache(q, k, v, g, beta, cu_seqlens, initial_state, scale), initial_state
        return initial_state.through(gdn_recurrent, q, k, v, g, beta, cu_seqlens, scale=scale)
    args = (q, k, v, g, beta, initial_state)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in args):
        return _GDNRecurrent.apply(q, k, v, g, beta, cu_seqlens, initial_state, scale, chunk_size)
    return _recurrent_forward(q, k, v, g, beta, cu_seqlens, initial_state, scale)


def _recurrent_in_cache(q, k, v, g, beta, cu_seqlens, rows: CacheRows, scale):
    """`_recurrent_forward` with the states read from and written to their cache rows in place:
    the same step (gdn_recurrent.cpp), so the same bits in o and in the rows."""
    check_shapes(q, k, v, g, beta)
    T, Hv, dv = v.shape
    cu, lens_l = sequence_lengths(cu_seqlens, T)
    if rows.rows.shape[0] != len(lens_l) or rows.cache.shape[1:] != (Hv, q.shape[2], dv):
        raise ValueError(f"CacheRows: {rows.rows.shape[0]} rows of {tuple(rows.cache.shape[1:])} for "
                         f"{len(lens_l)} sequences of states {(Hv, q.shape[2], dv)}")
    o = cpu_ext.ops().gdn_recurrent_rows_f32(*_step_operands(q, k, v, g, beta, cu), rows.cache, rows.rows_in(),
                                              rows.rows.contiguous(), float(scale))
    return o.to(v.dtype)


def causal_conv1d(x, weight, cu_seqlens, initial_state=None):
    """Depthwise causal conv over the flat varlen stream, NO activation (the caller applies
    silu, through lane_stable).

    x [T, C]; weight [C, K] or [C, 1, K] (HF/vLLM conv1d.weight); initial_state
    [N, C, K-1] (the K-1 inputs before each sequence's first token, oldest first) or None
    (zeros), or a CacheRows (the states in rows of an engine's cache: updated in place and
    returned as the final state; not differentiable). y_t = sum_{i=0..K-1} w[:, i] *
    x_{t-K+1+i}, products and sums in fp32 in the fixed order i = 0..K-1 (elementwise IEEE ops
    only, so invariant), cast to x's dtype.
    Returns (y [T, C], final_state [N, C, K-1] fp32: each sequence's last K-1 inputs,
    including initial-state ones when it is shorter than K-1; length 0 keeps its state).
    Differentiable w.r.t. x, weight and initial_state. On CPU the compiled form
    (csrc/causal_conv1d.cpp) computes the forward, the same operations as the torch form
    (`causal_conv1d_torch`, the definition), so the same bits; its backward is the torch form's."""
    if weight.dim() == 3:
        weight = weight[:, 0]
    args = (x, weight, initial_state)
    grad = torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in args)
    if isinstance(initial_state, CacheRows):
        if not grad and initial_state.in_place(x) and _conv_compiled(x, weight):
            return _conv_in_cache(x, weight, cu_seqlens, initial_state), initial_state
        return initial_state.through(causal_conv1d, x, weight, cu_seqlens)
    if not _conv_compiled(x, weight):
        return causal_conv1d_torch(x, weight, cu_seqlens, initial_state)
    if grad:
        return _CausalConv.apply(x, weight, cu_seqlens, initial_state)
    return _conv_forward(x, weight, cu_seqlens, initial_state)


def _conv_compiled(x: torch.Tensor, weight: torch.Tensor) -> bool:
    ok = (torch.float32, torch.bfloat16)
    return x.device.type == "cpu" and x.dtype in ok and weight.dtype in ok and x.dim() == 2


def _conv_args(x, weight, cu_seqlens):
    T, C = x.shape
    if weight.shape[0] != C or weight.dim() != 2:
        raise ValueError(f"causal_conv1d: weight must be [{C}, K] or [{C}, 1, K], got {tuple(weight.shape)}")
    cu, _ = sequence_lengths(cu_seqlens, T)
    return x.contiguous(), weight.contiguous(), cu.long().contiguous()


def _conv_forward(x, weight, cu_seqlens, initial_state):
    xc, wt, cu = _conv_args(x, weight, cu_seqlens)
    N, C, H = cu.shape[0] - 1, x.shape[1], weight.shape[1] - 1
    if initial_state is not None and initial_state.shape != (N, C, H):
        raise ValueError(f"initial_state must be {(N, C, H)}, got {tuple(initial_state.shape)}")
    init = torch.empty(0) if initial_state is None else initial_state.float().contiguous()
    return cpu_ext.ops().causal_conv1d_f32(xc, wt, cu, init)


def _conv_in_cache(x, weight, cu_seqlens, rows: CacheRows):
    xc, wt, cu = _conv_args(x, weight, cu_seqlens)
    N, C, H = cu.shape[0] - 1, x.shape[1], weight.shape[1] - 1
    if rows.rows.shape[0] != N or rows.cache.shape[1:] != (C, H):
        raise ValueError(f"CacheRows: {rows.rows.shape[0]} rows of {tuple(rows.cache.shape[1:])} for {N} "
                         f"sequences of conv states {(C, H)}")
    return cpu_ext.ops().causal_conv1d_rows_f32(xc, wt, cu, rows.cache, rows.rows_in(), rows.rows.contiguous())


class _CausalConv(torch.autograd.Function):
    """Forward: the compiled conv. Backward: the torch form's, recomputed under autograd (its
    forward is the same bits, so the gradients are those of the torch form)."""

    @staticmethod
    def forward(ctx, x, weight, cu_seqlens, initial_state):
        ctx.save_for_backward(x, weight, cu_seqlens, initial_state)
        return _conv_forward(x, weight, cu_seqlens, initial_state)

    @staticmethod
    def backward(ctx, gy, gs):
        x, weight, cu, init = ctx.saved_tensors
        need = ctx.needs_input_grad
        with torch.enable_grad():
            xs = [t.detach().requires_grad_(bool(need[i])) if t is not None else None
                  for i, t in enumerate((x, weight, None, init))]
            y, fs = causal_conv1d_torch(xs[0], xs[1], cu, xs[3])
            outs = [(o, g) for o, g in ((y, gy), (fs, gs)) if g is not None]
            wrt = [i for i, t in enumerate(xs) if t is not None and need[i]]
            got = torch.autograd.grad([o for o, _ in outs], [xs[i] for i in wrt], [g.to(o.dtype) for o, g in outs],
                                      allow_unused=True) if wrt and outs else ()
        res = [None] * 4
        for i, gr in zip(wrt, got):
            res[i] = gr  # None where the torch form does not use the input (K = 1: no state)
        return tuple(res)


def causal_conv1d_torch(x, weight, cu_seqlens, initial_state=None):
    """The definition in torch ops (the form for fp64 and non-CPU tensors, the compiled form's
    reference and its backward, and the stock kernels' conv): an extended stream per sequence, a
    gather, product and sum per tap."""
    if isinstance(initial_state, CacheRows):
        return initial_state.through(causal_conv1d_torch, x, weight, cu_seqlens)
    if weight.dim() == 3:
        weight = weight[:, 0]
    T, C = x.shape
    K = weight.shape[-1]
    H = K - 1
    cdt = compute_dtype(x)
    cu, lens_l = sequence_lengths(cu_seqlens, T)
    N = len(lens_l)
    dev = x.device
    lens = torch.tensor(lens_l, device=dev, dtype=torch.long)
    # Extended stream: each sequence's K-1 history entries, then its tokens.
    seq = torch.repeat_interleave(torch.arange(N, device=dev), lens)
    tok_e = torch.arange(T, device=dev) + (seq + 1) * H  # [T]
    ext = torch.zeros(T + N * H, C, dtype=cdt, device=dev)
    ext = ext.index_put((tok_e,), x.to(cdt))
    if initial_state is not None and H:
        if initial_state.shape != (N, C, H):
            raise ValueError(f"initial_state must be {(N, C, H)}, got {tuple(initial_state.shape)}")
        init_e = (cu[:-1] + torch.arange(N, device=dev) * H)[:, None] + torch.arange(H, device=dev)
        ext = ext.index_put((init_e.reshape(-1),), initial_state.to(cdt).transpose(1, 2).reshape(N * H, C))
    w = weight.to(cdt)
    y = None
    for i in range(K):  # fixed order i = 0..K-1
        term = ext[tok_e - H + i] * broadcast_rows(w[:, i], T)  # its gradient: a fixed sum over T
        y = term if y is None else y + term
    if y is None:
        y = ext[tok_e]
    return y.to(x.dtype), _final_state(ext, cu, N, H, C)


def _final_state(ext: torch.Tensor, cu: torch.Tensor, N: int, H: int, C: int) -> torch.Tensor:
    """Each sequence's last H entries of the extended stream (its history, then its tokens)."""
    end_e = cu[1:] + torch.arange(1, N + 1, device=ext.device) * H  # one past each sequence's last entry
    fin_e = end_e[:, None] - H + torch.arange(H, device=ext.device)  # [N, H]
    return ext[fin_e.reshape(-1)].reshape(N, H, C).transpose(1, 2).contiguous()


def conv_final_state(x: torch.Tensor, cu_seqlens: torch.Tensor, K: int, initial_state=None) -> torch.Tensor:
    """causal_conv1d's final state alone ([N, C, K-1] fp32: gathers, exact, differentiable):
    each sequence's last K-1 inputs, reaching back into its initial state (zeros without one)
    where the sequence is shorter. Gathers N x (K-1) rows, not the whole stream: the Triton
    conv calls it per GDN layer per step."""
    T, C = x.shape
    H = K - 1
    cdt = compute_dtype(x)
    cu, _ = sequence_lengths(cu_seqlens, T)
    N, dev = cu.numel() - 1, x.device
    rel = (cu[1:] - cu[:-1])[:, None] - H + torch.arange(H, device=dev)  # [N, H] positions in each sequence
    if initial_state is None:
        hist = torch.zeros(N, H, C, dtype=cdt, device=dev)
    else:
        hist = initial_state.to(cdt).transpose(1, 2)[torch.arange(N, device=dev)[:, None], (rel + H).clamp(0, H - 1)]
    if T == 0 or H == 0:
        return hist.transpose(1, 2).contiguous()
    own = x.to(cdt)[(cu[:-1, None] + rel).clamp(0, T - 1)]
    return torch.where((rel >= 0)[..., None], own, hist).transpose(1, 2).contiguous()
