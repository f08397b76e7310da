"""The parity command on folders transformers writes for Qwen3-Next, Qwen3.5 and Qwen3.5-MoE
(`--model.name=auto`), the text classes' and Qwen3.5's published vision-language form: exact
is bitwise (sampled tokens and full-vocab rows) in fp32 and bf16 at odd sizes; the stock
column is vLLM's own implementation (its CPU GDN op, bf16 only, at the shapes it takes:
titan_rl.hf_reference --stock-shapes) or, where those ops cannot run the folder,
transformers' own decode-vs-forward pair; neither is zero."""

import json

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from titan_rl import parity  # noqa: E402
from _folders import edited_copy  # noqa: E402
from titan_rl.hf_reference import ARCHS, VL_ARCHS, hf_model, vl_model  # noqa: E402

BUILTIN = {"qwen3_next": "vllm.model_executor.models.qwen3_next.Qwen3NextForCausalLM",
           "qwen3_5": "vllm.model_executor.models.qwen3_5.Qwen3_5ForCausalLM",
           "qwen3_5_moe": "vllm.model_executor.models.qwen3_5.Qwen3_5MoeForCausalLM"}
VL_BUILTIN = {"qwen3_5": "vllm.model_executor.models.qwen3_5.Qwen3_5ForConditionalGeneration",
              "qwen3_5_moe": "vllm.model_executor.models.qwen3_5.Qwen3_5MoeForConditionalGeneration"}


def _parity(tmp_path, folder, dtype, kernels, seed, *extra):
    out = tmp_path / f"{dtype}-{kernels}.json"
    rc = parity.main(["--config", "train_configs/debug_hybrid.toml", "--kernels", kernels, "--num-prompts", "6",
                      "--seed", str(seed % 1000), "--json", str(out), "--model.name=auto",
                      f"--model.checkpoint={folder}", f"--model.dtype={dtype}", "--rollout.max_model_len=512",
                      "--rollout.max_num_seqs=8", "--parity.full_vocab_prompts=2", *extra])
    assert rc == 0
    return {r["engine"]: r for r in json.loads(out.read_text())["results"]}


@pytest.mark.parametrize("arch", VL_ARCHS)
def test_a_vision_language_folder_is_bitwise_and_stock_is_vllms_own_form_of_it(tmp_path, arch, seed, monkeypatch):
    """Qwen3.5 as it is published (transformers' Qwen3_5(Moe)ForConditionalGeneration: the text
    model under `model.language_model.`, a vision tower beside it, plus an MTP head): both
    engines read the text model by the trainer's names (the spec's checkpoint_key) and skip
    the rest, and exact is bitwise on sampled tokens and full-vocab rows; the stock column is
    vLLM's own class for this form, its vision tower left out (language_model_only)."""
    monkeypatch.chdir(parity.__file__.rsplit("/titan_rl/", 1)[0])
    vl_model(seed % 2**31, arch=arch, scale=0.2, stock_shapes=True).save_pretrained(tmp_path / "vl")
    # published folders also carry a multi-token-prediction head, which transformers' classes
    # ignore on load and do not write
    edited_copy(tmp_path / "vl", tmp_path / "hf", edit_tensors=lambda t: t.update({"mtp.fc.weight": torch.ones(8, 16)}))
    res = _parity(tmp_path, tmp_path / "hf", "bfloat16", "both", seed, "--num-prompts", "4", "--sampling.max_tokens=24")
    exact, stock = res["exact"], res["stock"]
    assert exact["tokens"] > 0 and exact["full_vocab_positions"] > 0
    assert exact["max_abs_dlogp"] == 0 and exact["full_vocab_max_abs_dlogp"] == 0 and exact["bitwise_fraction"] == 1
    assert exact["contract"]["differs"] == []
    assert stock["contract"]["engine"]["entries"]["op.gdn_recurrence"] == f"vllm built-in {VL_BUILTIN[arch]}"
    assert stock["tokens"] == exact["tokens"] and stock["max_abs_dlogp"] > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_a_transformers_folder_is_bitwise_in_fp32_at_odd_sizes(tmp_path, arch, seed, monkeypatch):
    """The issue's command as a user runs it (`--kernels both`, fp32, odd sizes): exact is
    bitwise; vLLM's CPU ops cannot run this folder, so the stock column is transformers'
    own decode-vs-forward pair, which is not."""
    monkeypatch.chdir(parity.__file__.rsplit("/titan_rl/", 1)[0])
    hf_model(arch, seed % 2**31, scale=0.2).save_pretrained(tmp_path / "hf")
    res = _parity(tmp_path, tmp_path / "hf", "float32", "both", seed)
    exact, stock = res["exact"], res["stock"]
    assert exact["tokens"] > 0 and exact["full_vocab_positions"] > 0
    assert exact["max_abs_dlogp"] == 0 and exact["full_vocab_max_abs_dlogp"] == 0 and exact["bitwise_fraction"] == 1
    assert exact["contract"]["differs"] == []
    assert stock["stock_source"].startswith("transformers decode vs forward: model dtype 'float32'")
    assert stock["tokens"] == exact["tokens"] and stock["max_abs_dlogp"] > 0 and stock["bitwise_fraction"] < 1
    assert stock["full_vocab_positions"] == exact["full_vocab_positions"]


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_exact_is_bitwise_and_stock_is_vllms_own_and_not(tmp_path, arch, seed, monkeypatch):
    monkeypatch.chdir(parity.__file__.rsplit("/titan_rl/", 1)[0])
    hf_model(arch, seed % 2**31, scale=0.2, stock_shapes=True).save_pretrained(tmp_path / "hf")
    res = _parity(tmp_path, tmp_path / "hf", "bfloat16", "both", seed)
    exact, stock = res["exact"], res["stock"]
    assert exact["max_abs_dlogp"] == 0 and exact["full_vocab_max_abs_dlogp"] == 0
    assert stock["tokens"] == exact["tokens"] > 0
    assert stock["contract"]["engine"]["entries"]["op.gdn_recurrence"] == f"vllm built-in {BUILTIN[arch]}"
    assert stock["max_abs_dlogp"] > 0 and stock["bitwise_fraction"] < 1


def test_stock_without_a_folder_is_refused_in_one_line_where_vllms_cpu_ops_cannot_run(capsys, monkeypatch):
    from titan_rl.vllm.stock_cpu import conv_takes

    monkeypatch.chdir(parity.__file__.rsplit("/titan_rl/", 1)[0])
    rc = parity.main(["--config", "train_configs/debug_hybrid.toml", "--kernels", "both", "--model.name=qwen3_next",
                      "--model.flavor=debug_qwen3_next", "--model.dtype=float32"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    for part in ("model dtype 'float32'", "(32, 16)", "hidden_size = 200"):
        assert part in err[0], err[0]
    # width 3: refused by the compiled conv (AVX512-BF16), taken by the torch conv (elsewhere)
    assert ("linear_conv_kernel_dim = 3" in err[0]) == (not conv_takes(3)), err[0]


def _vllm_gdn_takes(dk: int, dv: int, width: int) -> bool:
    """Whether vLLM's own CPU GDN path on this CPU runs these dims, called as its GDN layer
    calls it (bf16 q/k/v/beta, fp32 gate and state): the chunked delta rule, then the conv its
    layer picks here (the compiled op on AVX512-BF16, its torch functions elsewhere). An op the
    loaded library does not register (AttributeError) is a path vLLM does not run here."""
    import torch
    import vllm._custom_ops as ops
    from vllm.model_executor.layers.mamba.ops.cpu import causal_conv1d as torch_conv
    from vllm.model_executor.layers.mamba.ops.cpu.gdn_attention import is_arm_bf16

    T, H, bf = 8, 2, torch.bfloat16
    q, k, v = torch.randn(1, T, H, dk, dtype=bf), torch.randn(1, T, H, dk, dtype=bf), torch.randn(1, T, H, dv, dtype=bf)
    one, cu = torch.tensor([0], dtype=torch.int32), torch.tensor([0, T], dtype=torch.int32)
    x, w = torch.randn(T, 64, dtype=bf).t(), torch.randn(64, width, dtype=bf)  # [channels, tokens]: its layout
    try:
        ops.chunk_gated_delta_rule_cpu(q, k, v, -torch.rand(1, T, H), torch.rand(1, T, H, dtype=bf),
                                       torch.zeros(1, H, dk, dv), True, cu, False, True, one)
        if torch.cpu._is_avx512_bf16_supported() or is_arm_bf16():
            ops.causal_conv1d_fwd_cpu(x, w, None, torch.zeros(1, 64, width - 1, dtype=bf), cu, one,
                                      torch.tensor([False]), True, False)
        else:
            state = torch.zeros(1, 64, width - 1, dtype=bf)
            torch_conv.causal_conv1d_fn_cpu(x, w, None, state, cu, one, torch.tensor([False]), "silu")
            torch_conv.causal_conv1d_update_cpu(torch.randn(1, 64, dtype=bf), state, w, None, "silu", one)
    except (RuntimeError, AttributeError):
        return False
    return True


def test_the_stock_refusal_says_what_vllms_ops_refuse():
    from types import SimpleNamespace

    from titan_rl.registry import get_architecture
    from titan_rl.vllm.stock_cpu import stock_cpu_problem

    spec = get_architecture("qwen3_5")
    for dk, dv, width in [(32, 32, 4), (64, 64, 4), (128, 128, 4), (64, 128, 4), (96, 96, 4), (64, 64, 3),
                          (128, 128, 5)]:
        cfg = SimpleNamespace(linear_conv_kernel_dim=width, linear_key_head_dim=dk, linear_value_head_dim=dv,
                              hidden_size=200)
        assert (stock_cpu_problem(spec, cfg, "bfloat16") == "") == _vllm_gdn_takes(dk, dv, width), (dk, dv, width)
