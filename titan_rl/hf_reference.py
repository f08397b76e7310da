"""Tiny HF folders written by transformers' own model classes: the reference the loaders are
tested against, and a checkpoint to point `python -m titan_rl.parity --model.name=auto` at
without a hub.

    python -m titan_rl.hf_reference --arch qwen3_5 --out /tmp/q35 [--stock-shapes] [--seed 0]
    python -m titan_rl.hf_reference --arch glm_moe_dsa --out /tmp/glm5
    python -m titan_rl.hf_reference --arch qwen3_5 --published --out /tmp/q35-0.8b   # real widths

Odd sizes by default (hidden 200, vocab 997, 3 value heads per key head, GDN head dims 32 / 16,
a conv of width 3, 5 experts of 72, a shared expert of 88). `--stock-shapes` keeps the odd
hidden / vocab / FFN widths where vLLM's own CPU ops allow them and changes what they do not
take (titan_rl.vllm.stock_cpu.stock_cpu_problem): conv width 4, GDN head dims 64 = 64, and for
the MoE models hidden 224 (a multiple of 32)."""

import argparse
import sys

from titan_rl import quiet

quiet.install()  # before torch and transformers load (torchao's CPU notices, shard progress bars)

import torch  # noqa: E402

ODD = dict(vocab_size=997, hidden_size=200, intermediate_size=328, num_hidden_layers=4, num_attention_heads=4,
           num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=6,
           linear_key_head_dim=32, linear_value_head_dim=16, linear_conv_kernel_dim=3, max_position_embeddings=4096)
MOE = dict(num_experts=5, num_experts_per_tok=2, moe_intermediate_size=72, shared_expert_intermediate_size=88)
STOCK = dict(linear_conv_kernel_dim=4, linear_key_head_dim=64, linear_value_head_dim=64)
STOCK_MOE = dict(hidden_size=224)
# GLM-5 (glm_moe_dsa): odd widths too (hidden 200, vocab 997, q latent 72, kv latent 40, v head 20,
# 3 indexer heads of 24, 5 experts of 72 top-2), a first dense layer, and index_topk = 16, below
# the prompts' lengths, so the indexer really selects
GLM = dict(vocab_size=997, hidden_size=200, intermediate_size=328, moe_intermediate_size=72, num_hidden_layers=3,
           num_attention_heads=4, num_key_value_heads=4, q_lora_rank=72, kv_lora_rank=40, qk_nope_head_dim=24,
           qk_rope_head_dim=16, v_head_dim=20, n_routed_experts=5, num_experts_per_tok=2, n_shared_experts=1,
           first_k_dense_replace=1, index_topk=16, index_head_dim=24, index_n_heads=3, max_position_embeddings=4096,
           routed_scaling_factor=2.5, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
# Llama (SmolLM2's shape family): odd widths, 6 heads over 2 KV heads, head_dim 32 apart from hidden / heads (35)
LLAMA = dict(vocab_size=997, hidden_size=210, intermediate_size=328, num_hidden_layers=4, num_attention_heads=6,
             num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-5, rope_theta=100_000.0, max_position_embeddings=4096)
# The smallest published model's widths (random weights: the benchmarks' real-size folders).
# Qwen3.5-0.8B's text model; GLM-5's are transformers' GlmMoeDsaConfig defaults (744B: cut with
# `layers`, its first three layers are dense).
PUBLISHED = {
    "qwen3_5": dict(vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
                    num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
                    linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
                    linear_conv_kernel_dim=4, full_attention_interval=4, partial_rotary_factor=0.25,
                    rope_theta=10_000_000.0, rms_norm_eps=1e-6, max_position_embeddings=262144),
    "glm_moe_dsa": {},
}
PUBLISHED_TIED = {"qwen3_5": True, "glm_moe_dsa": False}
ARCHS = ("qwen3_next", "qwen3_5", "qwen3_5_moe")  # the real hybrids (tests and scripts iterate them)
ALL_ARCHS = (*ARCHS, "glm_moe_dsa", "llama")


def classes(arch: str):
    """(config class, model class, extra config fields) of transformers for `arch`."""
    if arch == "qwen3_next":
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

        return Qwen3NextConfig, Qwen3NextForCausalLM, MOE
    if arch == "qwen3_5":
        from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig

        return Qwen3_5TextConfig, Qwen3_5ForCausalLM, {}
    if arch == "qwen3_5_moe":
        from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

        return Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM, MOE
    if arch == "glm_moe_dsa":
        from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

        return GlmMoeDsaConfig, GlmMoeDsaForCausalLM, {}
    if arch == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaConfig, LlamaForCausalLM, {}
    raise ValueError(f"arch = {arch!r}: allowed: {list(ALL_ARCHS)}")


def hf_model(arch: str, seed: int, *, tied: bool = False, stock_shapes: bool = False, scale: float = 0.02,
             published: bool = False, **fields):
    """transformers' model for `arch` at the tiny sizes (`published`: the smallest published
    model's widths, PUBLISHED), its weights moved off their init by N(0, scale) noise
    (transformers inits routers and norm weights to zero: unmoved, every token would route alike
    and a (1 + w) norm would read the same as w)."""
    config_cls, model_cls, extra = classes(arch)
    if published and arch not in PUBLISHED:
        raise ValueError(f"--published: arch = {arch!r} has no published widths here; allowed: {list(PUBLISHED)}")
    if published and stock_shapes:
        raise ValueError("--published and --stock-shapes: the published widths are what they are; pass one")
    sizes = (dict(PUBLISHED[arch]) if published else dict(GLM) if arch == "glm_moe_dsa"
             else dict(LLAMA) if arch == "llama" else {**ODD, **extra})
    if stock_shapes and arch == "glm_moe_dsa":
        raise ValueError("--stock-shapes: vLLM's CPU build has no sparse-attention backend for glm_moe_dsa at any "
                         "shape (its stock column is transformers' own pair)")
    if stock_shapes and arch != "llama":  # vLLM's CPU Llama takes the odd widths
        sizes.update(STOCK, **(STOCK_MOE if extra else {}))
    sizes.update(fields)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**sizes, tie_word_embeddings=tied)).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():  # GLM-5's e_score_correction_bias (a buffer there, saved)
            if name.endswith("e_score_correction_bias"):
                b.add_(scale * torch.randn(b.shape, generator=g))
    return model


VL_ARCHS = ("qwen3_5", "qwen3_5_moe")  # published as vision-language models


def vl_classes(arch: str):
    """(config class, model class, extra text config fields) of transformers' vision-language
    form of `arch` (Qwen3.5's published form)."""
    if arch == "qwen3_5":
        from transformers.models.qwen3_5 import Qwen3_5Config, Qwen3_5ForConditionalGeneration

        return Qwen3_5Config, Qwen3_5ForConditionalGeneration, {}
    if arch == "qwen3_5_moe":
        from transformers.models.qwen3_5_moe import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

        return Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration, MOE
    raise ValueError(f"arch = {arch!r}: allowed: {list(VL_ARCHS)}")


def vl_model(seed: int, *, arch: str = "qwen3_5", scale: float = 0.02, stock_shapes: bool = False, **fields):
    """transformers' Qwen3_5ForConditionalGeneration / Qwen3_5MoeForConditionalGeneration (a
    one-block vision tower of odd widths beside the tiny text model): a folder with
    `model.language_model.*` and `model.visual.*` tensors."""
    config_cls, model_cls, extra = vl_classes(arch)
    text = {**ODD, **extra, **((STOCK | (STOCK_MOE if extra else {})) if stock_shapes else {}), **fields}
    vision = dict(depth=1, hidden_size=36, intermediate_size=44, num_heads=2, num_position_embeddings=16,
                  out_hidden_size=text["hidden_size"])
    torch.manual_seed(seed)
    model = model_cls(config_cls(text_config=text, vision_config=vision)).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return model


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m titan_rl.hf_reference", description=__doc__.split("\n")[0])
    ap.add_argument("--arch", required=True, choices=ALL_ARCHS)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scale", type=float, default=None, help="std of the noise added to the init (default 0.2: "
                    "logits with a std of a few units, so sampling is not uniform; 0.02 with --published)")
    ap.add_argument("--stock-shapes", action="store_true", help="shapes vLLM's own CPU ops take")
    ap.add_argument("--tied", action="store_true", help="tie the LM head to the embedding")
    ap.add_argument("--published", action="store_true", help="the smallest published model's widths "
                    f"({', '.join(PUBLISHED)}: Qwen3.5-0.8B's text model, GLM-5), random weights")
    ap.add_argument("--layers", type=int, default=0, help="with --published: keep this many layers (0: all)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="the saved tensors' dtype")
    args = ap.parse_args(argv)
    if args.layers < 0 or (args.layers and not args.published):
        ap.error(f"--layers {args.layers}: a count >= 0, with --published (the tiny folders set their own)")
    if args.published and args.arch not in PUBLISHED:
        ap.error(f"--published --arch {args.arch}: no published widths here; allowed: {list(PUBLISHED)}")
    if args.published and args.stock_shapes:
        ap.error("--published with --stock-shapes: the published widths are what they are; pass one")
    if args.published and args.arch == "glm_moe_dsa" and not args.layers:
        ap.error("--published --arch glm_moe_dsa: GLM-5 is 744B parameters; pass --layers N (1-3 are its dense "
                 "layers, ~2.3B parameters with the embedding and head)")
    fields = {"num_hidden_layers": args.layers} if args.layers else {}
    if args.published and args.arch == "glm_moe_dsa" and args.layers and args.layers < 3:
        fields["first_k_dense_replace"] = args.layers  # all dense: GLM-5's first three layers
    tied = args.tied or (args.published and PUBLISHED_TIED[args.arch])
    scale = args.scale if args.scale is not None else 0.02 if args.published else 0.2
    model = hf_model(args.arch, args.seed, tied=tied, stock_shapes=args.stock_shapes, scale=scale,
                     published=args.published, **fields)
    model.to(getattr(torch, args.dtype)).save_pretrained(args.out)
    print(f"wrote {args.out} ({classes(args.arch)[1].__name__})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
