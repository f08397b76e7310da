"""HF-folder checkpoints: bitwise round trips (tied / untied / sharded), fingerprints, and
one clear error for every way a folder can fail to match the model."""

import json
import re
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from titan_rl.checkpoint import (
    INDEX_NAME,
    WEIGHTS_NAME,
    CheckpointError,
    checkpoint_fingerprint,
    load_hf_folder,
    load_state_dict_strict,
    save_hf_folder,
)
from titan_rl.models import qwen3
from titan_rl.models.options import ModelOptions
from titan_rl.registry import get_architecture

# Tiny enough that every test runs in milliseconds; two layers and GQA so every kind of
# parameter name occurs.
TINY = qwen3.Qwen3Config(
    vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=1, head_dim=32,
)
TINY_TIED = replace(TINY, tie_word_embeddings=True)


def _seed(rng) -> int:
    return int(torch.randint(0, 2**31 - 1, (1,), generator=rng))


def _model(cfg=TINY, rng=None, kernels="exact"):
    return qwen3.build(cfg, ModelOptions(kernels=kernels)).init_weights(seed=_seed(rng) if rng is not None else 0)


def _assert_same_params(a: torch.nn.Module, b: torch.nn.Module, dtype=None):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        want = sa[k] if dtype is None else sa[k].to(dtype)
        assert sb[k].dtype == want.dtype, k
        assert torch.equal(sb[k], want), k


def _rewrite_weights(folder, edit):
    """Load model.safetensors, apply `edit(dict)`, write it back."""
    sd = load_file(str(folder / WEIGHTS_NAME))
    edit(sd)
    save_file(sd, str(folder / WEIGHTS_NAME), metadata={"format": "pt"})


# -- round trips ------------------------------------------------------------------------------
@pytest.mark.parametrize("cfg", [TINY, TINY_TIED], ids=["untied", "tied"])
def test_round_trip_fp32_is_bitwise(cfg, tmp_path, rng):
    m = _model(cfg, rng)
    save_hf_folder(m, tmp_path, dtype=torch.float32)

    config = json.loads((tmp_path / "config.json").read_text())
    spec = get_architecture("qwen3")
    assert config["architectures"] == [spec.vllm_architecture]
    assert config["torch_dtype"] == "float32"
    assert qwen3.Qwen3Config.from_hf(config) == cfg

    stored = load_file(str(tmp_path / WEIGHTS_NAME))
    if cfg.tie_word_embeddings:  # like HF Qwen3-0.6B: only the embedding is written
        assert "lm_head.weight" not in stored and "model.embed_tokens.weight" in stored
        assert set(stored) == set(m.state_dict()) - {"lm_head.weight"}
    else:
        assert set(stored) == set(m.state_dict())
    assert all(t.dtype == torch.float32 and t.is_contiguous() for t in stored.values())

    loaded = load_hf_folder(tmp_path, kernels="exact", dtype=torch.float32)
    assert loaded.cfg == cfg
    _assert_same_params(m, loaded)
    if cfg.tie_word_embeddings:
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    else:
        assert loaded.lm_head.weight is not loaded.model.embed_tokens.weight

    tokens = torch.randint(0, cfg.vocab_size, (2, 9), generator=rng)
    with torch.no_grad():
        assert torch.equal(m(tokens), loaded(tokens))


@pytest.mark.parametrize("cfg", [TINY, TINY_TIED], ids=["untied", "tied"])
def test_round_trip_bf16_default_dtype_keeps_stored_dtype(cfg, tmp_path, rng):
    m = _model(cfg, rng)
    save_hf_folder(m, tmp_path)  # default: bf16 on disk
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    loaded = load_hf_folder(tmp_path, kernels="stock")  # dtype=None -> what the folder stores
    assert loaded.ops.kernels == "stock"
    _assert_same_params(m, loaded, dtype=torch.bfloat16)
    # bf16 -> fp32 is exact, so an fp32 load holds the very same values
    up = load_hf_folder(tmp_path, dtype=torch.float32)
    _assert_same_params(loaded, up, dtype=torch.float32)


def test_architecture_name_is_written(tmp_path):
    save_hf_folder(_model(), tmp_path, architecture="Qwen3ForCausalLM")
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]


@pytest.mark.parametrize("cfg", [TINY, TINY_TIED], ids=["untied", "tied"])
def test_sharded_folder_round_trip(cfg, tmp_path, rng):
    m = _model(cfg, rng)
    save_hf_folder(m, tmp_path, dtype=torch.float32, max_shard_bytes=20_000)
    shards = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(shards) > 2 and WEIGHTS_NAME not in shards
    assert all(re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", s) for s in shards)
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    assert sorted(set(index["weight_map"].values())) == shards
    _assert_same_params(m, load_hf_folder(tmp_path, dtype=torch.float32))

    # without the index every *.safetensors in the folder is read
    (tmp_path / INDEX_NAME).unlink()
    _assert_same_params(m, load_hf_folder(tmp_path, dtype=torch.float32))

    # re-saving unsharded into the same folder leaves no stale shard behind
    save_hf_folder(m, tmp_path, dtype=torch.float32)
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == [WEIGHTS_NAME]
    _assert_same_params(m, load_hf_folder(tmp_path, dtype=torch.float32))


def test_sharded_index_naming_a_missing_shard_is_an_error(tmp_path):
    save_hf_folder(_model(), tmp_path, max_shard_bytes=20_000)
    victim = sorted(tmp_path.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=re.escape(victim.name)):
        load_hf_folder(tmp_path)


def test_key_in_two_shards_is_an_error(tmp_path):
    save_hf_folder(_model(), tmp_path, max_shard_bytes=20_000)
    (tmp_path / INDEX_NAME).unlink()
    first = sorted(tmp_path.glob("model-*.safetensors"))[0]
    save_file(load_file(str(first)), str(tmp_path / "extra.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="appears in both"):
        load_hf_folder(tmp_path)


# -- fingerprints ------------------------------------------------------------------------------
@pytest.mark.parametrize("cfg", [TINY, TINY_TIED], ids=["untied", "tied"])
def test_fingerprint_matches_saved_file_and_sees_one_bit(cfg, tmp_path, rng):
    m = _model(cfg, rng)
    save_hf_folder(m, tmp_path, dtype=torch.float32)
    fp = checkpoint_fingerprint(m)
    assert re.fullmatch(r"[0-9a-f]{64}", fp)
    assert checkpoint_fingerprint(load_file(str(tmp_path / WEIGHTS_NAME))) == fp
    assert checkpoint_fingerprint(load_hf_folder(tmp_path, dtype=torch.float32)) == fp

    sd = {k: v.clone() for k, v in load_file(str(tmp_path / WEIGHTS_NAME)).items()}
    sd["model.norm.weight"].view(torch.int32)[3] ^= 1  # flip the lowest mantissa bit
    assert checkpoint_fingerprint(sd) != fp
    assert checkpoint_fingerprint({k: v.to(torch.bfloat16) for k, v in sd.items()}) != checkpoint_fingerprint(sd)
    renamed = dict(sd)
    renamed["model.norm.weight_renamed"] = renamed.pop("model.norm.weight")
    assert checkpoint_fingerprint(renamed) != checkpoint_fingerprint(sd)
    # order of insertion does not matter
    assert checkpoint_fingerprint(dict(reversed(list(sd.items())))) == checkpoint_fingerprint(sd)


# -- strict loading errors ---------------------------------------------------------------------
def test_missing_key_is_named_with_expected_shape(tmp_path):
    save_hf_folder(_model(), tmp_path)
    _rewrite_weights(tmp_path, lambda sd: sd.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError) as e:
        load_hf_folder(tmp_path)
    msg = str(e.value)
    assert "missing key model.layers.1.mlp.up_proj.weight" in msg
    assert "expected shape [48, 32]" in msg
    assert str(tmp_path) in msg


def test_untied_model_needs_lm_head(tmp_path):
    save_hf_folder(_model(), tmp_path)
    _rewrite_weights(tmp_path, lambda sd: sd.pop("lm_head.weight"))
    with pytest.raises(CheckpointError, match=r"missing key lm_head\.weight: expected shape \[64, 32\]"):
        load_hf_folder(tmp_path)


def test_unexpected_key_is_named_with_found_shape(tmp_path):
    save_hf_folder(_model(), tmp_path)
    _rewrite_weights(tmp_path, lambda sd: sd.update({"model.layers.0.self_attn.rotary.inv_freq": torch.zeros(16)}))
    with pytest.raises(CheckpointError) as e:
        load_hf_folder(tmp_path)
    msg = str(e.value)
    assert "unexpected key model.layers.0.self_attn.rotary.inv_freq: found shape [16]" in msg
    assert str(tmp_path) in msg


def test_wrong_shape_is_named_with_both_shapes(tmp_path):
    save_hf_folder(_model(), tmp_path)
    _rewrite_weights(tmp_path, lambda sd: sd.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(64, 32)}))
    with pytest.raises(CheckpointError) as e:
        load_hf_folder(tmp_path)
    assert "wrong shape for model.layers.0.self_attn.k_proj.weight: expected [32, 32], found [64, 32]" in str(e.value)


def test_all_problems_are_reported_in_one_error(tmp_path):
    save_hf_folder(_model(), tmp_path)

    def edit(sd):
        sd.pop("model.norm.weight")
        sd["bogus.weight"] = torch.zeros(2, 3)
        sd["model.layers.1.self_attn.q_norm.weight"] = torch.ones(31)

    _rewrite_weights(tmp_path, edit)
    with pytest.raises(CheckpointError) as e:
        load_hf_folder(tmp_path)
    msg = str(e.value)
    assert "(3 problems)" in msg
    assert "missing key model.norm.weight: expected shape [32]" in msg
    assert "unexpected key bogus.weight: found shape [2, 3]" in msg
    assert "wrong shape for model.layers.1.self_attn.q_norm.weight: expected [32], found [31]" in msg
    assert isinstance(e.value, ValueError)


def test_load_state_dict_strict_validates_before_copying(rng):
    m = _model(TINY, rng)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    sd = {k: torch.zeros_like(v) for k, v in m.state_dict().items()}
    sd.pop("model.embed_tokens.weight")
    sd["extra"] = torch.zeros(1)
    with pytest.raises(CheckpointError) as e:
        load_state_dict_strict(m, sd, source="vllm worker 0")
    msg = str(e.value)
    assert msg.startswith("checkpoint vllm worker 0 does not match Qwen3ForCausalLM (2 problems):")
    assert "missing key model.embed_tokens.weight" in msg and "unexpected key extra: found shape [1]" in msg
    for k, v in m.state_dict().items():  # nothing was copied
        assert torch.equal(v, before[k]), k

    # a good state dict in another dtype is cast into the model's parameters
    src = _model(TINY, rng)
    sd = {k: v.to(torch.bfloat16) for k, v in src.state_dict().items()}
    load_state_dict_strict(m, sd)
    assert m.model.norm.weight.dtype == torch.float32  # cast into the fp32 parameters
    _assert_same_params(src, m.to(torch.bfloat16), dtype=torch.bfloat16)


def test_tied_alias_may_be_absent_or_equal_but_not_different(rng):
    src = _model(TINY_TIED, rng)
    full = {k: v.clone() for k, v in src.state_dict().items()}  # state_dict lists both names
    assert "lm_head.weight" in full and "model.embed_tokens.weight" in full

    m = _model(TINY_TIED)
    load_state_dict_strict(m, {k: v for k, v in full.items() if k != "lm_head.weight"})
    _assert_same_params(src, m)
    assert m.lm_head.weight is m.model.embed_tokens.weight

    m = _model(TINY_TIED)
    load_state_dict_strict(m, full)  # both present and equal: fine
    _assert_same_params(src, m)

    bad = dict(full)
    bad["lm_head.weight"] = bad["lm_head.weight"] + 1
    with pytest.raises(CheckpointError, match=r"lm_head\.weight and model\.embed_tokens\.weight are tied"):
        load_state_dict_strict(_model(TINY_TIED), bad)

    missing_both = {k: v for k, v in full.items() if k not in ("lm_head.weight", "model.embed_tokens.weight")}
    with pytest.raises(CheckpointError, match=r"missing key model\.embed_tokens\.weight \(tied with lm_head\.weight\)"):
        load_state_dict_strict(_model(TINY_TIED), missing_both)


def test_tied_folder_with_conflicting_lm_head_is_an_error(tmp_path):
    save_hf_folder(_model(TINY_TIED), tmp_path)
    _rewrite_weights(tmp_path, lambda sd: sd.update({"lm_head.weight": sd["model.embed_tokens.weight"] * 2}))
    with pytest.raises(CheckpointError, match="hold different values"):
        load_hf_folder(tmp_path)
    # ... and an equal copy (some exports write both) loads
    _rewrite_weights(tmp_path, lambda sd: sd.update({"lm_head.weight": sd["model.embed_tokens.weight"].clone()}))
    load_hf_folder(tmp_path)


# -- config / registry errors -------------------------------------------------------------------
def test_missing_folder_and_config(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_hf_folder(tmp_path / "nope")
    save_hf_folder(_model(), tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(CheckpointError, match=re.escape(str(tmp_path / "config.json")) + " is missing"):
        load_hf_folder(tmp_path)


def test_unparsable_config(tmp_path):
    save_hf_folder(_model(), tmp_path)
    (tmp_path / "config.json").write_text('{"vocab_size": 64,')
    with pytest.raises(CheckpointError, match="config.json is not valid JSON"):
        load_hf_folder(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="must hold a JSON object"):
        load_hf_folder(tmp_path)


def test_config_missing_a_field(tmp_path):
    save_hf_folder(_model(), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["intermediate_size"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="lacks the field 'intermediate_size'"):
        load_hf_folder(tmp_path)


def test_no_weight_files(tmp_path):
    save_hf_folder(_model(), tmp_path)
    (tmp_path / WEIGHTS_NAME).unlink()
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors weight files in " + re.escape(str(tmp_path))):
        load_hf_folder(tmp_path)


def test_unsupported_head_dim_names_the_value(tmp_path):
    save_hf_folder(_model(), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["head_dim"] = 48
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"model\.head_dim = 48 is not supported") as e:
        load_hf_folder(tmp_path)
    assert str(tmp_path / "config.json") in str(e.value)
    with pytest.raises(ValueError, match="head_dim = 48"):
        qwen3.build(TINY, head_dim=48)


def test_unknown_model_name_and_flavor(tmp_path):
    save_hf_folder(_model(), tmp_path)
    with pytest.raises(ValueError, match=r"model\.name = 'llama9' is unknown; registered: \[.*'qwen3'"):
        load_hf_folder(tmp_path, arch="llama9")
    with pytest.raises(ValueError, match=r"model\.name = 'llama9' is unknown"):
        save_hf_folder(_model(), tmp_path / "out", arch="llama9")
    with pytest.raises(ValueError, match=r"model\.flavor = 'huge' is unknown for qwen3"):
        get_architecture("qwen3").build("huge")


def test_save_infers_the_architecture_from_the_config_type(tmp_path):
    class NotAConfig:
        pass

    m = _model()
    save_hf_folder(m, tmp_path, arch="qwen3")
    a = (tmp_path / "config.json").read_text()
    save_hf_folder(m, tmp_path)  # arch inferred: Qwen3Config belongs to 'qwen3'
    assert (tmp_path / "config.json").read_text() == a
    m.cfg = NotAConfig()
    with pytest.raises(ValueError, match="cannot tell which registered architecture a NotAConfig"):
        save_hf_folder(m, tmp_path / "x")


def test_unknown_kernels_mode(tmp_path):
    save_hf_folder(_model(), tmp_path)
    with pytest.raises(ValueError, match="kernels = 'fast' is not allowed"):
        load_hf_folder(tmp_path, kernels="fast")
