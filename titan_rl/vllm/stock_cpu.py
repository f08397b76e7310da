"""Can vLLM's own CPU build run this model (the stock column)? Asked of the installed vLLM, at start.

vLLM's CPU ops refuse some shapes and dtypes from inside a worker, mid-step; and which ops
exist depends on the CPU: its x86 wheel ships three libraries (`_C` for AVX512-BF16,
`_C_AVX512`, `_C_AVX2`) that register different ops, and its GDN layer runs its compiled conv
only where torch reports AVX512-BF16 (or an Arm CPU with bf16), a torch conv elsewhere. So
nothing here encodes one build's rules: `stock_cpu_problem` finds the path vLLM's GDN layer
takes on this CPU, checks that the loaded library registers that path's ops, and calls the
shape-dependent ones on a few tokens at the model's dims. What is left as a rule is vLLM's
Python (the bf16 assert in its GDN layer, the MoE experts' width), each named where it is.
"""

from __future__ import annotations

from functools import lru_cache

import torch

# vllm/model_executor/layers/mamba/ops/cpu/gdn_attention.py: ops every GDN call needs, and the
# conv ops of each path (prefill, decode)
GDN_OPS = ("chunk_gated_delta_rule_cpu", "fused_gdn_gating_cpu", "fused_sigmoid_gating_delta_rule_update_cpu")
CONV_OPS = {"compiled": ("causal_conv1d_fwd_cpu", "causal_conv1d_update_cpu"),
            "torch": ("causal_conv1d_update_cpu_vec",)}


def gdn_conv_path() -> str:
    """The conv vLLM's CPU GDN layer runs on this CPU: "compiled" (its C++ conv over packed
    weights) or "torch" (F.conv1d per sequence, its vectorised update for decode). The
    predicate is the layer's own (`_cpu_gdn_attention_nonspec`), evaluated here."""
    from vllm.model_executor.layers.mamba.ops.cpu.gdn_attention import is_arm_bf16

    return "compiled" if torch.cpu._is_avx512_bf16_supported() or is_arm_bf16() else "torch"


def missing_ops(names) -> list[str]:
    """The names among `names` that the vLLM library loaded here does not register."""
    import vllm._custom_ops  # noqa: F401  (loads the platform's library)

    return [n for n in names if not hasattr(torch.ops._C, n)]


def _randn(*shape, dtype=torch.float32):
    # a generator of its own: a probe must not move the global RNG a run's seeds come from
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(dtype)


def _runs(call) -> bool:
    try:
        call()
    except RuntimeError:
        return False
    return True


@lru_cache(maxsize=None)
def delta_rule_takes(dk: int, dv: int) -> bool:
    """vLLM's chunked delta rule (its GDN prefill) on 8 tokens at key/value head dims dk, dv,
    called as its layer calls it (bf16 q/k/v/beta, fp32 gate and state)."""
    import vllm._custom_ops as ops

    T, H, bf = 8, 2, torch.bfloat16
    q, k, v = _randn(1, T, H, dk, dtype=bf), _randn(1, T, H, dk, dtype=bf), _randn(1, T, H, dv, dtype=bf)
    return _runs(lambda: ops.chunk_gated_delta_rule_cpu(
        q, k, v, -_randn(1, T, H).abs(), _randn(1, T, H, dtype=bf).sigmoid(), torch.zeros(1, H, dk, dv), True,
        torch.tensor([0, T], dtype=torch.int32), False, True, torch.tensor([0], dtype=torch.int32)))


@lru_cache(maxsize=None)
def conv_takes(width: int) -> bool:
    """The conv of vLLM's GDN path on this CPU, at kernel width `width` (prefill and decode)."""
    import vllm._custom_ops as ops

    T, C, bf = 8, 64, torch.bfloat16
    w, one = _randn(C, width, dtype=bf), torch.tensor([0], dtype=torch.int32)
    if gdn_conv_path() == "compiled":
        x = _randn(T, C, dtype=bf).t()  # [channels, tokens], tokens contiguous per channel: its layout
        return _runs(lambda: ops.causal_conv1d_fwd_cpu(
            x, w, None, torch.zeros(1, C, width - 1, dtype=bf), torch.tensor([0, T], dtype=torch.int32), one,
            torch.tensor([False]), True, False))
    # F.conv1d takes any width; the decode update is vLLM's own op
    return _runs(lambda: ops.causal_conv1d_update_cpu_vec(
        _randn(1, C, dtype=bf), torch.zeros(1, C, width - 1, dtype=bf), w, None, "silu", one, None, -1))


def stock_cpu_problem(spec, cfg, dtype: str) -> str:
    """Why vLLM's own CPU build cannot run the model config `cfg` in `dtype` ("" when it can, or
    off CPU), found before the engine starts."""
    if not (spec.recurrent_state or spec.moe or spec.stock_cpu_refusal):
        return ""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return ""
    if spec.stock_cpu_refusal:
        return spec.stock_cpu_refusal
    problems = []
    if spec.recurrent_state:
        if dtype != "bfloat16":  # the assert in cpu_gdn_attention_core
            problems.append(f"model dtype {dtype!r} (its GDN layer takes 'bfloat16')")
        path = gdn_conv_path()
        absent = missing_ops((*GDN_OPS, *CONV_OPS[path]))
        if absent:
            problems.append(f"this CPU's vLLM library has no {', '.join(absent)} (its GDN layer's {path} conv path)")
        if not absent:
            if not conv_takes(cfg.linear_conv_kernel_dim):
                problems.append(f"linear_conv_kernel_dim = {cfg.linear_conv_kernel_dim} (its {path} conv refuses it)")
            dims = (cfg.linear_key_head_dim, cfg.linear_value_head_dim)
            if not delta_rule_takes(*dims):
                problems.append(f"linear_key_head_dim, linear_value_head_dim = {dims} (its delta rule refuses them)")
    if spec.moe and cfg.hidden_size % 32:  # layers/fused_moe/experts/cpu_moe.py
        problems.append(f"hidden_size = {cfg.hidden_size} (its MoE experts take a multiple of 32)")
    return "; ".join(problems)
