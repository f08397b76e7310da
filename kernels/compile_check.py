"""Every Triton kernel of the GPU path compiled for an H200 (sm_90), no GPU needed.

The interpreter runs the kernels' semantics on CPU, but two things only the compiler shows:
its frontend is stricter (types carried across branches and loops, what a constexpr may
be), and the TF32 trap: an fp32 `tl.dot` without input_precision="ieee" compiles to TF32
MMAs (a 10-bit mantissa) on a GPU while the interpreter computes it exactly. So each
kernel is compiled with `triton.compile` for GPUTarget("cuda", 90, 32), in bf16 where the
dtype follows the model's and in fp32 where a model may compute in fp32, and its PTX must
hold no TF32 instruction. Used by tests/test_triton_compile.py and by
scripts/gpu_check.py (its compiler rows, in a process without TRITON_INTERPRET).
"""

from __future__ import annotations

F32, I32, I64 = "*fp32", "*i32", "*i64"
TF32_MESSAGE = "a tl.dot compiles to TF32: pass input_precision='ieee'"


def kernels() -> list[tuple]:
    """(kernel, pointer dtypes other than bf16, constexpr values) for every Triton kernel."""
    from titan_rl.kernels.attention import triton_impl as at
    from titan_rl.kernels.elementwise import triton_impl as ew
    from titan_rl.kernels.gdn import triton_impl as gd
    from titan_rl.kernels.indexer import triton_impl as ix
    from titan_rl.kernels.layernorm import triton_impl as ln
    from titan_rl.kernels.lm_head import triton_impl as lm
    from titan_rl.kernels.matmul import triton_impl as mm
    from titan_rl.kernels.moe import triton_impl as mo
    from titan_rl.kernels.rmsnorm import triton_impl as rn
    from titan_rl.kernels.sampling import triton_impl as sp
    from titan_rl.kernels.sparse_attention import triton_impl as sa

    linear_tiles = {"BLOCK_M": mm.ROW_TILE, "BLOCK_N": mm.BLOCK_N, "BLOCK_K": mm.BLOCK_K}
    attention_tiles = {"BLOCK": at.BLOCK, "BLOCK_R": at.BLOCK_R, "BLOCK_D": 128}
    sparse_tiles = {"BLOCK_N": sa.BLOCK_N, "BLOCK_H": sa.BLOCK_H, "BLOCK_D": sa.BLOCK_D, "BLOCK_DV": sa.BLOCK_DV}
    index_tiles = {"BLOCK_N": ix.BLOCK_N, "BLOCK_H": 32, "BLOCK_D": 128}
    return [
        (mm._linear_kernel, {}, linear_tiles),
        (mm._linear_kernel, {"x_ptr": F32, "w_ptr": F32, "y_ptr": F32}, linear_tiles),  # the LM head's fp32 GEMM
        (rn._rms_norm_kernel, {}, {"BLOCK_N": 1024}),
        (lm._log_softmax_kernel, {"x_ptr": F32, "y_ptr": F32}, {"BLOCK_V": lm.BLOCK_V}),
        (at._attention_kernel, {"qsl_ptr": I32, "seqlen_ptr": I32, "bt_ptr": I32}, attention_tiles),
        (at._attention_kernel, {"q_ptr": F32, "k_ptr": F32, "v_ptr": F32, "o_ptr": F32, "qsl_ptr": I32,  # fp32 model
                                "seqlen_ptr": I32, "bt_ptr": I32}, attention_tiles),
        (gd._gdn_recurrent_kernel, {"g_ptr": F32, "b_ptr": F32, "cu_ptr": I64, "s0_ptr": F32, "o_ptr": F32,
                                    "sN_ptr": F32}, {"HAS_S0": True, "BLOCK_K": 64, "BLOCK_V": gd.BLOCK_V}),
        (gd._conv_kernel, {"w_ptr": "*bf16", "start_ptr": I64, "seq_ptr": I64, "s0_ptr": F32, "y_ptr": F32},
         {"K": 4, "HAS_S0": True, "BLOCK_T": gd.CONV_BLOCK_T, "BLOCK_C": gd.CONV_BLOCK_C}),
        (gd._l2norm_kernel, {"y_ptr": F32}, {"BLOCK": 128, "LEVELS": 7}),
        (ew._silu_mul_kernel, {}, {"BLOCK": ew.BLOCK}),
        (ew._rope_kernel, {"pos_ptr": I64}, {"BLOCK_D": 128}),
        (mo._softmax_kernel, {"x_ptr": F32, "y_ptr": F32}, {"BLOCK_E": 16}),
        (mo._topk_kernel, {"p_ptr": F32, "ids_ptr": I64}, {"BLOCK_E": 16}),
        (mo._combine_kernel, {"w_ptr": F32}, {"BLOCK_H": mo.BLOCK_H}),
        (sp._drop_kernel, {"x_ptr": F32, "k_ptr": I64, "p_ptr": F32, "d_ptr": "*i8"},
         {"USE_K": True, "USE_P": True, "BLOCK_V": sp.BLOCK_V, "STEPS": sp.STEPS}),
        # GLM-5 (DeepSeek sparse attention)
        (ln._layer_norm_kernel, {}, {"BLOCK_N": 1024}),
        (ln._layer_norm_kernel, {"x_ptr": F32, "w_ptr": F32, "b_ptr": F32, "y_ptr": F32}, {"BLOCK_N": 1024}),
        (mo._sigmoid_choice_kernel, {"c_ptr": F32, "ids_ptr": I64}, {"GROUPED": True, "BLOCK_G": 8, "BLOCK_P": 32}),
        (ix._index_scores_kernel, {"w_ptr": F32, "bt_ptr": I64, "seq_ptr": I64, "pos_ptr": I64, "key_ptr": I32},
         index_tiles),
        (ix._select_kernel, {"key_ptr": I32, "pos_ptr": I64, "out_ptr": I64}, {"BLOCK_S": ix.BLOCK_S}),
        (sa._sparse_attention_kernel, {"bt_ptr": I64, "seq_ptr": I64, "ind_ptr": I64}, sparse_tiles),
        (ix._index_scores_kernel, {"q_ptr": F32, "w_ptr": F32, "c_ptr": F32, "bt_ptr": I64, "seq_ptr": I64,
                                   "pos_ptr": I64, "key_ptr": I32}, index_tiles),
        (sa._sparse_attention_kernel, {"q_ptr": F32, "c_ptr": F32, "o_ptr": F32, "bt_ptr": I64, "seq_ptr": I64,
                                       "ind_ptr": I64}, sparse_tiles),
    ]


def kernel_id(fn, pointers: dict) -> str:
    fp32 = F32 in (pointers.get("x_ptr"), pointers.get("q_ptr"))
    return f"{getattr(fn, 'fn', fn).__name__}-{'fp32' if fp32 else 'bf16'}"


def signature(fn, pointers: dict, constexprs: dict) -> dict:
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = pointers.get(name, "*bf16")
        else:
            sig[name] = "fp32" if name in ("scale", "eps", "n_float") else "i32"
    return sig


class NoCudaBackend(RuntimeError):
    """This triton cannot compile for CUDA here (no backend or no ptxas)."""


def compile_sm90(fn, pointers: dict, constexprs: dict):
    """The kernel compiled for sm_90 (raises NoCudaBackend where this triton cannot)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if not isinstance(fn, triton.runtime.jit.JITFunction):
        raise RuntimeError("the kernel modules were imported under the Triton interpreter in this process")
    src = ASTSource(fn=fn, signature=signature(fn, pointers, constexprs), constexprs=constexprs)
    try:
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": False})
    except (RuntimeError, FileNotFoundError) as e:
        if "ptxas" in str(e) or "backend" in str(e).lower():
            raise NoCudaBackend(str(e)) from e
        raise


def check_all() -> dict[str, str]:
    """kernel id -> "ok", "tf32" (its PTX holds a TF32 instruction), "no cuda backend", or the error."""
    out = {}
    for fn, pointers, constexprs in kernels():
        name = kernel_id(fn, pointers)
        try:
            compiled = compile_sm90(fn, pointers, constexprs)
            out[name] = "tf32" if "tf32" in compiled.asm["ptx"] else "ok" if compiled.asm["cubin"] else "no cubin"
        except NoCudaBackend:
            out[name] = "no cuda backend"
        except Exception as e:  # one kernel's failure is that kernel's row
            out[name] = f"{type(e).__name__}: {str(e)[:300]}"
    return out
