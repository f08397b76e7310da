"""Per-step seeds: everything random in a run is a pure function of (seed, purpose, step,
global index), never of the rank, so a resumed run replays the same prompts and samples
and every layout draws the same global batch. Kept free of heavy imports: the start-up
checks derive the run's prompts from it before TorchTitan loads."""

# The purpose of each draw: the second part of its seed.
SFT_PAIRS, PROMPTS, COMPLETIONS = 1, 2, 3


def step_seed(*parts: int) -> int:
    h = 0
    for p in parts:
        h = (h * 1_000_003 + int(p)) % (2**31 - 1)
    return h


def sft_seed(seed: int, step: int) -> int:
    """The seed of step `step`'s whole supervised batch (algorithm.sft_batch pairs)."""
    return step_seed(seed, SFT_PAIRS, step)


def prompt_seed(seed: int, step: int) -> int:
    """The seed of step `step`'s whole prompt batch (algorithm.prompts_per_step prompts)."""
    return step_seed(seed, PROMPTS, step)


def completion_seeds(seed: int, step: int, prompts: range, group_size: int) -> list[int]:
    """The sampling seeds of the completions of the step's global prompts `prompts`,
    `group_size` each, in order: completion g of prompt i has global index
    i * group_size + g, and its seed depends on that index alone."""
    return [step_seed(seed, COMPLETIONS, step, i * group_size + g) for i in prompts for g in range(group_size)]
