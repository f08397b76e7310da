"""vLLM side of titan_rl: the engine (engine.make_llm), our model wrappers, the plugin.

vLLM's environment settings live here, the one place: every module that starts or
drives vLLM is in this package, so importing any of them sets these before `vllm` is
imported (a variable set by the user wins).
  * VLLM_ENABLE_V1_MULTIPROCESSING=0: the engine stays in this process (it starts in
    seconds, and the model object is reachable for weight updates).
  * VLLM_LOGGING_LEVEL=ERROR: vLLM logs a tokenizer traceback per engine when
    skip_tokenizer_init=True (harmless); progress output stays readable.
"""

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

from titan_rl.kernels import cpu_features  # noqa: E402

cpu_features.apply()  # TITAN_RL_CPU=avx2: vLLM picks its AVX2 library and paths (before it loads them)
