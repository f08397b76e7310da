"""Every quantization recipe on every architecture (5 x 6 cells): the
engine's forward (weights as a sync ships them: payload + scales, held in its own copy,
prepared once) equals the trainer's fake-quantized forward, bit for bit, for a batch and
for each row alone, and again after a second sync of new weights. The engine's weight
handling is the code the vLLM wrapper runs (Linear.load_quantized, prepare_for_engine);
vLLM's paged attention around it is tests/test_quant_vllm.py's. fp32 on the dense model, bf16
(what quantized runs use) on all; Qwen3-Next, Qwen3.5 and Qwen3.5-MoE too."""

import pytest
import torch

from titan_rl.kernels.quant.recipes import QUANT_RECIPES
from titan_rl.models.layers import Linear, prepare_for_engine
from titan_rl.models.options import ModelOptions, Quantization
from titan_rl.quant_weights import quantized_state, weight_recipes
from titan_rl.registry import get_architecture

ARCHS = [("qwen3", "debug"), ("qwen3_moe", "debug_moe"), ("qwen3_hybrid", "debug_hybrid")]
# The real hybrids' debug flavors are odd-sized (hidden 200: only fp8_rowwise's per-row
# scales fit it); every recipe runs on them at widths its blocks divide (128: fp8_block).
BLOCK_FIT = dict(hidden_size=256, intermediate_size=384, head_dim=64, linear_num_value_heads=4, linear_value_head_dim=32,
                 linear_key_head_dim=64)
MOE_FIT = dict(moe_intermediate_size=128, shared_expert_intermediate_size=128)
HYBRIDS = [("qwen3_next", "debug_qwen3_next", {**BLOCK_FIT, **MOE_FIT}), ("qwen3_5", "debug_qwen35", BLOCK_FIT),
           ("qwen3_5_moe", "debug_qwen35_moe", {**BLOCK_FIT, **MOE_FIT})]


def _sync(trainer, engine, dtype) -> None:
    """What a weight sync does: the trainer's weights in the engine's dtype, covered ones
    quantized once and shipped as payload + scales (titan_rl.quant_weights)."""
    state = {n: p.detach().to(dtype) for n, p in trainer.named_parameters()}
    quantized = {f"{n}.weight": m for n, m in engine.named_modules() if isinstance(m, Linear) and m.recipe is not None}
    params = dict(engine.named_parameters())
    with torch.no_grad():
        for name, t in quantized_state(state, weight_recipes(trainer)).items():
            if name in quantized:
                quantized[name].load_quantized(name, t, dtype)
            else:
                params[name].copy_(t)
    prepare_for_engine(engine)


CELLS = [(arch, flavor, recipe, dtype, {}) for arch, flavor in ARCHS for recipe in QUANT_RECIPES[1:]
         for dtype in ((torch.bfloat16, torch.float32) if arch == "qwen3" else (torch.bfloat16,))]
CELLS += [(arch, flavor, recipe, torch.bfloat16, fit) for arch, flavor, fit in HYBRIDS for recipe in QUANT_RECIPES[1:]]
CELLS += [(arch, flavor, "fp8_rowwise", torch.bfloat16, {}) for arch, flavor, _ in HYBRIDS]


def _id(v):
    return ("fit" if v else "odd") if isinstance(v, dict) else str(v).removeprefix("torch.")


@pytest.mark.parametrize("arch,flavor,recipe,dtype,sizes", CELLS, ids=_id)
def test_engine_forward_equals_the_trainers(arch, flavor, recipe, dtype, sizes, seed):
    spec = get_architecture(arch)
    options = ModelOptions(quantization=Quantization(recipe))
    trainer = spec.build(flavor, options, **sizes).init_weights(seed % 2**31, 0.05).to(dtype).eval()
    engine = spec.build(flavor, options, **sizes).to(dtype).eval()
    assert weight_recipes(trainer) and set(weight_recipes(trainer).values()) == {recipe}
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, trainer.cfg.vocab_size, (5, 23), generator=g)
    for sync in range(2):
        _sync(trainer, engine, dtype)
        held = [m.qweight for m in engine.modules() if isinstance(m, Linear) and m.recipe is not None]
        assert held and all(q is not None for q in held)
        with torch.no_grad():
            full = trainer(tokens)
            assert torch.equal(engine(tokens), full), (arch, recipe, sync)
            for i in (0, 3):
                assert torch.equal(engine(tokens[i:i + 1])[0], full[i]), (arch, recipe, sync, i)
            for p in trainer.parameters():  # the next sync ships other weights
                p.add_(0.01 * torch.randn(p.shape, generator=g).to(p.dtype))
