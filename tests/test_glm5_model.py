"""GLM-5's model file (models/glm_moe_dsa) against transformers' own GlmMoeDsaForCausalLM, its
folders (`model.name = "auto"`, strict loading, refusals in one line naming the key, before any
work starts for both `titan_rl.train` and `titan_rl.parity`), and the indexer's training (its own
loss, or frozen).

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
from titan_rl.kernels.indexer.reference import index_scores_reference  # noqa: E402
from titan_rl.metrics import canonical_sets  # noqa: E402
from titan_rl.parity import main as parity_main  # noqa: E402
from titan_rl.models.common import choice_points  # noqa: E402

CFG = "train_configs/debug_glm5.toml"
_both_refuse = partial(both_refuse, "train_configs/rl_debug_glm5.toml", CFG)
# Measured max |ours - transformers| / max |logit| with transformers' selections forced: 2.3e-6 at
# activations of ~90 after 3 layers (weights moved by N(0, 0.2)): fp32 rounding through three
# layers of different summation orders (absorbed vs decompressed MLA, fixed vs BLAS sums)
REL_TOL = 2e-5
# Index scores: the two models' indexer inputs differ by that rounding, so a near-tie at the
# top-k boundary may order either way within it (measured: every difference an exact tie at 0)
SCORE_TOL = 2e-5


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


def _indexer_inputs(model) -> list:
    """Hooks recording each indexer layer's (attention module, input rows, positions)."""
    seen = []
    hooks = [layer.self_attn.register_forward_pre_hook(lambda mod, args: seen.append((mod, args[0], args[1])))
             for layer in model.model.layers if layer.self_attn.indexer is not None]
    return seen, hooks


def _index_scores(attn, x, positions, B: int, L: int) -> list[torch.Tensor]:
    """Per query row, the fp64 index scores of its sequence's positions 0..pos (the kernels'
    reference) from this layer's indexer query, weights and keys."""
    ix = attn.indexer
    with torch.no_grad():
        keys = ix.key(x, positions).view(B, L, -1)
        q, w = ix.queries(x, attn.q_a_layernorm(attn.q_a_proj(x)), positions)
    return index_scores_reference(q, w, keys, torch.arange(B).view(B, 1), torch.arange(B).repeat_interleave(L),
                                  positions, 0, attn.index_scale)


@pytest.mark.parametrize("variant", ["default", "shared_indexer_and_groups", "tied"])
def test_forward_matches_transformers_within_fp32_rounding(tmp_path, rng, seed, variant):
    """With transformers' selections forced into ours, the logits agree to fp32 rounding, and
    our indexer's own choice in that forward (its inputs are transformers' up to rounding)
    differs from transformers' only by ties: in every row both sets are a top-k of the fp64
    scores, and every position in one set and not the other scores the k-th score (up to
    SCORE_TOL x the row's largest score: fp32 rounding of the inputs). The ties are relu's exact zeros (measured on 12 folders: 4-13 of 135 rows per layer differ, all
    with the boundary score 0; torch.topk returns some of the tied positions, we the lowest).
    Without forcing, one differing set changes every later layer's inputs, so the unforced
    disagreement measures that cascade, not the indexer."""
    fields = {"shared_indexer_and_groups": dict(num_hidden_layers=4, first_k_dense_replace=2, n_routed_experts=8,
                                                n_group=4, topk_group=2, num_experts_per_tok=3,
                                                indexer_types=["full", "shared", "full", "shared"]),
              "tied": dict(num_hidden_layers=2)}.get(variant, {})
    hf = hf_model("glm_moe_dsa", seed % 2**31, scale=0.2, tied=variant == "tied", **fields)
    hf.save_pretrained(tmp_path)
    ours = load_hf_folder(tmp_path, kernels="exact", dtype=torch.float32, arch="glm_moe_dsa").eval()
    B, L = 3, 45
    toks = torch.randint(2, 997, (B, L), generator=rng)
    ref, sets = _hf_selections(hf, toks)
    seen, hooks = _indexer_inputs(ours)
    with torch.no_grad():
        choice_points.force(ours, "indices", sets)
        forced = ours(toks)
        own = [s.long() for s in choice_points.own(ours, "indices")]
        choice_points.force(ours, "indices", None)
    for h in hooks:
        h.remove()
    err = float((forced - ref).abs().max()) / float(ref.abs().max())
    assert err < REL_TOL, err
    assert len(own) == len(sets) == len(seen) == sum(t == "full" for t in hf.config.indexer_types)
    for layer, ((attn, x, positions), mine, theirs) in enumerate(zip(seen, own, sets)):
        for r, scores in enumerate(_index_scores(attn, x, positions, B, L)):
            if torch.equal(mine[r], theirs[r]):
                continue
            kth, tol = float(scores[theirs[r][theirs[r] >= 0]].min()), SCORE_TOL * float(scores.abs().max())
            for chosen in (mine[r], theirs[r]):
                out = torch.ones(scores.shape[0], dtype=torch.bool)
                out[chosen[chosen >= 0]] = False
                assert float(scores[out].max()) <= kth + tol and kth - tol <= float(scores[~out].min()), (layer, r)
            differ = sorted(set(mine[r].tolist()) ^ set(theirs[r].tolist()))
            assert ((scores[differ] - kth).abs() <= tol).all(), (layer, r, scores[differ], kth)


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
    for key in ("--rollout.index_selection=replay", "--model.freeze_indexer=true", "--model.indexer_loss_coef=0.5"):
        capsys.readouterr()
        assert parity_main(["--config", "train_configs/debug_moe.toml", key]) == 2
        err = capsys.readouterr().err.strip()
        assert "needs a sparse-attention model (an indexer); model.name = 'qwen3_moe' has none" in err, err
    assert parity_main(["--config", CFG, "--rollout.index_selection=sometimes"]) == 2
    assert "allowed: ['pinned', 'replay']" in capsys.readouterr().err
    for bad in ("0", "-1", "nan"):
        assert parity_main(["--config", CFG, f"--model.indexer_loss_coef={bad}"]) == 2
        err = capsys.readouterr().err.strip()
        assert "must be a finite number > 0 (to leave the indexers untrained, set model.freeze_indexer = true)" in err


def _glm5(frozen: bool):
    from titan_rl.models.options import ModelOptions
    from titan_rl.titan.spec import model_config

    m = model_config("glm_moe_dsa", "debug_glm5", ModelOptions(),
                     frozen=(".self_attn.indexer.",) if frozen else ()).build()
    return m.init_weights(seed=1, std=0.05)


def _indexer(name: str) -> bool:
    return ".self_attn.indexer." in name


def _step(m, toks, with_indexer_loss: bool) -> dict:
    """One forward + backward of a stand-in policy loss (+ the indexer loss x 0.7) and an AdamW
    step with weight decay; the gradients before the step, by name."""
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    loss = m(toks).logsumexp(-1).mean()
    if with_indexer_loss:
        loss = loss + 0.7 * m.indexer_loss
    loss.backward()
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in m.named_parameters()}
    opt.step()
    return grads


def test_the_indexer_is_trained_by_its_own_loss_unless_frozen(rng):
    """model.freeze_indexer = false: the indexer loss (KL from the attention's distribution to
    the indexer's over the selected keys) gives every indexer parameter a non-zero gradient and
    moves it, and changes no other parameter's gradient (torch.equal with the policy loss alone,
    and with the frozen model's); true: the indexers' parameters are built frozen, get no
    gradient, the model computes no indexer loss, and a step leaves them bitwise as they were."""
    toks = torch.randint(2, 997, (2, 37), generator=rng)
    policy_only = _step(_glm5(frozen=False), toks, with_indexer_loss=False)
    trained, frozen = _glm5(frozen=False), _glm5(frozen=True)
    before = {n: p.detach().clone() for n, p in trained.named_parameters()}
    g_trained, g_frozen = _step(trained, toks, with_indexer_loss=True), _step(frozen, toks, with_indexer_loss=False)
    assert frozen.indexer_loss is None and float(trained.indexer_loss.detach()) > 0
    names = [n for n, _ in trained.named_parameters()]
    indexer = [n for n in names if _indexer(n)]
    assert len(indexer) == 15  # 3 indexer layers x (wq_b, wk, k_norm weight and bias, weights_proj)
    for n in indexer:
        assert g_trained[n] is not None and g_trained[n].abs().max() > 0, n
        assert g_frozen[n] is None and not dict(frozen.named_parameters())[n].requires_grad, n
    for n in names:
        if not _indexer(n) and not n.endswith("correction_bias"):
            assert torch.equal(g_trained[n], policy_only[n]) and torch.equal(g_trained[n], g_frozen[n]), n
    after_t, after_f = dict(trained.named_parameters()), dict(frozen.named_parameters())
    for n in names:
        moves = not n.endswith("correction_bias")
        assert (not torch.equal(after_t[n], before[n])) == moves, n
        assert (not torch.equal(after_f[n], before[n])) == (moves and not _indexer(n)), n


def test_the_indexer_loss_is_the_kl_to_the_attention_and_training_lowers_it(rng):
    """Layer 0's loss against a recomputation from the definition (per row: the attention's
    probabilities over the row's selected keys from the decompressed keys q_nope . W_uk c_kv +
    q_rope . k_rope, summed over heads and L1-normalised; the indexer's softmax over the same
    keys; KL; the mean over rows) in fp64 from the layer's fp32 projections: equal up to fp32
    rounding (rel 1e-5; measured ~1e-6: the model sums in fp32, absorbed, in another order).
    AdamW steps on the indexer loss alone lower it at every step (sets pinned: training moves
    the indexer's own choice, and small steps on a smooth function descend)."""
    m = _glm5(frozen=False)
    toks = torch.randint(2, 997, (1, 29), generator=rng)
    attn = m.model.layers[0].self_attn
    seen = {}
    hooks = [attn.register_forward_pre_hook(lambda mod, args: seen.update(x=args[0].detach(), pos=args[1])),
             attn.register_forward_hook(lambda mod, args, out: seen.update(loss=mod.indexer_loss.detach()))]
    m(toks)
    for h in hooks:
        h.remove()
    ref = _indexer_loss_reference(attn, seen["x"], seen["pos"], choice_points.used(m, "indices")[0].long())
    assert abs(float(seen["loss"]) - ref) <= 1e-5 * max(1.0, ref), (float(seen["loss"]), ref)
    choice_points.force(m, "indices", [s.long() for s in choice_points.used(m, "indices")])
    opt = torch.optim.AdamW([p for n, p in m.named_parameters() if _indexer(n)], lr=2e-3)
    losses = []
    for _ in range(8):
        opt.zero_grad()
        m(toks)
        losses.append(float(m.indexer_loss.detach()))
        m.indexer_loss.backward()
        opt.step()
    assert all(b < a for a, b in zip(losses, losses[1:])), losses


def _indexer_loss_reference(attn, x, pos, sets) -> float:
    from titan_rl.models.glm_moe_dsa.model import interleaved_rope

    ix, T = attn.indexer, x.shape[0]
    with torch.no_grad():
        q_latent = attn.q_a_layernorm(attn.q_a_proj(x))
        q = attn.q_b_proj(q_latent).view(T, attn.h, -1)
        q_nope, q_pe = q[..., : attn.nope], interleaved_rope(attn.ops, q[..., attn.nope:], pos, attn.theta)
        kv = attn.kv_a_proj_with_mqa(x)
        c_kv = attn.kv_a_layernorm(kv[:, : attn.kv_lora])
        k_pe = interleaved_rope(attn.ops, kv[:, None, attn.kv_lora:], pos, attn.theta)[:, 0]
        w_uk = attn.kv_b_proj.weight.view(attn.h, attn.nope + attn.v, attn.kv_lora)[:, : attn.nope]
        k_nope = torch.einsum("hdc,jc->jhd", w_uk.double(), c_kv.double())
        s = (torch.einsum("thd,jhd->thj", q_nope.double(), k_nope)
             + torch.einsum("thr,jr->thj", q_pe.double(), k_pe.double())) * attn.scale
        ki = ix.key(x, pos).double()
        qi, wi = ix.queries(x, q_latent, pos)
        si = torch.einsum("th,thj->tj", wi.double(),
                          torch.relu(torch.einsum("thd,jd->thj", qi.double(), ki) * attn.index_scale))
    total = 0.0
    for t in range(T):
        sel = sets[t][sets[t] >= 0]
        p = torch.softmax(s[t][:, sel], -1).sum(0)
        p = p / p.sum()
        total += float((p * (p.log() - torch.log_softmax(si[t, sel], -1))).sum())
    return total / T


def test_a_replayed_set_with_positions_a_row_cannot_see_is_refused(rng):
    from titan_rl.registry import get_architecture

    m = get_architecture("glm_moe_dsa").build("debug_glm5").init_weights(2, 0.05).eval()
    toks = torch.randint(2, 997, (1, 30), generator=rng)
    with torch.no_grad():
        m(toks)
        sets = [s.long().clone() for s in choice_points.own(m, "indices")]
    sets[1][4, 1] = 7  # position 4 would attend to position 7
    choice_points.force(m, "indices", sets)
    with pytest.raises(ValueError, match=r"layer 1: replayed key set \[0, 7, .* of position 4 is not ascending"):
        with torch.no_grad():
            m(toks)
