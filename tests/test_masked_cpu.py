"""The AVX2-only machine's paths, run on whatever machine this is (kernels/cpu_features.py).

CI runs on the CPU kind of the day: an AVX512-BF16 EPYC takes the compiled dpbf16 forms, native
bf16 GEMMs and vLLM's AVX512-BF16 library, and would never run what an AVX2-only EPYC runs (the
fp32 forms, vLLM's AVX2 library with its torch GDN conv, which lacks ops the other registers).
Here a child process starts under `MASKED_ENV`: the kernels built for x86-64-v3, ATen and oneDNN
capped at AVX2, torch's AVX512 probes answering False. It checks that every CPU-dependent choice
is the AVX2 one, then runs the tests of those choices. On an AVX2-only machine the whole suite
already runs them natively."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from titan_rl.kernels.cpu_features import MASKED_ENV

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not torch.cpu._is_avx512_supported(),
                                reason="an AVX2-only CPU: the whole suite runs the AVX2 paths natively")

# the tests of each CPU-dependent choice: linear / LM head / attention forms and the self-check,
# the quantized GEMM's form, vLLM's op probes and its own GDN layer (stock column) on its AVX2
# library, exact engine == trainer on those forms; the GDN step's and conv's AVX2 forms, and
# lane_stable on ATen's AVX2 kernels
SUBSET = ["tests/test_kernels.py", "tests/test_quant_gemm.py", "tests/test_invariance_guard.py",
          "tests/test_gdn_kernels.py::test_the_compiled_step_is_the_torch_forms_bits",
          "tests/test_gdn_kernels.py::test_states_in_cache_rows_are_the_gathered_states_bits",
          "tests/test_gdn_kernels.py::test_the_compiled_conv_is_the_torch_forms_bits",
          "tests/test_gdn_kernels.py::test_lane_stable_rows_do_not_depend_on_slicing_size_or_threads",
          "tests/test_hybrids_parity.py::test_the_stock_refusal_says_what_vllms_ops_refuse",
          "tests/test_hybrids_parity.py::test_stock_without_a_folder_is_refused_in_one_line_where_vllms_cpu_ops_cannot_run",
          "tests/test_hybrids_parity.py::test_bf16_exact_is_bitwise_and_stock_is_vllms_own_and_not",
          # the quantized engine's AVX2 form (expanded bf16 blocks): its cells, vLLM parity, and the
          # post-sync check with a corrupted payload, scale or expanded slot
          "tests/test_quant_cells.py", "tests/test_quant_vllm.py",
          *(f"tests/test_engine_link.py::test_a_corrupted_prepared_operand_stops_the_run_naming_it[qwen3-{recipe}-{kind}]"
            for recipe, kinds in (("fp8_rowwise", ("packed_qkv", "packed_gate_up", "gemm_weight",
                                                   "packed_qkv:packed", "packed_qkv:col_scale", "packed_qkv:expanded")),
                                  ("nvfp4", ("packed_qkv", "packed_gate_up", "gemm_weight", "packed_gate_up:packed",
                                             "packed_gate_up:block_scales", "packed_gate_up:col_scale",
                                             "packed_gate_up:expanded")))
            for kind in kinds)]
# in those files but the same on every CPU kind: glibc's thresholds (titan_rl/malloc.py, 12 s)
NOT_CPU_DEPENDENT = ["tests/test_invariance_guard.py::test_glibc_keeps_freed_memory_unless_told_not_to"]

PROBE = """
import json, torch
from titan_rl.kernels import cpu_features
cpu_features.apply()
from titan_rl.kernels.selfcheck import platform_choices
from titan_rl.vllm.stock_cpu import gdn_conv_path, missing_ops
import vllm._custom_ops  # loads vLLM's library for this CPU
libs = sorted({l.split("/")[-1] for l in open("/proc/self/maps").read().split() if "/vllm/_C" in l})
print(json.dumps({**platform_choices("cpu"), "vllm_libraries": libs, "gdn_conv_path": gdn_conv_path(),
                  "missing": missing_ops(["causal_conv1d_fwd_cpu", "causal_conv1d_update_cpu_vec"])}))
"""


def _masked(args, timeout):
    env = {**os.environ, **MASKED_ENV}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_every_cpu_dependent_choice_is_the_avx2_machines():
    out = _masked(["-c", PROBE], 600)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["cpu_capability"] == "AVX2"
    # the dpbf16 forms run on AVX2 too, from FMAs (csrc/dpbf16_avx2.h): the bits, not the instructions
    assert (got["bf16_gemm"], got["lm_head"], got["quant_gemm"], got["dpbf16"]) == ("fp32", "dpbf16", "dpbf16", "avx2-fma")
    assert got["attention"].endswith("bf16 form fp32")
    assert got["vllm_libraries"] == ["_C_AVX2.abi3.so"], got["vllm_libraries"]
    assert got["gdn_conv_path"] == "torch"
    # what the AVX2 EPYC showed (shared/PLATFORM.md): this library lacks the compiled conv's ops
    # and has the torch path's; the stock refusal asks for exactly those (test_hybrids_parity.py)
    assert got["missing"] == ["causal_conv1d_fwd_cpu"]


def test_the_cpu_dependent_tests_pass_as_on_an_avx2_machine():
    deselect = [a for t in NOT_CPU_DEPENDENT for a in ("--deselect", t)]
    out = _masked(["-m", "pytest", "-q", "-p", "no:cacheprovider", *SUBSET, *deselect], 1500)
    tail = out.stdout[-4000:]
    assert out.returncode == 0, tail
    assert " passed" in tail and " failed" not in tail, tail


# The LM head and quantized GEMM outputs on fixed inputs: odd sizes, several row counts, every
# recipe through the engine's packing and the trainer's per-call preparation, operands in the
# subnormal range. Written by the process that runs this, for the other kind to compare.
DPBF16_CASES = """
import sys, torch
from titan_rl.kernels import cpu_features
cpu_features.apply()
from titan_rl.kernels.lm_head.torch_impl import lm_head_logits
from titan_rl.kernels.quant.gemm import PackedQuant, quant_linear, quantize_weight, quant_gemm_implementation
g = torch.Generator().manual_seed(7)
out = {"implementation": quant_gemm_implementation()}
for m, k, n, scale in [(1, 37, 43, 1.0), (13, 203, 997, 0.07), (70, 64, 77, 1.0), (5, 51, 40, 2.0**-63)]:
    h = (torch.randn(m, k, generator=g) * scale).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g) * scale).to(torch.bfloat16)
    out[f"head {m}x{k}x{n}"] = lm_head_logits(h, w)
for recipe in ("fp8_rowwise", "nvfp4", "nvfp4_w4a4"):
    k = 48 if recipe != "fp8_rowwise" else 45
    x = torch.randn(19, k, generator=g).to(torch.bfloat16)
    ws = [torch.randn(n, k, generator=g).to(torch.bfloat16) for n in (33, 7)]
    out[f"{recipe} trainer"] = quant_linear(x, ws, recipe)
    out[f"{recipe} engine"] = quant_linear(x[:3], PackedQuant.from_parts(recipe, [quantize_weight(w, recipe) for w in ws]))
torch.save(out, sys.argv[1])
"""


def test_the_dpbf16_forms_give_the_same_bits_on_both_cpu_kinds(tmp_path):
    """One set of bits per recipe and dtype on every CPU: the bf16 LM head and the quantized
    GEMM computed by vdpbf16ps here and by AVX2 FMAs in the masked child are equal bit for
    bit, so a run trained on one kind resumes or serves on the other without a change."""
    here, there = tmp_path / "native.pt", tmp_path / "avx2.pt"
    native = subprocess.run([sys.executable, "-c", DPBF16_CASES, str(here)], cwd=ROOT, capture_output=True, text=True,
                            timeout=600)
    assert native.returncode == 0, native.stderr[-3000:]
    masked = _masked(["-c", DPBF16_CASES, str(there)], 600)
    assert masked.returncode == 0, masked.stderr[-3000:]
    a, b = torch.load(here), torch.load(there)
    if a["implementation"] != "avx512bf16":
        pytest.skip(f"this CPU computes the dpbf16 forms by {a['implementation']}: the masked child runs the same code")
    assert b.pop("implementation") == "avx2-fma" and a.pop("implementation") == "avx512bf16"
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name].view(torch.int16 if a[name].dtype == torch.bfloat16 else torch.int32),
                           b[name].view(torch.int16 if b[name].dtype == torch.bfloat16 else torch.int32)), name
