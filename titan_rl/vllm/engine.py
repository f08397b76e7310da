"""Build an in-process vLLM engine over a local HF-style folder, and sync weights into it.

Environment facts: vLLM's environment variables are set by this
package (titan_rl.vllm) before vllm is imported; on CPU the KV cache size must be given
explicitly; torch's thread count must be set before the engine is built.
"""

from __future__ import annotations

import torch

from titan_rl.kernels.mode import KernelMode, check_kernels
from titan_rl.registry import get_architecture


def make_llm(folder: str, *, arch: str = "qwen3", kernels: KernelMode = "exact", dtype: str = "bfloat16", seed: int = 0,
             kv_cache_mib: int = 256, max_model_len: int = 1024, max_num_seqs: int = 16,
             max_num_batched_tokens: int | None = None, enable_prefix_caching: bool = True,
             block_size: int | None = None, logprobs_mode: str = "raw_logprobs"):
    """kernels='exact': our wrapper (same model definition as the trainer);
    kernels='stock': vLLM's built-in implementation of the same architecture.
    logprobs_mode='processed_logprobs' records the log-probs of the policy actually
    sampled (temperature, top-k/top-p, renormalised); the exact engine then also uses
    titan_rl.kernels.sampling for the kept set (titan_rl.vllm.sampling.install)."""
    check_kernels(kernels)
    from vllm import LLM

    spec = get_architecture(arch)
    if kernels == "stock" and spec.hf_architecture == spec.vllm_architecture:
        raise ValueError(f"kernels = 'stock' is not available for {arch!r}: vLLM has no built-in implementation "
                         "of it (hf_architecture is our own wrapper); use kernels = 'exact'")
    if kernels == "exact":
        from titan_rl.vllm.sampling import install, install_logprobs

        install_logprobs()
        if logprobs_mode == "processed_logprobs":
            install()
    kwargs = dict(
        model=folder, skip_tokenizer_init=True, dtype=dtype, seed=seed, enforce_eager=True,
        kv_cache_memory_bytes=kv_cache_mib << 20, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
        enable_prefix_caching=enable_prefix_caching, max_logprobs=-1, logprobs_mode=logprobs_mode,
        use_tqdm_on_load=False,
        hf_overrides={"architectures": [spec.vllm_architecture if kernels == "exact" else spec.hf_architecture]},
    )
    if max_num_batched_tokens is not None:
        kwargs.update(max_num_batched_tokens=max_num_batched_tokens, enable_chunked_prefill=True)
    if spec.recurrent_state and enable_prefix_caching:
        # Recurrent (linear-attention) states are prefix-cached only in mamba cache mode
        # "align" (states checkpointed at block boundaries), which needs chunked prefill.
        kwargs.update(mamba_cache_mode="align", enable_chunked_prefill=True)
    if block_size is not None:
        kwargs.update(block_size=block_size)
    return LLM(**kwargs)


def _model_runner(llm):
    core = llm.llm_engine.engine_core
    core = getattr(core, "engine_core", core)
    return core.model_executor.driver_worker.worker.model_runner


def engine_model(llm) -> torch.nn.Module:
    """The model object inside an in-process engine."""
    return _model_runner(llm).model


def update_weights(llm, state_dict: dict[str, torch.Tensor]) -> None:
    """Load new weights into the engine and drop every cached prefix: KV (and state)
    computed under the old weights must never be reused. Our wrapper loads in place;
    vLLM's built-in models repack weights after loading (CPU), so they go through
    vLLM's own in-place reload."""
    from titan_rl.vllm.model import TitanForCausalLM

    model = engine_model(llm)
    if isinstance(model, TitanForCausalLM):
        model.load_weights(state_dict.items())
    else:
        _model_runner(llm).reload_weights(weights_iterator=iter(state_dict.items()))
    llm.reset_prefix_cache()
