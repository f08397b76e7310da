"""Batch-invariant kernels shared by the trainer and the rollout engine.

One folder per op. Each folder has:
  reference.py  the plain definition (slow, obviously right, no invariance claim)
  torch_impl.py the CPU path both engines call: vectorised and batch-invariant
  triton_impl.py the same algorithm in Triton (GPU; tested under TRITON_INTERPRET=1)

Both engines import the functions below and nothing else, so the trainer and the
sampler can never drift onto different code for the same op.
"""

from titan_rl.kernels.attention.torch_impl import attention_dense, attention_paged
from titan_rl.kernels.lm_head.torch_impl import lm_head_logits, log_softmax_fp32, token_logprobs
from titan_rl.kernels.matmul.torch_impl import leaf_partials, linear, linear_k_leaves, linear_n_blocks, tree_sum
from titan_rl.kernels.rmsnorm.torch_impl import rms_norm, rms_norm_heads

__all__ = [
    "attention_dense",
    "attention_paged",
    "leaf_partials",
    "linear",
    "linear_k_leaves",
    "linear_n_blocks",
    "lm_head_logits",
    "log_softmax_fp32",
    "rms_norm",
    "rms_norm_heads",
    "token_logprobs",
    "tree_sum",
]
