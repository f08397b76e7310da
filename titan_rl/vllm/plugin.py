"""vllm.general_plugins entry point: runs in every vLLM process (engine and workers)."""

import importlib.util
import os
import sys
import types

from titan_rl.lifeline import die_with_parent, started_by_a_trainer

# Set-up removes torchvision: the only builds reachable are CUDA builds that fail to import
# ("operator torchvision::nms does not exist"), and a broken torchvision breaks `import vllm`.
_QWEN2_VL_IMAGES = "transformers.models.qwen2_vl.image_processing_qwen2_vl"

# Set by titan_rl.vllm.engine for the engine processes it starts (inherited at spawn).
EXACT_SAMPLING = "TITAN_RL_EXACT_SAMPLING"
FORK_WORKER = "TITAN_RL_FORK_WORKER"  # "1": an engine of TP 1, whose engine core forks its one worker


def register() -> None:
    from vllm import ModelRegistry

    from titan_rl.registry import get_architecture, list_architectures
    from titan_rl.vllm import weight_transfer

    _text_only_vl_imports()
    _cpu_generators()
    for spec in map(get_architecture, list_architectures()):
        if spec.vllm_architecture not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(spec.vllm_architecture, spec.vllm_class)
    weight_transfer.register()
    if started_by_a_trainer():
        _engine_process()


def _engine_process() -> None:
    """In an engine process a trainer started: die with the process that started it (a
    killed trainer leaves no engine behind: PR_SET_PDEATHSIG, Linux), start an engine of TP 1's
    worker by fork, and sample with the exact engine's sampler (the patches
    titan_rl.vllm.engine.make_llm applies in-process).

    Fork: vLLM's CPU platform sets spawn for every process it starts, so the worker paid a
    fresh interpreter's imports (~7 s) after the engine core had paid them; the engine core
    forks its worker before it runs any model op (the hazard spawn avoids is a child forked
    after the parent's OpenMP pool started). A separate engine's start: 14.4 s -> 8.7 s
    (2026-12-05). A forked worker inherits this process's patches; the death signal, which a
    fork clears, is set again in it. Not at TP 2: a forked process ends in os._exit, without
    the C++ teardown that unlinks vLLM's CPU shared-memory TP channel (seen: 8 MiB left in
    /dev/shm per engine), so those workers stay spawned."""
    die_with_parent()
    if os.environ.get(FORK_WORKER) == "1":
        os.register_at_fork(after_in_child=die_with_parent)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"
    mode = os.environ.get(EXACT_SAMPLING)
    if mode:
        from titan_rl.vllm.sampling import install, install_logprobs

        install_logprobs()
        if mode == "processed_logprobs":
            install()


def _cpu_generators() -> None:
    """vLLM's CPU worker cannot rewind a seeded request's generator after a discarded
    chunked-prefill sample (titan_rl/vllm/cpu_generators.py); only where torch has no CUDA."""
    import torch

    if not torch.cuda.is_available():
        from titan_rl.vllm.cpu_generators import install

        install()


def _text_only_vl_imports() -> None:
    """vLLM's built-in Qwen3.5 models (the stock engine of `qwen3_5` and `qwen3_5_moe`) import
    Qwen3-VL's module, which imports Qwen2-VL's torchvision image processor at module level
    for the vision tower. Without torchvision that module is provided by the PIL twin
    transformers ships (same `smart_resize`, a PIL-backed processor class); a text-only model
    never gives it an image, and one that did is refused in one line (TextOnlyImageProcessor)."""
    if importlib.util.find_spec("torchvision") is not None or _QWEN2_VL_IMAGES in sys.modules:
        return
    import transformers.models.qwen2_vl as qwen2_vl
    from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil

    class TextOnlyImageProcessor(pil.Qwen2VLImageProcessorPil):
        """Built as vLLM builds it; processing an image is refused in one line (titan_rl serves
        these models' text part: the vision tower is not loaded)."""

        def preprocess(self, *args, **kwargs):
            from titan_rl.errors import UserError

            raise UserError("image inputs reached titan_rl's text-only stand-in for Qwen2-VL's image processor: "
                            "titan_rl serves the text model of vision-language folders (no torchvision, no vision "
                            "tower); send token ids or text only")

        __call__ = preprocess

    stand_in = types.ModuleType(_QWEN2_VL_IMAGES, "titan_rl stand-in: torchvision is not installed (text-only)")
    stand_in.smart_resize = pil.smart_resize
    stand_in.Qwen2VLImageProcessor = TextOnlyImageProcessor
    sys.modules[_QWEN2_VL_IMAGES] = stand_in
    # the package's lazy attribute would warn about the same fallback on every import
    qwen2_vl.Qwen2VLImageProcessor = TextOnlyImageProcessor
