"""GLM-5's model file (models/glm_moe_dsa) against transformers' own GlmMoeDsaForCausalLM, its
folders (`model.name = "auto"`, strict loading, refusals in one line naming the key, before any
work starts for both `titan_rl.train` and `titan_rl.parity`), and the frozen indexer.

transformers' indexer picks among tied scores with torch.topk (relu makes exact ties at 0
common), ours takes the lowest positions: so the forward is compared with transformers'
own selections forced into ours (replay), and our selection is checked to be a top-k of the
same scores. Folders are written by transformers' classes at odd sizes (hidden 200, vocab 997,
3 indexer heads of 24, index_topk 16 below the prompt lengths), weights moved off their init."""

from __future__ import annotations

from functools import partial

import pytest
import torch

pytest.importorskip("transformers")

from _folders import both_refuse, edited_copy  # noqa: E402
from titan_rl import config  # noqa: E402
from titan_rl.checkpoint import load_hf_folder, save_hf_folder  # noqa: E402
from titan_rl.hf_reference import hf_model  # noqa: E402
from titan_rl.metrics import canonical_sets, index_disagreement  # noqa: E402
from titan_rl.parity import main as parity_main  # noqa: E402

CFG = "train_configs/debug_glm5.toml"
_both_refuse = partial(both_refuse, "train_configs/rl_debug_glm5.toml", CFG)
# Measured max |ours - transformers| / max |logit| with transformers' selections forced: 2.3e-6 at
# activations of ~90 after 3 layers (weights moved by N(0, 0.2)): fp32 rounding through three
# layers of different summation orders (absorbed vs decompressed MLA, fixed vs BLAS sums)
REL_TOL = 2e-5


def _hf_selections(hf, toks):
    """transformers' forward logits and, per indexer layer, its selected positions [B * L, topk]
    reduced to the causal ones (its top-k returns masked positions for rows with fewer than topk)."""
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaIndexer

    got = []
    hooks = [m.register_forward_hook(lambda _m, _a, out: got.append(out))
             for m in hf.modules() if isinstance(m, GlmMoeDsaIndexer)]
    try:
        with torch.no_grad():
            logits = hf(input_ids=toks).logits.float()
    finally:
        for h in hooks:
            h.remove()
    B, L = toks.shape
    pos = torch.arange(L).view(1, L, 1)
    k = hf.config.index_topk
    sets = []
    for out in got:
        o = out.long()
        o = torch.where(o <= pos, o, -1)
        o = torch.cat([o, o.new_full((B, L, max(k - o.shape[-1], 0)), -1)], -1)[..., :k]
        sets.append(canonical_sets(o).view(B * L, k))
    return logits, sets


@pytest.mark.parametrize("variant", ["default", "shared_indexer_and_groups", "tied"])
def test_forward_matches_transformers_within_fp32_rounding(tmp_path, rng, seed, variant):
    fields = {"shared_indexer_and_groups": dict(num_hidden_layers=4, first_k_dense_replace=2, n_routed_experts=8,
                                                n_group=4, topk_group=2, num_experts_per_tok=3,
                                                indexer_types=["full", "shared", "full", "shared"]),
              "tied": dict(num_hidden_layers=2)}.get(variant, {})
    hf = hf_model("glm_moe_dsa", seed % 2**31, scale=0.2, tied=variant == "tied", **fields)
    hf.save_pretrained(tmp_path)
    ours = load_hf_folder(tmp_path, kernels="exact", dtype=torch.float32, arch="glm_moe_dsa").eval()
    toks = torch.randint(2, 997, (3, 45), generator=rng)
    ref, sets = _hf_selections(hf, toks)
    with torch.no_grad():
        own_logits = ours(toks)
        own = [s.long() for s in ours.last_own_indices]
        ours.set_index_override(sets)
        forced = ours(toks)
        ours.set_index_override(None)
    err = float((forced - ref).abs().max()) / float(ref.abs().max())
    assert err < REL_TOL, err
    # ours differs from transformers only where torch.topk broke ties another way
    assert len(own) == len(sets) == sum(t == "full" for t in hf.config.indexer_types)
    d = index_disagreement(torch.stack(own, 1), torch.stack(sets, 1))
    assert d < 0.5, d
    if d == 0:
        torch.testing.assert_close(own_logits, ref, atol=REL_TOL * float(ref.abs().max()), rtol=0)


def test_a_folder_we_write_loads_into_transformers_with_every_tensor_equal(tmp_path):
    from transformers import AutoModelForCausalLM

    from titan_rl.registry import get_architecture

    ours = get_architecture("glm_moe_dsa").build("debug_glm5").init_weights(3, 0.05)
    save_hf_folder(ours, tmp_path, architecture="GlmMoeDsaForCausalLM", dtype=torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    mine = {k: v for k, v in ours.state_dict().items()}
    theirs = {**dict(hf.named_parameters()), **{n: b for n, b in hf.named_buffers() if "rotary" not in n}}
    # transformers fuses the experts on load ([E, 2I, H] gate_up, [E, H, I] down)
    for n, t in theirs.items():
        if ".experts.gate_up_proj" in n:
            pre = n.removesuffix("gate_up_proj")
            g = torch.stack([mine.pop(f"{pre}{e}.gate_proj.weight") for e in range(t.shape[0])])
            u = torch.stack([mine.pop(f"{pre}{e}.up_proj.weight") for e in range(t.shape[0])])
            assert torch.equal(t, torch.cat([g, u], 1)), n
        elif ".experts.down_proj" in n:
            pre = n.removesuffix("down_proj")
            assert torch.equal(t, torch.stack([mine.pop(f"{pre}{e}.down_proj.weight") for e in range(t.shape[0])])), n
        else:
            assert torch.equal(t, mine.pop(n)), n
    assert not mine, sorted(mine)


# -- folders through the command lines -------------------------------------------------------

@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("glm")
    hf_model("glm_moe_dsa", 0, scale=0.2).save_pretrained(root / "hf")
    return root / "hf"


def test_auto_takes_glm5_from_config_json(folder):
    cfg = config.load(CFG, ["--model.name=auto", f"--model.checkpoint={folder}"])
    assert cfg.model.name == "glm_moe_dsa"


@pytest.mark.parametrize("case,edit_config,edit_tensors,pattern", [
    ("missing indexer tensor", None, lambda t: t.pop("model.layers.1.self_attn.indexer.wk.weight"),
     r"missing key model.layers.1.self_attn.indexer.wk.weight: expected shape \[24, 200\]"),
    ("missing correction bias", None, lambda t: t.pop("model.layers.2.mlp.gate.e_score_correction_bias"),
     r"missing key model.layers.2.mlp.gate.e_score_correction_bias: expected shape \[5\]"),
    ("wrong latent shape", None, lambda t: t.update({"model.layers.0.self_attn.kv_b_proj.weight": torch.zeros(176, 41)}),
     r"wrong shape for model.layers.0.self_attn.kv_b_proj.weight: expected \[176, 40\], found \[176, 41\]"),
    ("yarn rope", lambda c: c.update(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}), None,
     r"rope_parameters.rope_type = 'yarn' is not supported; allowed: \['default'\]"),
    ("no q latent", lambda c: c.update(q_lora_rank=None), None, r"q_lora_rank = None is not supported"),
    ("shared first indexer", lambda c: c.update(indexer_types=["shared", "full", "full"]), None,
     r"indexer_types\[0\] = 'shared'.*layer 0 must be 'full'"),
    ("indexer types of the wrong length", lambda c: c.update(indexer_types=["full", "full"]), None,
     r"indexer_types = \['full', 'full'\]: needs num_hidden_layers = 3 entries"),
])
def test_bad_folders_are_refused_in_one_line(folder, tmp_path, capsys, case, edit_config, edit_tensors, pattern):
    bad = edited_copy(folder, tmp_path / "case", edit_config, edit_tensors)
    _both_refuse(["--model.name=auto", f"--model.checkpoint={bad}"], pattern, capsys, tmp_path)


def test_sparse_attention_keys_need_a_model_with_an_indexer(capsys, tmp_path):
    for key in ("--rollout.index_selection=replay", "--model.freeze_indexer=true"):
        capsys.readouterr()
        assert parity_main(["--config", "train_configs/debug_moe.toml", key]) == 2
        err = capsys.readouterr().err.strip()
        assert "needs a sparse-attention model (an indexer); model.name = 'qwen3_moe' has none" in err, err
    assert parity_main(["--config", CFG, "--rollout.index_selection=sometimes"]) == 2
    assert "allowed: ['pinned', 'replay']" in capsys.readouterr().err


def test_frozen_indexer_gets_no_gradient_and_leaves_the_optimizer(rng):
    """model.freeze_indexer: the TorchTitan model is built with the indexers' parameters frozen;
    a training step leaves them bitwise as they were and moves the rest."""
    from titan_rl.models.options import ModelOptions
    from titan_rl.titan.spec import model_config

    m = model_config("glm_moe_dsa", "debug_glm5", ModelOptions(), frozen=(".self_attn.indexer.",)).build()
    m.init_weights(seed=1, std=0.05)
    frozen = {n for n, p in m.named_parameters() if not p.requires_grad}
    assert frozen == {n for n, _ in m.named_parameters() if ".self_attn.indexer." in n or n.endswith("correction_bias")}
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    toks = torch.randint(2, 997, (2, 40), generator=rng)
    m(toks).logsumexp(-1).mean().backward()
    assert all(p.grad is None for n, p in m.named_parameters() if n in frozen)
    opt.step()
    for n, p in m.named_parameters():
        assert torch.equal(p, before[n]) == (n in frozen), n


def test_a_replayed_set_with_positions_a_row_cannot_see_is_refused(rng):
    from titan_rl.registry import get_architecture

    m = get_architecture("glm_moe_dsa").build("debug_glm5").init_weights(2, 0.05).eval()
    toks = torch.randint(2, 997, (1, 30), generator=rng)
    with torch.no_grad():
        m(toks)
        sets = [s.long().clone() for s in m.last_own_indices]
    sets[1][4, 1] = 7  # position 4 would attend to position 7
    m.set_index_override(sets)
    with pytest.raises(ValueError, match=r"layer 1: replayed key set \[0, 7, .* of position 4 is not ascending"):
        with torch.no_grad():
            m(toks)
