"""Build an in-process vLLM engine over a local HF-style folder, and sync weights into it.

Environment facts: vLLM's environment variables are set by this
package (titan_rl.vllm) before vllm is imported; on CPU the KV cache size must be given
explicitly; torch's thread count must be set before the engine is built.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from titan_rl.kernels.mode import KernelMode, check_kernels
from titan_rl.kernels.quant.recipes import STOCK_QUANTIZATION, check_stock_recipe
from titan_rl.registry import get_architecture


@dataclass(frozen=True)
class EngineSettings:
    """How `make_llm` builds an engine. A run's engines take theirs from its config
    (`from_config`), so the RL trainer's engines (colocated and separate) and parity's are
    built the same way; the evaluator, which reads no run config, fills in its own."""

    arch: str = "qwen3"
    kernels: KernelMode = "exact"
    dtype: str = "bfloat16"
    seed: int = 0
    kv_cache_mib: int = 256
    max_model_len: int = 1024
    max_num_seqs: int = 16
    max_num_batched_tokens: int | None = None  # None: vLLM's default (no forced chunking)
    enable_prefix_caching: bool = True
    block_size: int | None = None
    logprobs_mode: str = "raw_logprobs"
    quantization: str = "none"  # kernels = 'stock' only; the exact engine reads the folder's recipe
    tensor_parallel_size: int = 1
    own_process: bool = False
    # kernels = 'stock' only: vLLM's default CPU configuration (torch.compile with inductor) rather
    # than eager; the benchmarks' faster stock column. RL runs and the exact engine stay eager.
    compiled: bool = False

    @classmethod
    def from_config(cls, cfg, **overrides) -> "EngineSettings":
        """A run config's engine ([model], [rollout], [quantization], training.seed), with
        `overrides` (the caller's own: a parity run's kernel mode and seed, a rollout's
        sequence count and log-prob mode)."""
        m, r = cfg.model, cfg.rollout
        return cls(**{**dict(arch=m.name, kernels=m.kernels, dtype=m.dtype, seed=cfg.training.seed,
                             kv_cache_mib=r.kv_cache_mib, max_model_len=r.max_model_len,
                             max_num_seqs=r.max_num_seqs, max_num_batched_tokens=r.max_num_batched_tokens or None,
                             enable_prefix_caching=r.enable_prefix_caching, quantization=cfg.quantization.recipe,
                             block_size=r.block_size or None),
                         **overrides})

    @classmethod
    def for_rollouts(cls, cfg, sequences: int, **overrides) -> "EngineSettings":
        """An RL trainer's rollout engine: room for `sequences` at once (at least
        rollout.max_num_seqs) and the log-probs of the policy actually sampled."""
        return cls.from_config(cfg, max_num_seqs=max(cfg.rollout.max_num_seqs, sequences),
                               logprobs_mode="processed_logprobs", **overrides)


def make_llm(folder: str, settings: EngineSettings = EngineSettings()):
    """kernels='exact': our wrapper (same model definition as the trainer; a quantization
    recipe comes with the folder's config.json, "titan_quantization");
    kernels='stock': vLLM's built-in implementation of the same architecture, and with a
    `quantization` recipe vLLM's own online form of it (kernels.quant.recipes.STOCK_QUANTIZATION).
    tensor_parallel_size > 1: one engine rank per process of a torchrun world of that
    size (vLLM's "external_launcher" executor: every process builds its engine with the
    same arguments and feeds it the same requests; the engine stays in-process, so
    `engine_model` and `update_weights` work per rank). The exact wrapper shards with the
    trainer's TP plan and needs the model's tp_leaves > 0.
    logprobs_mode='processed_logprobs' records the log-probs of the policy actually
    sampled (temperature, top-k/top-p, renormalised); the exact engine then also uses
    titan_rl.kernels.sampling for the kept set (titan_rl.vllm.sampling.install).
    own_process: the engine runs in its own process (vLLM's engine-core process; at
    tensor_parallel_size > 1 its workers are processes of vLLM's "mp" executor), reached
    through vLLM's collective RPC (titan_rl.vllm.worker_extension) and weight transfer
    (the "gloo" backend, titan_rl.vllm.weight_transfer); it dies with this process."""
    s = settings
    arch, kernels, dtype, quantization, logprobs_mode = s.arch, s.kernels, s.dtype, s.quantization, s.logprobs_mode
    tensor_parallel_size, own_process = s.tensor_parallel_size, s.own_process
    check_kernels(kernels)
    from vllm import LLM

    spec = get_architecture(arch)
    if kernels == "stock" and spec.hf_architecture == spec.vllm_architecture:
        raise ValueError(f"kernels = 'stock' is not available for {arch!r}: vLLM has no built-in implementation "
                         "of it (hf_architecture is our own wrapper); use kernels = 'exact'")
    if kernels == "stock":
        check_stock_recipe(quantization, recipe_key="quantization", kernels_key="kernels = 'stock'")
    if s.compiled and kernels != "stock":
        raise ValueError("compiled = True is vLLM's compiled stock engine; the exact engine runs eager (its bits are "
                         "the eager kernels')")
    if kernels == "stock" and (spec.recurrent_state or spec.moe or spec.stock_cpu_refusal):
        from titan_rl.checkpoint import check_hf_folder
        from titan_rl.vllm.stock_cpu import stock_cpu_problem

        problem = stock_cpu_problem(spec, check_hf_folder(folder, arch=arch), dtype)
        if problem:
            raise ValueError(f"kernels = 'stock' for {arch!r} ({folder}): {problem}")
    if kernels == "exact" and not own_process:
        from titan_rl.vllm.sampling import install, install_logprobs

        install_logprobs()
        if logprobs_mode == "processed_logprobs":
            install()
    kwargs = dict(
        model=folder, skip_tokenizer_init=True, dtype=dtype, seed=s.seed, enforce_eager=not s.compiled,
        kv_cache_memory_bytes=s.kv_cache_mib << 20, max_model_len=s.max_model_len, max_num_seqs=s.max_num_seqs,
        enable_prefix_caching=s.enable_prefix_caching, max_logprobs=-1, logprobs_mode=logprobs_mode,
        use_tqdm_on_load=False,
        hf_overrides={"architectures": [spec.vllm_architecture], **spec.vllm_overrides},
    )
    if kernels == "stock":
        kwargs.update(_stock_architecture(spec, folder))
    if s.max_num_batched_tokens is not None:
        kwargs.update(max_num_batched_tokens=s.max_num_batched_tokens, enable_chunked_prefill=True)
    if spec.recurrent_state and s.enable_prefix_caching:
        # Recurrent (linear-attention) states are prefix-cached only in mamba cache mode
        # "align" (states checkpointed at block boundaries), which needs chunked prefill.
        kwargs.update(mamba_cache_mode="align", enable_chunked_prefill=True)
    if s.block_size is not None:
        kwargs.update(block_size=s.block_size)
    if own_process:
        kwargs.update(worker_extension_cls="titan_rl.vllm.worker_extension.TitanWorkerExtension",
                      weight_transfer_config={"backend": "gloo"})
        if tensor_parallel_size != 1:
            kwargs.update(tensor_parallel_size=tensor_parallel_size, distributed_executor_backend="mp")
        return _llm_in_own_process(kwargs, "processed_logprobs" if logprobs_mode == "processed_logprobs" else
                                   "raw" if kernels == "exact" else "")
    if tensor_parallel_size != 1:
        kwargs.update(tensor_parallel_size=tensor_parallel_size, distributed_executor_backend="external_launcher")
    if kernels == "stock" and quantization != "none":
        kwargs.update(quantization="torchao")
        kwargs["hf_overrides"]["quantization_config_dict_json"] = _torchao_config_json(STOCK_QUANTIZATION[quantization])
    _freeze_heap()
    return LLM(**kwargs)


_UNFREEZE_AT_EXIT = []


def _freeze_heap() -> None:
    """Collect once, then move every object alive now (mostly the imported modules: torch,
    vLLM, TorchTitan, titan_rl) out of the garbage collector's sight. vLLM's engine start calls
    gc.collect() several times and each walks the whole heap (~0.2 s apiece on these 2-core
    EPYCs: a fresh 2-step debug RL run took 12.8-15.3 s with this, 14.4-16.6 s without,
    three runs each, 2026-12-04); vLLM freezes the heap itself at the end of its start. At
    exit the objects are handed back, so teardown frees them as before (frozen objects are
    never freed, and nanobind reports Triton's as leaks)."""
    gc.collect()
    gc.freeze()
    if not _UNFREEZE_AT_EXIT:
        atexit.register(gc.unfreeze)
        _UNFREEZE_AT_EXIT.append(True)


def _stock_architecture(spec, folder: str) -> dict:
    """The LLM arguments that pick vLLM's built-in class for the stock engine: the stock
    architecture (`hf_architecture`), or for a folder of one of its `hf_aliases` (Qwen3.5 as
    published: a vision-language model) vLLM's class for that form with the vision tower left
    out (`language_model_only`), as vLLM serves such a folder; its text class cannot read one."""
    from titan_rl.checkpoint import CONFIG_NAME

    cfg_path = Path(folder) / CONFIG_NAME
    archs = (json.loads(cfg_path.read_text()).get("architectures") or []) if cfg_path.is_file() else []
    alias = next((a for a in archs if a in spec.hf_aliases), None)
    if alias is None:
        return {"hf_overrides": {"architectures": [spec.hf_architecture]}}
    return {"hf_overrides": {"architectures": [alias]}, "language_model_only": True}


def _llm_in_own_process(kwargs: dict, exact_sampling: str):
    """LLM(**kwargs) with its engine core in a child process: vLLM's multiprocessing mode
    and the two settings the plugin reads there (titan_rl.vllm.plugin)."""
    import vllm.envs as envs
    from vllm import LLM

    from titan_rl.lifeline import TRAINER_PID
    from titan_rl.vllm.plugin import EXACT_SAMPLING, FORK_WORKER

    bind = "VLLM_CPU_OMP_THREADS_BIND"
    saved = {k: os.environ.get(k) for k in ("VLLM_ENABLE_V1_MULTIPROCESSING", TRAINER_PID, EXACT_SAMPLING, bind,
                                            FORK_WORKER)}
    os.environ.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "1", TRAINER_PID: str(os.getpid()),
                       EXACT_SAMPLING: exact_sampling,
                       FORK_WORKER: "1" if kwargs.get("tensor_parallel_size", 1) == 1 else "",
                       # vLLM's CPU workers bind to one NUMA node each by default; these machines have one
                       bind: os.environ.get(bind, "nobind")})
    try:
        if not envs.VLLM_ENABLE_V1_MULTIPROCESSING:
            raise RuntimeError("an engine in its own process cannot be started from a process that already ran "
                               "an in-process engine (vLLM has cached its environment)")
        return LLM(**kwargs)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _torchao_config_json(name: str) -> str:
    """The JSON vLLM's torchao quantization reads for torchao's config class `name`."""
    import json

    import torchao.quantization
    from torchao.core.config import config_to_dict

    return json.dumps(config_to_dict(getattr(torchao.quantization, name)()))


def engine_model(llm) -> torch.nn.Module:
    """The model object inside an in-process engine."""
    from titan_rl.vllm.sampling import model_runner

    return model_runner(llm).model


def update_weights(llm, state_dict: dict) -> None:
    """Load new weights into the engine and drop every cached prefix: KV (and state)
    computed under the old weights must never be reused. Our wrapper loads in place
    (a quantized weight may come as a kernels.quant.QuantizedWeight: titan_rl.quant_weights);
    vLLM's built-in models repack weights after loading (CPU), so they go through
    vLLM's own in-place reload."""
    from titan_rl.vllm.model import TitanForCausalLM

    model = engine_model(llm)
    if isinstance(model, TitanForCausalLM):
        model.load_weights(state_dict.items())
    else:
        from titan_rl.vllm.sampling import model_runner

        model_runner(llm).reload_weights(weights_iterator=iter(state_dict.items()))
    llm.reset_prefix_cache()
