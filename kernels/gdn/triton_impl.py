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
    args = (q, k, v, g, beta, initial_state)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in args):
        return _GDNTriton.apply(q, k, v, g, beta, cu_seqlens, initial_state, scale, chunk_size)
    return _gdn_forward(q, k, v, g, beta, cu_seqlens, initial_state, scale)
