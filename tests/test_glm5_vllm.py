"""GLM-5 in vLLM (our wrapper: the latent KV and the indexer keys in vLLM's paged cache,
titan_rl/vllm/dsa.py): the sampler's log-probs are the trainer's, bit for bit, and so are the
key sets every indexer layer selected at every computed position, for a request alone and in
a batch of mixed lengths, across chunked-prefill splits (64-token budgets) and decodes, on
prefix-cache hits, and after a weight sync; replay makes a trainer whose indexer was perturbed
attend to the recorded sets and give the sampler's log-probs again, and the RL step's scoring
does so only with index and router replay on (each override seen to matter). fp32 and bf16;
folders written by transformers at odd sizes (index_topk 16 below the prompts), fresh weights
per run."""

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from vllm import SamplingParams  # noqa: E402

from _vllm_helpers import _gen, _prompts, _trainer_logprobs, assert_alone_equals_batched  # noqa: E402
from titan_rl.checkpoint import load_hf_folder  # noqa: E402
from titan_rl.dtypes import DTYPES  # noqa: E402
from titan_rl.hf_reference import hf_model  # noqa: E402
from titan_rl.kernels import log_softmax_fp32  # noqa: E402
from titan_rl.metrics import expert_disagreement, index_disagreement  # noqa: E402
from titan_rl.rollout import Rollout, ScoredBatch  # noqa: E402
from titan_rl.vllm.dsa import TitanDsaForCausalLM  # noqa: E402
from titan_rl.vllm.engine import EngineSettings, engine_model, make_llm, update_weights  # noqa: E402
from titan_rl.vllm.indices import capture_indices  # noqa: E402
from titan_rl.vllm.routes import capture_routes  # noqa: E402
from titan_rl.models.common import choice_points  # noqa: E402

V = 997


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def setup(request, tmp_path_factory):
    from _seeds import draw_seed

    dtype = request.param
    folder = tmp_path_factory.mktemp(f"glm5_{dtype}")
    hf_model("glm_moe_dsa", draw_seed("weights seed") % 2**31, scale=0.2).save_pretrained(folder)
    trainer = load_hf_folder(folder, kernels="exact", dtype=DTYPES[dtype], arch="glm_moe_dsa").eval()
    llm = make_llm(str(folder), EngineSettings(arch="glm_moe_dsa", dtype=dtype, kv_cache_mib=64, max_model_len=512,
                                               max_num_seqs=8, max_num_batched_tokens=64, enable_prefix_caching=True,
                                               block_size=32))
    yield llm, trainer, folder, dtype
    del llm


def _assert_equal(trainer, prompts, res):
    for pi, (toks, mu, _) in zip(_trainer_logprobs(trainer, prompts, res), res):
        assert len(toks) == len(mu) > 0
        assert torch.equal(pi, mu), (pi - mu).abs().max()


def _sample(llm, *calls, max_tokens=10):
    """One capture over generate calls of the prompt lists `calls` (a later call's prefix-cache
    hits take their records from an earlier call's request)."""
    params = SamplingParams(max_tokens=max_tokens, logprobs=0, ignore_eos=True, top_p=0.9)
    outs = []
    with capture_indices(llm) as idx, capture_routes(llm) as rec:
        for prompts in calls:
            outs += llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return Rollout.from_vllm(outs, routes=rec, indices=idx), outs


def _trainer_sets(trainer, rollout):
    batch = rollout.batch(0)
    with torch.no_grad():
        logp = log_softmax_fp32(trainer(batch))
    own = torch.stack(choice_points.own(trainer, "indices"), 1).view(*batch.shape, len(choice_points.own(trainer, "indices")), -1)
    routes = torch.stack(choice_points.own(trainer, "routes"), 1).view(*batch.shape, len(choice_points.own(trainer, "routes")), -1)
    return logp, own, routes


def test_the_engine_is_our_wrapper_with_the_models_names(setup):
    llm, trainer, *_ = setup
    model = engine_model(llm)
    assert isinstance(model, TitanDsaForCausalLM)
    assert {n for n, _ in model.named_parameters() if not n.startswith("attn.")} == \
        {n for n, _ in trainer.named_parameters()}
    cfg = llm.llm_engine.vllm_config.cache_config
    assert cfg.enable_prefix_caching and cfg.block_size == 32  # vLLM's own MLA path (blocks of 16, no caching) is off


def test_alone_and_in_a_batch_of_mixed_lengths(setup, rng):
    llm, trainer, *_ = setup
    prompts = _prompts(rng, [37, 3, 90, 40, 9, 61, 1, 17], vocab=V)
    assert_alone_equals_batched(llm, prompts)
    _assert_equal(trainer, prompts, _gen(llm, prompts))


def test_key_sets_and_experts_equal_at_every_position_with_chunks_and_prefix_hits(setup, rng):
    """Every computed position's selected key set (each indexer layer) and experts: the engine's
    record == the trainer's own choice. Prompts cut into 64-token prefill chunks, decodes across a
    block boundary, and a second request whose first blocks are prefix-cache hits (their sets
    come from the request that computed them)."""
    llm, trainer, *_ = setup
    llm.reset_prefix_cache()
    shared = _prompts(rng, [75], vocab=V)[0]
    prompts = _prompts(rng, [140, 65, 27], vocab=V) + [shared + _prompts(rng, [5], vocab=V)[0],
                                                       shared + _prompts(rng, [40], vocab=V)[0]]
    # the first call puts the shared prefix in the cache; the second's last request hits it
    rollout, outs = _sample(llm, prompts[3:4], prompts, max_tokens=16)
    assert outs[-1].num_cached_tokens >= 64, [o.num_cached_tokens for o in outs]
    logp, own, routes = _trainer_sets(trainer, rollout)
    sets, eng_routes = rollout.padded_indices(), rollout.padded_routes()
    valid = sets[:, :, 0, 0] >= 0
    assert int(valid.sum()) == sum(len(p) + len(t) - 1 for p, t in zip(rollout.prompts, rollout.tokens))
    assert torch.equal(sets[valid].long(), own[valid].long())
    assert index_disagreement(sets[valid], own[valid]) == 0.0
    assert torch.equal(eng_routes[valid].long(), routes[valid].long())
    assert rollout.index_bytes_per_token == 2 * 3 * 16  # int16 x 3 indexer layers x 16
    assert int((sets[valid][..., -1] >= 0).sum()) > 100  # rows past position 16 really select 16 of more keys
    for i in range(len(rollout)):
        toks = torch.tensor(rollout.tokens[i])
        pi = logp[i, rollout.response_span(i)].gather(-1, toks[:, None])[:, 0].double()
        assert torch.equal(pi, rollout.mu[i])


def test_after_a_weight_sync(setup, rng):
    llm, trainer, folder, dtype = setup
    new = {k: v + 0.02 * torch.randn(v.shape, generator=rng).to(v.dtype) for k, v in trainer.state_dict().items()}
    after = load_hf_folder(folder, kernels="exact", dtype=DTYPES[dtype], arch="glm_moe_dsa").eval()
    after.load_state_dict(new)
    update_weights(llm, new)
    prompts = _prompts(rng, [70, 9, 33], vocab=V)
    try:
        _assert_equal(after, prompts, _gen(llm, prompts))
    finally:
        update_weights(llm, trainer.state_dict())


def test_replay_forces_the_recorded_sets_on_a_perturbed_indexer(setup, rng):
    """The indexer enters the output only through its selection: with the engine's sets replayed,
    a trainer whose indexers were perturbed (choosing other sets) gives the sampler's log-probs
    bit for bit."""
    llm, _, folder, dtype = setup
    rollout, _ = _sample(llm, _prompts(rng, [60, 33, 90], vocab=V))
    bent = load_hf_folder(folder, kernels="exact", dtype=DTYPES[dtype], arch="glm_moe_dsa").eval()
    with torch.no_grad():
        for name, p in bent.named_parameters():
            if ".indexer.wk." in name:
                p.add_(torch.randn(p.shape, generator=rng).to(p.dtype))
    sets = rollout.padded_indices()
    valid = sets[:, :, 0, 0] >= 0
    _, own, _ = _trainer_sets(bent, rollout)
    assert index_disagreement(sets[valid], own[valid]) > 0.05  # the perturbation does change the sets
    flat = sets.reshape(-1, *sets.shape[2:])
    choice_points.force(bent, "indices", [flat[:, layer] for layer in range(flat.shape[1])])
    logp, own_replayed, _ = _trainer_sets(bent, rollout)
    used = torch.stack(choice_points.used(bent, "indices"), 1).view(*own.shape)
    choice_points.force(bent, "indices", None)
    assert torch.equal(used[valid].long(), sets[valid].long())
    assert index_disagreement(sets[valid], own_replayed[valid]) > 0.05  # its own choice is still reported apart
    for i in range(len(rollout)):
        toks = torch.tensor(rollout.tokens[i])
        pi = logp[i, rollout.response_span(i)].gather(-1, toks[:, None])[:, 0].double()
        assert torch.equal(pi, rollout.mu[i])


def _rl_score(model, rollout, index_selection: str, router_replay: str) -> torch.Tensor:
    """max |log pi - mu| over the sampled tokens, pi scored the way the RL step scores a rollout
    (RLTrainer._score: it is what sets the overrides from rollout.index_selection /
    router_replay), then the overrides cleared as the step's end clears them."""
    from titan_rl.rl.trainer import RLTrainer

    rl = SimpleNamespace(rollout=SimpleNamespace(index_selection=index_selection, router_replay=router_replay),
                         sampling=SimpleNamespace(temperature=1.0, top_k=0, top_p=1.0))
    b = ScoredBatch.of(rollout, rollout.batch(0))
    try:
        with torch.no_grad():
            pi = RLTrainer._score(SimpleNamespace(rl=rl, model=model), b, range(len(rollout)), None)
    finally:
        choice_points.force(model, "indices", None)
        choice_points.force(model, "routes", None)
    return (pi[b.mask].double() - b.mu[b.mask].double()).abs().max()


def test_the_rl_step_scores_the_samplers_policy_only_with_both_replays_on_a_perturbed_trainer(setup, rng):
    """A trainer whose indexers (wk) and routers (the selection-only e_score_correction_bias)
    were moved slightly chooses other key sets and experts than the engine recorded; neither
    enters the output but through that choice, so the RL step's scoring gives the sampler's
    log-probs bit for bit with index and router replay, and not with either override off:
    a replay path that ignored an override would fail here (with the trainer's own choices
    equal to the engine's, as in an RL run, it could not)."""
    llm, _, folder, dtype = setup
    rollout, _ = _sample(llm, _prompts(rng, [60, 33, 90], vocab=V), max_tokens=12)
    bent = load_hf_folder(folder, kernels="exact", dtype=DTYPES[dtype], arch="glm_moe_dsa").eval()
    with torch.no_grad():
        for name, p in bent.named_parameters():
            if ".indexer.wk." in name or name.endswith("e_score_correction_bias"):
                p.add_(0.1 * torch.randn(p.shape, generator=rng).to(p.dtype))
    _, own, own_routes = _trainer_sets(bent, rollout)
    sets, routes = rollout.padded_indices(), rollout.padded_routes()
    valid = sets[:, :, 0, 0] >= 0
    assert index_disagreement(sets[valid], own[valid]) > 0  # the perturbation does change the choices
    assert expert_disagreement(routes[valid], own_routes[valid]) > 0
    assert _rl_score(bent, rollout, "replay", "replay") == 0
    assert _rl_score(bent, rollout, "pinned", "replay") > 0
    assert _rl_score(bent, rollout, "replay", "off") > 0
    assert _rl_score(bent, rollout, "pinned", "off") > 0
