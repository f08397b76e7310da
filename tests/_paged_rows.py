"""Sequences of cache rows in the two layouts GLM-5's kernels read (tests/test_glm5_kernels.py
for the CPU forms, tests/test_triton_glm5.py for the Triton ones)."""

import torch


def dense_and_paged(rows: list[torch.Tensor], page: int, rng: torch.Generator, dtype: torch.dtype,
                    spare: int, dense_fill: float = 0.0):
    """(dense, paged) for `rows` ([n_i, W] each): the trainer's dense layout, ([B, L, W] filled
    with `dense_fill` past each row, one page per sequence: block table [[0], [1], ...]), and
    vLLM's paged one, (cache [pages + spare, page, W], block table padded with -7): the pages
    shuffled after `spare` unused ones; unused pages and slots hold NaN, so a read outside a
    row's positions shows."""
    lens = [r.shape[0] for r in rows]
    dense = torch.full((len(rows), max(lens), rows[0].shape[1]), dense_fill, dtype=dtype)
    for i, r in enumerate(rows):
        dense[i, : r.shape[0]] = r
    n_pages = [-(-n // page) for n in lens]
    order = torch.randperm(sum(n_pages), generator=rng)
    cache = torch.full((sum(n_pages) + spare, page, rows[0].shape[1]), float("nan"), dtype=dtype)
    bt = torch.full((len(rows), max(n_pages)), -7, dtype=torch.long)
    k = 0
    for i in range(len(rows)):
        for p in range(n_pages[i]):
            slot = int(order[k]) + spare
            k += 1
            bt[i, p] = slot
            part = rows[i][p * page:(p + 1) * page]
            cache[slot, : part.shape[0]] = part
    return (dense, torch.arange(len(rows)).view(-1, 1)), (cache, bt)
