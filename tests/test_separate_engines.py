"""The pieces of separate placement that need no engine: the weight-transfer wire format,
the contract crossing a process boundary as its entries, the start-up refusals. The runs
themselves (torchrun, faults, off-policy steps, 2 engines with a quantized recipe) are in
tests/test_train.py, engine TP 2 on the GDN hybrid in tests/test_hybrid.py."""

import pytest
import torch

from titan_rl import config
from titan_rl.kernels.quant import QuantizedWeight
from titan_rl.vllm import weight_transfer as wt


def test_the_wire_format_gives_back_every_tensor_and_quantized_weight(rng):
    """Odd shapes, three dtypes and a quantized weight (payload + scales), packed into
    buckets smaller than some pieces, unpacked: torch.equal, dtypes and shapes kept."""
    state = {
        "a.weight": torch.randn(37, 53, generator=rng),
        "b.weight": torch.randn(3, 7, generator=rng).to(torch.bfloat16),
        "c.bias": torch.randint(0, 9, (11,), generator=rng),
        "q.weight": QuantizedWeight.of(torch.randn(32, 64, generator=rng), "fp8_rowwise"),
        "e": torch.randn(1, generator=rng),
    }
    meta, tensors, quantized = wt.pieces_of(state)
    assert [p.name for p in meta][3:5] == ["q.weight::payload", "q.weight::scale0"]
    groups = wt.buckets(meta, limit=2000)
    assert sorted(i for g in groups for i in g) == list(range(len(meta))) and len(groups) > 2
    pairs = []
    for g in groups:
        buf = wt._pack([tensors[i] for i in g])
        assert buf.numel() == sum(wt._nbytes(meta[i]) for i in g)
        pairs.extend(wt._unpack(buf, [meta[i] for i in g]))
    back = wt.assemble(iter(pairs), quantized)
    assert back.keys() == state.keys()
    for name, want in state.items():
        got = back[name]
        if isinstance(want, QuantizedWeight):
            assert got.recipe == want.recipe and got.dtype == want.dtype
            assert torch.equal(got.payload.view(torch.uint8), want.payload.view(torch.uint8))
            assert all(torch.equal(a, b) for a, b in zip(got.scales, want.scales))
            assert torch.equal(got.dense(), want.dense())
        else:
            assert got.dtype == want.dtype and torch.equal(got, want), name


def test_a_contract_sent_as_its_entries_is_the_same_contract():
    from titan_rl import contract
    from titan_rl.registry import get_architecture

    c = contract.contract_of(get_architecture("qwen3").build("debug").init_weights(0))
    back = contract.Contract.from_entries(c.entries())
    assert back == c and back.hash == c.hash


@pytest.mark.parametrize("overrides, message", [
    (["--rollout.engines=2"], r"rollout.engines = 2 needs rollout.placement = 'separate'"),
    (["--rollout.max_off_policy_steps=1"], r"rollout.max_off_policy_steps = 1 needs rollout.placement = 'separate'"),
    (["--rollout.placement=separate", "--rollout.engines=0"], r"rollout.engines = 0: must be >= 1"),
    (["--rollout.placement=separate", "--rollout.max_off_policy_steps=-1"],
     r"rollout.max_off_policy_steps = -1: allowed 0 \(synchronous\) to 8"),
    (["--rollout.placement=separate", "--rollout.max_off_policy_steps=9"],
     r"rollout.max_off_policy_steps = 9: allowed 0 \(synchronous\) to 8 \(the trainer keeps one copy"),
    (["--rollout.placement=separate", "--rollout.engine_tp=3"], r"rollout.engine_tp = 3: allowed 1 or 2"),
    (["--rollout.placement=separate", "--rollout.engine_tp=2"], r"rollout.engine_tp = 2 needs model.tp_leaves"),
    (["--rollout.placement=separate", "--rollout.engine_tp=2", "--model.tp_leaves=2",
      "--quantization.recipe=fp8_rowwise"],
     r"quantization.recipe = 'fp8_rowwise' with rollout.engine_tp = 2: a sharded weight's scales would be taken over "
     r"its shard .*; allowed: engine_tp = 1"),
    (["--rollout.placement=elsewhere"], r"rollout.placement"),
])
def test_separate_placement_keys_are_checked_at_start(overrides, message):
    with pytest.raises(config.ConfigError, match=message):
        config.load("train_configs/rl_debug.toml", overrides)


@pytest.mark.parametrize("name, flavor", [("qwen3_5", "debug_qwen35"), ("qwen3_5_moe", "debug_qwen35_moe")])
def test_qwen35_engine_tp_2_is_accepted(name, flavor):
    """Qwen3.5's TP plan (the unfused in_proj_qkv computed per rank from the whole weight):
    engine_tp = 2 passes the start checks with tp_leaves = 2 (its 6 value heads)."""
    cfg = config.load("train_configs/rl_debug_qwen35.toml", [
        "--rollout.placement=separate", "--rollout.engine_tp=2", "--model.tp_leaves=2", f"--model.name={name}",
        f"--model.flavor={flavor}"])
    assert cfg.rollout.engine_tp == 2


def test_glm5_tp_2_is_accepted():
    """GLM-5's TP plan (MLA's heads split, the latent rows, indexer and router whole), for the
    trainer and a separate engine."""
    cfg = config.load("train_configs/rl_debug_glm5.toml", ["--parallelism.tensor_parallel_degree=2",
                                                           "--model.tp_leaves=8", "--rollout.placement=separate",
                                                           "--rollout.engine_tp=2"])
    assert (cfg.parallelism.tensor_parallel_degree, cfg.rollout.engine_tp) == (2, 2)


def test_an_engine_tp_that_does_not_divide_the_heads_is_refused(tmp_path):
    from titan_rl.checkpoint import save_hf_folder
    from titan_rl.registry import get_architecture

    m = get_architecture("qwen3").build("debug", num_attention_heads=3, num_key_value_heads=1).init_weights(0)
    save_hf_folder(m, tmp_path, dtype=torch.float32, architecture="qwen3")
    with pytest.raises(config.ConfigError, match=r"rollout.engine_tp = 2 must divide the model's "
                                                 r"num_attention_heads \(3\) and num_key_value_heads \(1\)"):
        config.load("train_configs/rl_debug.toml", ["--rollout.placement=separate", "--rollout.engine_tp=2",
                                                     "--model.tp_leaves=2", f"--model.checkpoint={tmp_path}"])


@pytest.mark.parametrize("toml, overrides, message", [
    ("rl_debug_glm5.toml", ["--parallelism.tensor_parallel_degree=2", "--model.tp_leaves=16"],
     r"^model.tp_leaves = 16 must divide intermediate_size = 328$"),
    ("rl_debug_qwen35.toml", ["--model.tp_leaves=8"], r"^model.tp_leaves = 8 must divide linear_num_value_heads = 6$"),
    ("rl_debug_moe.toml", ["--model.name=qwen3_5_moe", "--model.flavor=debug_qwen35_moe", "--model.tp_leaves=8"],
     r"^model.tp_leaves = 8 must divide linear_num_value_heads = 6$"),
])
def test_the_trainers_layout_rules_are_checked_at_start(toml, overrides, message):
    """Before torchrun's ranks build anything: the model's TP plan and the widths tp_leaves
    must divide are config errors in one line, not a rank's traceback from the model build."""
    with pytest.raises(config.ConfigError, match=message):
        config.load(f"train_configs/{toml}", overrides)
