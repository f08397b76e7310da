"""Per-step seeds: everything random in a run is a pure function of (seed, purpose, step,
rank, ...), so a resumed run replays the same prompts and samples. Kept free of heavy
imports: the start-up checks derive the run's prompts from it before TorchTitan loads."""


def step_seed(*parts: int) -> int:
    h = 0
    for p in parts:
        h = (h * 1_000_003 + int(p)) % (2**31 - 1)
    return h
