"""MoE in vLLM: trainer log-probs AND expert choices == the sampler's, bitwise; router
replay; the stock engine's disagreement (debug_moe with a decisive router, fresh random
weights per run).

Covered with torch.equal: a request alone vs inside a batch of 8 mixed-length requests;
every decode position (each sampled token is compared); chunked-prefill splits;
prefix-cache hits (routes of cached positions filled from the request that computed
them); bf16 and fp32. Replay: the trainer, its router perturbed on purpose, uses exactly
the recorded experts.
"""


from dataclasses import replace

import pytest
import torch

pytest.importorskip("vllm")
from vllm import SamplingParams  # noqa: E402

from _vllm_helpers import DTYPES, _gen, _prompts, _trainer_logprobs, random_checkpoint  # noqa: E402
from titan_rl.checkpoint import load_hf_folder  # noqa: E402
from titan_rl.metrics import expert_disagreement  # noqa: E402
from titan_rl.models import qwen3_moe  # noqa: E402
from titan_rl.vllm.engine import EngineSettings, make_llm  # noqa: E402
from titan_rl.vllm.routes import capture_routes  # noqa: E402
from titan_rl.models.common import choice_points  # noqa: E402


def _weights(seed: int) -> qwen3_moe.Qwen3MoeForCausalLM:
    m = qwen3_moe.build("debug_moe").init_weights(seed, 0.05)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # a decisive router: routing varies from token to token
        for layer in m.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.5, generator=g)
    return m


@pytest.fixture(scope="module", params=["bfloat16", "float32"])
def setup(request, tmp_path_factory):
    dtype = request.param
    folder, trainer = random_checkpoint(tmp_path_factory, _weights, dtype, arch="qwen3_moe")
    common = EngineSettings(arch="qwen3_moe", dtype=dtype, kv_cache_mib=64, max_model_len=512, max_num_seqs=8,
                            enable_prefix_caching=True)
    engines = {"chunked": make_llm(folder, replace(common, max_num_batched_tokens=64)), "seeded": make_llm(folder, common)}
    yield engines, trainer, folder, dtype
    del engines


def _routes(llm, prompts, max_tokens=12):
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    with capture_routes(llm) as rec:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    by_id = rec.assemble(outs)
    return [(list(o.prompt_token_ids) + list(o.outputs[0].token_ids), by_id[o.request_id], o.num_cached_tokens)
            for o in outs], rec


@torch.no_grad()
def _trainer_routes(trainer, seqs):
    L = max(map(len, seqs))
    batch = torch.zeros(len(seqs), L, dtype=torch.long)
    for i, s in enumerate(seqs):
        batch[i, : len(s)] = torch.tensor(s)
    trainer(batch)
    own = torch.stack(choice_points.used(trainer, "routes"), 1).view(len(seqs), L, len(choice_points.used(trainer, "routes")), -1)
    return [own[i, : len(s) - 1] for i, s in enumerate(seqs)]


def test_logprobs_alone_vs_batch_of_8(setup, rng):
    engines, trainer, _, _ = setup
    llm = engines["seeded"]
    prompts = _prompts(rng, [37, 3, 150, 64, 9, 100, 1, 77])
    seeds = [int(x) for x in torch.randint(0, 2**31, (8,), generator=rng)]
    alone = _gen(llm, prompts[:1], seeds[:1])[0]
    batch = _gen(llm, prompts, seeds)
    assert batch[0][0] == alone[0] and torch.equal(batch[0][1], alone[1])
    for pi, (toks, mu, _) in zip(_trainer_logprobs(trainer, prompts, batch), batch):
        assert len(toks) == 12
        assert torch.equal(pi, mu), (pi - mu).abs().max()


def test_logprobs_chunked_prefill(setup, rng):
    engines, trainer, _, _ = setup
    prompts = _prompts(rng, [200, 65, 130, 2, 63])
    res = _gen(engines["chunked"], prompts, max_tokens=16)
    for pi, (_, mu, _) in zip(_trainer_logprobs(trainer, prompts, res), res):
        assert torch.equal(pi, mu), (pi - mu).abs().max()


@pytest.mark.parametrize("engine", ["chunked", "seeded"])
def test_routes_equal_every_position(setup, rng, engine):
    """Engine-recorded experts == the trainer router's choice at every computed position
    (prefill rows, decode steps, chunk boundaries), and routing is not trivial."""
    engines, trainer, _, _ = setup
    res, rec = _routes(engines[engine], _prompts(rng, [150, 3, 70, 21]))
    assert rec.bytes_per_token == trainer.cfg.num_hidden_layers * trainer.cfg.num_experts_per_tok  # uint8
    own = _trainer_routes(trainer, [s for s, _, _ in res])
    for (seq, eng, _), mine in zip(res, own):
        assert eng.shape[0] == len(seq) - 1
        assert torch.equal(eng, mine)
    assert len({tuple(r) for r in torch.cat(own)[:, 0].tolist()}) > 4


def test_routes_with_prefix_cache_hits(setup, rng):
    """Cached positions are not recomputed: their routes come from the request of the same
    capture that computed the prefix; with no such request, assemble refuses."""
    engines, trainer, _, _ = setup
    llm = engines["seeded"]
    llm.reset_prefix_cache()
    shared = _prompts(rng, [160])[0]
    prompts = [shared + _prompts(rng, [5])[0], shared + _prompts(rng, [40])[0]]
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=6, ignore_eos=True)
    with capture_routes(llm) as rec:
        outs = llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
        outs += llm.generate([{"prompt_token_ids": prompts[1]}], params, use_tqdm=False)
    assert outs[1].num_cached_tokens >= 128, f"expected a prefix-cache hit, got {outs[1].num_cached_tokens}"
    by_id = rec.assemble(outs)
    seqs = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs]
    for o, mine in zip(outs, _trainer_routes(trainer, seqs)):
        assert torch.equal(by_id[o.request_id], mine)
    with capture_routes(llm) as rec:
        again = llm.generate([{"prompt_token_ids": prompts[1]}], params, use_tqdm=False)
    assert again[0].num_cached_tokens >= 128
    with pytest.raises(RuntimeError, match="prefix-cache hit"):
        rec.assemble(again)


def test_replay_forces_recorded_experts_on_a_perturbed_router(setup, rng):
    engines, _, folder, dtype = setup
    res, _ = _routes(engines["seeded"], _prompts(rng, [40, 9, 66]))
    trainer = load_hf_folder(folder, kernels="exact", dtype=DTYPES[dtype], arch="qwen3_moe").eval()
    with torch.no_grad():
        for layer in trainer.model.layers:
            w = layer.mlp.gate.weight
            w.add_(torch.randn(w.shape, generator=rng).to(w.dtype) * 0.5)
    seqs = [s for s, _, _ in res]
    own = _trainer_routes(trainer, seqs)
    recorded = torch.cat([r for _, r, _ in res])
    assert expert_disagreement(torch.cat(own), recorded) > 0.05  # the perturbation does change routing
    L = max(map(len, seqs))
    forced = torch.full((len(seqs), L, *recorded.shape[1:]), -1, dtype=torch.int16)
    for i, (_, r, _) in enumerate(res):
        forced[i, : r.shape[0]] = r.to(torch.int16)
    flat = forced.view(len(seqs) * L, *recorded.shape[1:])
    choice_points.force(trainer, "routes", [flat[:, layer] for layer in range(flat.shape[1])])
    used = _trainer_routes(trainer, seqs)
    for (_, r, _), u in zip(res, used):
        assert torch.equal(u, r)
    # the router's own choice is still reported apart (it is what disagreement measures)
    assert expert_disagreement(torch.cat([o[: r.shape[0]] for o, (_, r, _) in zip(
        [torch.stack(choice_points.own(trainer, "routes"), 1).view(len(seqs), L, *recorded.shape[1:])[i] for i in range(len(seqs))],
        res)]), recorded) > 0.05


def test_stock_engine_routes_are_observed(setup, rng):
    """vLLM's built-in Qwen3-MoE on the same weights: its choices are recorded from its
    own gate, and match the trainer's on most positions (the same function, rounded
    differently)."""
    _, trainer, folder, dtype = setup
    llm = make_llm(folder, EngineSettings(arch="qwen3_moe", kernels="stock", dtype=dtype, kv_cache_mib=64,
                                          max_model_len=512, max_num_seqs=8))
    res, _ = _routes(llm, _prompts(rng, [80, 30, 120]))
    own = torch.cat(_trainer_routes(trainer, [s for s, _, _ in res]))
    d = expert_disagreement(torch.cat([r for _, r, _ in res]), own)
    print(f"stock {dtype}: expert disagreement {d:.4f}")
    assert d < 0.2
    del llm


def test_expert_disagreement_metric():
    a = torch.tensor([[[0, 1]], [[2, 3]]])
    assert expert_disagreement(a, a.flip(-1)) == 0.0  # order-free
    assert expert_disagreement(a, torch.tensor([[[0, 5]], [[6, 7]]])) == 0.75
    with pytest.raises(ValueError, match="shapes"):
        expert_disagreement(a, a[:1])
