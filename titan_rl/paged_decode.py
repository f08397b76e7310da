"""The engine's side of a parity check without vLLM: a paged prefill + decode of a model.

`paged_logits(model, tokens)` scores tokens [B, L] the way vLLM schedules them: sequence s
is prefilled with its first `prefill + s` tokens as one chunk (so the chunk lengths differ),
then every unfinished sequence decodes one token per step, all of a step's tokens in one
flat stream (prefills and decodes mixed, finished sequences leaving the batch). Each step
calls the model's flat-stream `hidden_states` with the engine-side objects its architecture
takes (the same ones titan_rl/vllm hands it, over tensors of our own):

- attention layers: keys and values go through the kernels' `kv_cache_write` into a
  NaN-filled cache [pages, Hkv, 2, page, D] per layer whose pages are shuffled over the
  sequences; attention is the kernels' `attention_paged` over that cache and a block table;
- recurrent layers (the GDN hybrids, `ArchitectureSpec.recurrent_state`): a `LinearState`
  whose per-sequence conv / recurrent states (fp32, as vLLM's state cache) are carried from
  step to step, zeros for a sequence's first chunk, as `VllmLinearState` does;
- GLM-5's latent cache (`ArchitectureSpec.sparse_attention`): a `LatentCache` writing each
  layer's rows into NaN-filled shuffled pages and returning the `KeyView` the indexer and
  the sparse attention read, as `VllmLatents` does.

Every op goes through the kernel dispatcher (kernels/dispatch.py), so on CUDA (or forced
Triton) this is the GPU engine path. The result must equal the trainer's dense
`model(tokens)` bit for bit.

Used by scripts/gpu_check.py (the GPU image has no vLLM) and by tests.
"""

from __future__ import annotations

import math

import torch

from titan_rl.kernels import attention_paged, kv_cache_write
from titan_rl.models.common.gdn import carried_states, store_states
from titan_rl.registry import architecture_of


class _Pages:
    """Sequences' positions over shuffled pages: block table [B, pages per sequence]."""

    def __init__(self, B: int, L: int, page_size: int, seed: int, dev):
        per_seq = -(-L // page_size)
        self.n_pages, self.page = B * per_seq + 1, page_size  # one page no sequence owns
        perm = torch.randperm(self.n_pages, generator=torch.Generator().manual_seed(seed))
        self.table = perm[: B * per_seq].view(B, per_seq).to(device=dev, dtype=torch.int32)

    def slots(self, owner: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return self.table[owner, pos // self.page].long() * self.page + pos % self.page


class _CarriedState:
    """LinearState over per-sequence fp32 states kept between steps (vLLM's state cache)."""

    def __init__(self, B: int, shapes, dev):
        self.shapes, self.B, self.dev = shapes, B, dev
        self.caches: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def step(self, seqs: torch.Tensor, has_context: torch.Tensor, cu_seqlens: torch.Tensor) -> "_CarriedState":
        self.seqs, self.has_context, self.cu_seqlens = seqs, has_context, cu_seqlens
        return self

    def initial(self, layer_idx: int):
        if layer_idx not in self.caches:
            return None, None  # no step has stored yet: every sequence starts here
        return carried_states(*self.caches[layer_idx], self.seqs, self.has_context)

    def store(self, layer_idx: int, conv_state: torch.Tensor, rec_state: torch.Tensor) -> None:
        if layer_idx not in self.caches:
            self.caches[layer_idx] = tuple(torch.full((self.B, *s), float("nan"), dtype=torch.float32,
                                                      device=self.dev) for s in self.shapes)
        store_states(*self.caches[layer_idx], self.seqs, conv_state, rec_state)


class _PagedLatents:
    """GLM-5's LatentCache over NaN-filled shuffled pages [pages, page, W] per layer."""

    def __init__(self, pages: _Pages, dtype: torch.dtype):
        self.pages, self.dtype = pages, dtype
        self.caches: dict[int, torch.Tensor] = {}

    def step(self, seqs, owner, pos, block_table) -> "_PagedLatents":
        self.row_seq = torch.searchsorted(seqs, owner)  # a row's index among this step's sequences
        self.row_pos, self.block_table = pos, block_table.long()
        self.slots = self.pages.slots(owner, pos)
        return self

    def store(self, layer_idx: int, rows: torch.Tensor):
        from titan_rl.models.glm_moe_dsa.model import KeyView

        p = self.pages
        if layer_idx not in self.caches:
            self.caches[layer_idx] = torch.full((p.n_pages, p.page, rows.shape[1]), float("nan"), dtype=self.dtype,
                                                device=rows.device)
        cache = self.caches[layer_idx]
        with torch.no_grad():
            cache.view(-1, cache.shape[-1])[self.slots] = rows.to(cache.dtype)
        return KeyView(cache, self.block_table, self.row_seq, self.row_pos)


def paged_logits(model: torch.nn.Module, tokens: torch.Tensor, *, page_size: int = 16, prefill: int = 3,
                 seed: int = 0) -> torch.Tensor:
    """fp32 logits [B, L, V] of every position of tokens [B, L] by paged prefill + decode."""
    cfg = model.cfg
    spec = architecture_of(model)
    B, L = tokens.shape
    dev = tokens.device
    dtype = model.lm_head.weight.dtype
    pages = _Pages(B, L, page_size, seed, dev)
    caches = None if spec.sparse_attention else [
        torch.full((pages.n_pages, cfg.num_key_value_heads, 2, page_size, cfg.head_dim), float("nan"), dtype=dtype,
                   device=dev) for _ in range(cfg.num_hidden_layers)]
    state = _CarriedState(B, cfg.linear_state_shapes(), dev) if spec.recurrent_state else None
    latents = _PagedLatents(pages, dtype) if spec.sparse_attention else None
    scale = 1.0 / math.sqrt(cfg.head_dim) if caches is not None else None
    out = torch.empty(B, L, cfg.vocab_size, dtype=torch.float32, device=dev)
    done = [0] * B
    while min(done) < L:
        spans = [(s, a, min(L, prefill + s) if a == 0 else a + 1) for s, a in enumerate(done) if a < L]
        pos = torch.cat([torch.arange(a, b, device=dev) for _, a, b in spans])
        ids = torch.cat([tokens[s, a:b] for s, a, b in spans])
        seqs = torch.tensor([s for s, _, _ in spans], device=dev)
        owner = torch.cat([torch.full((b - a,), s, device=dev) for s, a, b in spans])
        slots = pages.slots(owner, pos)
        qsl = torch.tensor([0] + [b - a for _, a, b in spans], device=dev).cumsum(0).to(torch.int32)
        seq_lens = torch.tensor([b for _, _, b in spans], device=dev, dtype=torch.int32)
        block_table = pages.table[seqs]

        def attn(i, q, k, v):
            kv_cache_write(caches[i], k, v, slots)
            return attention_paged(q, caches[i], qsl, seq_lens, block_table, scale)

        with torch.no_grad():
            if latents is not None:
                h = model.hidden_states(ids, pos, latents.step(seqs, owner, pos, block_table))
            elif state is not None:
                has_context = torch.tensor([a > 0 for _, a, _ in spans], device=dev)
                h = model.hidden_states(ids, pos, attn, state=state.step(seqs, has_context, qsl.to(torch.int64)))
            else:
                h = model.hidden_states(ids, pos, attn)
            logits = model.logits(h)
        for j, (s, a, b) in enumerate(spans):
            out[s, a:b] = logits[qsl[j]: qsl[j + 1]]
            done[s] = b
    return out
