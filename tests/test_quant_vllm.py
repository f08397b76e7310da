"""Quantized policy, both sides: the trainer's fake-quantized forward == the vLLM engine's
quantized forward, bitwise (torch.equal), debug model in bf16, fresh random weights.

One engine per recipe family (fp8: fp8_rowwise, W8A8; fp4: nvfp4_w4a4, W4A4), with
chunked prefill (a 64-token budget) and prefix caching. Covered: requests alone and inside
a batch of 8 mixed-length requests (each sampled token's log-prob against the trainer's);
chunked-prefill splits; prefix-cache hits; after a weight sync that ships payload + scales;
the quantized checksum; the engine's weight memory; the trainer's straight-through gradient.
"""

import pytest
import torch

from titan_rl.models.options import ModelOptions, Quantization
from titan_rl.models.qwen3 import build

pytest.importorskip("vllm")

from titan_rl.checkpoint import checkpoint_fingerprint  # noqa: E402
from titan_rl.kernels.quant import QuantizedWeight  # noqa: E402
from titan_rl.quant_weights import (  # noqa: E402
    engine_weights, fake_quantized_state, held_bytes, quantized_state, state_bytes, weight_recipes,
)
from titan_rl.vllm.engine import EngineSettings, engine_model, make_llm, update_weights  # noqa: E402

from _vllm_helpers import _gen, _prompts, _trainer_logprobs, random_checkpoint  # noqa: E402


@pytest.fixture(scope="module", params=["fp8_rowwise", "nvfp4_w4a4"])
def setup(request, tmp_path_factory):
    recipe = request.param
    folder, trainer = random_checkpoint(
        tmp_path_factory, lambda seed: build("debug", ModelOptions(quantization=Quantization(recipe))).init_weights(seed, 0.05), "bfloat16")
    llm = make_llm(folder, EngineSettings(dtype="bfloat16", kv_cache_mib=64, max_model_len=512, max_num_seqs=8,
                                          enable_prefix_caching=True, max_num_batched_tokens=64))
    yield llm, trainer, recipe
    del llm


def _assert_equal(trainer, prompts, res):
    for pi, (toks, mu, _) in zip(_trainer_logprobs(trainer, prompts, res), res):
        assert len(toks) > 0
        assert torch.equal(pi, mu), (pi - mu).abs().max()


def test_engine_holds_payload_and_scales(setup):
    llm, trainer, recipe = setup
    model = engine_model(llm)
    names = weight_recipes(trainer)
    assert len(names) == 28 and set(names.values()) == {recipe}  # q/k/v/o + gate/up/down, 4 layers
    held = {f"{n}.weight": m.qweight for n, m in model.named_modules() if getattr(m, "qweight", None) is not None}
    assert set(held) == set(names)
    assert all(isinstance(q, QuantizedWeight) and q.payload.element_size() == 1 for q in held.values())
    assert all(m.weight is None for n, m in model.named_modules() if getattr(m, "qweight", None) is not None)
    assert held_bytes(model) < 0.65 * held_bytes(trainer)  # the linears' bf16 weights are most of the model
    # nothing high-precision was quantized: embeddings, LM head, norms stay parameters
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= {n for n, _ in model.named_parameters()}


def test_alone_and_in_a_batch_of_8_mixed_lengths(setup, rng):
    llm, trainer, _ = setup
    prompts = _prompts(rng, [37, 3, 150, 64, 9, 100, 1, 77])
    _assert_equal(trainer, prompts[:1], _gen(llm, prompts[:1]))
    _assert_equal(trainer, prompts[2:3], _gen(llm, prompts[2:3]))
    _assert_equal(trainer, prompts, _gen(llm, prompts))


def test_chunked_prefill_splits(setup, rng):
    llm, trainer, _ = setup
    prompts = _prompts(rng, [200, 65, 130, 2, 63])  # split at 64-token boundaries, mixed with decodes
    _assert_equal(trainer, prompts, _gen(llm, prompts, max_tokens=16))


def test_prefix_cache_hits(setup, rng):
    llm, trainer, _ = setup
    shared = _prompts(rng, [160])[0]
    prompts = [shared + _prompts(rng, [5])[0], shared + _prompts(rng, [40])[0]]
    _gen(llm, prompts[:1])
    res = _gen(llm, prompts)
    assert res[1][2] >= 128, f"expected a prefix-cache hit, got {res[1][2]} cached tokens"
    _assert_equal(trainer, prompts, res)


def test_after_a_weight_sync_of_payload_and_scales(setup, rng):
    llm, trainer, recipe = setup
    state = {k: v + 0.02 * torch.randn(v.shape, generator=rng).to(v.dtype) for k, v in trainer.state_dict().items()}
    after = build("debug", ModelOptions(quantization=Quantization(recipe))).to(torch.bfloat16).eval()
    after.load_state_dict(state)
    recipes = weight_recipes(after)
    shipped = quantized_state(state, recipes)
    assert state_bytes(shipped) < 0.65 * state_bytes(state)
    update_weights(llm, shipped)
    # the checksum: the engine's dequantized payloads == the trainer's fake-quantized weights
    engine = {n: w for n, w in engine_weights(engine_model(llm)).items() if n in state}
    assert checkpoint_fingerprint(engine) == checkpoint_fingerprint(fake_quantized_state(state, recipes))
    assert checkpoint_fingerprint(engine) != checkpoint_fingerprint(state)  # quantized: not the masters
    prompts = _prompts(rng, [20, 90, 6])
    _assert_equal(after, prompts, _gen(llm, prompts))
    update_weights(llm, trainer.state_dict())  # a dense state is quantized on load: back to the fixture's
    engine = {n: w for n, w in engine_weights(engine_model(llm)).items() if n in state}
    assert checkpoint_fingerprint(engine) == checkpoint_fingerprint(fake_quantized_state(trainer.state_dict(),
                                                                                        recipes))


def test_trainer_gradient_is_straight_through(rng):
    """d loss / d W of a quantized linear = the gradient at the fake-quantized operands."""
    from titan_rl.kernels.quant import fake_quantize
    from titan_rl.models.layers import Linear
    from titan_rl.models.ops import Ops

    lin = Linear(96, 48, Ops(ModelOptions(quantization=Quantization("fp8_rowwise"))), "col", "mlp")
    lin.weight.data = torch.randn(48, 96, generator=rng)
    x = torch.randn(7, 96, generator=rng, requires_grad=True)
    lin(x).square().sum().backward()
    wq = fake_quantize(lin.weight.detach(), "fp8_rowwise", "weight").requires_grad_()
    xq = fake_quantize(x.detach(), "fp8_rowwise", "activation").requires_grad_()
    from titan_rl.kernels import linear
    linear(xq, wq).square().sum().backward()
    assert torch.equal(lin.weight.grad, wq.grad) and torch.equal(x.grad, xq.grad)


def test_stock_engine_refuses_a_recipe_vllm_cannot_run_online(tmp_path):
    with pytest.raises(ValueError, match=r"quantization = 'nvfp4' with kernels = 'stock': .*allowed with stock "
                                         r"kernels: \['none', 'fp8_rowwise'\]"):
        make_llm(str(tmp_path), EngineSettings(kernels="stock", quantization="nvfp4"))


@pytest.mark.parametrize("arch, flavor, recipe", [("qwen3_moe", "debug_moe", "mxfp8"),
                                                  ("qwen3_hybrid", "debug_hybrid", "nvfp4"),
                                                  ("qwen3_next", "debug_qwen3_next", "fp8_rowwise"),
                                                  ("qwen3_5", "debug_qwen35", "fp8_rowwise")])
def test_moe_and_hybrid_engines_hold_the_recipe_and_record_the_trainers_logprobs(tmp_path, arch, flavor, recipe,
                                                                              seed, rng):
    """The real engine (routed experts, GDN layers) on a quantized checkpoint: payload and
    scales held, its log-probs the trainer's fake-quantized ones bit for bit, in a batch and
    after a sync (tests/test_quant_cells.py has every recipe x architecture cell in one process)."""
    from titan_rl.checkpoint import load_hf_folder, save_hf_folder
    from titan_rl.registry import get_architecture

    options = ModelOptions(quantization=Quantization(recipe))
    model = get_architecture(arch).build(flavor, options).init_weights(seed % 2**31, 0.05)
    save_hf_folder(model, tmp_path, dtype=torch.bfloat16, arch=arch)
    trainer = load_hf_folder(tmp_path, dtype=torch.bfloat16, arch=arch).eval()
    llm = make_llm(str(tmp_path), EngineSettings(arch=arch, dtype="bfloat16", kv_cache_mib=64, max_model_len=256,
                                                 max_num_seqs=4, enable_prefix_caching=False))
    try:
        held = [m for m in engine_model(llm).modules() if getattr(m, "qweight", None) is not None]
        assert held and {m.qweight.recipe for m in held} == {recipe}
        prompts = _prompts(rng, [23, 2, 61, 9], vocab=trainer.cfg.vocab_size)
        _assert_equal(trainer, prompts, _gen(llm, prompts))
        state = {k: v + 0.02 * torch.randn(v.shape, generator=rng).to(v.dtype) for k, v in trainer.state_dict().items()}
        trainer.load_state_dict(state)
        update_weights(llm, quantized_state(state, weight_recipes(trainer)))
        _assert_equal(trainer, prompts, _gen(llm, prompts))
    finally:
        del llm
