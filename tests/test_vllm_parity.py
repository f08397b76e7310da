"""Trainer log-probs == vLLM sampler log-probs, bitwise (torch.equal), debug model.

Two in-process engines per dtype, both with prefix caching: "chunked" forces chunked
prefill (a 64-token budget, so long prompts are split across steps) and draws from
the engine's global RNG; "seeded" uses per-request seeds so the same request samples
the same tokens alone and in a batch. (vLLM 0.32 on CPU cannot combine per-request
seeds with a partial-prefill step: it rewinds the generator with set_offset, which
CPU generators lack.) Covered: a request alone
vs inside a batch of 8 mixed-length requests; every decode position (each sampled
token is compared); chunked-prefill splits; prefix-cache hits; after a weight update.
"""


from dataclasses import replace

import pytest
import torch

from titan_rl.models.qwen3 import build

pytest.importorskip("vllm")

from titan_rl.vllm.engine import EngineSettings, engine_model, make_llm, update_weights  # noqa: E402

from _vllm_helpers import DTYPES, _gen, _prompts, _trainer_logprobs, random_checkpoint  # noqa: E402


@pytest.fixture(scope="module", params=["bfloat16", "float32"])
def setup(request, tmp_path_factory):
    dtype = request.param
    folder, trainer = random_checkpoint(tmp_path_factory, lambda seed: build("debug").init_weights(seed, 0.05), dtype)
    common = EngineSettings(dtype=dtype, kv_cache_mib=64, max_model_len=512, max_num_seqs=8, enable_prefix_caching=True)
    engines = {"chunked": make_llm(folder, replace(common, max_num_batched_tokens=64)), "seeded": make_llm(folder, common)}
    yield engines, trainer, dtype
    del engines


def test_alone_vs_batch_of_8_mixed_lengths(setup, rng):
    engines, trainer, _ = setup
    llm = engines["seeded"]
    prompts = _prompts(rng, [37, 3, 150, 64, 9, 100, 1, 77])  # 150/100/77 span several prefill chunks
    seeds = [int(x) for x in torch.randint(0, 2**31, (8,), generator=rng)]
    alone = _gen(llm, prompts[:1], seeds[:1])[0]
    batch = _gen(llm, prompts, seeds)
    assert batch[0][0] == alone[0]
    assert torch.equal(batch[0][1], alone[1])
    for pi, (toks, mu, _) in zip(_trainer_logprobs(trainer, prompts, batch), batch):
        assert len(toks) == 12
        assert torch.equal(pi, mu), (pi - mu).abs().max()


def test_chunked_prefill_splits(setup, rng):
    engines, trainer, _ = setup
    prompts = _prompts(rng, [200, 65, 130, 2, 63])  # split at 64-token boundaries, mixed with decodes
    res = _gen(engines["chunked"], prompts, max_tokens=20)
    for pi, (_, mu, _) in zip(_trainer_logprobs(trainer, prompts, res), res):
        assert torch.equal(pi, mu), (pi - mu).abs().max()


@pytest.mark.parametrize("engine", ["chunked", "seeded"])
def test_prefix_cache_hits(setup, rng, engine):
    engines, trainer, _ = setup
    llm = engines[engine]
    shared = _prompts(rng, [160])[0]
    prompts = [shared + _prompts(rng, [5])[0], shared + _prompts(rng, [40])[0]]
    _gen(llm, prompts[:1])  # fills the cache with the shared prefix
    res = _gen(llm, prompts)
    assert res[1][2] >= 128, f"expected a prefix-cache hit, got {res[1][2]} cached tokens"
    for pi, (_, mu, _) in zip(_trainer_logprobs(trainer, prompts, res), res):
        assert torch.equal(pi, mu), (pi - mu).abs().max()


def test_after_weight_update(setup, rng):
    engines, trainer, dtype = setup
    llm = engines["seeded"]
    prompts = _prompts(rng, [20, 90, 6])
    before = _gen(llm, prompts, [3, 4, 5])
    new = {k: v + 0.02 * torch.randn(v.shape, generator=rng).to(v.dtype) for k, v in trainer.state_dict().items()}
    model_after = build("debug").to(DTYPES[dtype]).eval()
    model_after.load_state_dict(new)
    update_weights(llm, new)
    after = _gen(llm, prompts, [3, 4, 5])
    assert any(not torch.equal(a[1], b[1]) for a, b in zip(before, after)), "weights did not change the engine"
    for pi, (_, mu, _) in zip(_trainer_logprobs(model_after, prompts, after), after):
        assert torch.equal(pi, mu), (pi - mu).abs().max()
    update_weights(llm, trainer.state_dict())  # restore for other tests


def test_engine_holds_the_models_parameter_names(setup):
    engines, trainer, _ = setup
    names = {n for n, _ in engine_model(engines["chunked"]).named_parameters() if not n.startswith("attn.")}
    assert names == {n for n, _ in trainer.named_parameters()}


def test_bf16_upcast_form_is_exact_too(tmp_path_factory, rng, monkeypatch):
    """The bf16 GEMM form of CPUs without bf16 instructions (operands upcast to fp32, one
    fp32 GEMM, rounded; the engine prepares its weights once) run here on purpose:
    trainer == engine, alone vs in a batch, with chunked prefill."""
    from titan_rl.kernels.lm_head import torch_impl as head
    from titan_rl.kernels.matmul import torch_impl as mm

    monkeypatch.setattr(mm, "BF16_GEMM", "fp32")
    monkeypatch.setattr(head, "HEAD_FORM", "fp32")  # and their LM head: the fp32 GEMM on upcast operands
    folder, trainer = random_checkpoint(tmp_path_factory, lambda seed: build("debug").init_weights(seed, 0.05),
                                        "bfloat16")
    llm = make_llm(folder, EngineSettings(dtype="bfloat16", kv_cache_mib=64, max_model_len=512, max_num_seqs=8,
                                          max_num_batched_tokens=64))
    from titan_rl.models.layers import held_operands

    held = dict(held_operands(engine_model(llm)._net))
    assert held["model.layers.0.mlp.packed_gate_up"].dtype == torch.float32
    prompts = _prompts(rng, [150, 3, 70, 20])
    res = _gen(llm, prompts, max_tokens=12)
    assert isinstance(engine_model(llm)._lm_head_prepared, mm.PackedWeight)
    for pi, (_, mu, _) in zip(_trainer_logprobs(trainer, prompts, res), res):
        assert torch.equal(pi, mu), (pi - mu).abs().max()
    del llm
