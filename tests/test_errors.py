"""Bad input gets an error that names the key, the value and what is allowed."""

import pytest

from titan_rl import config
from titan_rl.models.qwen3 import FLAVORS, Qwen3Config, build
from titan_rl.registry import get_architecture


def test_unknown_model_name():
    with pytest.raises(ValueError, match=r"model.name = 'qwen9' is unknown; registered: \[.*'qwen3'"):
        get_architecture("qwen9")
    with pytest.raises(ValueError, match="qwen9"):
        config.load(None, ["--model.name=qwen9"])


def test_unknown_flavor():
    with pytest.raises(ValueError, match=r"model.flavor = 'huge' is unknown.*debug"):
        build("huge")
    with pytest.raises(config.ConfigError, match=r"model.flavor = 'debg'.*did you mean 'debug'"):
        config.load(None, ["--model.flavor=debg"])


def test_unsupported_head_size():
    with pytest.raises(ValueError, match=r"model.head_dim = 48 is not supported; allowed: \[32, 64"):
        Qwen3Config(head_dim=48).validate()


def test_config_unknown_key_bad_type_bad_value(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('[sampling]\ntop_pp = 0.9\n')
    with pytest.raises(config.ConfigError, match=r"unknown key 'sampling.top_pp'.*did you mean 'top_p'"):
        config.load(p)
    with pytest.raises(config.ConfigError, match=r"sampling.max_tokens = 'many': expected int"):
        config.load(None, ['--sampling.max_tokens="many"'])
    with pytest.raises(config.ConfigError, match=r"sampling.top_p = 1.5: must be in \(0, 1\]"):
        config.load(None, ["--sampling.top_p=1.5"])
    with pytest.raises(config.ConfigError, match=r"model.dtype = 'fp16' is not allowed; allowed: \['bfloat16', 'float32'\]"):
        config.load(None, ["--model.dtype=fp16"])
    with pytest.raises(config.ConfigError, match="does not exist"):
        config.load(tmp_path / "missing.toml")


def test_shipped_configs_load():
    import glob

    for name in ("debug", "small"):
        cfg = config.load(f"train_configs/{name}.toml")
        assert cfg.model.flavor == name and cfg.sampling.top_p < 1.0
        config.validate_parity(cfg)
    for path in glob.glob("train_configs/*.toml"):
        config.load(path)  # every shipped config is valid
    assert config.load("train_configs/qwen3_0.6b.toml").model.checkpoint.endswith("Qwen3-0.6B")
    assert FLAVORS["debug"].vocab_size == 1024
