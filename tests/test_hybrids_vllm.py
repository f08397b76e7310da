"""Qwen3-Next, Qwen3.5 and Qwen3.5-MoE in vLLM (our hybrid wrapper: GDN states in vLLM's state
cache, gated attention over the paged KV cache, routed experts with the shared expert): the
sampler's log-probs are the trainer's, bit for bit, for a request alone and in a batch of
mixed lengths, across chunked-prefill splits and decodes, on prefix-cache hits (align mode),
after a weight sync, and with the MoE routes recorded and replayed. Odd sizes (hidden 200,
vocab 997, 3 value heads per key head); fresh random weights each run."""

import pytest
import torch

pytest.importorskip("vllm")

from _vllm_helpers import _gen, _prompts, _trainer_logprobs, assert_alone_equals_batched, random_checkpoint  # noqa: E402

from titan_rl.dtypes import DTYPES  # noqa: E402
from titan_rl.registry import get_architecture  # noqa: E402
from titan_rl.vllm.engine import EngineSettings, engine_model, make_llm, update_weights  # noqa: E402
from titan_rl.vllm.hybrid import TitanHybridForCausalLM  # noqa: E402
from titan_rl.models.common import choice_points  # noqa: E402

CASES = [(arch, flavor, dtype) for arch, flavor in [("qwen3_next", "debug_qwen3_next"), ("qwen3_5", "debug_qwen35"),
                                                   ("qwen3_5_moe", "debug_qwen35_moe")]
         for dtype in ("float32", "bfloat16")]


def _model(arch, flavor, seed):
    m = get_architecture(arch).build(flavor).init_weights(seed, 0.05)
    with torch.no_grad():  # routers that route: experts chosen by the tokens, not by ties
        for name, p in m.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(seed))
    return m


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-{c[2]}")
def setup(request, tmp_path_factory):
    arch, flavor, dtype = request.param
    folder, trainer = random_checkpoint(tmp_path_factory, lambda seed: _model(arch, flavor, seed), dtype, arch=arch)
    llm = make_llm(folder, EngineSettings(arch=arch, dtype=dtype, kv_cache_mib=64, max_model_len=512, max_num_seqs=8,
                                          max_num_batched_tokens=64, enable_prefix_caching=True, block_size=32))
    yield llm, trainer, arch, flavor, dtype
    del llm


def _assert_equal(trainer, prompts, res):
    for pi, (toks, mu, _) in zip(_trainer_logprobs(trainer, prompts, res), res):
        assert len(toks) == len(mu) > 0
        assert torch.equal(pi, mu), (pi - mu).abs().max()


def test_the_engine_is_our_hybrid_wrapper_with_the_models_names(setup):
    llm, trainer, arch, _, _ = setup
    model = engine_model(llm)
    assert isinstance(model, TitanHybridForCausalLM)
    assert sorted(model.attn) == ["3"] and sorted(model.linear_state) == ["0", "1", "2"]
    assert {n for n, _ in model.named_parameters() if not n.startswith("attn.")} == \
        {n for n, _ in trainer.named_parameters()}


def test_alone_and_in_a_batch_of_mixed_lengths(setup, rng):
    # 5 lengths: a 1-token prompt, short ones, and an odd one split over three 64-token
    # prefill chunks; the batch's own greedy log-probs are then the trainer's (one forward)
    llm, trainer, *_ = setup
    prompts = _prompts(rng, [37, 1, 151, 9, 70], vocab=997)
    _assert_equal(trainer, prompts, assert_alone_equals_batched(llm, prompts, max_tokens=6))


def test_chunked_prefill_decodes_and_prefix_cache_hits(setup, rng):
    llm, trainer, *_ = setup
    block = llm.llm_engine.vllm_config.cache_config.block_size
    # 64-token budgets (200: four chunks), a decode across a block (block - 5 + 8 tokens)
    prompts = _prompts(rng, [200, 65, 2, block - 5], vocab=997)
    _assert_equal(trainer, prompts, _gen(llm, prompts, max_tokens=8))
    shared = _prompts(rng, [block + 40], vocab=997)[0]
    hits = [shared + _prompts(rng, [5], vocab=997)[0], shared + _prompts(rng, [40], vocab=997)[0]]
    _gen(llm, hits[:1], max_tokens=1)  # fills the cache; the hits' point is their prefill
    res = _gen(llm, hits, max_tokens=4)
    assert res[0][2] >= block and res[1][2] >= block, [r[2] for r in res]
    _assert_equal(trainer, hits, res)


def test_after_a_weight_sync(setup, rng):
    llm, trainer, arch, flavor, dtype = setup
    new = {k: v + 0.02 * torch.randn(v.shape, generator=rng).to(v.dtype) for k, v in trainer.state_dict().items()}
    after = get_architecture(arch).build(flavor).to(DTYPES[dtype]).eval()
    after.load_state_dict(new)
    update_weights(llm, new)
    prompts = _prompts(rng, [70, 9, 33], vocab=997)
    try:
        _assert_equal(after, prompts, _gen(llm, prompts, max_tokens=6))
    finally:
        update_weights(llm, trainer.state_dict())


def test_moe_routes_are_recorded_and_replay_changes_nothing(setup, rng):
    llm, trainer, arch, *_ = setup
    if not get_architecture(arch).moe:
        pytest.skip(f"{arch} has no router")
    from titan_rl.rollout import Rollout
    from titan_rl.vllm.routes import capture_routes
    from vllm import SamplingParams

    prompts = _prompts(rng, [41, 6, 90], vocab=997)
    # unseeded: vLLM 0.32's CPU runner cannot rewind a request generator after a partial
    # prefill ("CPU Generator does not use offset"), and align mode cuts prompts at blocks
    params = SamplingParams(max_tokens=6, logprobs=0, ignore_eos=True)
    with capture_routes(llm) as rec:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    rollout = Rollout.from_vllm(outs, routes=rec)
    batch = rollout.batch(0)
    with torch.no_grad():
        plain = trainer(batch)
        own = torch.stack(choice_points.own(trainer, "routes"), 1)
        routes = rollout.padded_routes()
        valid = routes[:, :, 0, 0] >= 0
        assert valid.sum() > 0 and own.shape[-1] == routes.shape[-1]
        own = own.view(*routes.shape)
        assert torch.equal(own[valid].long().sort(-1).values, routes[valid].long().sort(-1).values)
        flat = routes.reshape(-1, *routes.shape[2:])
        choice_points.force(trainer, "routes", [flat[:, layer] for layer in range(flat.shape[1])])
        replayed = trainer(batch)
        choice_points.force(trainer, "routes", None)
    assert torch.equal(replayed, plain)  # exact: the router already chose the engine's experts
    assert len({tuple(r) for r in routes[valid][:, 0].tolist()}) > 2  # routing varies
