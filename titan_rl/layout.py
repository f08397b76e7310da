"""The layout rules, written once: which tensor-parallel degree a model allows, how the
global batch is cut into gradient leaves (parallelism.deterministic_reduction; the plans that
run it are titan_rl.rl.batch_plan's), and what expert parallelism is built for.

A TP degree t > 1 (the trainer's `parallelism.tensor_parallel_degree`, the separate
engines' `rollout.engine_tp`, an engine's vLLM `tensor_parallel_size`) needs
  - an architecture with a TP plan (`check_plan`);
  - the widths the plan splits by heads divisible by t (`check_widths`, the plan's `divides`);
  - the model's leaf count tp_leaves a multiple of t (`check_tp_leaves`): each rank then
    computes whole leaves, so TP = 1, 2, ..., tp_leaves give the same bits;
  - no quantization recipe (`check_recipe`: the recipes' own rule, kernels.quant.recipes.check_tp_recipe).
The widths tp_leaves itself must divide are the model's (models/options.py,
ModelOptions.validate); expert parallelism's are `check_expert_parallel` here and
titan_rl.rl.global_batch (EP = the data-parallel degree, against the world size).

Callers: the config's checks (titan_rl.config), the trainer's TP (titan_rl.parallel.plan's
TPPlan.check_degree, from titan_rl.titan.model and apply_plan; titan_rl.titan.parallelize),
and every engine at TP > 1, colocated or separate (titan_rl.vllm.model._shard_for_tp).
The TP rules raise ValueError naming the key, its value and what is allowed (the config turns
it into a ConfigError; the engines raise it as it is); the leaf and EP rules, read from the
config only, raise ConfigError.
"""

from __future__ import annotations

from titan_rl.errors import ConfigError
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


# -- gradient leaves (parallelism.deterministic_reduction) ------------------------------------

# Each leaf is one forward + backward: 2 covers data-parallel degrees 1 and 2 at little
# cost (docs/torchtitan.md has the timings); a run meant to move to more ranks sets
# parallelism.gradient_leaves to that degree or more.
AUTO_MAX_LEAVES = 2


def uses_leaf_tree(cfg) -> bool:
    """parallelism.deterministic_reduction, resolved: unset means on in exact mode."""
    on = cfg.parallelism.deterministic_reduction
    return cfg.model.kernels == "exact" if on is None else on


def _global_batches(cfg) -> list[tuple[str, int]]:
    a = cfg.algorithm
    return [("prompts_per_step x group_size", a.prompts_per_step * a.group_size)] + (
        [("sft_batch", a.sft_batch)] if a.sft_steps > 0 else [])


def leaf_count(cfg) -> int:
    """parallelism.gradient_leaves, resolved: 0 (auto) is the largest power of two up to
    AUTO_MAX_LEAVES that divides every global batch of the run (a function of the config
    alone, so the same on every layout)."""
    if cfg.parallelism.gradient_leaves:
        return cfg.parallelism.gradient_leaves
    n = AUTO_MAX_LEAVES
    while any(size % n for _, size in _global_batches(cfg)):
        n //= 2
    return n


def check_leaves(cfg) -> None:
    """parallelism.deterministic_reduction's settings, refused by key when they cannot be honoured."""
    p = cfg.parallelism
    if p.deterministic_reduction and cfg.model.kernels == "stock":
        raise ConfigError("parallelism.deterministic_reduction = true cannot be honoured with model.kernels = 'stock': "
                          "the stock engine's rollouts depend on the batch composition, so the global batch differs "
                          "by layout; use model.kernels = 'exact', or leave the key unset")
    if not uses_leaf_tree(cfg):
        return
    leaves = p.gradient_leaves
    if leaves < 0 or leaves & (leaves - 1):
        raise ConfigError(f"parallelism.gradient_leaves = {leaves}: must be 0 (auto) or a power of two")
    if not leaves:
        return
    for what, n in _global_batches(cfg):
        if n % leaves:
            raise ConfigError(f"parallelism.gradient_leaves = {leaves} must divide algorithm.{what} = {n} "
                              "(the global batch is cut into equal leaves)")
    if p.data_parallel_replicate_degree > 1:
        raise ConfigError(f"parallelism.data_parallel_replicate_degree = {p.data_parallel_replicate_degree}: "
                          "deterministic_reduction covers FSDP only; use 1, or deterministic_reduction = false")


def check_layout(cfg, dp: int, world: int) -> None:
    """Every data-parallel rank owns an equal run of leaves."""
    leaves = leaf_count(cfg)
    if uses_leaf_tree(cfg) and leaves % dp:
        tp = cfg.parallelism.tensor_parallel_degree
        what = "" if cfg.parallelism.gradient_leaves else " (0 = auto: the largest power of two up to 2 dividing the batches)"
        raise ConfigError(f"parallelism.gradient_leaves = {leaves}{what} must be divisible by the data-parallel degree "
                          f"{dp} (WORLD_SIZE = {world} / parallelism.tensor_parallel_degree = {tp}): each rank owns an "
                          f"equal run of leaves; set parallelism.gradient_leaves to a power of two >= {dp} that divides "
                          "the batches, or parallelism.deterministic_reduction = false")


# -- expert parallelism ---------------------------------------------------------------------

def check_expert_parallel(cfg, spec, arch_cfg) -> None:
    """parallelism.expert_parallel_degree: what titan_rl/titan/expert_parallel.py builds (the degree
    against the world size is checked with the other layout rules, rl/global_batch.py)."""
    p, key = cfg.parallelism, "parallelism.expert_parallel_degree"
    ep = p.expert_parallel_degree
    if ep < 1:
        raise ConfigError(f"{key} = {ep}: must be >= 1")
    if ep == 1:
        return
    if not spec.moe:
        raise ConfigError(f"{key} = {ep} needs a mixture-of-experts model; model.name = {cfg.model.name!r} has no "
                          "routed experts; allowed: 1")
    if p.tensor_parallel_degree > 1:
        raise ConfigError(f"{key} = {ep} with parallelism.tensor_parallel_degree = {p.tensor_parallel_degree} is not "
                          "built (the experts' ranks are the data-parallel ranks); use one of the two")
    if not uses_leaf_tree(cfg):
        raise ConfigError(f"{key} = {ep} needs the leaf tree (model.kernels = 'exact' with "
                          "parallelism.deterministic_reduction unset or true): the experts' gradients are added in it")
    if cfg.quantization.recipe != "none":
        raise ConfigError(f"{key} = {ep} with quantization.recipe = {cfg.quantization.recipe!r} is not built; "
                          "allowed: 1, or quantization.recipe = 'none'")
    if cfg.activation_checkpoint.mode != "none":
        # a recomputed forward would dispatch the experts' rows a second time before the leaf's
        # backward, which the per-leaf exchange (titan_rl/titan/expert_parallel.py) does not pair
        raise ConfigError(f"{key} = {ep} with activation_checkpoint.mode = {cfg.activation_checkpoint.mode!r} is "
                          "not built (the recomputed forward would exchange the experts' rows again inside the "
                          "backward); allowed: activation_checkpoint.mode = 'none', or expert_parallel_degree = 1")
    n = getattr(arch_cfg, "num_experts", None) or getattr(arch_cfg, "n_routed_experts", None)
    if n and n < ep:
        raise ConfigError(f"{key} = {ep} must be <= the model's routed experts ({n}): each rank owns at least one")
