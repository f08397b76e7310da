"""TorchTitan side, single process: CPU shims, ModelSpec, the model adapter, the K-leaf
linear, the state-dict adapter. (Distributed layouts: tests/test_titan_parallel.py.)"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from titan_rl.titan import cpu_compat

cpu_compat.apply()

from titan_rl.kernels import linear  # noqa: E402
from titan_rl.models.options import ModelOptions  # noqa: E402
from titan_rl.models.qwen3 import FLAVORS, build  # noqa: E402
from titan_rl.titan.model import TitanModel  # noqa: E402
from titan_rl.titan.spec import model_config, model_spec  # noqa: E402
from titan_rl.titan.state_dict import TitanStateDictAdapter  # noqa: E402
from titan_rl.kernels import leaf_partials, linear_k_leaves, linear_n_blocks, tree_sum  # noqa: E402

SEED = 3


def _tokens(rng, vocab, B=2, L=37):
    return torch.randint(0, vocab, (B, L), generator=rng)


# -- shims -----------------------------------------------------------------------------

def test_cpu_compat_is_idempotent_and_complete():
    cpu_compat.apply()
    cpu_compat.apply()
    import torchtitan.distributed.fsdp as tt_fsdp
    import torchtitan.distributed.utils as tt_dist_utils
    import torchtitan.tools.utils as tt_utils

    if cpu_compat.on_cpu():
        assert tt_utils.device_type == "cpu"
        assert tt_utils.device_module is torch.cpu
        assert getattr(tt_dist_utils.set_pg_timeouts, "_titan_rl_shim", False)
        assert getattr(tt_fsdp.disable_fsdp_gradient_division, "_titan_rl_shim", False)
        # torchtitan's memory monitor works on the CPU module.
        from torchtitan.components.metrics import DeviceMemoryMonitor

        mon = DeviceMemoryMonitor("cpu")
        assert mon.device_capacity > 0
        mon.get_peak_stats()


def test_cpu_compat_fixes_torchtitan_imported_first():
    """apply() after torchtitan was imported (device_type already "cuda") still works;
    torch's own device probe is left unchanged."""
    import subprocess
    import sys

    code = (
        "import torch, torchtitan.distributed.utils as du, torchtitan.tools.utils as tu\n"
        "before = tu.device_type\n"
        "from titan_rl.titan import cpu_compat; cpu_compat.apply()\n"
        "import torchtitan.components.metrics as m\n"
        "print(before, tu.device_type, du.device_type, m.device_type, du.device_module is torch.cpu,\n"
        "      torch._utils._get_available_device_type())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr[-2000:]
    if cpu_compat.on_cpu():
        assert out.stdout.split()[-6:] == ["cuda", "cpu", "cpu", "cpu", "True", "None"]


# -- ModelSpec ---------------------------------------------------------------------------

def test_model_spec_bundles_config_parallelize_and_adapter():
    from torchtitan.protocols import ModelSpec

    from titan_rl.titan.parallelize import parallelize_fn

    spec = model_spec("qwen3", "debug", ModelOptions(kernels="exact"))
    assert isinstance(spec, ModelSpec)
    assert (spec.name, spec.flavor) == ("qwen3", "debug")
    assert isinstance(spec.model, TitanModel.Config)
    assert spec.parallelize_fn is parallelize_fn
    assert spec.state_dict_adapter is TitanStateDictAdapter
    assert spec.pipelining_fn is None
    assert spec.model.to_dict()["arch"] == "qwen3"  # torchtitan logs the config as a dict
    with pytest.raises(ValueError, match="flavor"):
        model_spec("qwen3", "nope")
    with pytest.raises(ValueError, match="unknown"):
        model_spec("no_such_arch")
    with pytest.raises(ValueError, match="kernels"):
        model_spec("qwen3", "debug", ModelOptions(kernels="fast"))


@pytest.mark.parametrize("kernels", ["exact", "stock"])
def test_built_model_is_the_model_file(rng, kernels):
    """The spec's model IS the registry's model class: same names, same logits bits."""
    spec = model_spec("qwen3", "debug", ModelOptions(kernels=kernels), init_seed=SEED)
    m = spec.model.build().init_weights()
    ref = build("debug", ModelOptions(kernels=kernels)).init_weights(SEED)
    assert isinstance(m, type(ref)) and isinstance(m, TitanModel)
    m.verify_module_protocol()
    assert [n for n, _ in m.named_parameters()] == [n for n, _ in ref.named_parameters()]
    tok = _tokens(rng, ref.cfg.vocab_size)
    with torch.no_grad():
        assert torch.equal(m(tok), ref(tok))
        # torchtitan passes positions from its dataloader: 0..L-1 per row is accepted.
        pos = torch.arange(tok.shape[1]).expand_as(tok)
        assert torch.equal(m(tok, positions=pos), ref(tok))
        with pytest.raises(ValueError):
            m(tok, positions=pos + 1)


def test_meta_build_then_init_matches_eager_and_keeps_ties(rng):
    """TorchTitan's order: build on meta, to_empty, init_weights(buffer_device=...)."""
    tied = replace(FLAVORS["debug"], tie_word_embeddings=True)
    for cfg in (FLAVORS["debug"], tied):
        mc = model_config("qwen3", model_config=cfg, init_seed=SEED)
        with torch.device("meta"):
            m = mc.build()
        m.to_empty(device="cpu")
        m.init_weights(buffer_device=None)
        ref = build(cfg).init_weights(SEED)
        tok = _tokens(rng, cfg.vocab_size)
        with torch.no_grad():
            assert torch.equal(m(tok), ref(tok))
        if cfg.tie_word_embeddings:
            assert m.lm_head.weight is m.model.embed_tokens.weight


def test_update_from_config_and_flops():
    from torchtitan.config import ParallelismConfig

    mc = model_config("qwen3", "debug")
    ok = SimpleNamespace(training=SimpleNamespace(seq_len=128), parallelism=ParallelismConfig(),
                         compile=SimpleNamespace(enable=False))
    mc.update_from_config(config=ok)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        mc.update_from_config(config=replace_ns(ok, training=SimpleNamespace(seq_len=10**6)))
    with pytest.raises(ValueError, match="num_key_value_heads"):  # debug has 2 KV heads
        mc.update_from_config(config=replace_ns(ok, parallelism=ParallelismConfig(tensor_parallel_degree=4)))
    with pytest.raises(ValueError, match="compile"):
        mc.update_from_config(config=replace_ns(ok, compile=SimpleNamespace(enable=True)))
    with pytest.raises(ValueError, match="tp_leaves"):
        model_config("qwen3", "debug", ModelOptions(tp_leaves=1)).update_from_config(
            config=replace_ns(ok, parallelism=ParallelismConfig(tensor_parallel_degree=2)))
    with torch.device("meta"):
        m = mc.build()
    n, flops = mc.get_nparams_and_flops(m, 128)
    assert n == sum(p.numel() for p in m.parameters())
    assert flops > 6 * (n - m.model.embed_tokens.weight.numel())


def replace_ns(ns, **kw):
    return SimpleNamespace(**{**vars(ns), **kw})


# -- the K-leaf linear (the TP-invariant reduction) -------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("K,N", [(256, 256), (768, 256), (1024, 96)])
def test_leaf_tree_is_the_same_bits_for_every_tp_split(rng, dtype, K, N):
    """Emulates TP = 1, 2, 4, 8 in one process: rank r owns K-share r, sums its subtree,
    and the subtree sums go through the same tree: identical to linear_k_leaves."""
    x = torch.randn(45, K, generator=rng).to(dtype)
    w = (torch.randn(N, K, generator=rng) * 0.05).to(dtype)
    want = linear_k_leaves(x, w, 8)
    assert want.dtype == dtype
    ref = linear(x.float(), w.float())
    assert torch.allclose(want.float(), ref, atol=5e-2 if dtype == torch.bfloat16 else 1e-4)
    for t in (1, 2, 4, 8):
        ks = K // t
        subtrees = [tree_sum(leaf_partials(x[:, r * ks:(r + 1) * ks].contiguous(),
                                           w[:, r * ks:(r + 1) * ks].contiguous(), 8 // t))
                    for r in range(t)]
        got = tree_sum(torch.stack(subtrees)).to(dtype)
        assert torch.equal(got, want), f"TP={t}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("K,N", [(256, 768), (1024, 1024), (2048, 2048)])
def test_column_blocks_are_the_same_bits_for_every_tp_split(rng, dtype, K, N):
    """Emulates column-parallel TP = 1, 2, 4, 8: rank r's columns from its own weight
    rows, as n_blocks/t blocks == the same columns of linear_n_blocks on the full weight.
    (The plain kernel is not: its bits depend on N at some sizes, e.g. fp32 K=1024
    N=1024 / 8 with 1 thread, bf16 K=2048 with 2 threads.)"""
    x = torch.randn(45, K, generator=rng).to(dtype)
    w = (torch.randn(N, K, generator=rng) * 0.05).to(dtype)
    want = linear_n_blocks(x, w, 8)
    assert torch.equal(linear_n_blocks(x, w, 1), linear(x, w))
    for t in (1, 2, 4, 8):
        ns = N // t
        got = torch.cat([linear_n_blocks(x, w[r * ns:(r + 1) * ns], 8 // t) for r in range(t)], -1)
        assert torch.equal(got, want), f"TP={t}"


def test_leaf_tree_rows_are_batch_invariant(rng):
    x = torch.randn(70, 256, generator=rng)
    w = torch.randn(128, 256, generator=rng) * 0.05
    full = linear_k_leaves(x, w, 8)
    for m in (1, 3, 64, 65):
        assert torch.equal(linear_k_leaves(x[:m], w, 8), full[:m])


def test_leaf_linear_validation():
    x, w = torch.randn(4, 96), torch.randn(8, 96)
    with pytest.raises(ValueError, match="power of two"):
        linear_k_leaves(x, w, 3)
    with pytest.raises(ValueError, match="divisible"):
        linear_k_leaves(torch.randn(4, 100), torch.randn(8, 100), 8)
    with pytest.raises(ValueError, match="divisible"):
        linear_n_blocks(torch.randn(4, 96), torch.randn(100, 96), 8)


def test_tp_leaves_goes_into_the_model_file(rng):
    """TitanModel.Config(options=ModelOptions(tp_leaves=8)) builds the model file with those
    options: no re-classing, the same bits as the model file built directly (what the
    rollout engine builds), and close to (not equal to) tp_leaves=0 (another reduction order)."""
    from titan_rl.models.layers import Linear

    m = model_config("qwen3", "debug", ModelOptions(tp_leaves=8), init_seed=SEED).build().init_weights()
    assert m.options.tp_leaves == 8 and m.ops.tp_leaves == 8
    direct = build("debug", ModelOptions(tp_leaves=8)).init_weights(SEED)
    ref = build("debug").init_weights(SEED)
    layer = m.model.layers[0]
    for lin, kind in ((layer.self_attn.o_proj, "row"), (layer.mlp.down_proj, "row"),
                      (layer.self_attn.q_proj, "col"), (layer.self_attn.k_proj, "col"),
                      (layer.self_attn.v_proj, "col"), (layer.mlp.gate_proj, "col"),
                      (layer.mlp.up_proj, "col"), (m.lm_head, "plain")):
        assert type(lin) is Linear and lin.kind == kind
    assert [n for n, _ in m.named_parameters()] == [n for n, _ in ref.named_parameters()]
    tok = _tokens(rng, ref.cfg.vocab_size)
    with torch.no_grad():
        a, b, c = m(tok), ref(tok), direct(tok)
    assert torch.equal(a, c)
    assert not torch.equal(a, b) and torch.allclose(a, b, atol=1e-4, rtol=0)
    # gradients flow through the leaves
    a2 = m(tok)
    a2.float().square().mean().backward()
    assert m.model.layers[0].mlp.down_proj.weight.grad.abs().sum() > 0


def test_model_options_travel_unchanged(tmp_path):
    """One ModelOptions from the TOML config to the trainer's Ops, through config.json to
    the engine's: never copied field by field, never re-derived."""
    from titan_rl import config
    from titan_rl.checkpoint import load_hf_folder, save_hf_folder
    from titan_rl.titan.build import build_titan_config

    cfg = config.load(None, ["--model.tp_leaves=8", "--quantization.recipe=\"fp8_rowwise\"",
                             "--quantization.layers=[\"mlp\"]"])
    options = cfg.model_options()
    assert (options.tp_leaves, options.quantization.recipe, options.quantization.layers) == (8, "fp8_rowwise", ("mlp",))
    spec = build_titan_config(cfg, str(tmp_path / "run")).model_spec
    assert spec.model.options == options
    m = spec.model.build()
    assert m.options == options and m.ops.options == options
    save_hf_folder(build("debug", options).init_weights(SEED), tmp_path / "w")
    assert load_hf_folder(tmp_path / "w").options == options
    with pytest.raises(ValueError, match="tp_leaves = 3"):
        model_config("qwen3", "debug", ModelOptions(tp_leaves=3))


# -- state-dict adapter --------------------------------------------------------------------

def _adapter(cfg):
    return TitanStateDictAdapter(model_config("qwen3", model_config=cfg), None)


def test_state_dict_adapter_identity_round_trip():
    m = build("debug").init_weights(SEED)
    sd = m.state_dict()
    ad = _adapter(FLAVORS["debug"])
    hf = ad.to_hf(sd)
    assert list(hf) == list(sd)
    assert all(hf[k] is sd[k] for k in sd)
    back = ad.from_hf(dict(hf, **{"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(3)}))
    assert list(back) == list(sd)


def test_state_dict_adapter_tied_embeddings_through_safetensors_and_dcp(tmp_path, rng):
    """HF folders of tied models have no lm_head.weight: to_hf drops it, from_hf restores
    it; TorchTitan's HF load path (to_hf template -> DCP read -> from_hf) reproduces the
    model bit for bit."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    cfg = replace(FLAVORS["debug"], tie_word_embeddings=True)
    ad = _adapter(cfg)
    m = build(cfg).init_weights(SEED)
    hf = ad.to_hf(m.state_dict())
    assert "lm_head.weight" not in hf and "model.embed_tokens.weight" in hf
    save_file({k: v.contiguous() for k, v in hf.items()}, str(tmp_path / "model.safetensors"))

    fresh = build(cfg).init_weights(SEED + 1)
    template = ad.to_hf(fresh.state_dict())
    dcp.load(template, storage_reader=ad.get_hf_storage_reader(str(tmp_path)))
    sd = ad.from_hf(template)
    assert sd["lm_head.weight"] is sd["model.embed_tokens.weight"]
    fresh.load_state_dict(sd, strict=True)
    tok = _tokens(rng, cfg.vocab_size)
    with torch.no_grad():
        assert torch.equal(fresh(tok), m(tok))
    with pytest.raises(KeyError):
        ad.from_hf({"model.norm.weight": torch.ones(2)})
