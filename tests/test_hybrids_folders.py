"""Real-hybrid folders through the command lines: `model.name = "auto"` takes the
architecture from config.json, and a bad folder or name is one line naming the key (exit 2)
for both `titan_rl.train` and `titan_rl.parity`, before any work starts."""

import json
from functools import partial

import pytest
import torch

pytest.importorskip("transformers")

from _folders import both_refuse, edited_copy  # noqa: E402
from titan_rl import config  # noqa: E402
from titan_rl.checkpoint import check_hf_folder  # noqa: E402
from titan_rl.hf_reference import hf_model, vl_model  # noqa: E402

HYBRID = "train_configs/debug_hybrid.toml"
_both_refuse = partial(both_refuse, "train_configs/rl_debug_qwen35.toml", HYBRID)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    for arch in ("qwen3_next", "qwen3_5", "qwen3_5_moe"):
        hf_model(arch, 0).save_pretrained(root / arch)
    vl_model(0).save_pretrained(root / "qwen3_5_vl")
    return root


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen3_5_vl"])
def test_auto_takes_the_architecture_from_config_json(folders, arch):
    cfg = config.load(HYBRID, ["--model.name=auto", f"--model.checkpoint={folders / arch}",
                               "--rollout.max_model_len=512"])
    config.validate(cfg)
    assert cfg.model.name == arch.removesuffix("_vl")


def test_auto_without_a_checkpoint_and_unknown_names(capsys, tmp_path, folders):
    _both_refuse(["--model.name=auto"], r"model.name = 'auto' needs model.checkpoint", capsys, tmp_path)
    _both_refuse(["--model.name=qwen9"], r"model.name = 'qwen9' is unknown; registered: \[.*'qwen3_5'.*\]",
                 capsys, tmp_path)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    _both_refuse(["--model.name=auto", f"--model.checkpoint={foreign}"],
                 r"architectures = \['GPT2LMHeadModel'\].*'Qwen3NextForCausalLM'", capsys, tmp_path)


def test_a_missing_gdn_tensor_is_named(folders, tmp_path, capsys):
    case = edited_copy(folders / "qwen3_5", tmp_path / "case", edit_tensors=lambda t: t.pop("model.layers.1.linear_attn.A_log"))
    _both_refuse(["--model.name=auto", f"--model.checkpoint={case}", "--rollout.max_model_len=512"],
                 r"missing key model.layers.1.linear_attn.A_log: expected shape \[6\]", capsys, tmp_path)


def test_layer_types_of_the_wrong_length_is_named(folders, tmp_path, capsys):
    case = edited_copy(folders / "qwen3_next", tmp_path / "case",
                 edit_config=lambda c: c.update(layer_types=c["layer_types"][:3]))
    _both_refuse(["--model.name=auto", f"--model.checkpoint={case}", "--rollout.max_model_len=512"],
                 r"config.json: layer_types = \['linear_attention', 'linear_attention', 'linear_attention'\]: needs "
                 r"num_hidden_layers = 4 entries", capsys, tmp_path)


def test_a_folder_of_vision_weights_only_is_refused(folders, tmp_path, capsys):
    case = edited_copy(folders / "qwen3_5_vl", tmp_path / "case",
                 edit_tensors=lambda t: [t.pop(k) for k in list(t) if not k.startswith("model.visual.")])
    _both_refuse(["--model.name=auto", f"--model.checkpoint={case}", "--rollout.max_model_len=512"],
                 r"case: only tensors of parts titan_rl does not load \(model.visual.\* \(21\)\)", capsys, tmp_path)


def test_a_published_qwen3_next_folder_loads_without_its_mtp_head(folders, tmp_path, capsys):
    """Published Qwen3-Next folders carry a multi-token-prediction head (`mtp.*`, not written by
    transformers' class): the trainer skips it in one line, as the engine does (one checkpoint_key)."""
    case = edited_copy(folders / "qwen3_next", tmp_path / "case",
                       edit_tensors=lambda t: t.update({"mtp.fc.weight": torch.ones(8, 16)}))
    check_hf_folder(case, arch="qwen3_next")
    assert "1 tensors the text model does not use are not loaded: mtp.fc.* (1)" in capsys.readouterr().err


def test_a_model_len_past_the_models_positions_is_named(folders, tmp_path, capsys):
    _both_refuse(["--model.name=auto", f"--model.checkpoint={folders / 'qwen3_5'}", "--rollout.max_model_len=8192"],
                 r"rollout.max_model_len = 8192 exceeds the model.s max_position_embeddings = 4096", capsys, tmp_path)
