"""The ArchitectureSpec says what each engine must know, as typed fields; the TP plan is
data in each model folder, checked against the model's Linear kinds."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from titan_rl.models import qwen3, qwen3_hybrid, qwen3_moe
from titan_rl.parallel.plan import TPPlan
from titan_rl.registry import ArchitectureSpec, architecture_of, get_architecture
from titan_rl.titan.spec import model_config


def test_the_builtins_say_what_they_are():
    dense, moe, hybrid = (get_architecture(n) for n in ("qwen3", "qwen3_moe", "qwen3_hybrid"))
    assert (dense.moe, dense.recurrent_state, dense.tp_plan is not None) == (False, False, True)
    assert (moe.moe, moe.recurrent_state, moe.tp_plan is not None) == (True, False, True)
    assert (hybrid.moe, hybrid.recurrent_state, isinstance(hybrid.tp_plan, TPPlan)) == (False, True, True)


def test_architecture_of_plain_and_titan_built_models():
    assert architecture_of(qwen3.build("debug")).name == "qwen3"
    assert architecture_of(qwen3_moe.build("debug_moe")).name == "qwen3_moe"
    assert architecture_of(qwen3_hybrid.build("debug_hybrid")).name == "qwen3_hybrid"
    assert architecture_of(model_config("qwen3_moe", "debug_moe").build()).name == "qwen3_moe"
    with pytest.raises(ValueError, match="not a registered titan_rl architecture"):
        architecture_of(torch.nn.Linear(2, 2))


def test_tp_plans_resolve_to_the_linear_kinds():
    def layer_tp_plan(layer):
        return architecture_of(model).tp_plan.resolve(layer)

    model = qwen3.build("debug")
    dense = layer_tp_plan(model.model.layers[0])
    assert sorted(dense["colwise"]) == sorted(["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                               "mlp.gate_proj", "mlp.up_proj"])
    assert sorted(dense["rowwise"]) == ["mlp.down_proj", "self_attn.o_proj"]
    model = qwen3_moe.build("debug_moe")
    moe = layer_tp_plan(model.model.layers[0])
    n = model.cfg.num_experts
    assert sorted(moe["colwise"]) == sorted(
        ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]
        + [f"mlp.experts.{e}.{p}" for e in range(n) for p in ("gate_proj", "up_proj")])
    assert sorted(moe["rowwise"]) == sorted(["self_attn.o_proj"] + [f"mlp.experts.{e}.down_proj" for e in range(n)])
    assert "mlp.gate" not in moe["colwise"] + moe["rowwise"]  # the router stays replicated
    assert dense["heads"] == moe["heads"] == ["self_attn"]
    model = qwen3_hybrid.build("debug_hybrid")
    hybrid = model.model.layers
    gdn, full = layer_tp_plan(hybrid[0]), layer_tp_plan(hybrid[3])
    assert sorted(gdn["colwise"]) == sorted(["linear_attn.in_proj_qkvz", "linear_attn.in_proj_ba",
                                             "mlp.gate_proj", "mlp.up_proj"])
    assert sorted(gdn["rowwise"]) == ["linear_attn.out_proj", "mlp.down_proj"]
    assert (gdn["heads"], full["heads"]) == (["linear_attn"], ["self_attn"])


def test_a_spec_without_tp_must_say_why():
    base = get_architecture("qwen3")
    with pytest.raises(ValueError, match="tp_plan = None needs no_tp_reason"):
        replace(base, name="x", tp_plan=None)
    with pytest.raises(ValueError, match="tp_plan = 'rows'"):
        replace(base, name="x", tp_plan="rows")
    assert isinstance(replace(base, name="x", tp_plan=None, no_tp_reason="why"), ArchitectureSpec)


def test_a_plan_that_disagrees_with_the_maths_is_refused(monkeypatch):
    """The model computes a Linear's kind in one process (Ops.linear_for): a plan splitting
    it the other way, or leaving it unsplit, would give other bits under TP."""
    import torch.distributed as dist

    from titan_rl.models.qwen3.parallelize import TP_PLAN
    from titan_rl.parallel.plan import apply_plan

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)  # the check runs before any collective
    swapped = TPPlan(layer={**TP_PLAN.layer, "mlp.down_proj": "colwise"}, heads=TP_PLAN.heads, divides=TP_PLAN.divides)
    missing = TPPlan(layer={k: v for k, v in TP_PLAN.layer.items() if k != "mlp.up_proj"}, heads=TP_PLAN.heads)
    for plan, match in ((swapped, r"mlp.down_proj is split colwise but is a 'row' Linear"),
                        (missing, r"mlp.up_proj is a 'col' Linear the plan does not split")):
        with pytest.raises(ValueError, match=match):
            apply_plan(qwen3.build("debug"), plan, object(), lambda lin, dim: None)


def test_qwen35_plan_keeps_in_proj_qkv_whole(monkeypatch):
    """Qwen3.5's in_proj_qkv (q, then k, then v of all heads: a rank's heads are three row
    ranges) is neither split by the plan nor left unmentioned: it is named `whole`, and a plan
    without that is refused like any unsplit 'col' Linear."""
    import torch.distributed as dist

    from titan_rl.models import qwen3_5
    from titan_rl.parallel.plan import apply_plan

    model = qwen3_5.build("debug_qwen35")
    plan = architecture_of(model).tp_plan
    gdn = plan.resolve(model.model.layers[0])
    assert sorted(gdn["colwise"]) == sorted(["linear_attn.in_proj_z", "linear_attn.in_proj_b", "linear_attn.in_proj_a",
                                             "mlp.gate_proj", "mlp.up_proj"])
    assert plan.whole == ("linear_attn.in_proj_qkv",)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)  # the check runs before any collective
    with pytest.raises(ValueError, match=r"linear_attn.in_proj_qkv is a 'col' Linear the plan does not split"):
        apply_plan(model, replace(plan, whole=()), object(), lambda lin, dim: None)
