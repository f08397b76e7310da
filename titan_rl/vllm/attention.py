"""vLLM attention backend whose math is titan_rl.kernels.attention_paged.

vLLM keeps what it is good at: scheduling, the paged KV cache, block tables, prefix
caching. We subclass its CPU backend only to inherit the cache layout
([num_pages, Hkv, page, 2*D]: keys in the first `page` rows of a page, values in the
next) and the metadata builder (query_start_loc, seq_lens, block_table); both the
cache write and the attention itself are ours. get_name() stays "CPU_ATTN" because
vLLM validates backend names against its enum.
"""

from __future__ import annotations

import torch
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from titan_rl.kernels import attention_paged


def _split_cache(kv_cache: torch.Tensor):
    n_pages, hkv, page, _ = kv_cache.shape
    return kv_cache.view(n_pages, hkv, 2 * page, -1).chunk(2, dim=2)


class TitanAttentionImpl(CPUAttentionBackendImpl):
    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        key_cache, value_cache = _split_cache(kv_cache)
        page = key_cache.shape[2]
        n = slot_mapping.shape[0]
        slots = slot_mapping.long()
        keep = slots >= 0  # -1 marks padding tokens
        slots = slots[keep]
        key_cache[slots // page, :, slots % page] = key[:n][keep].to(key_cache.dtype)
        value_cache[slots // page, :, slots % page] = value[:n][keep].to(value_cache.dtype)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        if attn_metadata is None:  # profiling / warm-up run
            return output
        n = attn_metadata.num_actual_tokens
        n_pages, hkv, page, _ = kv_cache.shape
        output[:n] = attention_paged(
            query[:n], kv_cache.view(n_pages, hkv, 2, page, -1), attn_metadata.query_start_loc,
            attn_metadata.seq_lens, attn_metadata.block_table, self.scale,
        )
        return output


class TitanAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls():
        return TitanAttentionImpl
