"""Shared helpers of the vLLM parity tests: generate, rescore in one batch, random prompts."""


import torch

from titan_rl.dtypes import DTYPES
from _seeds import draw_seed
from vllm import SamplingParams

from titan_rl.kernels import log_softmax_fp32


def _gen(llm, prompts, seeds=None, max_tokens=12):
    seeds = seeds or [None] * len(prompts)
    params = [SamplingParams(temperature=1.0, top_p=0.9, max_tokens=max_tokens, ignore_eos=True, logprobs=0, seed=s)
              for s in seeds]
    return _results(llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))


@torch.no_grad()
def _trainer_logprobs(trainer, prompts, results):
    """Score all sequences in ONE right-padded batch (another composition again)."""
    seqs = [p + r[0] for p, r in zip(prompts, results)]
    L = max(map(len, seqs))
    batch = torch.zeros(len(seqs), L, dtype=torch.long)
    for i, s in enumerate(seqs):
        batch[i, : len(s)] = torch.tensor(s)
    logp = log_softmax_fp32(trainer(batch))
    out = []
    for i, (p, r) in enumerate(zip(prompts, results)):
        rows = logp[i, len(p) - 1 : len(p) - 1 + len(r[0])]
        out.append(rows.gather(-1, torch.tensor(r[0])[:, None])[:, 0].double())
    return out


def _results(outs):
    """(tokens, their log-probs as float64, cached prompt tokens) per request output."""
    res = []
    for o in outs:
        c = o.outputs[0]
        res.append((list(c.token_ids), torch.tensor([lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)],
                                                    dtype=torch.float64), o.num_cached_tokens))
    return res


def assert_alone_equals_batched(llm, prompts, max_tokens=12):
    """Greedy: the first prompt generated alone and inside the whole batch gives the same tokens
    and the same log-prob bits. Returns the batch's results (as `_gen` gives them), so a caller
    can compare that batch with the trainer instead of generating it again."""
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    alone, batch = (llm.generate([{"prompt_token_ids": p} for p in ps], greedy, use_tqdm=False)
                    for ps in (prompts[:1], prompts))
    a, b = alone[0].outputs[0], batch[0].outputs[0]
    assert a.token_ids == b.token_ids
    assert [lp[t].logprob for t, lp in zip(a.token_ids, a.logprobs)] == \
        [lp[t].logprob for t, lp in zip(b.token_ids, b.logprobs)]
    return _results(batch)


def _prompts(rng, lens, vocab=1024):
    return [torch.randint(2, vocab, (n,), generator=rng).tolist() for n in lens]




def random_checkpoint(tmp_path_factory, make_model, dtype: str, arch: str = "qwen3"):
    """Fresh random weights (seed drawn from the OS, printed) saved as a local HF folder in
    `dtype`, and the exact trainer-side model loaded from it: (folder, trainer).
    make_model(seed) -> model with initialised weights."""
    from titan_rl.checkpoint import load_hf_folder, save_hf_folder

    seed = draw_seed("weights seed")
    folder = str(tmp_path_factory.mktemp(f"{arch}_{dtype}"))
    save_hf_folder(make_model(seed), folder, dtype=DTYPES[dtype])
    return folder, load_hf_folder(folder, kernels="exact", dtype=DTYPES[dtype], arch=arch).eval()
