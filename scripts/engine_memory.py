"""What the rollout engine holds for its model, by quantization recipe: the bytes of every
tensor its model keeps (parameters, prepared GEMM operands, quantized payloads and scales, the
AVX2 form's expanded bf16 blocks, the LM head's copy; the KV cache and rope tables aside),
counted once per storage, for the debug qwen3 in bf16, each recipe's engine built and run on one
prompt. Prints a table (bytes, and the ratio to the unquantized engine) and writes JSON.

    python scripts/engine_memory.py [--json OUT]      # TITAN_RL_CPU=avx2 ...: the AVX2 machine's forms
"""
import json
import sys
import torch
import titan_rl.vllm  # noqa: F401  (vLLM's environment first)
from titan_rl import config
from titan_rl.registry import get_architecture
from titan_rl.rl.engine_link import ColocatedEngine
from titan_rl.rl.ranks import Ranks
from titan_rl.rl.requests import prompt_episodes
from titan_rl.vllm.engine import engine_model
from vllm import SamplingParams

def held_bytes(m):
    seen, total = set(), 0
    def visit(x, depth=0):
        nonlocal total
        if depth > 6: return
        if isinstance(x, torch.Tensor):
            if x.layout == torch._mkldnn:
                key = id(x); n = x.to_dense().nbytes
            else:
                key = (x.untyped_storage().data_ptr(), x.untyped_storage().nbytes()); n = x.untyped_storage().nbytes()
            if key not in seen:
                seen.add(key); total += n
            return
        if isinstance(x, (list, tuple)):
            for y in x: visit(y, depth+1)
        elif isinstance(x, dict):
            for y in x.values(): visit(y, depth+1)
        elif isinstance(getattr(type(x), "__slots__", None), tuple) and not isinstance(x, (torch.nn.Module, type)):
            for f in type(x).__slots__: visit(getattr(x, f, None), depth+1)
        elif hasattr(x, "__dict__") and not isinstance(x, (torch.nn.Module, type)) and type(x).__module__.startswith(("titan_rl", "kernels", "models")):
            for y in vars(x).values(): visit(y, depth+1)
    for mod in m.modules():
        for k, y in vars(mod).items():
            if "cache" in k or k.startswith("_forward") or k in ("_parameters", "_buffers", "_modules"): continue
            if not isinstance(y, torch.nn.Module): visit(y)
        for p in mod.parameters(recurse=False): visit(p)
        for b in mod.buffers(recurse=False): visit(b)
    visit(getattr(m, "_lm_head_prepared", None))
    return total

out = {}
for recipe in ("none", "nvfp4", "fp8_rowwise"):
    cfg = config.load(None, ["--model.dtype=\"bfloat16\"", f"--quantization.recipe=\"{recipe}\""])
    model = get_architecture(cfg.model.name).build(cfg.model.flavor, cfg.model_options()).init_weights(1, 0.05).to(torch.bfloat16)
    import tempfile

    link = ColocatedEngine(cfg, tempfile.mkdtemp(prefix=f"engine_memory_{recipe}_"), model, torch.bfloat16, Ranks(),
                           "collective")
    link.collect(link.submit(1, prompt_episodes([[2, 3, 5]], [SamplingParams(max_tokens=2, logprobs=0)])))
    out[recipe] = held_bytes(engine_model(link.llm))
    del link
from titan_rl.kernels.cpu_features import kind

print(f"{'recipe':12s} {'bytes held':>12s} {'x unquantized':>14s}   (CPU forms: {kind()})")
for recipe, n in out.items():
    print(f"{recipe:12s} {n:>12d} {n / out['none']:>14.3f}")
if "--json" in sys.argv:
    with open(sys.argv[sys.argv.index("--json") + 1], "w") as f:
        json.dump({"cpu_forms": kind(), "bytes": out, "ratio": {k: v / out["none"] for k, v in out.items()}}, f, indent=1)
