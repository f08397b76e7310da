"""qwen3_hybrid (GDN linear attention 3 : 1 full attention): the model against a plain
fp64 reference, trainer invariance, trainer log-probs == vLLM sampler log-probs bitwise
(torch.equal; bf16 and fp32) with the recurrent state in vLLM's state cache, an RL run
with mismatch 0 (and the same run with a separate engine at TP 2: the same metrics lines; on
Qwen3.5 too), and config errors.

One vLLM engine per dtype, prefix caching on (mamba cache mode "align"), chunked prefill
with a 64-token budget (long prompts split across steps, mixed with decodes), block_size
32 requested (vLLM raises it so an attention page holds a GDN state page: 160 tokens in
bf16, 96 in fp32). It draws from the engine's seeded RNG (per-request seeds cannot be
combined with chunked prefill on vLLM 0.32's CPU runner), so "alone vs in a batch" uses
greedy decoding: the same tokens and log-prob bits either way.
"""

import json
import math
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from titan_rl.dtypes import DTYPES
import torch.nn.functional as F

from titan_rl.kernels.gdn import causal_conv1d_reference, gdn_reference
from titan_rl.models.common.gdn import FreshState
from titan_rl.models.qwen3_hybrid import FLAVORS, Qwen3HybridConfig, build
from titan_rl.models.options import ModelOptions

import _zygote



# -- the model ---------------------------------------------------------------------------

class RecordingState:
    """LinearState with given initial states (None = zeros) that records what is stored."""

    def __init__(self, cu, initial=None):
        self.cu_seqlens, self._initial, self.stored = cu, initial or {}, {}

    def initial(self, i):
        return self._initial.get(i, (None, None))

    def store(self, i, conv, rec):
        self.stored[i] = (conv, rec)


def _reference_gdn(layer, x, cu, conv0, rec0):
    """The GDN layer's math in fp64 with plain torch and the kernels' fp64 references."""
    hk, hv, dk, dv, r = layer.hk, layer.hv, layer.dk, layer.dv, layer.r
    T = x.shape[0]
    xd = x.double()
    qkvz = (xd @ layer.in_proj_qkvz.weight.double().T).view(T, hk, 2 * dk + 2 * r * dv)
    q, k, v, z = qkvz.split([dk, dk, r * dv, r * dv], -1)
    b, a = (xd @ layer.in_proj_ba.weight.double().T).view(T, hk, 2 * r).split([r, r], -1)
    mixed = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], -1)
    y, conv1 = causal_conv1d_reference(mixed, layer.conv1d.weight.double(), cu, conv0)
    q, k, v = F.silu(y).split([hk * dk, hk * dk, hv * dv], -1)
    q, k = (t.reshape(T, hk, dk) / torch.sqrt((t.reshape(T, hk, dk) ** 2).sum(-1, keepdim=True) + 1e-6) for t in (q, k))
    beta = torch.sigmoid(b.reshape(T, hv))
    g = -torch.exp(layer.A_log.double()) * F.softplus(a.reshape(T, hv) + layer.dt_bias.double())
    o, rec1 = gdn_reference(q, k, v.reshape(T, hv, dv), g, beta, cu, rec0, 1.0 / math.sqrt(dk))
    o = o * torch.rsqrt((o ** 2).mean(-1, keepdim=True) + layer.norm.eps) * layer.norm.weight.double()
    o = o * F.silu(z.reshape(T, hv, dv))
    return o.reshape(T, -1) @ layer.out_proj.weight.double().T, conv1, rec1


def test_gdn_layer_matches_fp64_reference(rng):
    """fp32 model vs the same math in fp64, with carried-in states. Tolerance 2e-5 absolute
    on outputs of size ~1e-1..1 and on the states: fp32 rounding (~1e-7 relative) through
    projections of K = 256 and ~70 recurrence steps stays below 1e-5 here; a wrong gate,
    layout or state hand-off is off by 1e-2 or more."""
    m = build("debug_hybrid").init_weights(int(torch.randint(0, 2**31, (1,), generator=rng)), 0.05)
    layer = m.model.layers[0].linear_attn
    cfg = m.cfg
    cu = torch.tensor([0, 9, 10, 40, 73])
    N = cu.numel() - 1
    C, K1 = cfg.linear_state_shapes()[0]
    conv0 = torch.randn(N, C, K1, generator=rng)
    rec0 = 0.3 * torch.randn(N, *cfg.linear_state_shapes()[1], generator=rng)
    x = torch.randn(int(cu[-1]), cfg.hidden_size, generator=rng)
    st = RecordingState(cu, {0: (conv0, rec0)})
    with torch.no_grad():
        out = layer(x, st)
        ref, conv1, rec1 = _reference_gdn(layer, x, cu, conv0.double(), rec0.double())
    conv_got, rec_got = st.stored[0]
    assert conv_got.dtype == rec_got.dtype == torch.float32
    for got, want in ((out, ref), (conv_got, conv1), (rec_got, rec1)):
        err = (got.double() - want).abs().max().item()
        assert err < 2e-5, err
    assert ref.abs().max() > 0.05  # the comparison is not between two near-zero tensors


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_layer_split_and_batch_invariance(rng, dtype):
    """One pass == the same tokens in two calls with the state handed over (what the
    engine does across chunked prefill and decode), and a sequence alone == in a batch."""
    m = build("debug_hybrid").init_weights(int(torch.randint(0, 2**31, (1,), generator=rng)), 0.05)
    m = m.to(DTYPES[dtype])
    layer = m.model.layers[1].linear_attn
    x = torch.randn(80, m.cfg.hidden_size, generator=rng).to(DTYPES[dtype])
    with torch.no_grad():
        whole = RecordingState(torch.tensor([0, 50, 80]))
        out = layer(x, whole)
        alone = layer(x[50:], RecordingState(torch.tensor([0, 30])))
        assert torch.equal(alone, out[50:])
        for cut in (1, 3, 17, 49):  # the first sequence in two calls; the second one decodes a token
            first = RecordingState(torch.tensor([0, cut]))
            a = layer(x[:cut], first)
            conv, rec = first.stored[1]
            second = RecordingState(torch.tensor([0, 50 - cut]), {1: (conv, rec)})
            b = layer(x[cut:50], second)
            assert torch.equal(torch.cat([a, b]), out[:50]), cut
            assert torch.equal(second.stored[1][0], whole.stored[1][0][:1])
            assert torch.equal(second.stored[1][1], whole.stored[1][1][:1])


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_trainer_rows_are_batch_and_prefix_invariant(rng, dtype):
    m = build("debug_hybrid").init_weights(int(torch.randint(0, 2**31, (1,), generator=rng)), 0.05)
    m = m.to(DTYPES[dtype]).eval()
    toks = torch.randint(2, 1024, (5, 41), generator=rng)
    with torch.no_grad():
        batch = m(toks)
        assert torch.equal(m(toks[3:4]), batch[3:4])
        assert torch.equal(m(toks[2:3, :17]), batch[2:3, :17])


def test_stock_mode_is_close_not_exact(rng):
    """kernels='stock' (plain torch, chunkwise gdn_chunked): the same function up to fp32
    rounding, not the same bits. Measured over 600 weight seeds, max |a - b| / max |a|:
    median 4.7e-6, max 3.9e-5 (absolute: median 1.7e-5, max 1.4e-4; the chunkwise form's
    triangular solve amplifies rounding on some draws, so an absolute 1e-4 failed by chance).
    Tolerance 1e-3 relative: 25x the worst draw seen."""
    exact = build("debug_hybrid").init_weights(int(torch.randint(0, 2**31, (1,), generator=rng)), 0.05)
    stock = build("debug_hybrid", ModelOptions(kernels="stock"))
    stock.load_state_dict(exact.state_dict())
    toks = torch.randint(2, 1024, (2, 50), generator=rng)
    with torch.no_grad():
        a, b = exact(toks), stock(toks)
    assert not torch.equal(a, b)
    assert (a - b).abs().max() <= 1e-3 * a.abs().max()


def test_fresh_state_from_positions():
    L = 7
    st = FreshState.from_positions(torch.arange(L).repeat(3))
    assert st.cu_seqlens.tolist() == [0, 7, 14, 21] and st.cu_seqlens.dtype == torch.int64
    assert FreshState.from_positions(torch.tensor([5, 6, 0, 1])).cu_seqlens.tolist() == [0, 2, 4]


def test_flavors_and_names():
    m = build("debug_hybrid")
    n = sum(p.numel() for p in m.parameters())
    assert 3e6 < n < 5e6
    assert [layer.is_full_attention for layer in m.model.layers] == [False, False, False, True]
    names = {k for k, _ in m.named_parameters()}
    for suffix in ("in_proj_qkvz.weight", "in_proj_ba.weight", "conv1d.weight", "out_proj.weight", "dt_bias",
                   "A_log", "norm.weight"):
        assert f"model.layers.0.linear_attn.{suffix}" in names
    assert "model.layers.3.self_attn.q_proj.weight" in names and "model.layers.0.self_attn.q_proj.weight" not in names
    assert m.model.layers[0].linear_attn.conv1d.weight.shape == (512, 1, 4)
    m.init_weights(0)
    decay = torch.exp(-torch.exp(m.model.layers[0].linear_attn.A_log) * F.softplus(m.model.layers[0].linear_attn.dt_bias))
    assert 0.1 < decay.min() and decay.max() < 1.0  # a useful range, not A_log ~ 0
    small = FLAVORS["small_hybrid"]
    assert small.layer_types.count("full_attention") == 2 and small.num_hidden_layers == 10
    cfg = FLAVORS["debug_hybrid"]
    assert Qwen3HybridConfig.from_hf(cfg.hf_config()) == cfg


# -- config errors -------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, match", [
    (dict(linear_num_key_heads=4, linear_num_value_heads=6),
     r"model.linear_num_value_heads = 6 must be a multiple of model.linear_num_key_heads = 4"),
    (dict(linear_key_head_dim=48), r"model.linear_key_head_dim = 48 is not supported; allowed: \[16, 32"),
    (dict(linear_value_head_dim=512), r"model.linear_value_head_dim = 512 is not supported"),
    (dict(linear_conv_kernel_dim=1), r"model.linear_conv_kernel_dim = 1 is not supported; allowed: 2..8"),
    (dict(full_attention_interval=1), r"model.full_attention_interval = 1 must be in 2..num_hidden_layers \(4\)"),
    (dict(full_attention_interval=8), r"model.full_attention_interval = 8 must be in 2..num_hidden_layers"),
    (dict(tp_leaves=16), r"model.tp_leaves = 16 must divide in_proj_ba \(2\*linear_num_value_heads\) = 8"),
    (dict(tp_leaves=64, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=1,
          linear_num_value_heads=2), r"model.tp_leaves = 64 must divide in_proj_qkvz .* = 96"),
    (dict(linear_num_key_heads=0), r"model.linear_num_key_heads = 0 must be >= 1"),
])
def test_bad_config_errors_name_the_key(overrides, match):
    options = ModelOptions(tp_leaves=overrides.pop("tp_leaves", 0))
    with pytest.raises(ValueError, match=match):
        build("debug_hybrid", options, **overrides)


def test_other_errors():
    with pytest.raises(ValueError, match=r"model.flavor = 'debug' is unknown for qwen3_hybrid; allowed"):
        build("debug")
    d = FLAVORS["debug_hybrid"].hf_config()
    bad = {k: v for k, v in d.items() if k != "linear_num_value_heads"}
    with pytest.raises(ValueError, match=r"lacks the hybrid keys \['linear_num_value_heads'\]"):
        Qwen3HybridConfig.from_hf(bad)
    with pytest.raises(ValueError, match="layer_types"):
        Qwen3HybridConfig.from_hf(dict(d, layer_types=["linear_attention"] * 4))
    from titan_rl.models.qwen3_hybrid import SPEC

    with pytest.raises(ValueError, match=r"tensor_parallel_degree = 2 must divide .*linear_num_key_heads \(1\)"):
        SPEC.tp_plan.check_degree(replace(FLAVORS["debug_hybrid"], linear_num_key_heads=1), 2, 8)


def test_config_accepts_the_hybrid():
    from titan_rl import config

    for path in ("train_configs/debug_hybrid.toml", "train_configs/rl_debug_hybrid.toml"):
        cfg = config.load(os.path.join(os.path.dirname(__file__), "..", path), [])
        assert (cfg.model.name, cfg.model.flavor) == ("qwen3_hybrid", "debug_hybrid")
    with pytest.raises(config.ConfigError, match="debug_hybrid"):
        config.load(None, ['--model.name="qwen3_hybrid"', '--model.flavor="debug_hybrd"'])


# -- vLLM: trainer log-probs == sampler log-probs --------------------------------------------

from _vllm_helpers import _gen, _prompts, _trainer_logprobs, random_checkpoint  # noqa: E402
from vllm import SamplingParams  # noqa: E402

from titan_rl.vllm.engine import EngineSettings, engine_model, make_llm, update_weights  # noqa: E402
from titan_rl.vllm.hybrid import TitanHybridForCausalLM  # noqa: E402


@pytest.fixture(scope="module", params=["bfloat16", "float32"])
def setup(request, tmp_path_factory):
    dtype = request.param
    folder, trainer = random_checkpoint(tmp_path_factory, lambda seed: build("debug_hybrid").init_weights(seed, 0.05),
                                        dtype, arch="qwen3_hybrid")
    llm = make_llm(folder, EngineSettings(arch="qwen3_hybrid", dtype=dtype, kv_cache_mib=64, max_model_len=512,
                                          max_num_seqs=8, max_num_batched_tokens=64, enable_prefix_caching=True,
                                          block_size=32))
    yield llm, trainer, dtype
    del llm


def _greedy(llm, prompts, max_tokens=12):
    p = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": x} for x in prompts], p, use_tqdm=False)
    return [(list(o.outputs[0].token_ids),
             torch.tensor([lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)],
                          dtype=torch.float64), o.num_cached_tokens) for o in outs]


def _assert_trainer_equals_sampler(trainer, prompts, res):
    for pi, (toks, mu, _) in zip(_trainer_logprobs(trainer, prompts, res), res):
        assert len(toks) == len(mu) > 0
        assert torch.equal(pi, mu), (pi - mu).abs().max()


def test_engine_is_the_hybrid_wrapper_with_align_state_cache(setup):
    llm, trainer, _ = setup
    cc = llm.llm_engine.vllm_config.cache_config
    assert cc.enable_prefix_caching and cc.mamba_cache_mode == "align"
    assert cc.mamba_block_size == cc.block_size >= 32 and cc.block_size % 32 == 0
    model = engine_model(llm)
    assert isinstance(model, TitanHybridForCausalLM)
    assert sorted(model.attn) == ["3"] and sorted(model.linear_state) == ["0", "1", "2"]
    conv, rec = model.linear_state["0"].kv_cache
    assert conv.dtype == rec.dtype == torch.float32 and rec.shape[1:] == (4, 64, 64) and conv.shape[1:] == (512, 3)
    names = {n for n, _ in model.named_parameters() if not n.startswith("attn.")}
    assert names == {n for n, _ in trainer.named_parameters()}


def test_alone_vs_batch_of_mixed_lengths(setup, rng):
    llm, trainer, _ = setup
    prompts = _prompts(rng, [37, 1, 151, 9, 70])  # 151/70 span several 64-token prefill chunks; a 1-token prompt
    alone = _greedy(llm, prompts[:1], max_tokens=6)[0]
    batch = _greedy(llm, prompts, max_tokens=6)
    assert batch[0][0] == alone[0]
    assert torch.equal(batch[0][1], alone[1])
    _assert_trainer_equals_sampler(trainer, prompts, batch)


def test_chunked_prefill_and_every_decode_position(setup, rng):
    llm, trainer, _ = setup
    block = llm.llm_engine.vllm_config.cache_config.block_size
    # split at 64-token budgets, mixed with decodes; the last one decodes across a block
    # boundary at its 6th token (align mode moves its running state to the next block's page there)
    prompts = _prompts(rng, [200, 65, 2, 63, block - 5])
    res = _gen(llm, prompts, max_tokens=8)
    _assert_trainer_equals_sampler(trainer, prompts, res)


def test_prefix_cache_hits_restore_the_state(setup, rng):
    llm, trainer, _ = setup
    block = llm.llm_engine.vllm_config.cache_config.block_size
    shared = _prompts(rng, [block + 40])[0]
    prompts = [shared + _prompts(rng, [5])[0], shared + _prompts(rng, [40])[0]]
    _gen(llm, prompts[:1], max_tokens=1)  # fills the cache (KV and the GDN state at the block boundary)
    res = _gen(llm, prompts, max_tokens=4)
    assert res[0][2] >= block and res[1][2] >= block, f"expected prefix-cache hits, got {[r[2] for r in res]}"
    _assert_trainer_equals_sampler(trainer, prompts, res)


def test_after_weight_update_states_are_dropped(setup, rng):
    llm, trainer, dtype = setup
    block = llm.llm_engine.vllm_config.cache_config.block_size
    prompts = _prompts(rng, [block + 20, 90, 6])
    before = _greedy(llm, prompts, max_tokens=6)
    assert _greedy(llm, prompts[:1], max_tokens=1)[0][2] >= block  # cached under the old weights
    new = {k: v + 0.02 * torch.randn(v.shape, generator=rng).to(v.dtype) for k, v in trainer.state_dict().items()}
    model_after = build("debug_hybrid").to(DTYPES[dtype]).eval()
    model_after.load_state_dict(new)
    update_weights(llm, new)
    after = _greedy(llm, prompts, max_tokens=6)
    assert after[0][2] == 0, "prefix cache (KV and recurrent state) must be dropped after a weight update"
    assert any(not torch.equal(a[1], b[1]) for a, b in zip(before, after)), "weights did not change the engine"
    _assert_trainer_equals_sampler(model_after, prompts, after)
    again = _gen(llm, prompts, max_tokens=4)  # now a hit, under the new weights
    assert again[0][2] >= block
    _assert_trainer_equals_sampler(model_after, prompts, again)
    update_weights(llm, trainer.state_dict())  # restore for other tests


def test_stock_engine_is_refused_for_the_hybrid(tmp_path):
    with pytest.raises(ValueError, match=r"kernels = 'stock' is not available for 'qwen3_hybrid'"):
        make_llm(str(tmp_path), EngineSettings(arch="qwen3_hybrid", kernels="stock"))


# -- RL on the built-in task ----------------------------------------------------------------

# tp_leaves = 2: the leaf tree an engine at TP 2 computes (the separate run below compares with it)
HYBRID_RL = ["--config", "train_configs/rl_debug_hybrid.toml", "--training.steps=4", "--algorithm.sft_steps=2",
             "--algorithm.prompts_per_step=4", "--algorithm.group_size=4", "--algorithm.sft_batch=16",
             "--lr_scheduler.warmup_steps=1", "--checkpoint.enable=false", "--model.tp_leaves=2"]


# Qwen3.5 (unfused GDN projections; 6 value heads: tp_leaves = 2), the same short run
QWEN35_RL = ["--config", "train_configs/rl_debug_qwen35.toml", *HYBRID_RL[2:]]


def _colocated_and_separate_tp2(tmp_path_factory, args: list[str]) -> dict:
    """A short RL run (2 SFT + 2 RL steps), colocated and with a separate engine of TP 2, both
    at once (one thread each: the suite's 2 cores): name -> (return code, output, metrics
    lines)."""
    extras = {"colocated": [], "separate_tp2": ["--rollout.placement=separate", "--rollout.engine_tp=2"]}
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    dirs = {name: tmp_path_factory.mktemp(f"hybrid_{name}") for name in extras}
    procs = {name: _zygote.popen([sys.executable, "-m", "titan_rl.train", "--run-dir", str(dirs[name]), *args, *extra],
                                 env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 cwd=os.path.join(os.path.dirname(__file__), ".."))
             for name, extra in extras.items()}
    try:
        outs = {name: p.communicate(timeout=300)[0] for name, p in procs.items()}
    finally:
        for p in procs.values():
            p.kill()
    runs = {}
    for name, p in procs.items():
        path = dirs[name] / "metrics.jsonl"
        lines = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.exists() else []
        runs[name] = (p.returncode, outs[name], lines)
    return runs


@pytest.fixture(scope="module")
def hybrid_runs(tmp_path_factory) -> dict:
    return _colocated_and_separate_tp2(tmp_path_factory, HYBRID_RL)


def _run(runs: dict, name: str) -> list[dict]:
    code, out, lines = runs[name]
    assert code == 0, out[-3000:]
    return lines


def test_rl_run_on_the_hybrid_has_zero_mismatch(hybrid_runs):
    ms = _run(hybrid_runs, "colocated")
    assert [m["phase"] for m in ms] == ["sft", "sft", "rl", "rl"]
    for m in ms[2:]:
        assert m["max_abs_dlogp"] == 0.0 and m["bitwise_fraction"] == 1.0, m
        assert m["weights_checksum_equal"] is True


def test_a_separate_engine_at_tp_2_writes_the_colocated_metrics(hybrid_runs):
    """rollout.placement = "separate", rollout.engine_tp = 2: the engine in its own process with
    two vLLM workers, each holding half of the GDN and attention heads (and their recurrent
    state), weights sent over vLLM's weight transfer and checked per worker: every metrics line
    of the colocated run at the same leaf tree, wall-clock fields aside."""
    from titan_rl.run_dir import comparable

    got = _run(hybrid_runs, "separate_tp2")
    assert [comparable(m) for m in got] == [comparable(m) for m in _run(hybrid_runs, "colocated")]
    assert all(m["weights_checksum_equal"] and m["weight_sync_bytes"] > 0 for m in got if m["phase"] == "rl")


def test_a_separate_engine_at_tp_2_on_qwen35_writes_the_colocated_metrics(tmp_path_factory):
    """Qwen3.5 with a separate engine of TP 2: each vLLM worker keeps in_proj_qkv whole and
    computes its heads' q, k and v rows (models/common/parallelize.py, UnfusedGdnHeads),
    in_proj_z / b / a and the recurrent state split by value heads; every metrics line equals
    the colocated run's (engine TP 1), with zero log-prob mismatch."""
    from titan_rl.run_dir import comparable

    runs = _colocated_and_separate_tp2(tmp_path_factory, QWEN35_RL)
    got, want = _run(runs, "separate_tp2"), _run(runs, "colocated")
    assert [comparable(m) for m in got] == [comparable(m) for m in want]
    for m in (m for m in got if m["phase"] == "rl"):
        assert m["max_abs_dlogp"] == 0.0 and m["bitwise_fraction"] == 1.0, m
        assert m["weights_checksum_equal"] and m["weight_sync_bytes"] > 0
