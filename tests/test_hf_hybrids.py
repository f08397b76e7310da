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
from transformers import AutoModelForCausalLM

from titan_rl.checkpoint import load_hf_folder, save_hf_folder
from titan_rl.hf_reference import ARCHS, classes, hf_model
from titan_rl.models.common import choice_points

ATOL = 5e-5


def _hf_model(arch, seed, tied=False):
    return hf_model(arch, seed, tied=tied)


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
        own = [r.long() for r in choice_points.own(ours, "routes")]
        for layer, (theirs, p) in enumerate(zip(routes, probs)):
            top = p.topk(k + 1, -1).values
            near_tie = (top[:, k - 1] - top[:, k]) < 1e-5
            same = (own[layer].sort(-1).values == theirs.sort(-1).values).all(-1)
            assert bool((same | near_tie).all()), f"layer {layer}: other experts without a near tie"
        choice_points.force(ours, "routes", [r.to(torch.int16) for r in routes])
        with torch.no_grad():
            got = ours(tokens)
        choice_points.force(ours, "routes", None)
    diff = (got - want).abs().max().item()
    assert diff <= ATOL, f"max |ours - transformers| = {diff:.3g} > {ATOL}"
    assert want.std().item() > 1000 * ATOL  # the logits carry signal well above the tolerance
    return diff


@pytest.mark.parametrize("kernels", ["exact", "stock"])
@pytest.mark.parametrize("arch", ARCHS)
def test_a_transformers_folder_loads_strictly_and_gives_its_logits(tmp_path, arch, kernels, seed, rng):
    hf = _hf_model(arch, seed % 2**31, tied=arch == "qwen3_5")
    hf.save_pretrained(tmp_path)
    ours = load_hf_folder(tmp_path, kernels=kernels, dtype=torch.float32, arch=arch).eval()
    assert type(ours).__name__.lower().replace("_", "").startswith(arch.replace("_", ""))
    tokens = torch.randint(0, 997, (3, 37), generator=rng)
    print(f"{arch} {kernels}: max |ours - transformers| = {_compare(ours, hf, tokens):.3g}")


@pytest.mark.parametrize("arch", ARCHS)
def test_a_folder_we_write_loads_into_transformers(tmp_path, arch, seed, rng):
    hf = _hf_model(arch, seed % 2**31)
    hf.save_pretrained(tmp_path / "theirs")
    ours = load_hf_folder(tmp_path / "theirs", dtype=torch.float32, arch=arch).eval()
    save_hf_folder(ours, tmp_path / "ours", dtype=torch.float32, arch=arch, architecture=classes(arch)[1].__name__)
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ours"), dtype=torch.float32,
                                                local_files_only=True).eval()
    assert type(back) is classes(arch)[1]
    for (n, a), (m, b) in zip(sorted(hf.state_dict().items()), sorted(back.state_dict().items())):
        assert n == m and torch.equal(a, b), n  # every tensor round-trips exactly
    tokens = torch.randint(0, 997, (2, 23), generator=rng)
    _compare(ours, back, tokens)


def test_a_vision_language_folder_loads_its_text_model(tmp_path, seed, rng, capsys):
    from titan_rl.hf_reference import vl_model

    hf = vl_model(seed % 2**31)
    hf.save_pretrained(tmp_path)
    capsys.readouterr()
    ours = load_hf_folder(tmp_path, dtype=torch.float32, arch="qwen3_5").eval()
    note = capsys.readouterr().err.strip().splitlines()
    assert len(note) == 1 and "model.visual.*" in note[0] and "not loaded" in note[0], note
    tokens = torch.randint(0, 997, (2, 29), generator=rng)
    with torch.no_grad():
        want, got = hf(input_ids=tokens).logits, ours(tokens)
    diff = (got - want).abs().max().item()
    assert diff <= ATOL and want.std().item() > 1000 * ATOL, diff
