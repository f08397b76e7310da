"""tp_leaves in the model file: ModelOptions.tp_leaves = L > 0 makes q/k/v/gate/up run as
L fixed column blocks and o/down as L K-leaves summed by a fixed fp32 tree (the pieces
the trainer's TP layers compute on any TP degree dividing L). Checked here, single
process: batch invariance of that forward, the config round trip through config.json,
validation, and the in-process vLLM engine (built from config.json) recording the
same log-probs as the trainer-side model, bit for bit.
(TP = 2 vs this model: tests/test_titan_parallel.py.)
"""

from __future__ import annotations


import pytest
import torch

import _tp_pieces
from titan_rl.dtypes import DTYPES

from titan_rl.kernels import linear, linear_k_leaves, linear_n_blocks
from titan_rl.models.layers import Linear
from titan_rl.models.options import ModelOptions
from titan_rl.models.qwen3 import FLAVORS, Qwen3Config, build

L = 4


def _model(tp_leaves: int, seed: int, dtype=torch.float32, kernels: str = "exact"):
    return build("debug", ModelOptions(kernels=kernels, tp_leaves=tp_leaves)).init_weights(seed, 0.05).to(dtype).eval()


def _check(cfg, tp_leaves: int) -> None:
    """What building a model checks of tp_leaves against its config."""
    ModelOptions(tp_leaves=tp_leaves).validate().check_widths(cfg.validate().tp_widths())


# -- the model's leaf path ----------------------------------------------------------------

def test_layers_use_their_kind():
    m = _model(L, 0)
    layer = m.model.layers[0]
    kinds = {n: mod.kind for n, mod in m.named_modules() if isinstance(mod, Linear) and n.startswith("model.layers.0.")}
    assert kinds == {
        "model.layers.0.self_attn.q_proj": "col", "model.layers.0.self_attn.k_proj": "col",
        "model.layers.0.self_attn.v_proj": "col", "model.layers.0.self_attn.o_proj": "row",
        "model.layers.0.mlp.gate_proj": "col", "model.layers.0.mlp.up_proj": "col",
        "model.layers.0.mlp.down_proj": "row",
    }
    assert m.lm_head.kind == "plain"
    x = torch.randn(5, m.cfg.hidden_size)
    w_col, w_row = layer.self_attn.q_proj.weight, layer.mlp.down_proj.weight
    with torch.no_grad():
        assert torch.equal(layer.self_attn.q_proj(x), linear_n_blocks(x, w_col, L))
        h = torch.randn(5, m.cfg.intermediate_size)
        assert torch.equal(layer.mlp.down_proj(h), linear_k_leaves(h, w_row, L))
        assert torch.equal(m.lm_head(x), linear(x, m.lm_head.weight))


def test_leaf_primitives_have_one_definition():
    import titan_rl.kernels as K
    from titan_rl.parallel import tp_linear

    for name in ("tree_sum", "leaf_partials", "linear_k_leaves", "linear_n_blocks"):
        assert getattr(tp_linear, name) is getattr(K, name), name


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_row_alone_equals_row_in_batch(dtype, seed):
    m = _model(L, seed, DTYPES[dtype])
    g = torch.Generator().manual_seed(seed)
    tok = torch.randint(0, m.cfg.vocab_size, (5, 41), generator=g)
    with torch.no_grad():
        batch = m(tok)
        for i in (0, 3):
            assert torch.equal(m(tok[i:i + 1])[0], batch[i]), f"row {i}"
        # a shorter prefix of a row (causal): its logits are the row's first positions
        assert torch.equal(m(tok[1:2, :17])[0], batch[1, :17])
    # tp_leaves changes the reduction order: close to tp_leaves = 0 (fp32; in bf16 the
    # rounding of 4 layers of bf16 activations spreads further)
    with torch.no_grad():
        plain = _model(0, seed, DTYPES[dtype])(tok)
    if dtype == "float32":
        assert torch.allclose(batch, plain, atol=1e-4, rtol=0)
    else:
        assert (batch - plain).abs().mean() < 5e-2


def test_stock_mode_ignores_tp_leaves(seed):
    a, b = _model(L, seed, kernels="stock"), _model(0, seed, kernels="stock")
    assert a.ops.tp_leaves == 0
    tok = torch.randint(0, a.cfg.vocab_size, (2, 19), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        assert torch.equal(a(tok), b(tok))


# -- config --------------------------------------------------------------------------------

def test_config_round_trip():
    options = ModelOptions(tp_leaves=8)
    d = {**FLAVORS["small"].hf_config(), **options.to_hf()}
    assert d["titan_tp_leaves"] == 8
    assert ModelOptions.from_hf(d) == options and Qwen3Config.from_hf(d) == FLAVORS["small"]
    assert "titan_tp_leaves" not in ModelOptions().to_hf()  # only written when > 0
    assert ModelOptions.from_hf(FLAVORS["small"].hf_config()).tp_leaves == 0


def test_config_round_trip_through_a_checkpoint_folder(tmp_path):
    import json

    from titan_rl.checkpoint import load_hf_folder, save_hf_folder

    m = _model(L, 1)
    save_hf_folder(m, str(tmp_path))
    assert json.loads((tmp_path / "config.json").read_text())["titan_tp_leaves"] == L
    back = load_hf_folder(str(tmp_path), kernels="exact")
    assert back.options.tp_leaves == L and back.ops.tp_leaves == L


@pytest.mark.parametrize("value,needle", [
    (3, "model.tp_leaves = 3 must be 0 or a power of two"),
    (-2, "model.tp_leaves = -2 must be 0 or a power of two"),
    (256, "model.tp_leaves = 256 must divide num_key_value_heads*head_dim = 128"),
])
def test_validation_names_key_and_value(value, needle):
    with pytest.raises(ValueError, match=needle.replace("*", r"\*")):
        _check(FLAVORS["debug"], value)
    with pytest.raises(ValueError, match="model.tp_leaves"):
        build("debug", ModelOptions(tp_leaves=value))


def test_validation_intermediate_and_heads():
    with pytest.raises(ValueError, match=r"must divide intermediate_size = 770"):
        _check(Qwen3Config(intermediate_size=770), 4)
    with pytest.raises(ValueError, match=r"must divide num_attention_heads\*head_dim = 96"):
        _check(Qwen3Config(num_attention_heads=3, num_key_value_heads=1, head_dim=32), 64)
    with pytest.raises(ValueError, match="titan_tp_leaves|tp_leaves"):
        ModelOptions.from_hf({**FLAVORS["debug"].hf_config(), "titan_tp_leaves": 6})


# -- the rollout engine builds the same model from config.json ------------------------------

def _sampling():
    from vllm import SamplingParams

    return SamplingParams(temperature=1.0, max_tokens=6, logprobs=0, ignore_eos=True)


def _assert_trainer_equals(trainer, prompts, outs):
    """The engine's sampled log-probs are the trainer's, bit for bit: all sequences scored in one
    right-padded trainer batch (another composition than the engine's)."""
    from _vllm_helpers import _results, _trainer_logprobs

    res = _results(outs)
    for pi, (toks, mu, _) in zip(_trainer_logprobs(trainer, prompts, res), res):
        assert len(toks) == 6
        assert torch.equal(pi, mu), (pi - mu).abs().max()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_vllm_logprobs_equal_trainer_with_tp_leaves(tmp_path, dtype, seed):
    pytest.importorskip("vllm")
    from titan_rl.checkpoint import save_hf_folder
    from titan_rl.vllm.engine import EngineSettings, engine_model, make_llm

    trainer = _model(L, seed, DTYPES[dtype])
    folder = str(tmp_path / "w")
    save_hf_folder(trainer, folder, dtype=DTYPES[dtype])
    llm = make_llm(folder, EngineSettings(dtype=dtype, kv_cache_mib=64, max_model_len=256, max_num_seqs=8))
    try:
        assert engine_model(llm).options.tp_leaves == L  # built from config.json's titan_tp_leaves
        g = torch.Generator().manual_seed(seed)
        prompts = [torch.randint(2, trainer.cfg.vocab_size, (n,), generator=g).tolist() for n in (23, 2, 90, 57, 7)]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _sampling(), use_tqdm=False)
    finally:
        del llm
    _assert_trainer_equals(trainer, prompts, outs)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_vllm_hybrid_logprobs_equal_trainer_with_tp_leaves(tmp_path, dtype, seed):
    """The GDN hybrid with tp_leaves = 4 (the odd-sized model of the TP = 2 test in
    tests/test_titan_parallel.py, whose model file equals TP = 2): vLLM's hybrid wrapper at
    TP = 1, built from config.json, records the trainer's log-probs bit for bit, with
    chunked prefill cutting the longer prompts."""
    pytest.importorskip("vllm")
    from _titan_parallel_worker import hybrid_config

    from titan_rl.checkpoint import save_hf_folder
    from titan_rl.models import qwen3_hybrid
    from titan_rl.vllm.engine import EngineSettings, engine_model, make_llm

    trainer = qwen3_hybrid.build(hybrid_config(), ModelOptions(tp_leaves=L)).init_weights(seed, 0.05)
    trainer = trainer.to(DTYPES[dtype]).eval()
    folder = str(tmp_path / "w")
    save_hf_folder(trainer, folder, dtype=DTYPES[dtype])
    llm = make_llm(folder, EngineSettings(arch="qwen3_hybrid", dtype=dtype, kv_cache_mib=64, max_model_len=256,
                                          max_num_seqs=8, max_num_batched_tokens=48, enable_prefix_caching=False))
    try:
        assert engine_model(llm).options.tp_leaves == L
        g = torch.Generator().manual_seed(seed)
        prompts = [torch.randint(2, trainer.cfg.vocab_size, (n,), generator=g).tolist() for n in (23, 2, 90, 57, 7)]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _sampling(), use_tqdm=False)
    finally:
        del llm
    _assert_trainer_equals(trainer, prompts, outs)


def test_engine_tp_needs_tp_leaves():
    """The exact wrapper at tensor_parallel_size > 1 refuses tp_leaves = 0 (its log-probs
    would depend on the TP degree), naming the key, before any sharding."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from titan_rl.vllm.model import _shard_for_tp

    def vllm_config(tp):
        return SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=tp))

    from titan_rl.models.qwen3 import SPEC

    assert _shard_for_tp(_model(0, 0), SPEC, vllm_config(1)) == (0, 1, {})
    with pytest.raises(ValueError, match=r"tensor_parallel_size = 2 needs the model's tp_leaves > 0 and a multiple "
                                         r"of it \(config.json \"titan_tp_leaves\""):
        _shard_for_tp(_model(0, 0), SPEC, vllm_config(2))


# -- the backward's fixed pieces (TP ranks simulated in one process) ------------------------

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_column_blocks_backward_equals_the_ranks_subtrees(dtype, seed):
    from titan_rl.kernels import tree_sum

    _tp_pieces.column_blocks_backward_equals_the_ranks_subtrees(linear_n_blocks, tree_sum, DTYPES[dtype], seed)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_k_leaves_equal_the_ranks_subtrees(dtype, seed):
    from titan_rl.kernels import leaf_partials, tree_sum

    _tp_pieces.k_leaves_equal_the_ranks_subtrees(linear_k_leaves, leaf_partials, tree_sum, DTYPES[dtype], seed)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_head_norm_weight_gradient_equals_the_ranks_heads(dtype, seed):
    from titan_rl.kernels import rms_norm, rms_norm_heads

    _tp_pieces.head_norm_weight_gradient_equals_the_ranks_heads(rms_norm_heads, rms_norm, DTYPES[dtype], seed)
