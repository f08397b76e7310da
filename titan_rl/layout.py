"""The layout rules, written once: which tensor-parallel degree a model allows.

A TP degree t > 1 (the trainer's `parallelism.tensor_parallel_degree`, the separate
engines' `rollout.engine_tp`, an engine's vLLM `tensor_parallel_size`) needs
  - an architecture with a TP plan (`check_plan`);
  - the widths the plan splits by heads divisible by t (`check_widths`, the plan's `divides`);
  - the model's leaf count tp_leaves a multiple of t (`check_tp_leaves`): each rank then
    computes whole leaves, so TP = 1, 2, ..., tp_leaves give the same bits;
  - no quantization recipe (`check_recipe`: the recipes' own rule, kernels.quant.recipes.check_tp_recipe).
The widths tp_leaves itself must divide are the model's (models/options.py,
ModelOptions.validate); expert parallelism's rules are titan_rl.config._check_expert_parallel
and titan_rl.rl.global_batch (EP = the data-parallel degree).

Callers: the config's checks (titan_rl.config), the trainer's TP (titan_rl.parallel.plan's
TPPlan.check_degree, from titan_rl.titan.model and apply_plan; titan_rl.titan.parallelize),
and every engine at TP > 1, colocated or separate (titan_rl.vllm.model._shard_for_tp).
Each raises ValueError naming the key, its value and what is allowed; the config turns it
into a ConfigError.
"""

from __future__ import annotations

from titan_rl.kernels.quant.recipes import check_tp_recipe as check_recipe  # noqa: F401  (the recipes' rule)

# the largest TP degree any shipped layout uses; tp_leaves = 8 covers TP 1/2/4/8
LEAVES_HINT = "8 covers TP 1/2/4/8"


def check_plan(key: str, tp: int, spec, fallback: str = "") -> None:
    """TP > 1 needs the architecture's TP plan; one without it says why."""
    if tp > 1 and spec.tp_plan is None:
        raise ValueError(f"{key} = {tp}: {spec.name!r} has no TP plan ({spec.no_tp_reason}); allowed: 1{fallback}")


def check_widths(key: str, tp: int, arch_cfg, fields) -> None:
    """`tp` must divide each of the model's widths `fields` (a plan's `divides`: head counts)
    that its config has."""
    widths = {f: getattr(arch_cfg, f) for f in fields if getattr(arch_cfg, f, None) is not None}
    if any(n % tp for n in widths.values()):
        raise ValueError(f"{key} = {tp} must divide the model's " +
                         " and ".join(f"{f} ({n})" for f, n in widths.items()))


def check_tp_leaves(key: str, tp: int, tp_leaves: int, *, leaves_key: str = "model.tp_leaves", where: str = "",
                    why: str = "", allow_zero: bool = False) -> None:
    """`tp_leaves` (`leaves_key`, set in `where`) must be a multiple of `tp`, and > 0 unless
    `allow_zero` (without leaves the logits are close to, not bitwise equal to, TP = 1's);
    `why`: what the rule keeps, for the message."""
    if tp == 1 or (allow_zero and tp_leaves == 0) or (tp_leaves and tp_leaves % tp == 0):
        return
    need = "a multiple of it" if allow_zero else "> 0 and a multiple of it"
    raise ValueError(f"{key} = {tp} needs {leaves_key} {need} ({where + '; ' if where else ''}got {tp_leaves}; "
                     f"{LEAVES_HINT})" + (f" {why}" if why else ""))
