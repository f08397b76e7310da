"""The engine's side of a parity check without vLLM: a paged-KV prefill + decode of a model.

`paged_logits(model, tokens)` scores tokens [B, L] the way vLLM schedules them: sequence s
is prefilled with its first `prefill + s` tokens as one chunk (so the chunk lengths differ),
then every unfinished sequence decodes one token per step, all of a step's tokens in one
flat stream (prefills and decodes mixed, finished sequences leaving the batch). Keys and
values go through the kernels' `kv_cache_write` into a NaN-filled cache
[pages, Hkv, 2, page, D] per layer whose pages are shuffled over the sequences; attention
is the kernels' `attention_paged` over that cache and a block table. Every op goes through
the kernel dispatcher (kernels/dispatch.py), so on CUDA (or forced Triton) this is the GPU
engine path. The result must equal the trainer's dense `model(tokens)` bit for bit.

Used by scripts/gpu_check.py (the GPU image has no vLLM) and by tests.
"""

from __future__ import annotations

import math

import torch

from titan_rl.kernels import attention_paged, kv_cache_write


def paged_logits(model: torch.nn.Module, tokens: torch.Tensor, *, page_size: int = 16, prefill: int = 3,
                 seed: int = 0) -> torch.Tensor:
    """fp32 logits [B, L, V] of every position of tokens [B, L] by paged prefill + decode."""
    cfg = model.cfg
    B, L = tokens.shape
    dev = tokens.device
    dtype = model.lm_head.weight.dtype
    per_seq = -(-L // page_size)
    n_pages = B * per_seq + 1
    caches = [torch.full((n_pages, cfg.num_key_value_heads, 2, page_size, cfg.head_dim), float("nan"),
                         dtype=dtype, device=dev) for _ in range(cfg.num_hidden_layers)]
    perm = torch.randperm(n_pages, generator=torch.Generator().manual_seed(seed))
    table = perm[: B * per_seq].view(B, per_seq).to(device=dev, dtype=torch.int32)
    scale = 1.0 / math.sqrt(cfg.head_dim)
    out = torch.empty(B, L, cfg.vocab_size, dtype=torch.float32, device=dev)
    done = [0] * B
    while min(done) < L:
        spans = [(s, a, min(L, prefill + s) if a == 0 else a + 1) for s, a in enumerate(done) if a < L]
        pos = torch.cat([torch.arange(a, b, device=dev) for _, a, b in spans])
        ids = torch.cat([tokens[s, a:b] for s, a, b in spans])
        seqs = torch.tensor([s for s, _, _ in spans], device=dev)
        owner = torch.cat([torch.full((b - a,), s, device=dev) for s, a, b in spans])
        slots = table[owner, pos // page_size].long() * page_size + pos % page_size
        qsl = torch.tensor([0] + [b - a for _, a, b in spans], device=dev).cumsum(0).to(torch.int32)
        seq_lens = torch.tensor([b for _, _, b in spans], device=dev, dtype=torch.int32)
        block_table = table[seqs]

        def attn(i, q, k, v):
            kv_cache_write(caches[i], k, v, slots)
            return attention_paged(q, caches[i], qsl, seq_lens, block_table, scale)

        with torch.no_grad():
            logits = model.logits(model.hidden_states(ids, pos, attn))
        for j, (s, a, b) in enumerate(spans):
            out[s, a:b] = logits[qsl[j]: qsl[j + 1]]
            done[s] = b
    return out
