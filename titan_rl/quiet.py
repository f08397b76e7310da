"""Silence third-party messages known to be harmless here, so the console shows progress
lines and titan_rl's own warnings. Each filter matches one message, not a whole logger:
anything new from those libraries still shows.

  * torchao: its CUDA/cutlass extensions do not load on CPU (we use no torchao kernel).
  * torch._pytree: torchao registers Enums as pytree constants (a deprecation notice).
  * TorchTitan: lspci is absent and CPU peak flops are unknown (only its MFU estimate,
    which we do not report, uses them); no HF index in the run dir (we never save HF
    format through TorchTitan); CUDA graphs do not exist on CPU.
  * FSDP2: "returned a view tensor": the warning is about an in-place op on the model
    output dropping FSDP's pre-backward hook. Every use of the output in
    titan_rl/rl/trainer.py is out of place (slicing + boolean indexing, log-softmax), and
    the bitwise trainer-vs-engine tests would catch a skipped all-gather.
  * c10's C++ warnings (read once, at torch import: TORCH_CPP_LOG_LEVEL=ERROR unless the
    user set it): the one a run prints is vLLM's CPU worker announcing its NUMA memory
    binding. Set TORCH_CPP_LOG_LEVEL=WARNING to see them.
  * vLLM: Triton has no CPU backend (vLLM falls back to its torch ops); a deprecated
    alias its dispatcher touches while scanning torch.distributed.
  * multiprocessing's resource tracker: at exit, the shared memory and semaphores of an
    engine process that was killed (separate placement) are "leaked"; it cleans them up.
  * transformers (the stock pair of titan_rl.stock_pair, the reference folders): its GDN
    and conv run their torch reference forms because the GPU kernel packages are absent
    (that is the point: they are the stock implementation here), and its per-folder
    progress bars when weights are read or written.
"""

from __future__ import annotations

import logging
import os
import warnings

_LOG_MESSAGES = {
    "torchao": ("Failed to load ",),
    "torch.utils._pytree": ("is an Enum subclass and is now natively supported",),
    "": ("Error running lspci", "Peak flops undefined for", "model.safetensors.index.json not found at hf_assets_path",
         "CUDA graph capture is only supported on NVIDIA CUDA"),
    "vllm.triton_utils.importing": ("Triton is installed, but doesn't include CPU backend",),
    "transformers.integrations.hub_kernels": ("is falling back to its reference PyTorch implementation",),
}

_WARNINGS = (
    (UserWarning, r"FSDP2-wrapped module .* returned a view tensor"),
    (FutureWarning, r"`torch.distributed.reduce_op` is deprecated"),
)


class _Drop(logging.Filter):
    def __init__(self, prefixes):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not any(p in msg for p in self.prefixes)


_INSTALLED = False


def install() -> None:
    """Call from an entry point before importing torch / torchao / TorchTitan / vLLM.
    Logger filters apply to records logged on that very logger, which survives TorchTitan
    replacing the root handlers."""
    global _INSTALLED
    if _INSTALLED:
        return
    _INSTALLED = True
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    for name, prefixes in _LOG_MESSAGES.items():
        logging.getLogger(name).addFilter(_Drop(prefixes))
    for category, message in _WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers reads it for its own bars too
    # read by the resource-tracker process multiprocessing starts (a child: only the
    # environment reaches it); its only message is this one
    if "PYTHONWARNINGS" not in os.environ:
        os.environ["PYTHONWARNINGS"] = "ignore::UserWarning:multiprocessing.resource_tracker"
