"""Gated delta rule in Triton: the same per-token recurrent algorithm as torch_impl.

One program per (sequence, v head, block of BLOCK_V value columns). The state tile
S [BLOCK_K, BLOCK_V] (fp32, BLOCK_K = next_power_of_2(dk), masked rows are 0) lives in
registers; tokens of the program's sequence are visited in order:
    S *= exp(g_t); kS = sum_k S * k_t; u = beta_t (v_t - kS); S += k_t u^T; o_t = scale sum_k S * q_t
Why the bits do not depend on batch, length or split:
  * a program touches only its own sequence's tokens, its own head and its own columns;
    no other program's data enters its arithmetic, and there is no cross-program reduction;
  * the dk-reductions are tl.sum over axis 0 of a [BLOCK_K, BLOCK_V] tile: the reduction
    tree depends on BLOCK_K only (a function of dk), never on the batch; masked rows add 0;
  * exp runs the same instruction on every element (no scalar-tail path);
  * the state goes to fp32 memory between calls and is reloaded exactly, so prefill +
    decode (any split) equals one call;
  * enable_fp_fusion=False at launch: no FMA contraction, whatever the environment says.
Not bit-equal to torch_impl (different reduction tree): both engines must call the same
implementation on a platform. The backward is torch_impl's (gdn_chunked recomputed under
autograd): only the forward has to match the engine.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from titan_rl.kernels.autograd import with_eager_backward
from titan_rl.kernels.gdn import torch_impl
from titan_rl.kernels.gdn.cache_rows import CacheRows
from titan_rl.kernels.gdn.inputs import sequence_lengths
from titan_rl.kernels.gdn.torch_impl import _GDNRecurrent

BLOCK_V = 16  # value columns per program; fixed (never chosen from the batch)


@triton.jit
def _gdn_recurrent_kernel(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, cu_ptr, s0_ptr, o_ptr, sN_ptr,
                          HV, REP, DK, DV, scale,
                          sq_t, sq_h, sv_t, sv_h, sg_t, ss_n, ss_h, ss_k, so_t, so_h,
                          HAS_S0: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    pid = tl.program_id(0)
    n = pid // HV
    h = pid % HV
    hk = h // REP
    kk = tl.arange(0, BLOCK_K)
    vv = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    kmask = kk < DK
    vmask = vv < DV
    smask = kmask[:, None] & vmask[None, :]
    s_off = n * ss_n + h * ss_h + kk[:, None] * ss_k + vv[None, :]
    if HAS_S0:
        S = tl.load(s0_ptr + s_off, mask=smask, other=0.0).to(tl.float32)
    else:
        S = tl.zeros((BLOCK_K, BLOCK_V), tl.float32)
    start = tl.load(cu_ptr + n)
    end = tl.load(cu_ptr + n + 1)
    for t in range(start, end):
        kt = tl.load(k_ptr + t * sq_t + hk * sq_h + kk, mask=kmask, other=0.0).to(tl.float32)
        qt = tl.load(q_ptr + t * sq_t + hk * sq_h + kk, mask=kmask, other=0.0).to(tl.float32)
        vt = tl.load(v_ptr + t * sv_t + h * sv_h + vv, mask=vmask, other=0.0).to(tl.float32)
        a = tl.exp(tl.load(g_ptr + t * sg_t + h).to(tl.float32))
        bt = tl.load(b_ptr + t * sg_t + h).to(tl.float32)
        S = S * a
        kS = tl.sum(S * kt[:, None], axis=0)
        u = bt * (vt - kS)
        S = S + kt[:, None] * u[None, :]
        o = tl.sum(S * qt[:, None], axis=0) * scale
        tl.store(o_ptr + t * so_t + h * so_h + vv, o, mask=vmask)
    tl.store(sN_ptr + s_off, S, mask=smask)


def _gdn_forward(q, k, v, g, beta, cu_seqlens, initial_state=None, scale=None):
    """The kernel's launch: q, k [T, Hk, dk];
    v [T, Hv, dv]; g, beta [T, Hv]; cu_seqlens [N+1] (length-0 sequences allowed);
    initial_state [N, Hv, dk, dv] or None. Returns (o [T, Hv, dv] in v's dtype,
    final_state [N, Hv, dk, dv] fp32)."""
    T, Hk, dk = q.shape
    Hv, dv = v.shape[1], v.shape[2]
    if scale is None:
        scale = dk ** -0.5
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    g, beta = g.float().contiguous(), beta.float().contiguous()
    cu = cu_seqlens.to(device=v.device, dtype=torch.int64).contiguous()
    N = cu.numel() - 1
    o = torch.empty(T, Hv, dv, dtype=torch.float32, device=v.device)
    sN = torch.empty(N, Hv, dk, dv, dtype=torch.float32, device=v.device)
    s0 = initial_state.float().contiguous() if initial_state is not None else sN
    if N * Hv:
        grid = (N * Hv, triton.cdiv(dv, BLOCK_V))
        _gdn_recurrent_kernel[grid](q, k, v, g, beta, cu, s0, o, sN, Hv, Hv // Hk, dk, dv, scale,
                                    q.stride(0), q.stride(1), v.stride(0), v.stride(1), g.stride(0),
                                    sN.stride(0), sN.stride(1), sN.stride(2), o.stride(0), o.stride(1),
                                    HAS_S0=initial_state is not None, BLOCK_K=triton.next_power_of_2(dk),
                                    BLOCK_V=BLOCK_V, enable_fp_fusion=False)
    return o.to(v.dtype), sN


class _GDNTriton(_GDNRecurrent):
    """torch_impl's autograd Function with this kernel as the forward."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, cu_seqlens, initial_state, scale, chunk_size):
        ctx.save_for_backward(q, k, v, g, beta, cu_seqlens, initial_state)
        ctx.scale, ctx.chunk_size = scale, chunk_size
        return _gdn_forward(q, k, v, g, beta, cu_seqlens, initial_state, scale)


def gdn_recurrent(q, k, v, g, beta, cu_seqlens, initial_state=None, scale=None, chunk_size=64):
    """Same contract as torch_impl.gdn_recurrent (chunk_size is the backward's)."""
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if isinstance(initial_state, CacheRows):
        return initial_state.through(gdn_recurrent, q, k, v, g, beta, cu_seqlens, scale=scale)
    args = (q, k, v, g, beta, initial_state)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in args):
        return _GDNTriton.apply(q, k, v, g, beta, cu_seqlens, initial_state, scale, chunk_size)
    return _gdn_forward(q, k, v, g, beta, cu_seqlens, initial_state, scale)


# -- the causal conv and the per-head L2 norm -------------------------------------------------
# The conv is elementwise IEEE arithmetic in torch_impl (fp32 products summed over the taps
# i = 0..K-1, rounded to x's dtype once): this form computes the same operations in the same
# order, so it gives torch_impl's bits (torch.equal under the interpreter). The norm sums
# the squares by torch_impl's halving tree, one program per row (row-invariant), then the
# correctly rounded sqrt and division; it is within an ulp of torch_impl, not equal (torch
# on CPU adds the Python eps in another precision). Both backwards are torch_impl's gradient.

CONV_BLOCK_T = 16
CONV_BLOCK_C = 64


@triton.jit(do_not_specialize=["T"])
def _conv_kernel(x_ptr, w_ptr, start_ptr, seq_ptr, s0_ptr, y_ptr, T, C, sx_t, sw_c, ss_n, ss_c, sy_t,
                 K: tl.constexpr, HAS_S0: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    tm, cm = t < T, c < C
    m2 = tm[:, None] & cm[None, :]
    start = tl.load(start_ptr + t, mask=tm, other=0)
    seq = tl.load(seq_ptr + t, mask=tm, other=0)
    acc = tl.zeros((BLOCK_T, BLOCK_C), tl.float32)
    for i in tl.static_range(K):  # the taps in torch_impl's order; tap 0 starts the sum
        u = t - (K - 1) + i
        own = u >= start
        xv = tl.load(x_ptr + u[:, None] * sx_t + c[None, :], mask=m2 & own[:, None], other=0.0).to(tl.float32)
        if HAS_S0:  # positions before the sequence's first token: its initial state, oldest first
            j = u - start + (K - 1)
            hv = tl.load(s0_ptr + seq[:, None] * ss_n + c[None, :] * ss_c + j[:, None],
                         mask=m2 & (~own)[:, None], other=0.0).to(tl.float32)
            xv = tl.where(own[:, None], xv, hv)
        term = xv * tl.load(w_ptr + c * sw_c + i, mask=cm, other=0.0).to(tl.float32)[None, :]
        if i == 0:
            acc = term
        else:
            acc = acc + term
    tl.store(y_ptr + t[:, None] * sy_t + c[None, :], acc, mask=m2)  # fp32: the caller rounds, as torch_impl


def _conv_y(x, weight, cu_seqlens, initial_state):
    T, C = x.shape
    K = weight.shape[-1]
    x, w = x.contiguous(), weight.contiguous()
    cu, lens = sequence_lengths(cu_seqlens, T)
    cu = cu.to(x.device)
    seq = torch.repeat_interleave(torch.arange(len(lens), device=x.device),
                                  torch.tensor(lens, device=x.device, dtype=torch.long))
    start = cu[:-1][seq].contiguous()
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    s0 = initial_state.contiguous() if initial_state is not None and K > 1 else x
    if T and C:
        grid = (triton.cdiv(T, CONV_BLOCK_T), triton.cdiv(C, CONV_BLOCK_C))
        _conv_kernel[grid](x, w, start, seq, s0, y, T, C, x.stride(0), w.stride(0),
                           s0.stride(0) if s0 is not x else 0, s0.stride(1) if s0 is not x else 0, y.stride(0),
                           K=K, HAS_S0=s0 is not x, BLOCK_T=CONV_BLOCK_T, BLOCK_C=CONV_BLOCK_C,
                           enable_fp_fusion=False)
    return y.to(x.dtype)


def _conv_y_eager(x, weight, cu_seqlens, initial_state):
    return torch_impl.causal_conv1d(x, weight, cu_seqlens, initial_state)[0]


_conv_y_op = with_eager_backward(_conv_y, _conv_y_eager)


def causal_conv1d(x, weight, cu_seqlens, initial_state=None):
    """torch_impl.causal_conv1d's contract and bits; y from the kernel, the final state by
    torch_impl's gathers (data movement only). fp64 (gradchecks) runs torch_impl."""
    if x.dtype == torch.float64:
        return torch_impl.causal_conv1d(x, weight, cu_seqlens, initial_state)
    if isinstance(initial_state, CacheRows):
        return initial_state.through(causal_conv1d, x, weight, cu_seqlens)
    if weight.dim() == 3:
        weight = weight[:, 0]
    if initial_state is not None and initial_state.shape != (len(cu_seqlens) - 1, x.shape[1], weight.shape[-1] - 1):
        raise ValueError(f"initial_state must be {(len(cu_seqlens) - 1, x.shape[1], weight.shape[-1] - 1)}, "
                         f"got {tuple(initial_state.shape)}")
    y = _conv_y_op(x, weight, cu_seqlens, initial_state)
    return y, torch_impl.conv_final_state(x, cu_seqlens, weight.shape[-1], initial_state)


@triton.jit
def _l2norm_kernel(x_ptr, y_ptr, D, eps, sx, sy, BLOCK: tl.constexpr, LEVELS: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + r * sx + d, mask=d < D, other=0.0).to(tl.float32)
    s = x * x
    for lv in tl.static_range(LEVELS):  # torch_impl.tree_sum_last: first half + second half
        s = tl.sum(tl.reshape(s, (2, BLOCK >> (lv + 1))), axis=0)
    total = tl.sum(s, axis=0)  # one element
    # correctly rounded sqrt and division (the GPU's default forms are approximate), as torch
    tl.store(y_ptr + r * sy + d, tl.div_rn(x, tl.sqrt_rn(total + eps)), mask=d < D)


def _l2norm(x, eps):
    d = x.shape[-1]
    x2 = x.reshape(-1, d).contiguous()
    y = torch.empty(x2.shape, dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(d)
    if x2.shape[0] and d:
        _l2norm_kernel[(x2.shape[0],)](x2, y, d, eps, x2.stride(0), y.stride(0), BLOCK=block,
                                       LEVELS=block.bit_length() - 1, enable_fp_fusion=False)
    return y.reshape(x.shape)


_l2norm_op = with_eager_backward(_l2norm, torch_impl.l2norm)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """torch_impl.l2norm's contract (fp32 out; fp64 runs torch_impl)."""
    if x.dtype == torch.float64:
        return torch_impl.l2norm(x, eps)
    return _l2norm_op(x, eps)
