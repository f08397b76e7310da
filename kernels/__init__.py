"""Batch-invariant kernels shared by the trainer and the rollout engine.

One folder per op. Each folder has:
  reference.py  the plain definition (slow, obviously right, no invariance claim)
  torch_impl.py the CPU path both engines call: vectorised and batch-invariant
  triton_impl.py the same algorithm in Triton (GPU; tested under TRITON_INTERPRET=1)

Both engines import the functions below and nothing else, so the trainer and the
sampler can never drift onto different code for the same op. Each is a dispatched op
(kernels/dispatch.py: torch_impl for CPU tensors, triton_impl for CUDA ones; the
tensor-parallel pieces are composed once over each form's GEMMs, kernels/matmul/blocks.py).
"""

from titan_rl.kernels.mkl_vml import first_call_on_one_thread as _first_vml_call

_first_vml_call()  # before any op of ours or torch's splits a VML call across threads

from titan_rl.kernels.dispatch import (  # noqa: E402
    attention_dense, attention_paged, causal_conv1d, gdn_l2norm, gdn_recurrent, gemm_weight, index_topk, kv_cache_write, layer_norm, leaf_partials,
    linear, linear_k_leaves, linear_n_blocks, lm_head_logits, lm_head_weight, log_softmax_fp32, rms_norm, rms_norm_heads,
    rope, silu_mul, sparse_mla_attention, token_logprobs, tree_sum,
)

__all__ = [
    "attention_dense",
    "attention_paged",
    "causal_conv1d",
    "gdn_l2norm",
    "gdn_recurrent",
    "gemm_weight",
    "index_topk",
    "kv_cache_write",
    "layer_norm",
    "leaf_partials",
    "linear",
    "linear_k_leaves",
    "linear_n_blocks",
    "lm_head_logits",
    "lm_head_weight",
    "log_softmax_fp32",
    "rms_norm",
    "rms_norm_heads",
    "rope",
    "silu_mul",
    "sparse_mla_attention",
    "token_logprobs",
    "tree_sum",
]
