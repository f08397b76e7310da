"""Qwen3-Next, Qwen3.5 and Qwen3.5-MoE against transformers' own classes, both ways: a folder
transformers writes (odd sizes: hidden 200, vocab 997, 3 value heads per key head, 5
experts of 72, a shared expert of 88) loads strictly into ours and gives transformers'
logits; a folder we write loads back into transformers and gives ours.

Closeness, not identity (two implementations): measured max |ours - transformers| over the
fp32 logits (std ~0.4) is 1.1e-6 .. 2.2e-6 in both kernel modes (fp32 rounding through 4
layers; the GDN recurrence vs transformers' chunked form). ATOL = 5e-5 is ~20x that; a
modelling slip is far above it (the (1 + w) norm read as w moves the logits by O(1), a
rotary_dim of head_dim instead of a quarter by ~1e-1). Routing: transformers' experts are
recorded and ours must choose the same, except where transformers' k-th and (k+1)-th
router probabilities lie within 1e-5 (a near tie fp32 noise may break either way); ours
then runs with transformers' experts (router replay) so the comparison stays one of
arithmetic.
"""

import pytest
import torch

try:
    import transformers  # noqa: F401
except ModuleNotFoundError as e:  # transformers is a dev extra; a broken import must fail, not skip
    if e.name != "transformers":
        raise
    pytest.skip("transformers is not installed", allow_module_level=True)
from transformers import AutoModelForCausalLM, Qwen3NextConfig, Qwen3NextForCausalLM
from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig
from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

from titan_rl.checkpoint import load_hf_folder, save_hf_folder

ATOL = 5e-5
ODD = dict(vocab_size=997, hidden_size=200, intermediate_size=328, num_hidden_layers=4, num_attention_heads=4,
           num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=6,
           linear_key_head_dim=32, linear_value_head_dim=16, linear_conv_kernel_dim=3, max_position_embeddings=512)
MOE = dict(num_experts=5, num_experts_per_tok=2, moe_intermediate_size=72, shared_expert_intermediate_size=88)
CASES = {
    "qwen3_next": (Qwen3NextConfig, Qwen3NextForCausalLM, MOE),
    "qwen3_5": (Qwen3_5TextConfig, Qwen3_5ForCausalLM, {}),
    "qwen3_5_moe": (Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM, MOE),
}


def _hf_model(arch, seed, tied=False):
    config_cls, model_cls, extra = CASES[arch]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**ODD, **extra, tie_word_embeddings=tied)).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # transformers inits routers and norms to zero: move them so routing varies
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g))
    return model


def _hf_routes(model, tokens):
    """transformers' logits and, per MoE layer, its experts [T, k] and router probabilities."""
    routes, probs, hooks = [], [], []

    def record(mod, args, out):  # (router logits, weights, indices); returns None: the output is kept
        routes.append(out[2])
        probs.append(out[0].float().softmax(-1))

    for layer in model.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None:
            hooks.append(gate.register_forward_hook(record))
    with torch.no_grad():
        logits = model(input_ids=tokens).logits
    for h in hooks:
        h.remove()
    return logits, routes, probs


def _compare(ours, hf, tokens):
    want, routes, probs = _hf_routes(hf, tokens)
    with torch.no_grad():
        got = ours(tokens)
    if routes:
        k = routes[0].shape[1]
        own = [r.long() for r in ours.last_own_routes]
        for layer, (theirs, p) in enumerate(zip(routes, probs)):
            top = p.topk(k + 1, -1).values
            near_tie = (top[:, k - 1] - top[:, k]) < 1e-5
            same = (own[layer].sort(-1).values == theirs.sort(-1).values).all(-1)
            assert bool((same | near_tie).all()), f"layer {layer}: other experts without a near tie"
        ours.set_route_override([r.to(torch.int16) for r in routes])
        with torch.no_grad():
            got = ours(tokens)
        ours.set_route_override(None)
    diff = (got - want).abs().max().item()
    assert diff <= ATOL, f"max |ours - transformers| = {diff:.3g} > {ATOL}"
    assert want.std().item() > 1000 * ATOL  # the logits carry signal well above the tolerance
    return diff


@pytest.mark.parametrize("kernels", ["exact", "stock"])
@pytest.mark.parametrize("arch", list(CASES))
def test_a_transformers_folder_loads_strictly_and_gives_its_logits(tmp_path, arch, kernels, seed, rng):
    hf = _hf_model(arch, seed % 2**31, tied=arch == "qwen3_5")
    hf.save_pretrained(tmp_path)
    ours = load_hf_folder(tmp_path, kernels=kernels, dtype=torch.float32, arch=arch).eval()
    assert type(ours).__name__.lower().replace("_", "").startswith(arch.replace("_", ""))
    tokens = torch.randint(0, 997, (3, 37), generator=rng)
    print(f"{arch} {kernels}: max |ours - transformers| = {_compare(ours, hf, tokens):.3g}")


@pytest.mark.parametrize("arch", list(CASES))
def test_a_folder_we_write_loads_into_transformers(tmp_path, arch, seed, rng):
    hf = _hf_model(arch, seed % 2**31)
    hf.save_pretrained(tmp_path / "theirs")
    ours = load_hf_folder(tmp_path / "theirs", dtype=torch.float32, arch=arch).eval()
    save_hf_folder(ours, tmp_path / "ours", dtype=torch.float32, arch=arch, architecture=CASES[arch][1].__name__)
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ours"), dtype=torch.float32,
                                                local_files_only=True).eval()
    assert type(back) is CASES[arch][1]
    for (n, a), (m, b) in zip(sorted(hf.state_dict().items()), sorted(back.state_dict().items())):
        assert n == m and torch.equal(a, b), n  # every tensor round-trips exactly
    tokens = torch.randint(0, 997, (2, 23), generator=rng)
    _compare(ours, back, tokens)
