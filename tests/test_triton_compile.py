"""Every Triton kernel of the GPU path compiles for an H200 (sm_90 cubin), no GPU needed.

The interpreter tests (tests/test_triton_kernels.py) run the kernels' semantics on CPU; the
compiler's frontend is stricter (types of values carried across branches and loops,
what a constexpr may be), so each kernel is also compiled with `triton.compile` for
GPUTarget("cuda", 90, 32), in bf16 where the dtype follows the model's, and its PTX must hold
no TF32 instruction (an fp32 `tl.dot` without input_precision="ieee" is TF32 on a GPU and
exact under the interpreter, so only the compiler shows it). Skipped where this triton has
no CUDA backend or runs as the interpreter.
"""

import os

import pytest

triton = pytest.importorskip("triton")

if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("the Triton interpreter replaces the compiler in this process", allow_module_level=True)

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from titan_rl.kernels.attention import triton_impl as at  # noqa: E402
from titan_rl.kernels.elementwise import triton_impl as ew  # noqa: E402
from titan_rl.kernels.gdn import triton_impl as gd  # noqa: E402
from titan_rl.kernels.indexer import triton_impl as ix  # noqa: E402
from titan_rl.kernels.layernorm import triton_impl as ln  # noqa: E402
from titan_rl.kernels.lm_head import triton_impl as lm  # noqa: E402
from titan_rl.kernels.matmul import triton_impl as mm  # noqa: E402
from titan_rl.kernels.moe import triton_impl as mo  # noqa: E402
from titan_rl.kernels.rmsnorm import triton_impl as rn  # noqa: E402
from titan_rl.kernels.sampling import triton_impl as sp  # noqa: E402
from titan_rl.kernels.sparse_attention import triton_impl as sa  # noqa: E402

F32, I32, I64 = "*fp32", "*i32", "*i64"
# kernel, pointer dtypes other than bf16, constexpr values
KERNELS = [
    (mm._linear_kernel, {}, {"BLOCK_M": mm.ROW_TILE, "BLOCK_N": mm.BLOCK_N, "BLOCK_K": mm.BLOCK_K}),
    (mm._linear_kernel, {"x_ptr": F32, "w_ptr": F32, "y_ptr": F32},  # the LM head's fp32 GEMM
     {"BLOCK_M": mm.ROW_TILE, "BLOCK_N": mm.BLOCK_N, "BLOCK_K": mm.BLOCK_K}),
    (rn._rms_norm_kernel, {}, {"BLOCK_N": 1024}),
    (lm._log_softmax_kernel, {"x_ptr": F32, "y_ptr": F32}, {"BLOCK_V": lm.BLOCK_V}),
    (at._attention_kernel, {"qsl_ptr": I32, "seqlen_ptr": I32, "bt_ptr": I32},
     {"BLOCK": at.BLOCK, "BLOCK_R": at.BLOCK_R, "BLOCK_D": 128}),
    (at._attention_kernel, {"q_ptr": F32, "k_ptr": F32, "v_ptr": F32, "o_ptr": F32, "qsl_ptr": I32,  # an fp32 model
                            "seqlen_ptr": I32, "bt_ptr": I32},
     {"BLOCK": at.BLOCK, "BLOCK_R": at.BLOCK_R, "BLOCK_D": 128}),
    (gd._gdn_recurrent_kernel, {"g_ptr": F32, "b_ptr": F32, "cu_ptr": I64, "s0_ptr": F32, "o_ptr": F32, "sN_ptr": F32},
     {"HAS_S0": True, "BLOCK_K": 64, "BLOCK_V": gd.BLOCK_V}),
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
     {"BLOCK_N": ix.BLOCK_N, "BLOCK_H": 32, "BLOCK_D": 128}),
    (ix._select_kernel, {"key_ptr": I32, "pos_ptr": I64, "out_ptr": I64}, {"BLOCK_S": ix.BLOCK_S}),
    (sa._sparse_attention_kernel, {"bt_ptr": I64, "seq_ptr": I64, "ind_ptr": I64},
     {"BLOCK_N": sa.BLOCK_N, "BLOCK_H": sa.BLOCK_H, "BLOCK_D": sa.BLOCK_D, "BLOCK_DV": sa.BLOCK_DV}),
    (ix._index_scores_kernel, {"q_ptr": F32, "w_ptr": F32, "c_ptr": F32, "bt_ptr": I64, "seq_ptr": I64,
                               "pos_ptr": I64, "key_ptr": I32}, {"BLOCK_N": ix.BLOCK_N, "BLOCK_H": 32, "BLOCK_D": 128}),
    (sa._sparse_attention_kernel, {"q_ptr": F32, "c_ptr": F32, "o_ptr": F32, "bt_ptr": I64, "seq_ptr": I64,
                                   "ind_ptr": I64},
     {"BLOCK_N": sa.BLOCK_N, "BLOCK_H": sa.BLOCK_H, "BLOCK_D": sa.BLOCK_D, "BLOCK_DV": sa.BLOCK_DV}),
]


def _signature(fn, pointers: dict, constexprs: dict) -> dict:
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = pointers.get(name, "*bf16")
        else:
            sig[name] = "fp32" if name in ("scale", "eps", "n_float") else "i32"
    return sig


@pytest.mark.parametrize("fn, pointers, constexprs", KERNELS,
                         ids=[f"{getattr(k[0], 'fn', k[0]).__name__}-"
                              f"{'fp32' if F32 in (k[1].get('x_ptr'), k[1].get('q_ptr')) else 'bf16'}" for k in KERNELS])
def test_kernel_compiles_for_sm90(fn, pointers, constexprs):
    if not isinstance(fn, triton.runtime.jit.JITFunction):
        pytest.skip("the kernel modules were imported under the Triton interpreter in this process")
    src = ASTSource(fn=fn, signature=_signature(fn, pointers, constexprs), constexprs=constexprs)
    try:
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": False})
    except (RuntimeError, FileNotFoundError) as e:
        if "ptxas" in str(e) or "backend" in str(e).lower():
            pytest.skip(f"no CUDA backend in this triton: {e}")
        raise
    assert compiled.asm["cubin"]
    # the TF32 trap: an fp32 tl.dot without input_precision="ieee" compiles to TF32 MMAs
    # (10-bit mantissa); every dot here is meant to be exact in its operands' precision
    assert "tf32" not in compiled.asm["ptx"], "a tl.dot compiles to TF32: pass input_precision='ieee'"
