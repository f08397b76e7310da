"""[quantization]: recipe names checked when the config is read, and every recipe but
"none" refused until the engines run it (the quantizers exist; the wiring does not)."""

import pytest

from titan_rl import config
from titan_rl.kernels.quant import QUANT_LAYERS, QUANT_RECIPES

BASE = "train_configs/rl_debug.toml"


def test_default_is_none_over_every_layer_group():
    cfg = config.load(BASE)
    assert cfg.quantization.recipe == "none"
    assert cfg.quantization.layers == list(QUANT_LAYERS)
    assert config.to_dict(cfg)["quantization"] == {"recipe": "none", "layers": list(QUANT_LAYERS)}


def test_unknown_recipe_lists_the_allowed_ones():
    with pytest.raises(config.ConfigError, match=r"^quantization.recipe = 'fp4' is not allowed; allowed: "
                                                 r"\['none', 'fp8_rowwise', 'fp8_block', 'mxfp8', 'nvfp4', "
                                                 r"'nvfp4_w4a4'\]$"):
        config.load(BASE, ["--quantization.recipe=fp4"])


@pytest.mark.parametrize("recipe", [r for r in QUANT_RECIPES if r != "none"])
def test_recipes_are_refused_until_the_engines_run_them(recipe):
    with pytest.raises(config.ConfigError, match=rf"^quantization.recipe = '{recipe}': the quantizer exists "
                                                 r"\(titan_rl.kernels.quant\) but neither engine runs it yet; "
                                                 r"allowed today: 'none'$"):
        config.load(BASE, [f"--quantization.recipe={recipe}"])


def test_unknown_layer_group_lists_the_allowed_ones():
    with pytest.raises(config.ConfigError, match=r"^quantization.layers\[1\] = 'lm_head' is not allowed; allowed: "
                                                 r"\['attention', 'mlp', 'experts', 'linear_attention'\]$"):
        config.load(BASE, ['--quantization.layers=["mlp", "lm_head"]'])
