"""vLLM attention backend whose math is titan_rl.kernels.attention_paged.

vLLM keeps what it is good at: scheduling, the paged KV cache, block tables, prefix
caching. We subclass its CPU backend only to inherit the cache allocation
([num_pages, Hkv, page, 2*D] per layer) and the metadata builder (query_start_loc,
seq_lens, block_table); the cache write (in the layout our kernel reads: keys
transposed per page, then values; kernels/attention/torch_impl.py) and the attention
itself are ours. get_name() stays "CPU_ATTN" because
vLLM validates backend names against its enum.
"""

from __future__ import annotations

from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from titan_rl.kernels import attention_paged, kv_cache_write


class TitanAttentionImpl(CPUAttentionBackendImpl):
    # The kernel forward() calls, named here so the execution contract (titan_rl.contract)
    # reads the engine's attention from the object that runs it.
    kernel = staticmethod(attention_paged)

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        n_pages, hkv, page, _ = kv_cache.shape
        n = slot_mapping.shape[0]  # padding tokens (slot -1) are skipped by the kernel
        kv_cache_write(kv_cache.view(n_pages, hkv, 2, page, -1), key[:n], value[:n], slot_mapping)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        if attn_metadata is None:  # profiling / warm-up run
            return output
        n = attn_metadata.num_actual_tokens
        n_pages, hkv, page, _ = kv_cache.shape
        output[:n] = self.kernel(
            query[:n], kv_cache.view(n_pages, hkv, 2, page, -1), attn_metadata.query_start_loc,
            attn_metadata.seq_lens, attn_metadata.block_table, self.scale,
        )
        return output


class TitanAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls():
        return TitanAttentionImpl
