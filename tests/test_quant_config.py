"""[quantization]: recipe names checked when the config is read; every recipe accepted on
the debug models; what cannot run (a shape that does not tile, tensor parallelism, a
per-tensor activation scale in exact mode, a stock recipe vLLM has no online form of) is
refused naming the key, the value and what is allowed."""

import pytest

from titan_rl import config
from titan_rl.kernels.quant import QUANT_LAYERS, QUANT_RECIPES

BASE = "train_configs/rl_debug.toml"


def test_default_is_none_over_every_layer_group():
    cfg = config.load(BASE)
    assert cfg.quantization.recipe == "none"
    assert cfg.quantization.layers == list(QUANT_LAYERS)
    assert config.to_dict(cfg)["quantization"] == {"recipe": "none", "layers": list(QUANT_LAYERS),
                                                   "activation_scale": "row"}


def test_unknown_recipe_lists_the_allowed_ones():
    with pytest.raises(config.ConfigError, match=r"^quantization.recipe = 'fp4' is not allowed; allowed: "
                                                 r"\['none', 'fp8_rowwise', 'fp8_block', 'mxfp8', 'nvfp4', "
                                                 r"'nvfp4_w4a4'\]$"):
        config.load(BASE, ["--quantization.recipe=fp4"])


@pytest.mark.parametrize("recipe", [r for r in QUANT_RECIPES if r != "none"])
@pytest.mark.parametrize("name, flavor", [("qwen3", "debug"), ("qwen3_moe", "debug_moe"),
                                          ("qwen3_hybrid", "debug_hybrid")])
def test_every_recipe_is_accepted_on_the_debug_models(recipe, name, flavor):
    cfg = config.load(BASE, [f"--quantization.recipe={recipe}", f"--model.name={name}", f"--model.flavor={flavor}"])
    assert cfg.quantization.recipe == recipe


def test_a_shape_that_does_not_tile_is_refused_naming_what_runs(tmp_path):
    # intermediate 88: not a multiple of 128 (fp8_block), 32 (mxfp8) or 16 (nvfp4)
    from titan_rl.checkpoint import save_hf_folder
    from titan_rl.models.qwen3 import build

    save_hf_folder(build("debug", intermediate_size=88, num_hidden_layers=1), str(tmp_path))
    with pytest.raises(config.ConfigError, match=r"^quantization.recipe = 'fp8_block' cannot run on model 'qwen3' "
                                                 r"\(.*\): fp8_block quantizes weights in blocks of 128x128 .*; allowed "
                                                 r"for this model: \['none', 'fp8_rowwise'\]$"):
        config.load(BASE, ["--quantization.recipe=fp8_block", f"--model.checkpoint={tmp_path}"])


def test_per_tensor_activation_scale_is_refused_in_exact_mode():
    with pytest.raises(config.ConfigError, match=r"^quantization.activation_scale = 'tensor': a per-tensor dynamic "
                                                 r"activation scale .* depend on its neighbours"):
        config.load(BASE, ["--quantization.recipe=fp8_rowwise", "--quantization.activation_scale=tensor"])


def test_tensor_parallelism_is_refused_with_a_recipe():
    with pytest.raises(config.ConfigError, match=r"^quantization.recipe = 'mxfp8' with "
                                                 r"parallelism.tensor_parallel_degree = 2: .*allowed: "
                                                 r"tensor_parallel_degree = 1"):
        config.load(BASE, ["--quantization.recipe=mxfp8", "--parallelism.tensor_parallel_degree=2",
                           "--model.tp_leaves=2"])


def test_stock_kernels_take_only_the_recipes_vllm_runs_online():
    assert config.load(BASE, ["--quantization.recipe=fp8_rowwise", "--model.kernels=stock"])
    with pytest.raises(config.ConfigError, match=r"^quantization.recipe = 'nvfp4' with model.kernels = 'stock': .*"
                                                 r"allowed with stock kernels: \['none', 'fp8_rowwise'\]"):
        config.load(BASE, ["--quantization.recipe=nvfp4", "--model.kernels=stock"])


def test_unknown_layer_group_lists_the_allowed_ones():
    with pytest.raises(config.ConfigError, match=r"^quantization.layers\[1\] = 'lm_head' is not allowed; allowed: "
                                                 r"\['attention', 'mlp', 'experts', 'linear_attention'\]$"):
        config.load(BASE, ['--quantization.layers=["mlp", "lm_head"]'])


def test_parity_cli_refuses_a_stock_recipe_vllm_cannot_run_before_any_engine(capsys):
    from titan_rl.parity import main

    assert main(["--config", "train_configs/debug.toml", "--kernels", "both", "--quantization.recipe=mxfp8"]) == 2
    err = capsys.readouterr().err
    assert "quantization.recipe = 'mxfp8' with --kernels both" in err and "['none', 'fp8_rowwise']" in err
