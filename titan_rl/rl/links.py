"""The engine link `rollout.placement` names (titan_rl.rl.engine_link)."""

from __future__ import annotations

from titan_rl.rl.engine_link import ColocatedEngine, EngineLink
from titan_rl.rl.separate_engines import SeparateEngines

LINKS = {"colocated": ColocatedEngine, "separate": SeparateEngines}


def link_for(cfg, run_dir: str, model, compute_dtype, ranks, gradient_reduction: str, env=None) -> EngineLink:
    return LINKS[cfg.rollout.placement](cfg, run_dir, model, compute_dtype, ranks, gradient_reduction, env)
