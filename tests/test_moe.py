"""MoE routing / expert kernels (kernels/moe) and the Qwen3-MoE model (models/qwen3_moe/).

Tolerances (measured, see the constants) are against the fp64 per-token reference and
transformers; invariance checks are torch.equal.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from titan_rl.kernels.moe import compact_routes, load_balancing_loss, moe_experts, router_topk, swiglu_expert
from titan_rl.kernels.moe.reference import moe_experts_reference, router_topk_reference
from titan_rl.models import qwen3_moe
from titan_rl.models.options import ModelOptions
from titan_rl.models.common import choice_points

# Measured max |torch_impl - fp64 reference| (H=64, I=32, |out| ~ 1): router weights
# 2.4e-6 over 300 seeds with the oneDNN GEMM (the logits of randn x randn over H = 64 reach
# |40|, where one fp32 ulp is 3.8e-6; a weight moves by ~p(1-p) per unit of logit error),
# so 5e-6; experts ~5e-7. bf16 experts: the gate/up outputs and silu(g)*u are rounded to bf16
# (8 bits) before the down GEMM, so errors scale with the output's magnitude, not with
# each element (seen: 0.031 at max |out| ~ 5, relative 0.76 on a cancelled element):
# bound = 2^-6 (a few bf16 ulps) x max(1, max |out|).
ROUTER_ATOL = 5e-6
EXPERTS_ATOL = {torch.float32: 5e-6, torch.bfloat16: 2**-6}
E, K, H, I = 8, 2, 64, 32


def _experts(g, dtype):
    def rnd(*s):
        return (torch.randn(*s, generator=g) * 0.2).to(dtype)
    return rnd(E, I, H), rnd(E, I, H), rnd(E, H, I)


def _fns(wg, wu, wd):
    return [swiglu_expert(wg[e], wu[e], wd[e]) for e in range(len(wg))]


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_matches_reference(rng, norm, dtype):
    x = torch.randn(50, H, generator=rng).to(dtype)
    gw = torch.randn(E, H, generator=rng).to(dtype)
    w, ids = router_topk(x, gw, K, norm)
    rw, rids = router_topk_reference(x, gw, K, norm)
    assert w.dtype == torch.float32 and ids.shape == (50, K)
    assert torch.equal(ids, rids)
    torch.testing.assert_close(w, rw, atol=ROUTER_ATOL, rtol=0)
    if norm:
        torch.testing.assert_close(w.sum(-1), torch.ones(50), atol=1e-6, rtol=0)


@pytest.mark.parametrize("k", [1, 2, 3, 5, 8])
def test_tie_rule_lowest_index_wins(k):
    # all logits equal -> experts 0..k-1, in order
    w, ids = router_topk(torch.zeros(3, H), torch.randn(E, H), k, False)
    assert ids.tolist() == [list(range(k))] * 3
    torch.testing.assert_close(w, torch.full((3, k), 1.0 / E), atol=0, rtol=0)
    # constructed ties: logits [1, 3, 3, 0, 3, 2, 2, 1] (exact in fp32)
    logits = torch.tensor([1.0, 3, 3, 0, 3, 2, 2, 1])
    x = torch.zeros(4, H)
    x[:, 0] = 1.0
    gw = torch.zeros(E, H)
    gw[:, 0] = logits
    _, ids = router_topk(x, gw, k, True)
    assert ids.tolist() == [[1, 2, 4, 5, 6, 0, 7, 3][:k]] * 4
    _, rids = router_topk_reference(x, gw, k, True)
    assert torch.equal(ids, rids)


def test_router_rejects_bad_input():
    with pytest.raises(ValueError, match="top-k"):
        router_topk(torch.zeros(2, H), torch.zeros(E, H), E + 1, False)
    with pytest.raises(ValueError, match="NaN"):
        router_topk(torch.full((2, H), float("nan")), torch.ones(E, H), 2, False)
    with pytest.raises(ValueError, match="outside"):
        router_topk(torch.zeros(2, H), torch.zeros(E, H), 2, False, route_override=torch.full((2, 2), E))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_experts_matches_reference(rng, dtype):
    T = 40
    x = torch.randn(T, H, generator=rng).to(dtype)
    wg, wu, wd = _experts(rng, dtype)
    weights, ids = router_topk(x, torch.randn(E, H, generator=rng), K, True)
    out = moe_experts(x, ids, weights, _fns(wg, wu, wd))
    ref = moe_experts_reference(x, ids, weights, wg, wu, wd)
    assert out.dtype == dtype and out.shape == (T, H)
    atol = EXPERTS_ATOL[dtype] * max(1.0, float(ref.float().abs().max()))
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_experts_batch_invariant(rng, dtype):
    N = 130
    x = torch.randn(N, H, generator=rng).to(dtype)
    gw = torch.randn(E, H, generator=rng).to(dtype)
    wg, wu, wd = _experts(rng, dtype)

    def run(idx):
        w, ids = router_topk(x[idx], gw, K, True)
        return moe_experts(x[idx], ids, w, _fns(wg, wu, wd))

    full = run(torch.arange(N))
    for t in (0, 7, N - 1):
        assert torch.equal(run(torch.tensor([t]))[0], full[t]), f"token {t} alone differs"
    for size in (2, 3, 17, 64, 65, 100):
        for _ in range(2):
            idx = torch.randperm(N, generator=rng)[:size]
            assert torch.equal(run(idx), full[idx]), f"batch of {size} differs"
    rev = torch.arange(N - 1, -1, -1)
    assert torch.equal(run(rev), full[rev])


def _small_cfg(**kw):
    return replace(qwen3_moe.FLAVORS["debug_moe"], num_hidden_layers=2, **kw)


def test_model_logits_row_invariant(rng):
    model = qwen3_moe.build(_small_cfg()).init_weights(seed=int(torch.randint(0, 2**31 - 1, (1,), generator=rng)))
    # a larger router std so that routing is decisive (and varies across tokens)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.5, generator=rng)
    tokens = torch.randint(0, model.cfg.vocab_size, (4, 37), generator=rng)
    with torch.no_grad():
        full = model(tokens)
        routes = [r.clone() for r in choice_points.used(model, "routes")]
        assert len({tuple(r) for r in routes[0].tolist()}) > 2, "routing should vary across tokens"
        for b in (0, 3):
            assert torch.equal(model(tokens[b : b + 1])[0], full[b]), f"row {b} alone differs"
        for m in (1, 5, 36):
            assert torch.equal(model(tokens[:, :m]), full[:, :m]), f"prefix {m} differs"
        assert torch.equal(model(tokens[[2, 0]]), full[[2, 0]])


def test_route_override_forces_experts(rng):
    model = qwen3_moe.build(_small_cfg()).init_weights(seed=3)
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 11), generator=rng)
    T, k = tokens.numel(), model.cfg.num_experts_per_tok
    forced = [torch.stack([torch.randperm(E, generator=rng)[:k] for _ in range(T)]).to(torch.uint8)
              for _ in range(model.cfg.num_hidden_layers)]
    with torch.no_grad():
        model(tokens)
        natural = [r.clone() for r in choice_points.used(model, "routes")]
        choice_points.force(model, "routes", forced)
        ref = model(tokens)
        assert all(torch.equal(a, b) for a, b in zip(choice_points.used(model, "routes"), forced))
        for layer in model.model.layers:  # a very different router: experts stay the forced ones
            layer.mlp.gate.weight.add_(torch.randn(layer.mlp.gate.weight.shape, generator=rng) * 5)
        out = model(tokens)
        assert all(torch.equal(a, b) for a, b in zip(choice_points.used(model, "routes"), forced))
        assert not torch.equal(out, ref)  # the weights follow the (changed) router
        choice_points.force(model, "routes", None)
        model(tokens)
        assert any(not torch.equal(a, b) for a, b in zip(choice_points.used(model, "routes"), natural))
    with pytest.raises(ValueError, match="layers"):
        choice_points.force(model, "routes", forced[:1])


def test_compact_routes_and_aux_loss():
    ids = torch.tensor([[0, 7], [255, 3]])
    assert compact_routes(ids, 256).dtype == torch.uint8
    assert compact_routes(ids, 257).dtype == torch.int16
    assert torch.equal(compact_routes(ids, 300).long(), ids)
    # perfectly balanced routing with uniform probs gives k (transformers' normalisation)
    probs = torch.full((4, 4), 0.25)
    ids = torch.tensor([[0, 1], [2, 3], [0, 1], [2, 3]])
    assert float(load_balancing_loss([probs], [ids], 4)) == pytest.approx(2.0)


def test_model_backward_and_aux_loss_grad(rng):
    model = qwen3_moe.build(_small_cfg()).init_weights(seed=1)
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 9), generator=rng)
    logits = model(tokens)
    (logits.logsumexp(-1).mean() + model.cfg.router_aux_loss_coef * model.aux_loss).backward()
    gate = model.model.layers[0].mlp.gate.weight
    assert gate.grad is not None and gate.grad.abs().sum() > 0
    used = choice_points.used(model, "routes")[0].long().unique()
    assert model.model.layers[0].mlp.experts[int(used[0])].down_proj.weight.grad is not None


def test_hf_config_round_trip():
    for name, cfg in qwen3_moe.FLAVORS.items():
        d = cfg.hf_config()
        assert d["model_type"] == "qwen3_moe"
        assert qwen3_moe.Qwen3MoeConfig.from_hf(json.loads(json.dumps(d))) == cfg, name
    d = qwen3_moe.FLAVORS["debug_moe"].hf_config()
    with pytest.raises(ValueError, match="dense layers"):
        qwen3_moe.Qwen3MoeConfig.from_hf({**d, "mlp_only_layers": [1]})
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        qwen3_moe.build(replace(qwen3_moe.FLAVORS["debug_moe"], moe_intermediate_size=66), ModelOptions(tp_leaves=4))


# Measured max |ours - transformers| over fp32 logits (2 layers, |logits| ~ 1): exact
# ~1e-6 (tiled GEMM vs one GEMM sum in a different order), stock ~1e-7 (same ops, the
# experts' combination order differs: slot order vs transformers' expert order).
HF_ATOL = 5e-5


def _hf_class():
    try:
        from transformers import Qwen3MoeForCausalLM
    except ImportError:  # transformers missing or too old for Qwen3-MoE
        return None
    return Qwen3MoeForCausalLM


@pytest.mark.parametrize("kernels", ["exact", "stock"])
def test_logits_match_transformers(tmp_path, rng, kernels):
    HF = _hf_class()
    if HF is None:
        pytest.skip("transformers' Qwen3MoeForCausalLM is not importable")
    from safetensors.torch import save_file

    cfg = _small_cfg()
    ours = qwen3_moe.build(cfg, ModelOptions(kernels=kernels)).init_weights(seed=int(torch.randint(0, 2**31 - 1, (1,), generator=rng)))
    with torch.no_grad():
        for layer in ours.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.5, generator=rng)
    save_file({n: p.detach().contiguous() for n, p in ours.state_dict().items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(cfg.hf_config("Qwen3MoeForCausalLM", dtype="float32")))
    hf = HF.from_pretrained(str(tmp_path), torch_dtype=torch.float32, local_files_only=True).eval()
    assert hf.config.num_experts == cfg.num_experts and hf.config.norm_topk_prob == cfg.norm_topk_prob
    tokens = torch.randint(0, cfg.vocab_size, (3, 23), generator=rng)
    with torch.no_grad():
        ref = hf(tokens, output_router_logits=True)
        out = ours(tokens)
    diff = (out - ref.logits).abs().max().item()
    print(f"{kernels}: max |ours - HF| = {diff:.3g}")
    assert diff < HF_ATOL
    torch.testing.assert_close(ours.aux_loss, ref.aux_loss.float(), atol=1e-5, rtol=0)
