"""titan_rl.metrics on hand-made tensors whose answers are known by construction, and
titan_rl.rollout's record built from stand-ins for vLLM's RequestOutputs (ragged lengths)."""

import math
from types import SimpleNamespace

import pytest
import torch

from titan_rl.metrics import STEP_MISMATCH, expert_disagreement, full_vocab_mismatch, logprob_mismatch
from titan_rl.rollout import Rollout, pad_sequences, response_mask
from titan_rl.vllm.routes import RouteRecord
from titan_rl.vllm.sampling import KeptSets, encode

V = 11


# -- metrics ---------------------------------------------------------------------------
def test_identical_logprobs_are_an_exact_zero():
    pi = -torch.rand(37, dtype=torch.float32) * 5
    m = logprob_mismatch(pi, pi.clone())
    assert m == {"tokens": 37, "bitwise_fraction": 1.0, "max_abs_dlogp": 0.0, "mean_abs_dlogp": 0.0,
                 "k3_mean": 0.0, "k3_max": 0.0}


def test_one_perturbed_token_gives_its_exact_value():
    mu = torch.full((8,), -2.0, dtype=torch.float64)
    pi = mu.clone()
    pi[5] = -1.5  # d = +0.5 at one of 8 tokens
    m = logprob_mismatch(pi, mu)
    assert m["tokens"] == 8
    assert m["bitwise_fraction"] == 7 / 8
    assert m["max_abs_dlogp"] == 0.5
    assert m["mean_abs_dlogp"] == 0.5 / 8
    k3 = math.exp(0.5) - 0.5 - 1
    assert m["k3_max"] == pytest.approx(k3, rel=1e-15) and m["k3_mean"] == pytest.approx(k3 / 8, rel=1e-15)


def test_mismatch_is_taken_in_float64_and_is_sign_free():
    mu = torch.tensor([-1.0, -3.0], dtype=torch.float32)
    pi = torch.tensor([-1.25, -3.0], dtype=torch.float32)  # d = -0.25, 0
    m = logprob_mismatch(pi, mu)
    assert m["max_abs_dlogp"] == 0.25 and m["mean_abs_dlogp"] == 0.125 and m["bitwise_fraction"] == 0.5
    assert m["k3_max"] == pytest.approx(math.exp(-0.25) + 0.25 - 1, rel=1e-15)


def test_step_mismatch_names_logged_keys_of_logprob_mismatch():
    assert list(STEP_MISMATCH) == ["bitwise_fraction", "max_abs_dlogp", "mean_abs_dlogp", "k3_mean"]
    assert STEP_MISMATCH["max_abs_dlogp"] == "max" and set(STEP_MISMATCH.values()) == {"mean", "max"}
    assert set(STEP_MISMATCH) <= set(logprob_mismatch(torch.zeros(1), torch.zeros(1)))


def test_full_vocab_mismatch_counts_positions_and_entries():
    a = torch.zeros(3, 4)
    b = a.clone()
    b[2, 1] = 0.125  # one entry of 3 * 4 + 2 * 4 = 20 differs
    c = torch.ones(2, 4)
    m = full_vocab_mismatch([(a, b), (c, c.clone())])
    assert m == {"full_vocab_positions": 5, "full_vocab_max_abs_dlogp": 0.125,
                 "full_vocab_bitwise_fraction": 19 / 20}
    assert full_vocab_mismatch([(c, c.clone())])["full_vocab_max_abs_dlogp"] == 0.0


def test_expert_disagreement_known_fractions():
    a = torch.tensor([[[0, 1], [2, 3]], [[4, 5], [6, 7]]], dtype=torch.uint8)  # [2 positions, 2 layers, k=2]
    assert expert_disagreement(a, a.flip(-1)) == 0.0  # order-free
    b = a.clone()
    b[1, 0, 0] = 9  # one of 8 choices moved to an expert `a` did not pick
    assert expert_disagreement(a, b) == 1 / 8
    assert expert_disagreement(a[:0], b[:0]) == 0.0
    with pytest.raises(ValueError, match="shapes"):
        expert_disagreement(a, a[:1])


# -- rollout ---------------------------------------------------------------------------
def _lp(x):
    return SimpleNamespace(logprob=x)


def _output(rid, prompt, toks, full=False):
    """A stand-in for vLLM's RequestOutput: mu of token j is -(j + 1) / 8; with full=True
    every vocabulary entry is recorded (logprobs=-1), entry t = -t / 16 except the token's."""
    logprobs = []
    for j, t in enumerate(toks):
        d = {v: _lp(-v / 16) for v in range(V)} if full else {}
        d[t] = _lp(-(j + 1) / 8)
        logprobs.append(d)
    comp = SimpleNamespace(token_ids=list(toks), logprobs=logprobs)
    return SimpleNamespace(request_id=rid, prompt_token_ids=list(prompt), outputs=[comp])


PROMPT_LENS, TOKEN_LENS = [1, 7, 13], [13, 1, 7]  # ragged: sequence lengths 14, 8, 20


def _outputs(full_first=False):
    outs = []
    for i, (P, R) in enumerate(zip(PROMPT_LENS, TOKEN_LENS)):
        prompt = [2 + (i + p) % (V - 2) for p in range(P)]
        toks = [(3 * i + j) % V for j in range(R)]
        outs.append(_output(f"r{i}", prompt, toks, full=full_first and i == 0))
    return outs


def test_from_vllm_reads_tokens_mu_and_full_rows():
    outs = _outputs(full_first=True)
    r = Rollout.from_vllm(outs)
    assert len(r) == 3 and r.num_tokens == sum(TOKEN_LENS) and r.request_ids == ["r0", "r1", "r2"]
    assert r.prompts == [o.prompt_token_ids for o in outs]
    assert r.tokens == [o.outputs[0].token_ids for o in outs]
    for m, R in zip(r.mu, TOKEN_LENS):
        assert m.dtype == torch.float64 and m.tolist() == [-(j + 1) / 8 for j in range(R)]
    assert r.full[0].shape == (13, V) and r.full[1] is None and r.full[2] is None
    toks0 = r.tokens[0]
    for j, row in enumerate(r.full[0]):
        want = [-(j + 1) / 8 if v == toks0[j] else -v / 16 for v in range(V)]
        assert row.tolist() == want
    assert r.kept is None and r.routes is None


def test_batch_and_mask_on_ragged_lengths():
    r = Rollout.from_vllm(_outputs())
    batch, mask = r.batch(pad=-7), r.mask()
    assert batch.dtype == torch.long and batch.shape == (3, 20)
    assert mask.dtype == torch.bool and mask.shape == (3, 19)
    for i, (P, R) in enumerate(zip(PROMPT_LENS, TOKEN_LENS)):
        assert batch[i, : P + R].tolist() == r.prompts[i] + r.tokens[i]
        assert (batch[i, P + R :] == -7).all()
        want = torch.zeros(19, dtype=torch.bool)
        want[P - 1 : P - 1 + R] = True
        assert torch.equal(mask[i], want)
        assert r.response_span(i) == slice(P - 1, P - 1 + R)
        # the masked targets are exactly the sampled tokens
        assert batch[i, 1:][mask[i]].tolist() == r.tokens[i]
    assert int(mask.sum()) == r.num_tokens
    assert torch.equal(r.batch(0, range(1, 3)), pad_sequences(r.sequences(range(1, 3)), 0))
    assert r.batch(0, range(1, 2)).shape == (1, 8)


def test_padded_mu_sits_under_the_mask():
    r = Rollout.from_vllm(_outputs())
    mu, mask = r.padded_mu(), r.mask()
    assert mu.dtype == torch.float32 and mu.shape == mask.shape
    assert (mu[~mask] == 0).all()
    assert torch.equal(mu[mask], torch.cat(r.mu).to(torch.float32))


def test_pad_sequences_and_response_mask():
    b = pad_sequences([[5], [1, 2, 3]], pad=0)
    assert b.tolist() == [[5, 0, 0], [1, 2, 3]]
    m = response_mask([1, 2], [0, 1], 2)
    assert m.tolist() == [[False, False], [False, True]]


def test_kept_sets_are_checked_and_concatenated_in_request_order():
    outs = _outputs()
    ks = KeptSets(vocab_size=V)
    rows = {}
    for o in outs:
        toks = o.outputs[0].token_ids
        kept = torch.zeros(len(toks), V, dtype=torch.bool)
        kept[torch.arange(len(toks)), torch.tensor(toks)] = True
        kept[:, 0] = True
        rows[o.request_id] = kept
        ks.encoded[o.request_id] = [encode(row) for row in kept]
        ks.tokens[o.request_id] = list(toks)
    r = Rollout.from_vllm(outs, kept_sets=ks)
    assert r.kept.shape == (sum(TOKEN_LENS), V)
    assert torch.equal(r.kept, torch.cat([rows[f"r{i}"] for i in range(3)]))
    assert r.kept_bytes == ks.total_bytes > 0
    ks.tokens["r1"] = [(t + 1) % V for t in ks.tokens["r1"]]
    with pytest.raises(ValueError, match="captured tokens"):
        Rollout.from_vllm(outs, kept_sets=ks)


def test_routes_are_padded_with_minus_one():
    outs = _outputs()
    layers, k = 2, 3
    rec = RouteRecord(dtype=torch.uint8, num_layers=layers, k=k)
    for i, o in enumerate(outs):
        n = len(o.prompt_token_ids) + len(o.outputs[0].token_ids) - 1
        rec.by_request[o.request_id] = {
            p: torch.full((layers, k), 10 * i + p % 10, dtype=torch.uint8) for p in range(n)}
    r = Rollout.from_vllm(outs, routes=rec)
    assert r.route_bytes_per_token == layers * k
    routes = r.padded_routes()
    assert routes.dtype == torch.int16 and routes.shape == (3, 20, layers, k)
    for i, (P, R) in enumerate(zip(PROMPT_LENS, TOKEN_LENS)):
        n = P + R - 1  # the last sampled token is never fed back
        assert torch.equal(routes[i, :n], r.routes[i].to(torch.int16))
        assert (routes[i, n:] == -1).all()
        assert int(routes[i, :n, 0, 0].max()) == 10 * i + min(n - 1, 9)
    with pytest.raises(ValueError, match="no routes"):
        Rollout.from_vllm(outs).padded_routes()
