"""Top-k/top-p kept sets and sampled-policy log-probs (docs/sampling.md).

Unit part: our apply_top_k_top_p is row-invariant, equals the per-row reference and
vLLM's own pytorch implementation. vLLM part (debug model, fp32, in-process engine with
logprobs_mode="processed_logprobs", chunked prefill so partial-prefill samples are
discarded): the recorded log-probs equal the trainer's sampled_logprobs bitwise in
"recompute" and in "replay" (captured kept sets) modes; the unrenormalised ratio equals
the kept mass.
"""


import pytest
from _seeds import draw_seed
import torch

from titan_rl.kernels.sampling import apply_top_k_top_p, kept_mask, sampled_logprobs
from titan_rl.kernels.sampling.reference import kept_mask_reference, sampled_logprobs_reference

KP = [(None, 0.9), (50, None), (50, 0.9), (1, None), (None, 0.5), (1024, 1.0), ("rand", "rand")]


def _kp(k, p, n, rng):
    if k == "rand":
        k = torch.randint(0, 1100, (n,), generator=rng)  # 0 and >= V: top-k off for that row
    if p == "rand":
        p = torch.rand(n, generator=rng) * 1.2  # some >= 1: top-p off for that row
    return (None if k is None else torch.as_tensor(k).reshape(-1).expand(n).clone(),
            None if p is None else torch.as_tensor(p, dtype=torch.float32).reshape(-1).expand(n).clone())


@pytest.mark.parametrize("k,p", KP)
def test_row_invariant_and_matches_reference(rng, k, p):
    N, V = 24, 1024
    x = torch.randn(N, V, generator=rng) * 4
    x[3, :7] = float("-inf")  # already-masked entries stay out of the kept set
    x[5, 100:140] = x[5, 99]  # ties at the thresholds
    k, p = _kp(k, p, N, rng)
    out = apply_top_k_top_p(x, k, p)
    for i in range(N):  # a row alone, and inside a different batch
        alone = apply_top_k_top_p(x[i:i + 1], None if k is None else k[i:i + 1], None if p is None else p[i:i + 1])
        assert torch.equal(alone, out[i:i + 1]), i
    perm = torch.randperm(N, generator=rng)
    shuffled = apply_top_k_top_p(x[perm], None if k is None else k[perm], None if p is None else p[perm])
    assert torch.equal(shuffled, out[perm])
    kept = kept_mask(x, k, p)
    assert torch.equal(kept, kept_mask_reference(x, k, p))
    assert torch.equal(out[kept], x[kept]) and bool((out[~kept] == float("-inf")).all())
    assert bool(kept.any(dim=1).all())


@pytest.mark.parametrize("V", [1, 2, 997, 2049, 151_936])
def test_compiled_stable_sort_is_torch_stable_sort(rng, V):
    """The radix sort behind top-p returns exactly torch's stable order: ties by index,
    -0 tied with +0 (values kept as given), -inf first, +inf then NaN last, odd widths."""
    from titan_rl.kernels.sampling.torch_impl import stable_sort

    N = 6 if V > 10_000 else 7
    x = torch.randn(N, V, generator=rng) * 5
    if V > 2:
        x[0] = x[0].round()  # many ties
        x[1, ::3] = 0.0
        x[1, 1::3] = -0.0
        x[2, : V // 2] = float("-inf")
        x[2, V // 2 :: 5] = float("inf")
        x[3, ::4] = float("nan")
        x[4] = torch.tensor(1e-40).expand(V)  # subnormal, all tied
        x[5, 1::2] = -x[5, 0 : V - 1 : 2]  # +a and -a pairs
    vals, idx = stable_sort(x)
    ref_vals, ref_idx = x.sort(dim=-1, stable=True)
    assert torch.equal(idx, ref_idx)
    assert torch.equal(vals.view(torch.int32), ref_vals.view(torch.int32))  # -0 stays -0, NaN bits too
    if N > 1:  # a row's order does not depend on the rows beside it
        assert torch.equal(stable_sort(x[1:2])[1], idx[1:2])


def test_matches_vllm_pytorch_impl(rng):
    vllm_ops = pytest.importorskip("vllm.v1.sample.ops.topk_topp_sampler")
    N, V = 16, 1024
    x = torch.randn(N, V, generator=rng) * 3
    k = torch.randint(1, V, (N,), generator=rng)
    p = torch.rand(N, generator=rng) * 0.98 + 0.01
    for kk, pp in [(k, p), (None, p), (k, None)]:
        theirs = vllm_ops.apply_top_k_top_p_pytorch(x.clone(), kk, pp, allow_cpu_sync=True)
        assert torch.equal(apply_top_k_top_p(x, kk, pp), theirs)


def test_sampled_logprobs_reference_and_outside_raises(rng):
    N, V = 12, 1024
    x = torch.randn(N, V, generator=rng) * 3
    temp = torch.full((N,), 0.8)
    kept = kept_mask(x / temp[:, None], 50, 0.9)
    tokens = torch.multinomial(kept.float(), 1, generator=rng)[:, 0]
    rec = sampled_logprobs(x, tokens, 0.8, 50, 0.9)
    assert torch.equal(rec, sampled_logprobs(x, tokens, temp, torch.full((N,), 50), torch.full((N,), 0.9)))
    assert torch.equal(rec, sampled_logprobs(x, tokens, 0.8, kept=kept))
    assert torch.equal(rec, sampled_logprobs_reference(x, tokens, 0.8, 50, 0.9))
    # gradients flow to the kept logits only
    xg = x.clone().requires_grad_(True)
    sampled_logprobs(xg, tokens, 0.8, 50, 0.9).sum().backward()
    assert bool((xg.grad[~kept] == 0).all()) and bool(torch.isfinite(xg.grad).all())
    bad = tokens.clone()
    bad[7] = int(torch.nonzero(~kept[7])[0])
    with pytest.raises(ValueError, match=f"row 7 token {int(bad[7])}"):
        sampled_logprobs(x, bad, 0.8, 50, 0.9)
    with pytest.raises(ValueError, match=f"row 7 token {int(bad[7])}"):
        sampled_logprobs(x, bad, 0.8, kept=kept)
    with pytest.raises(ValueError, match="greedy"):
        sampled_logprobs(x, tokens, 0.0, 50, 0.9)


@pytest.mark.parametrize("V", [1024, 1000, 7])
def test_encode_decode_round_trip_and_size_rule(rng, V):
    from titan_rl.vllm.sampling import decode, encode, encoded_size

    bitmap = 1 + (V + 7) // 8
    for n in sorted({0, 1, 2, (V + 7) // 32, (V + 7) // 32 + 1, V // 2, V}):
        n = min(n, V)
        m = torch.zeros(V, dtype=torch.bool)
        m[torch.randperm(V, generator=rng)[:n]] = True
        b = encode(m)
        assert torch.equal(decode(b, V), m)
        assert len(b) == encoded_size(n, V) == min(bitmap, 1 + 4 * n)
        assert b[0] == (1 if 4 * n < (V + 7) // 8 else 0)


# ---------------------------------------------------------------- vLLM, in process

@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    pytest.importorskip("vllm")
    from vllm import LLM

    from titan_rl.checkpoint import load_hf_folder, save_hf_folder
    from titan_rl.models.qwen3 import build
    from titan_rl.registry import get_architecture
    from titan_rl.vllm.sampling import install

    seed = draw_seed("weights seed")
    folder = str(tmp_path_factory.mktemp("w_sampling"))
    save_hf_folder(build("debug").init_weights(seed, 0.05), folder, dtype=torch.float32)
    install()
    # make_llm's kwargs (titan_rl/vllm/engine.py) plus logprobs_mode, which it does not take;
    # a 64-token budget forces chunked prefill, so some steps sample rows vLLM discards.
    llm = LLM(model=folder, skip_tokenizer_init=True, dtype="float32", seed=0, enforce_eager=True,
              kv_cache_memory_bytes=64 << 20, max_model_len=256, max_num_seqs=8, enable_prefix_caching=True,
              max_logprobs=-1, hf_overrides={"architectures": [get_architecture("qwen3").vllm_architecture]},
              max_num_batched_tokens=64, enable_chunked_prefill=True, logprobs_mode="processed_logprobs")
    trainer = load_hf_folder(folder, kernels="exact", dtype=torch.float32).eval()
    yield llm, trainer
    del llm


def test_vllm_processed_logprobs_recompute_and_replay(engine, rng):
    from vllm import SamplingParams

    from titan_rl.vllm.sampling import capture_kept_sets, installed

    llm, trainer = engine
    assert installed()
    lens = [37, 3, 150, 64, 9, 100, 1, 77]
    prompts = [torch.randint(2, 1024, (n,), generator=rng).tolist() for n in lens]
    # request 4 has both filters off: vLLM hands it k=V, p=1.0 inside this batch
    filt = [(50, 0.9)] * 4 + [(0, 1.0)] + [(50, 0.9)] * 3
    params = [SamplingParams(temperature=0.8, top_k=k, top_p=p, max_tokens=12, ignore_eos=True, logprobs=0)
              for k, p in filt]
    with capture_kept_sets(llm) as ks:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert ks.total_bytes == sum(len(b) for v in ks.encoded.values() for b in v) > 0
    print(f"kept sets: {sum(map(len, ks.encoded.values()))} steps, {ks.total_bytes} bytes")

    seqs = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)]
    L = max(map(len, seqs))
    batch = torch.zeros(len(seqs), L, dtype=torch.long)
    for i, s in enumerate(seqs):
        batch[i, : len(s)] = torch.tensor(s)
    with torch.no_grad():
        logits = trainer(batch)
    assert logits.dtype == torch.float32

    ratios, masses = [], []
    for i, (p, o, (k, tp)) in enumerate(zip(prompts, outs, filt)):
        c = o.outputs[0]
        toks = torch.tensor(c.token_ids)
        assert len(toks) == 12
        mu = torch.tensor([lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)], dtype=torch.float32)
        rows = logits[i, len(p) - 1: len(p) - 1 + len(toks)]
        kept = ks.kept_for(o.request_id, c.token_ids)
        assert kept.shape == (12, 1024)
        recompute = sampled_logprobs(rows, toks, 0.8, k, tp)
        replay = sampled_logprobs(rows, toks, 0.8, kept=kept)
        assert torch.equal(recompute, mu), (i, (recompute - mu).abs().max())
        assert torch.equal(replay, mu), (i, (replay - mu).abs().max())
        assert torch.equal(recompute, replay)
        assert torch.equal(kept, kept_mask(rows / torch.tensor(0.8), k, tp))
        # (c) the bias of not renormalising: p_raw / p_processed == kept mass, and exactly 1 when renormalised
        raw_lp = (rows / torch.tensor(0.8)).log_softmax(-1, dtype=torch.float32)
        raw = raw_lp.gather(1, toks[:, None])[:, 0]
        mass = (raw_lp.double().exp() * kept).sum(-1)
        ratio = (raw.double() - mu.double()).exp()
        assert torch.allclose(ratio, mass, rtol=1e-5, atol=0), (ratio - mass).abs().max()
        assert bool(((replay.double() - mu.double()).exp() == 1).all())
        if k != 0:
            ratios.append(ratio)
            masses.append(mass)
    ratios, masses = torch.cat(ratios), torch.cat(masses)
    # tolerance 1e-6 absolute on a mean of fp32-derived values (single-token errors ~1e-7 relative)
    assert abs(ratios.mean().item() - masses.mean().item()) < 1e-6
    assert masses.mean().item() < 0.99  # top-k 50 / top-p 0.9 drop real mass: the unrenormalised ratio is biased
