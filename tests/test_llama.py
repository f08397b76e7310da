"""Llama (models/llama, on the common dense decoder) against folders transformers' own
LlamaForCausalLM writes, at odd widths (hidden 210, vocab 997, 6 heads over 2 KV heads, head_dim
32 apart from hidden / heads): close to transformers' forward, and through the parity command
(`--model.name=auto --kernels both`) exact is bitwise in fp32 and bf16 while the stock column is
vLLM's own Llama and is not."""

import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("vllm")

from titan_rl import parity  # noqa: E402
from titan_rl.checkpoint import load_hf_folder, save_hf_folder  # noqa: E402
from titan_rl.hf_reference import hf_model  # noqa: E402
from titan_rl.models import llama  # noqa: E402
from titan_rl.models.llama.config import LlamaConfig  # noqa: E402

# Our fp32 forward against transformers' (exact kernels: other summation orders, fp32 rounding
# through 4 layers; stock kernels: the same torch ops as transformers). Measured at these sizes
# (logits' std 3, max |logit| 12-18, L = 7 / 61 / 200, 2 seeds): exact 3.3e-5..3.4e-4, growing with
# L and with the logits' scale, i.e. at most 2.3e-5 of max |logit|; stock 0. A modelling mistake
# is far above: a wrong rms_norm_eps or rope_theta moved Qwen3's logits by 1e-2..0.5
# (tests/test_hf_reference.py). RTOL = 2e-4 of max |logit| is ~9x the measured worst.
RTOL = 2e-4


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("kernels", ["exact", "stock"])
def test_logits_match_transformers_llama(tmp_path, tied, kernels, seed, rng):
    hf = hf_model("llama", seed % 2**31, tied=tied, scale=0.2)
    hf.save_pretrained(tmp_path)
    ours = load_hf_folder(tmp_path, kernels=kernels, dtype=torch.float32, arch="llama")
    assert isinstance(ours, llama.LlamaForCausalLM) and ours.cfg.tie_word_embeddings == tied
    assert ours.cfg.rope_theta == 100_000.0 and ours.cfg.rms_norm_eps == 1e-5 and not ours.cfg.qk_norm
    for L in (7, 61):
        tokens = torch.randint(0, 997, (3, L), generator=rng)
        with torch.no_grad():
            a, b = ours(tokens), hf(input_ids=tokens).logits
        diff, bound = (a - b).abs().max().item(), RTOL * b.abs().max().item()
        assert diff <= bound, f"L={L}: max |ours - transformers| {diff:.3g} > {bound:.3g}"
        assert b.std().item() > 100 * bound  # the logits carry signal far above the tolerance


def test_config_json_round_trip_and_flavors(tmp_path):
    model = llama.build("debug", tie_word_embeddings=True).init_weights(seed=3)
    save_hf_folder(model, tmp_path, architecture="LlamaForCausalLM", dtype=torch.float32)
    d = json.loads((tmp_path / "config.json").read_text())
    assert d["model_type"] == "llama" and d["architectures"] == ["LlamaForCausalLM"]
    assert LlamaConfig.from_hf(d) == model.cfg
    with torch.device("meta"):
        real = llama.build("smollm2_135m")
    assert real.lm_head.weight is real.model.embed_tokens.weight
    n = sum(p.numel() for p in real.parameters())
    assert n == 134_515_008  # SmolLM2-135M's parameter count (tied embeddings counted once)


@pytest.mark.parametrize("edit, says", [
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192, "rope_theta": 500000.0}}, "rope_scaling rope type 'llama3' is not supported"),
    ({"attention_bias": True}, "attention_bias = True is not supported"),
    ({"mlp_bias": True}, "mlp_bias = True is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act = 'gelu' is not supported"),
])
def test_what_llama_does_not_compute_is_refused_in_one_line(tmp_path, capsys, monkeypatch, edit, says):
    hf_model("llama", 0).save_pretrained(tmp_path / "hf")
    cfg_path = tmp_path / "hf" / "config.json"
    d = json.loads(cfg_path.read_text())
    d.update(edit)
    cfg_path.write_text(json.dumps(d))
    capsys.readouterr()  # transformers' progress bar while writing
    monkeypatch.chdir(parity.__file__.rsplit("/titan_rl/", 1)[0])
    rc = parity.main(["--config", "train_configs/debug.toml", "--kernels", "exact", "--model.name=auto",
                      f"--model.checkpoint={tmp_path / 'hf'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert says in err[0], err[0]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_transformers_llama_folder_is_bitwise_and_stock_is_vllms_own_llama(tmp_path, dtype, seed, monkeypatch):
    monkeypatch.chdir(parity.__file__.rsplit("/titan_rl/", 1)[0])
    hf_model("llama", seed % 2**31, tied=True, scale=0.2).save_pretrained(tmp_path / "hf")
    out = tmp_path / "parity.json"
    rc = parity.main(["--config", "train_configs/debug.toml", "--kernels", "both", "--num-prompts", "6",
                      "--seed", str(seed % 1000), "--json", str(out), "--model.name=auto",
                      f"--model.checkpoint={tmp_path / 'hf'}", f"--model.dtype={dtype}",
                      "--parity.full_vocab_prompts=2"])
    assert rc == 0
    res = {r["engine"]: r for r in json.loads(out.read_text())["results"]}
    exact, stock = res["exact"], res["stock"]
    assert exact["tokens"] > 0 and exact["full_vocab_positions"] > 0
    assert exact["max_abs_dlogp"] == 0 and exact["full_vocab_max_abs_dlogp"] == 0 and exact["bitwise_fraction"] == 1
    assert exact["contract"]["differs"] == []
    assert stock["contract"]["engine"]["entries"]["op.linear"].startswith("vllm built-in")
    assert "LlamaForCausalLM" in stock["contract"]["engine"]["entries"]["op.linear"]
    assert stock["tokens"] == exact["tokens"] and stock["max_abs_dlogp"] > 0
