"""Our Qwen3 against transformers' Qwen3ForCausalLM, from the same saved folder.

This pins the model definition (names, RoPE, q/k norms, GQA, tied embeddings, config
round trip) to the reference implementation; it does not test bitwise identity (the two
are different code), only closeness at fp32.
"""

import json
from dataclasses import replace

import pytest
import torch

try:
    import transformers  # noqa: F401
except ModuleNotFoundError as e:  # transformers is a dev extra; a broken import must fail, not skip
    if e.name != "transformers":
        raise
    pytest.skip("transformers is not installed", allow_module_level=True)
from transformers import Qwen3ForCausalLM as HFQwen3ForCausalLM

from titan_rl.checkpoint import load_hf_folder, save_hf_folder
from titan_rl.models import qwen3

# Measured max |ours - HF| over the fp32 logits (|logits| up to ~2, debug flavor, 4 layers,
# L in {7, 64, 200}, tied and untied): 'exact' 0.9e-6 .. 1.3e-6 (our batch-invariant kernels
# sum over hidden=256 / intermediate=768 / head_dim in a different order than torch's
# GEMM/SDPA: fp32 rounding, eps 1.2e-7, accumulated through a few layers), 'stock' 0.0
# (same torch ops in the same order as HF). A real modelling mistake is far above this:
# rms_norm_eps 1e-5 instead of 1e-6 already moves the logits by 1e-2, rope_theta 1e4 instead
# of 1e6 by 0.5. ATOL = 5e-5 is ~40x above the measured fp32 noise and ~200x below the
# smallest modelling error tried.
ATOL = 5e-5
LENGTHS = (7, 64)
BATCH = 3


@pytest.fixture(params=[False, True], ids=["untied", "tied"])
def folder(request, tmp_path, rng):
    cfg = replace(qwen3.FLAVORS["debug"], tie_word_embeddings=request.param)
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=rng))
    model = qwen3.build(cfg).init_weights(seed=seed)
    save_hf_folder(model, tmp_path, architecture="Qwen3ForCausalLM", dtype=torch.float32)
    return tmp_path, cfg


@pytest.mark.parametrize("kernels", ["exact", "stock"])
def test_logits_match_transformers(folder, kernels, rng):
    path, cfg = folder
    hf = HFQwen3ForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32, local_files_only=True).eval()
    # the config round trip is what transformers actually used
    assert hf.config.rope_parameters["rope_theta"] == cfg.rope_theta
    assert hf.config.rms_norm_eps == cfg.rms_norm_eps and hf.config.head_dim == cfg.head_dim
    assert hf.config.tie_word_embeddings == cfg.tie_word_embeddings
    assert (hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()) == cfg.tie_word_embeddings

    ours = load_hf_folder(path, kernels=kernels, dtype=torch.float32)
    assert ours.lm_head.weight.dtype == torch.float32
    for L in LENGTHS:
        tokens = torch.randint(0, cfg.vocab_size, (BATCH, L), generator=rng)
        with torch.no_grad():
            a = ours(tokens)
            b = hf(input_ids=tokens).logits
        assert a.shape == b.shape == (BATCH, L, cfg.vocab_size)
        assert a.dtype == b.dtype == torch.float32
        diff = (a - b).abs().max().item()
        print(f"kernels={kernels} tied={cfg.tie_word_embeddings} L={L}: max|ours-hf|={diff:.3g}")
        assert diff <= ATOL, f"kernels={kernels} L={L}: max abs diff {diff:.3g} > {ATOL}"
        # and it is not trivially close: the logits carry signal well above the tolerance
        assert b.std().item() > 1000 * ATOL


@pytest.mark.parametrize("arch", ["qwen3_5", "glm_moe_dsa"])
def test_the_published_widths_are_taken_as_they_are(arch, tmp_path):
    """`hf_reference --published` (the benchmarks' real-size folders): transformers' config at
    the smallest published model's widths reads into our config unchanged (no width refused,
    none rounded), without building the model."""
    from titan_rl.hf_reference import PUBLISHED, PUBLISHED_TIED, classes
    from titan_rl.registry import architecture_of_folder

    config_cls, model_cls, _ = classes(arch)
    d = config_cls(**PUBLISHED[arch], tie_word_embeddings=PUBLISHED_TIED[arch]).to_dict()
    d["architectures"] = [model_cls.__name__]
    (tmp_path / "config.json").write_text(json.dumps(d))
    spec = architecture_of_folder(str(tmp_path))
    ours = spec.config_from_hf(d)
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "tie_word_embeddings"):
        assert getattr(ours, key) == d[key], key
    if arch == "qwen3_5":  # Qwen3.5-0.8B
        assert (ours.hidden_size, ours.num_hidden_layers, ours.vocab_size, ours.head_dim) == (1024, 24, 248320, 256)
        assert ours.layer_types.count("full_attention") == 6
        assert (ours.linear_num_value_heads, ours.linear_key_head_dim, ours.linear_value_head_dim) == (16, 128, 128)
    else:  # GLM-5
        assert (ours.hidden_size, ours.num_hidden_layers, ours.index_topk, ours.kv_lora_rank) == (6144, 78, 2048, 512)
