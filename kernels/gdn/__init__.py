"""Gated delta-rule (GDN) linear attention: the exact recurrent kernel both engines call,
its causal conv, helpers, and a (non-exact) chunkwise-parallel form. See docs/gdn.md."""

from titan_rl.kernels.gdn.cache_rows import CacheRows
from titan_rl.kernels.gdn.chunked import gdn_chunked
from titan_rl.kernels.gdn.reference import causal_conv1d_reference, gdn_reference
from titan_rl.kernels.gdn.torch_impl import causal_conv1d, causal_conv1d_torch, gdn_recurrent, l2norm, lane_stable, tree_sum_last

__all__ = [
    "CacheRows",
    "causal_conv1d",
    "causal_conv1d_torch",
    "causal_conv1d_reference",
    "gdn_chunked",
    "gdn_recurrent",
    "gdn_reference",
    "l2norm",
    "lane_stable",
    "tree_sum_last",
]
