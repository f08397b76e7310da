"""The stock pair where vLLM's own CPU ops cannot run a folder (the real hybrids in fp32, or
at shapes its CPU GDN / MoE kernels do not take: titan_rl.vllm.engine.stock_cpu_problem):
transformers' own model on both sides. Its cached decode samples (the recurrent GDN step
per token: the sampler's pass) and records mu from its raw logits; its forward over the
whole sequence (the chunked GDN form: the trainer's pass) gives pi. The mismatch is the
prefill/decode seam of one stock implementation, which every stack that samples with one
kernel path and trains with another carries."""

from __future__ import annotations

import torch

from titan_rl.rollout import Rollout


def sample_and_rescore(folder: str, cfg, prompts: list[list[int]], seed: int, full_vocab: int):
    """(Rollout, the trainer side's pi / entropy / full rows) of transformers' model in
    `folder` at cfg.model.dtype, with cfg.sampling's temperature / top-k / top-p: one request
    at a time, seeded per request."""
    from transformers import AutoModelForCausalLM

    from titan_rl.dtypes import DTYPES

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=DTYPES[cfg.model.dtype], local_files_only=True).eval()
    s = cfg.sampling
    ro = Rollout([], [], [], [], [])
    scores = {"pi": [], "entropy": [], "full": []}
    with torch.no_grad():
        for i, p in enumerate(prompts):
            torch.manual_seed(seed * 100_003 + i)
            prompt = torch.tensor([p])
            out = model.generate(prompt, do_sample=True, temperature=s.temperature, top_k=s.top_k or None,
                                 top_p=s.top_p, max_new_tokens=s.max_tokens, min_new_tokens=s.max_tokens,
                                 output_logits=True, return_dict_in_generate=True, pad_token_id=0,
                                 eos_token_id=None)
            toks = out.sequences[0, len(p):]
            mu_rows = torch.stack([lg[0].float().log_softmax(-1) for lg in out.logits])
            pi_rows = model(input_ids=out.sequences).logits[0, len(p) - 1:-1].float().log_softmax(-1)
            ro.request_ids.append(str(i))
            ro.prompts.append(list(p))
            ro.tokens.append(toks.tolist())
            ro.mu.append(mu_rows.gather(-1, toks[:, None])[:, 0].double())
            ro.full.append(mu_rows if i < full_vocab else None)
            scores["pi"].append(pi_rows.gather(-1, toks[:, None])[:, 0])
            scores["entropy"].append(-(pi_rows.exp() * pi_rows).nansum(-1))
            scores["full"].append(pi_rows if i < full_vocab else None)
    return ro, scores
