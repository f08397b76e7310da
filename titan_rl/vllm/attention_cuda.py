"""vLLM attention backend on CUDA whose math is the Triton kernel of titan_rl.kernels.

Which vLLM backend we build on, and why: vLLM's Triton backend
(vllm/v1/attention/backends/triton_attn.py). Its cache is vLLM's generic GPU layout
(logical [num_blocks, Hkv, block_size, 2*D]: keys then values per slot, HND or NHD
strides), which our kernel reads in place through strides, and its metadata builder gives
exactly what the kernel takes (query_start_loc, seq_lens, block_table, max_query_len,
slot_mapping) with no FlashAttention-specific scheduler state; it runs on every CUDA GPU
and needs nothing outside vLLM itself. FlashAttention's and FlashInfer's builders plan for
their own kernels (scheduler metadata, wrappers), which we would compute and ignore.

We subclass its metadata builder only to declare CUDA graphs unsupported: the kernel's
launch grid is sized from the step's max_query_len (a host integer), so a captured graph
would replay a stale grid. vLLM then runs this backend eagerly (and `make_llm` passes
enforce_eager=True anyway): CUDA graphs are off. The cache write and the attention are ours
(the dispatcher's `kv_cache_write` / `attention_paged`, kernels/attention/triton_impl.py);
get_name() stays "TRITON_ATTN" because vLLM validates backend names against its enum.
"""

from __future__ import annotations

import torch
from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.attention.backends.triton_attn import (TritonAttentionBackend, TritonAttentionImpl,
                                                    TritonAttentionMetadataBuilder)

from titan_rl.kernels import attention_paged, kv_cache_write


def cache_view(kv_cache: torch.Tensor, head_size: int) -> torch.Tensor:
    """vLLM's per-layer cache [num_blocks, Hkv, block_size, 2*D] (any of its strides) as the
    kernels' [num_blocks, Hkv, 2, block_size, D] (keys, values): a view, no copy."""
    return kv_cache.unflatten(-1, (2, head_size)).transpose(2, 3)


def kernel_args(query: torch.Tensor, kv_cache: torch.Tensor, attn_metadata, head_size: int, scale: float) -> dict:
    """The arguments of `attention_paged` for one step, from the Triton backend's metadata."""
    n = attn_metadata.num_actual_tokens
    return {"q": query[:n], "kv_cache": cache_view(kv_cache, head_size),
            "query_start_loc": attn_metadata.query_start_loc, "seq_lens": attn_metadata.seq_lens,
            "block_table": attn_metadata.block_table, "scale": scale, "max_query_len": attn_metadata.max_query_len}


class TitanTritonMetadataBuilder(TritonAttentionMetadataBuilder):
    _cudagraph_support = AttentionCGSupport.NEVER


class TitanTritonAttentionImpl(TritonAttentionImpl):
    # The kernel forward() calls, named here so the execution contract (titan_rl.contract)
    # reads the engine's attention from the object that runs it.
    kernel = staticmethod(attention_paged)

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        n = slot_mapping.shape[0]
        slots = slot_mapping.long()
        keep = slots >= 0  # -1 marks padding tokens
        kv_cache_write(cache_view(kv_cache, self.head_size), key[:n][keep], value[:n][keep], slots[keep])

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        if attn_metadata is None:  # profiling / warm-up run
            return output
        args = kernel_args(query.view(query.shape[0], self.num_heads, self.head_size), kv_cache, attn_metadata,
                           self.head_size, self.scale)
        n = attn_metadata.num_actual_tokens
        output[:n] = self.kernel(**args).view(output[:n].shape)
        return output


class TitanTritonAttentionBackend(TritonAttentionBackend):
    @staticmethod
    def get_impl_cls():
        return TitanTritonAttentionImpl

    @staticmethod
    def get_builder_cls():
        return TitanTritonMetadataBuilder
