"""Batch-invariant kernels shared by the trainer and the rollout engine.

One folder per op. Each folder has:
  reference.py  the plain definition (slow, obviously right, no invariance claim)
  torch_impl.py the CPU path both engines call: vectorised and batch-invariant
  triton_impl.py the same algorithm in Triton (GPU; tested under TRITON_INTERPRET=1)

Both engines import the functions below and nothing else, so the trainer and the
sampler can never drift onto different code for the same op. Most are dispatched ops
(kernels/dispatch.py: torch_impl for CPU tensors, triton_impl for CUDA ones); the
tensor-parallel pieces (tree_sum, leaf_partials, linear_k_leaves, linear_n_blocks,
rms_norm_heads) are the CPU implementation's.
"""

from titan_rl.kernels.dispatch import Dispatched
from titan_rl.kernels.matmul.torch_impl import leaf_partials, linear_k_leaves, linear_n_blocks, tree_sum
from titan_rl.kernels.rmsnorm.torch_impl import rms_norm_heads

attention_dense = Dispatched("attention_dense")
attention_paged = Dispatched("attention_paged")
kv_cache_write = Dispatched("kv_cache_write")
gemm_weight = Dispatched("gemm_weight")
linear = Dispatched("linear")
lm_head_logits = Dispatched("lm_head_logits")
log_softmax_fp32 = Dispatched("log_softmax_fp32")
rms_norm = Dispatched("rms_norm")
rope = Dispatched("rope")
silu_mul = Dispatched("silu_mul")
token_logprobs = Dispatched("token_logprobs")
gdn_recurrent = Dispatched("gdn_recurrent")

__all__ = [
    "attention_dense",
    "attention_paged",
    "gdn_recurrent",
    "gemm_weight",
    "kv_cache_write",
    "leaf_partials",
    "linear",
    "linear_k_leaves",
    "linear_n_blocks",
    "lm_head_logits",
    "log_softmax_fp32",
    "rms_norm",
    "rms_norm_heads",
    "rope",
    "silu_mul",
    "token_logprobs",
    "tree_sum",
]
