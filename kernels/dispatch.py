"""Which implementation of each kernel op runs: one table, per op and backend.

A backend is chosen by the device of the op's first tensor argument (`DEVICE_BACKEND`):
CPU tensors run "torch" (kernels/<op>/torch_impl.py: vectorised torch and the compiled C++
extension), CUDA tensors run "triton" (kernels/<op>/triton_impl.py). Both engines call the
`Dispatched` objects of this module (bound in titan_rl.kernels and used by models/ops.py),
so the trainer and the sampler on one device always reach the same implementation.

`use_backend("triton")` forces the Triton column for CPU tensors too, which is only
possible under the Triton interpreter (TRITON_INTERPRET=1, set before triton is first
imported): tests and `scripts/gpu_check.py --cpu-interpret` run the GPU code path on CPU
that way. Implementations are looked up on every call (importlib + getattr), so what runs
is what the module holds at that moment (the self-check and its tests rely on that).

Each implementation keeps its own cache layout for the paged ops (attention_paged,
kv_cache_write): the contract is [num_pages, Hkv, 2, page, D] (keys, values); the CPU
kernel needs that tensor contiguous in its own layout, the Triton one reads any strides
(vLLM's GPU cache is passed as a strided view; titan_rl/vllm/attention_cuda.py).
"""

from __future__ import annotations

import contextlib
import importlib
import os
from typing import Callable, Iterator

import torch

BACKENDS = ("torch", "triton")
DEVICE_BACKEND = {"cpu": "torch", "cuda": "triton"}

# op -> backend -> "module:attribute" (modules under titan_rl.kernels).
TABLE: dict[str, dict[str, str]] = {
    "linear": {"torch": "matmul.torch_impl:linear", "triton": "matmul.triton_impl:linear"},
    "gemm_weight": {"torch": "matmul.torch_impl:gemm_weight", "triton": "matmul.triton_impl:gemm_weight"},
    "rms_norm": {"torch": "rmsnorm.torch_impl:rms_norm", "triton": "rmsnorm.triton_impl:rms_norm"},
    "silu_mul": {"torch": "elementwise.torch_impl:silu_mul", "triton": "elementwise.triton_impl:silu_mul"},
    "rope": {"torch": "elementwise.torch_impl:rope", "triton": "elementwise.triton_impl:rope"},
    "lm_head_logits": {"torch": "lm_head.torch_impl:lm_head_logits", "triton": "lm_head.triton_impl:lm_head_logits"},
    "lm_head_weight": {"torch": "lm_head.torch_impl:lm_head_weight", "triton": "lm_head.triton_impl:lm_head_weight"},
    "log_softmax_fp32": {"torch": "lm_head.torch_impl:log_softmax_fp32",
                         "triton": "lm_head.triton_impl:log_softmax_fp32"},
    "token_logprobs": {"torch": "lm_head.torch_impl:token_logprobs", "triton": "lm_head.triton_impl:token_logprobs"},
    "attention_dense": {"torch": "attention.torch_impl:attention_dense",
                        "triton": "attention.triton_impl:attention_dense"},
    "attention_paged": {"torch": "attention.torch_impl:attention_paged",
                        "triton": "attention.triton_impl:attention_paged"},
    "kv_cache_write": {"torch": "attention.torch_impl:kv_cache_write", "triton": "attention.triton_impl:kv_cache_write"},
    "gdn_recurrent": {"torch": "gdn.torch_impl:gdn_recurrent", "triton": "gdn.triton_impl:gdn_recurrent"},
    "causal_conv1d": {"torch": "gdn.torch_impl:causal_conv1d", "triton": "gdn.triton_impl:causal_conv1d"},
    "gdn_l2norm": {"torch": "gdn.torch_impl:l2norm", "triton": "gdn.triton_impl:l2norm"},
    "router_topk": {"torch": "moe.torch_impl:router_topk", "triton": "moe.triton_impl:router_topk"},
    "drop_mask": {"torch": "sampling.torch_impl:drop_mask", "triton": "sampling.triton_impl:drop_mask"},
    "moe_experts": {"torch": "moe.torch_impl:moe_experts", "triton": "moe.triton_impl:moe_experts"},
    # DeepSeek sparse attention (GLM-5): the indexer's top-k, attention over the selected keys,
    # the indexer key's LayerNorm, the sigmoid router
    "index_topk": {"torch": "indexer.torch_impl:index_topk", "triton": "indexer.triton_impl:index_topk"},
    "sparse_mla_attention": {"torch": "sparse_attention.torch_impl:sparse_mla_attention",
                             "triton": "sparse_attention.triton_impl:sparse_mla_attention"},
    "layer_norm": {"torch": "layernorm.torch_impl:layer_norm", "triton": "layernorm.triton_impl:layer_norm"},
    "router_sigmoid_topk": {"torch": "moe.torch_impl:router_sigmoid_topk",
                            "triton": "moe.triton_impl:router_sigmoid_topk"},
    # the tensor-parallel pieces (fixed column blocks, K-leaves and their tree, the per-head
    # norm's tree): both forms compose their own GEMMs the same way (matmul/blocks.py)
    "tree_sum": {"torch": "matmul.torch_impl:tree_sum", "triton": "matmul.triton_impl:tree_sum"},
    "leaf_partials": {"torch": "matmul.torch_impl:leaf_partials", "triton": "matmul.triton_impl:leaf_partials"},
    "linear_k_leaves": {"torch": "matmul.torch_impl:linear_k_leaves", "triton": "matmul.triton_impl:linear_k_leaves"},
    "linear_n_blocks": {"torch": "matmul.torch_impl:linear_n_blocks", "triton": "matmul.triton_impl:linear_n_blocks"},
    "rms_norm_heads": {"torch": "rmsnorm.torch_impl:rms_norm_heads", "triton": "rmsnorm.triton_impl:rms_norm_heads"},
}

_forced: list[str] = []


def _check_backend(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"kernel backend = {name!r} is not allowed; allowed: {list(BACKENDS)}")
    return name


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Run every dispatched op on backend `name` inside the block, whatever the device."""
    _forced.append(_check_backend(name))
    try:
        yield
    finally:
        _forced.pop()


def backend_for(device: torch.device | str) -> str:
    """The backend ops on `device` run (the forced one inside `use_backend`)."""
    kind = device.type if isinstance(device, torch.device) else torch.device(device).type
    if not _forced and kind in DEVICE_BACKEND:
        return DEVICE_BACKEND[kind]
    if _forced:
        name = _forced[-1]
        if name == "triton" and kind == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("kernel backend 'triton' on CPU tensors needs TRITON_INTERPRET=1, set before "
                               "triton is first imported (the Triton interpreter)")
        return name
    raise ValueError(f"device {kind!r} has no titan_rl kernels; supported: {sorted(DEVICE_BACKEND)}")


_MODULES: dict[tuple[str, str], tuple[object, str]] = {}  # (op, backend) -> (module, attribute)


def implementation(op: str, device: torch.device | str) -> Callable:
    """The function (or class) that runs `op` for tensors on `device` (the module's
    attribute as it is now)."""
    key = (op, backend_for(device))
    hit = _MODULES.get(key)
    if hit is None:
        if op not in TABLE:
            raise KeyError(f"kernel op {op!r} is not in the dispatch table; ops: {sorted(TABLE)}")
        if key[1] not in TABLE[op]:
            raise NotImplementedError(f"kernel op {op!r} has no {key[1]!r} implementation (only "
                                      f"{sorted(TABLE[op])}); tensors on {device} cannot run it")
        module, attr = TABLE[op][key[1]].split(":")
        hit = _MODULES[key] = (importlib.import_module(f"titan_rl.kernels.{module}"), attr)
    return getattr(hit[0], hit[1])


def _device_of(args, kwargs) -> torch.device:
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a.device
        data = getattr(a, "data", None)  # a prepared weight (matmul.torch_impl.PackedWeight)
        if isinstance(data, torch.Tensor):
            return data.device
    raise TypeError("a dispatched kernel op needs a tensor argument to choose its device")


class Dispatched:
    """A kernel op: calls `implementation(op, device of its first tensor argument)`."""

    __slots__ = ("op",)

    def __init__(self, op: str):
        if op not in TABLE:
            raise KeyError(f"kernel op {op!r} is not in the dispatch table; ops: {sorted(TABLE)}")
        self.op = op

    def __call__(self, *args, **kwargs):
        first = args[0] if args else None
        device = first.device if isinstance(first, torch.Tensor) else _device_of(args, kwargs)
        return implementation(self.op, device)(*args, **kwargs)

    def __repr__(self) -> str:
        return f"Dispatched({self.op!r})"


def resolve(fn: Callable, device: torch.device | str) -> Callable:
    """What `fn` runs on `device`: the chosen implementation for a Dispatched op, else fn."""
    return implementation(fn.op, device) if isinstance(fn, Dispatched) else fn


def choices(device: torch.device | str) -> dict[str, str]:
    """op -> "module.attribute" of what runs on `device` (the dispatcher's column; ops
    without an implementation there are left out)."""
    out = {}
    backend = backend_for(device)
    for op in TABLE:
        if backend not in TABLE[op]:
            continue
        fn = implementation(op, device)
        out[op] = f"{fn.__module__}.{fn.__qualname__}"
    return out


# -- the ops: the only Dispatched objects (titan_rl.kernels and its subpackages re-export them)
attention_dense = Dispatched("attention_dense")
attention_paged = Dispatched("attention_paged")
kv_cache_write = Dispatched("kv_cache_write")
gemm_weight = Dispatched("gemm_weight")
linear = Dispatched("linear")
lm_head_logits = Dispatched("lm_head_logits")
lm_head_weight = Dispatched("lm_head_weight")
log_softmax_fp32 = Dispatched("log_softmax_fp32")
rms_norm = Dispatched("rms_norm")
rope = Dispatched("rope")
silu_mul = Dispatched("silu_mul")
token_logprobs = Dispatched("token_logprobs")
gdn_recurrent = Dispatched("gdn_recurrent")
causal_conv1d = Dispatched("causal_conv1d")
gdn_l2norm = Dispatched("gdn_l2norm")
router_topk = Dispatched("router_topk")
moe_experts = Dispatched("moe_experts")
drop_mask = Dispatched("drop_mask")
index_topk = Dispatched("index_topk")
sparse_mla_attention = Dispatched("sparse_mla_attention")
layer_norm = Dispatched("layer_norm")
router_sigmoid_topk = Dispatched("router_sigmoid_topk")
tree_sum = Dispatched("tree_sum")
leaf_partials = Dispatched("leaf_partials")
linear_k_leaves = Dispatched("linear_k_leaves")
linear_n_blocks = Dispatched("linear_n_blocks")
rms_norm_heads = Dispatched("rms_norm_heads")
