"""Guard test: pins the measured platform facts exact mode is built on.

For the torch_impl kernels both engines call (tiled linear, rms_norm, log_softmax) and
for the batched matmul shapes inside the fixed-block attention, every row computed in a
batch must have the bits of the same row computed alone, across row counts (1..130 and
some larger, crossing the 64-row tile edges), K, N, dtype and torch thread count. If a
torch / MKL / oneDNN upgrade or a new CPU breaks one of these facts, this test names the
failing parameters; kernels/selfcheck.py then refuses exact mode at start-up.
"""

import pytest
import torch

from titan_rl.kernels import selfcheck
from titan_rl.kernels.attention.torch_impl import BLOCK, ROW_MULTIPLE
from titan_rl.kernels.lm_head.torch_impl import log_softmax_fp32
from titan_rl.kernels.matmul.torch_impl import linear
from titan_rl.kernels.rmsnorm.torch_impl import rms_norm

ROWS = list(range(1, 131)) + [200, 257]  # row counts swept (the input has 257 rows)
SUFFIX_ROWS = [1, 2, 63, 64, 65, 127, 128, 129, 200]  # also the LAST M rows: other tile positions
# Rows whose lone result is computed (one call each): all of the first 130, then the
# 64-row tile edges and the ends; rows beyond 130 are compared only at these.
ALONE = sorted(set(range(130)) | {191, 192, 193, 199, 200, 255, 256})
SPARSE_ROWS = [1, 2, 3, 7, 8, 63, 64, 65, 127, 128, 129, 200, 257]  # for the costly shapes
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(params=[1, 2], ids=lambda n: f"threads{n}")
def threads(request):
    old = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(old)


def _sweep(fn, x, what, rows=ROWS):
    """fn(x[:M]) (and fn(x[-M:]) for M in SUFFIX_ROWS) must give, for every row, the bits
    of fn on that row alone, for every M in rows. Fails listing every bad (M, row)."""
    idx = [i for i in ALONE if i < x.shape[0]]
    alone = dict(zip(idx, torch.cat([fn(x[i : i + 1]) for i in idx])))
    bad = []
    for m in rows:
        for name, start in (("first", 0), ("last", x.shape[0] - m)):
            if name == "last" and m not in SUFFIX_ROWS:
                continue
            got = fn(x[start : start + m])
            bad += [f"M={m} ({name} rows): row {i} differs" for i in range(start, start + m)
                    if i in alone and not torch.equal(got[i - start], alone[i])]
    assert not bad, (f"{what} NOT row-invariant on this platform (threads {torch.get_num_threads()}, "
                     f"{len(bad)} bad rows): " + "; ".join(bad[:8]))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("K,N", [(64, 256), (256, 512), (1024, 384), (3072, 256)])
def test_linear_rows_invariant(K, N, dtype, threads, rng):
    w = (torch.randn(N, K, generator=rng) * K**-0.5).to(dtype)
    x = torch.randn(max(ROWS), K, generator=rng).to(dtype)
    _sweep(lambda t: linear(t, w), x, f"linear K={K} N={N} dtype={dtype}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [64, 128, 1024, 3072])
def test_rms_norm_rows_invariant(hidden, dtype, threads, rng):
    w = (1 + 0.1 * torch.randn(hidden, generator=rng)).to(dtype)
    x = torch.randn(max(ROWS), hidden, generator=rng).to(dtype)
    _sweep(lambda t: rms_norm(t, w, 1e-6), x, f"rms_norm hidden={hidden} dtype={dtype}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("V", [1000, 32000])
def test_log_softmax_rows_invariant(V, dtype, threads, rng):
    x = (4 * torch.randn(max(ROWS), V, generator=rng)).to(dtype)
    _sweep(log_softmax_fp32, x, f"log_softmax_fp32 V={V} input dtype={dtype}",
           rows=ROWS if V <= 1000 else SPARSE_ROWS)


def test_log_softmax_rows_invariant_full_vocab(threads, rng):
    """A Qwen-sized vocabulary (151936) on fewer row counts (memory)."""
    x = 4 * torch.randn(130, 151936, generator=rng)
    full = log_softmax_fp32(x)
    for i in (0, 1, 63, 64, 65, 129):
        assert torch.equal(log_softmax_fp32(x[i : i + 1]), full[i : i + 1]), f"V=151936 row {i}"
    for m in (2, 7, 64, 65, 129):
        assert torch.equal(log_softmax_fp32(x[:m]), full[:m]), f"V=151936 first {m} rows"


# Measured on this CPU (torch 2.13 MKL, AVX512): with K = D = 256 and k^T passed as a
# transposed VIEW, q @ k^T changed a row's bits with the row count / batch size; the core
# therefore makes k^T contiguous, and this sweep pins that layout at D = 256 too.



def _kv_blocks(k, v, layout):
    """k/v [S, L, Hkv, D] -> k/v blocks [S, Hkv, NB, BLOCK, D] laid out as the core gets them."""
    S, L, Hkv, D = k.shape
    nb = L // BLOCK
    if layout == "dense":  # attention_dense: views of the [B, L, Hkv, D] activations
        return [t.view(S, nb, BLOCK, Hkv, D).permute(0, 3, 1, 2, 4) for t in (k, v)]
    # attention_paged: one fp32 buffer [2, S, Hkv, pages*page/BLOCK, BLOCK, D], sliced to nb
    buf = torch.zeros(2, S, Hkv, nb + 1, BLOCK, D)
    buf[:, :, :, :nb] = torch.stack([k, v]).view(2, S, nb, BLOCK, Hkv, D).permute(0, 1, 4, 2, 3, 5)
    buf = buf[:, :, :, :nb]
    return buf[0], buf[1]


@pytest.mark.parametrize("layout", ["dense", "paged"])
@pytest.mark.parametrize("D", [64, 128, 256])
def test_attention_block_matmuls_rows_invariant(D, layout, threads, rng):
    """The two batched GEMMs of _blocked_core (always fp32), with its operand layouts:
    scores q[S, Hkv, 1, R, D] @ k_blocks^T[S, Hkv, NB, D, BLOCK] and values
    p[S, Hkv, NB, R, BLOCK] @ v_blocks[S, Hkv, NB, BLOCK, D]. The core pads R to a
    multiple of ROW_MULTIPLE, so R sweeps those multiples (and NB = 1 and 3 blocks, 2
    sequences); "alone" is one sequence, one block, the row at position 0 of a
    ROW_MULTIPLE-row call (a lone decode row)."""
    S, Hkv, NB = 2, 2, 3
    R = ROW_MULTIPLE * -(-max(ROWS) // ROW_MULTIPLE)
    lone = list(range(12)) + [63, 64, 65, 127, 128, 129, 191, 192, 193, 255, 256, R - 1]  # positions checked
    kb, vb = _kv_blocks(torch.randn(S, NB * BLOCK, Hkv, D, generator=rng),
                        torch.randn(S, NB * BLOCK, Hkv, D, generator=rng), layout)
    q = torch.randn(S, Hkv, R, D, generator=rng)
    p = torch.rand(S, Hkv, NB, R, BLOCK, generator=rng)
    ops = (("q@k^T", lambda rows, nb: torch.matmul(rows[:, :, None], kb[:, :, :nb].transpose(-1, -2).contiguous()),
            lambda s, j, i: torch.matmul(_pad_row(q[s : s + 1, :, i : i + 1], 2)[:, :, None],
                                          kb[s : s + 1, :, j : j + 1].transpose(-1, -2).contiguous())),
           ("p@v", lambda rows, nb: torch.matmul(rows[:, :, :nb], vb[:, :, :nb]),
            lambda s, j, i: torch.matmul(_pad_row(p[s : s + 1, :, j : j + 1, i : i + 1], 3), vb[s : s + 1, :, j : j + 1])))
    for (name, batched, single), a in zip(ops, (q, p)):
        alone = torch.stack([torch.stack([torch.stack([single(s, j, i)[0, :, 0, 0] for i in lone], 1)
                                          for j in range(NB)], 1) for s in range(S)])  # [S, Hkv, NB, lone, N]
        bad = []
        for nb in (1, NB):
            for m in range(ROW_MULTIPLE, R + 1, ROW_MULTIPLE):
                sel = [j for j, i in enumerate(lone) if i < m]
                got = batched(a[..., :m, :].contiguous(), nb)[:, :, :, [lone[j] for j in sel]]
                if not torch.equal(got, alone[:, :, :nb, sel]):
                    bad.append(f"R={m} NB={nb}")
        assert not bad, (f"attention {name} D={D} BLOCK={BLOCK} {layout} layout NOT row-invariant "
                         f"(threads {torch.get_num_threads()}): rows differ from a lone row for {bad[:10]}")


def _pad_row(row, dim):
    """A single row zero-padded to ROW_MULTIPLE rows along `dim`, as _to_rows pads a decode."""
    shape = list(row.shape)
    shape[dim] = ROW_MULTIPLE - 1
    return torch.cat([row, row.new_zeros(shape)], dim)


def test_sweep_catches_a_batch_dependent_kernel(rng):
    """The guard itself can fail: a linear whose rows drift in big batches is reported."""
    x = torch.randn(max(ROWS), 64, generator=rng)
    w = torch.randn(32, 64, generator=rng)
    with pytest.raises(AssertionError, match="M=100 .first rows.: row 0 differs"):
        _sweep(_broken(lambda t: linear(t, w)), x, "broken linear")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_check_platform_passes_here(dtype, threads):
    selfcheck.clear_cache()
    selfcheck.check_platform(dtype)  # quick probe
    selfcheck.check_platform(dtype)  # cached


def _broken(fn):
    """fn, but the first output element drifts when the call is big (>= 100 rows): the
    shape of bug a kernel that depends on the batch size has."""
    def g(*args, **kw):
        out = fn(*args, **kw)
        if args[0].shape[:-1].numel() >= 100:
            out = out.clone()
            out.view(-1)[0] = out.view(-1)[0] * 1.05 + 0.05
        return out
    return g


@pytest.mark.parametrize("op", ["linear", "rms_norm", "log_softmax_fp32", "lm_head_logits",
                                "attention_dense", "attention_paged"])
def test_check_platform_catches_a_broken_kernel(op):
    broken = _broken(selfcheck._default_ops()[op])
    with pytest.raises(selfcheck.PlatformNotInvariant) as e:
        selfcheck.check_platform(torch.bfloat16, ops={op: broken})
    msg = str(e.value)
    assert op in msg and "threads" in msg and "kernels='stock'" in msg, msg
    assert ("bfloat16" in msg) or (op in ("lm_head_logits", "log_softmax_fp32") and "float32" in msg), msg


def test_check_platform_checks_the_installed_linear_and_caches(monkeypatch):
    """The default probe calls torch_impl.linear as installed (looked up at call time);
    a failure is cached and re-raised; a pass is cached and costs nothing."""
    from titan_rl.kernels.matmul import torch_impl as mm

    selfcheck.clear_cache()
    try:
        monkeypatch.setattr(mm, "linear", _broken(mm.linear))
        with pytest.raises(selfcheck.PlatformNotInvariant, match="linear"):
            selfcheck.check_platform(torch.float32)
        calls = []
        monkeypatch.setattr(mm, "linear", lambda *a, **k: calls.append(1))
        with pytest.raises(selfcheck.PlatformNotInvariant, match="linear"):
            selfcheck.check_platform(torch.float32)  # the cached failure, nothing re-run
        assert not calls
    finally:
        monkeypatch.undo()
        selfcheck.clear_cache()
    selfcheck.check_platform(torch.float32)
    monkeypatch.setattr(mm, "linear", lambda *a, **k: calls.append(1))
    selfcheck.check_platform(torch.float32)  # cached pass: the (now useless) linear is not called
    assert not calls
    monkeypatch.undo()
    selfcheck.clear_cache()
