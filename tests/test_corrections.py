"""Hand-computed checks of titan_rl.algorithms.corrections (mismatch corrections)."""

import math

import pytest
import torch

from titan_rl.algorithms.corrections import (
    CorrectionConfig,
    apply_corrections,
    enabled,
    warning_if_exact,
)

LN = math.log
NEG_INF = float("-inf")
NAN = float("nan")


def _inputs(log_ratios, valid):
    """pi_old = mu + log_ratio with a non-trivial mu; masked entries get garbage
    (pi_old = nan, mu = -inf) that must never leak into the outputs."""
    lr = torch.tensor(log_ratios, dtype=torch.float64)
    mask = torch.tensor(valid, dtype=torch.bool)
    mu = torch.full_like(lr, LN(0.25))
    pi = mu + lr
    mu = torch.where(mask, mu, torch.full_like(mu, NEG_INF))
    pi = torch.where(mask, pi, torch.full_like(pi, NAN))
    return pi, mu, mask


def _assert_finite(weights):
    assert torch.isfinite(weights).all()


# ----------------------------------------------------------------------------- off


def test_off_by_default(rng):
    cfg = CorrectionConfig()
    assert not enabled(cfg)
    pi = torch.randn(3, 5, generator=rng) - 2
    mu = torch.randn(3, 5, generator=rng) - 2
    mask = torch.rand(3, 5, generator=rng) > 0.3
    mu[~mask] = NEG_INF
    w, new_mask, stats = apply_corrections(pi, mu, mask, cfg)
    assert torch.equal(w, torch.ones(3, 5))
    assert w.dtype == torch.float32
    assert torch.equal(new_mask, mask)
    assert stats == {
        "tis_clipped_fraction": 0.0,
        "token_band_masked_fraction": 0.0,
        "seq_geo_rejected_fraction": 0.0,
        "outlier_seq_masked_fraction": 0.0,
        "tokens_kept_fraction": 1.0,
    }


# ----------------------------------------------------------------------------- TIS


def test_tis_hand_computed():
    # cap = 2; rho per token:
    #   seq 0: [3, 1.5, 1, 0.5]   -> weights [min(3,2)=2, 1.5, 1, 0.5]  (1 clipped)
    #   seq 1: [8, pad, pad, pad] -> weights [2, 1, 1, 1]                (1 clipped)
    # valid tokens: 5, clipped (rho > 2): 2 -> tis_clipped_fraction = 2/5
    pi, mu, mask = _inputs(
        [[LN(3), LN(1.5), 0.0, LN(0.5)], [LN(8), 0.0, 0.0, 0.0]],
        [[1, 1, 1, 1], [1, 0, 0, 0]],
    )
    cfg = CorrectionConfig(tis_cap=2.0)
    assert enabled(cfg)
    w, new_mask, stats = apply_corrections(pi, mu, mask, cfg)
    expected = torch.tensor([[2.0, 1.5, 1.0, 0.5], [2.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
    torch.testing.assert_close(w, expected)
    assert w.dtype == torch.float64  # pi_old's float dtype (>= float32)
    assert torch.equal(new_mask, mask)  # TIS never masks
    assert stats["tis_clipped_fraction"] == pytest.approx(2 / 5)
    assert stats["tokens_kept_fraction"] == 1.0


def test_tis_huge_log_ratio_is_capped_not_inf():
    # log-ratio 1000 overflows exp() in float32/64; the weight must still be the cap
    pi = torch.tensor([[1000.0, -1.0]])
    mu = torch.tensor([[0.0, -1.0]])
    ones = torch.ones(1, 2, dtype=torch.bool)
    w, _, stats = apply_corrections(pi, mu, ones, CorrectionConfig(tis_cap=5.0))
    assert w.dtype == torch.float32
    torch.testing.assert_close(w, torch.tensor([[5.0, 1.0]]))
    assert stats["tis_clipped_fraction"] == 0.5


def test_tis_no_gradient():
    pi = torch.tensor([[LN(0.5), LN(0.2)]], requires_grad=True)
    mu = torch.tensor([[LN(0.25), LN(0.2)]])
    ones = torch.ones(1, 2, dtype=torch.bool)
    w, _, _ = apply_corrections(pi, mu, ones, CorrectionConfig(tis_cap=4.0))
    assert not w.requires_grad
    torch.testing.assert_close(w, torch.tensor([[2.0, 1.0]]))


# ----------------------------------------------------------------------------- token band


def test_token_band_hand_computed():
    # band [0.5, 2]; rho:
    #   seq 0: [3, 1.5, 1, 0.25]  -> tokens 0 (3 > 2) and 3 (0.25 < 0.5) masked
    #   seq 1: [0.6, 2.5, pad, pad] -> token 1 masked
    # valid 6, masked 3 -> token_band_masked_fraction = 0.5, tokens_kept_fraction = 0.5
    pi, mu, mask = _inputs(
        [[LN(3), LN(1.5), 0.0, LN(0.25)], [LN(0.6), LN(2.5), 0.0, 0.0]],
        [[1, 1, 1, 1], [1, 1, 0, 0]],
    )
    w, new_mask, stats = apply_corrections(
        pi, mu, mask, CorrectionConfig(token_band_low=0.5, token_band_high=2.0)
    )
    assert torch.equal(w, torch.ones_like(w))
    assert new_mask.tolist() == [[False, True, True, False], [True, False, False, False]]
    assert stats["token_band_masked_fraction"] == 0.5
    assert stats["tokens_kept_fraction"] == 0.5
    assert stats["seq_geo_rejected_fraction"] == 0.0


def test_token_band_is_closed_interval():
    # band [1, 1]: only rho exactly 1 (log-ratio exactly 0) survives
    pi = torch.tensor([[-1.0, -1.0, -2.0]])
    mu = torch.tensor([[-1.0, -1.0 + 1e-6, -2.0]])
    ones = torch.ones(1, 3, dtype=torch.bool)
    cfg = CorrectionConfig(token_band_low=1.0, token_band_high=1.0)
    _, new_mask, stats = apply_corrections(pi, mu, ones, cfg)
    assert new_mask.tolist() == [[True, False, True]]
    assert stats["token_band_masked_fraction"] == pytest.approx(1 / 3)


def test_token_band_upper_only():
    # low = 0 with high > 0 is a one-sided band: rho >= 0 always
    pi, mu, mask = _inputs([[LN(1e-9), LN(10)]], [[1, 1]])
    _, new_mask, _ = apply_corrections(pi, mu, mask, CorrectionConfig(token_band_high=5.0))
    assert new_mask.tolist() == [[True, False]]


# ----------------------------------------------------------------------------- seq geo


def test_seq_geo_hand_computed():
    # band [0.8, 1.25]
    #   seq 0: log-ratios [ln 2, 0]       mean ln2/2 -> geo sqrt(2) = 1.414 > 1.25: rejected
    #   seq 1: [ln 2, ln 0.5]             mean 0 -> geo 1: kept (token rho 2 and 0.5 are fine)
    #   seq 2: [ln 1.2, pad]              geo 1.2: kept (the pad is not averaged in;
    #                                     averaging it as 0 would give sqrt(1.2))
    #   seq 3: [ln 0.7, ln 0.7]           geo 0.7 < 0.8: rejected
    #   seq 4: all padding                not counted
    #   seq 5: [ln 1.5, pad]              geo 1.5 > 1.25: rejected (averaging the pad as
    #                                     0 would wrongly give sqrt(1.5) = 1.22: kept)
    # counted sequences 5, rejected 3 -> 0.6; valid tokens 8, kept 3 -> 3/8
    pi, mu, mask = _inputs(
        [
            [LN(2), 0.0],
            [LN(2), LN(0.5)],
            [LN(1.2), 0.0],
            [LN(0.7), LN(0.7)],
            [0.0, 0.0],
            [LN(1.5), 0.0],
        ],
        [[1, 1], [1, 1], [1, 0], [1, 1], [0, 0], [1, 0]],
    )
    w, new_mask, stats = apply_corrections(
        pi, mu, mask, CorrectionConfig(seq_geo_low=0.8, seq_geo_high=1.25)
    )
    assert torch.equal(w, torch.ones_like(w))
    assert new_mask.tolist() == [
        [False, False],
        [True, True],
        [True, False],
        [False, False],
        [False, False],
        [False, False],
    ]
    assert stats["seq_geo_rejected_fraction"] == pytest.approx(0.6)
    assert stats["tokens_kept_fraction"] == pytest.approx(3 / 8)


# ----------------------------------------------------------------------------- outlier


def test_outlier_hand_computed():
    # outlier_log_ratio = 1.0
    #   seq 0: [0.5, -1.5]        |-1.5| > 1: dropped
    #   seq 1: [0.9, -0.9, pad]   kept; pad has mu = -inf, pi = nan: ignored
    #   seq 2: [1.0]              |1.0| is not > 1: kept
    # 3 counted sequences, 1 dropped; valid tokens 5, kept 3
    pi, mu, mask = _inputs(
        [[0.5, -1.5, 0.0], [0.9, -0.9, 0.0], [1.0, 0.0, 0.0]],
        [[1, 1, 0], [1, 1, 0], [1, 0, 0]],
    )
    _, new_mask, stats = apply_corrections(pi, mu, mask, CorrectionConfig(outlier_log_ratio=1.0))
    assert new_mask.tolist() == [
        [False, False, False],
        [True, True, False],
        [True, False, False],
    ]
    assert stats["outlier_seq_masked_fraction"] == pytest.approx(1 / 3)
    assert stats["tokens_kept_fraction"] == pytest.approx(3 / 5)


# ----------------------------------------------------------------------------- combinations


def test_all_corrections_combined():
    # tis_cap 2, token band [0.5, 3], seq geo [0.5, 2], outlier 2.0
    #   seq 0: rho [2.5, 1]     tis w [2, 1] (1 clipped); band keeps both;
    #                           geo sqrt(2.5) = 1.58 kept; |ln 2.5| = 0.92 kept
    #   seq 1: rho [4, 1]       tis w [2, 1] (clipped); band masks token 0 (4 > 3);
    #                           geo over BOTH input tokens = 2.0 -> inside [0.5, 2]: kept
    #   seq 2: rho [e^2.5, 1, 1] tis w [2, 1, 1] (clipped); band masks token 0;
    #                           geo exp(2.5/3) = 2.30 > 2: rejected; |2.5| > 2: outlier
    #   seq 3: rho [0.3, 0.3]   tis w [0.3, 0.3]; band masks both (0.3 < 0.5);
    #                           geo 0.3 < 0.5 rejected; not an outlier (|ln .3| = 1.2)
    # valid tokens 9: clipped 3 -> 1/3; band-masked 4 -> 4/9
    # sequences 4: geo-rejected 2 -> 0.5; outliers 1 -> 0.25
    # kept: seq 0 both, seq 1 token 1 -> 3/9
    pi, mu, mask = _inputs(
        [[LN(2.5), 0.0, 0.0], [LN(4), 0.0, 0.0], [2.5, 0.0, 0.0], [LN(0.3), LN(0.3), 0.0]],
        [[1, 1, 0], [1, 1, 0], [1, 1, 1], [1, 1, 0]],
    )
    cfg = CorrectionConfig(
        tis_cap=2.0,
        token_band_low=0.5,
        token_band_high=3.0,
        seq_geo_low=0.5,
        seq_geo_high=2.0 + 1e-9,  # geo of seq 1 is 2 up to rounding
        outlier_log_ratio=2.0,
    )
    w, new_mask, stats = apply_corrections(pi, mu, mask, cfg)
    expected_w = torch.tensor(
        [[2.0, 1.0, 1.0], [2.0, 1.0, 1.0], [2.0, 1.0, 1.0], [0.3, 0.3, 1.0]], dtype=torch.float64
    )
    torch.testing.assert_close(w, expected_w)
    assert new_mask.tolist() == [
        [True, True, False],
        [False, True, False],
        [False, False, False],
        [False, False, False],
    ]
    assert stats["tis_clipped_fraction"] == pytest.approx(1 / 3)
    assert stats["token_band_masked_fraction"] == pytest.approx(4 / 9)
    assert stats["seq_geo_rejected_fraction"] == 0.5
    assert stats["outlier_seq_masked_fraction"] == 0.25
    assert stats["tokens_kept_fraction"] == pytest.approx(3 / 9)


def test_exact_parity_is_a_noop_for_every_correction(rng):
    pi = torch.randn(4, 6, generator=rng) - 3
    mask = torch.rand(4, 6, generator=rng) > 0.2
    cfg = CorrectionConfig(
        tis_cap=1.0,
        token_band_low=1.0,
        token_band_high=1.0,
        seq_geo_low=1.0,
        seq_geo_high=1.0,
        outlier_log_ratio=1e-12,
    )
    w, new_mask, stats = apply_corrections(pi, pi.clone(), mask, cfg)
    assert torch.equal(w, torch.ones_like(w))
    assert torch.equal(new_mask, mask)
    assert stats["tokens_kept_fraction"] == 1.0


# ----------------------------------------------------------------------------- masking safety


def test_padding_never_leaks_nan_or_inf():
    # masked positions: mu in {0, -inf}, pi in {nan, -inf, +inf}; all corrections on
    pi = torch.tensor([[-1.0, NAN, float("-inf")], [float("inf"), 0.0, NAN]])
    mu = torch.tensor([[-1.0, NEG_INF, 0.0], [NEG_INF, NEG_INF, NEG_INF]])
    mask = torch.tensor([[1, 0, 0], [0, 0, 0]], dtype=torch.bool)
    cfg = CorrectionConfig(
        tis_cap=2.0,
        token_band_low=0.5,
        token_band_high=2.0,
        seq_geo_low=0.5,
        seq_geo_high=2.0,
        outlier_log_ratio=1.0,
    )
    w, new_mask, stats = apply_corrections(pi, mu, mask, cfg)
    _assert_finite(w)
    assert torch.equal(w, torch.ones_like(w))
    assert torch.equal(new_mask, mask)
    assert all(math.isfinite(v) for v in stats.values())
    # seq 1 has no valid tokens: it is neither counted nor rejected
    assert stats["seq_geo_rejected_fraction"] == 0.0
    assert stats["outlier_seq_masked_fraction"] == 0.0


def test_no_valid_tokens_at_all():
    pi = torch.full((2, 3), NAN)
    mu = torch.full((2, 3), NEG_INF)
    mask = torch.zeros(2, 3)  # 0/1 float masks are accepted too
    cfg = CorrectionConfig(tis_cap=2.0, token_band_high=2.0, seq_geo_low=0.5, seq_geo_high=2.0)
    w, new_mask, stats = apply_corrections(pi, mu, mask, cfg)
    _assert_finite(w)
    assert new_mask.dtype == torch.bool and not new_mask.any()
    assert stats["tokens_kept_fraction"] == 1.0
    assert stats["tis_clipped_fraction"] == 0.0


def test_nan_at_valid_token_counts_as_out_of_range():
    pi = torch.tensor([[NAN, -1.0], [-1.0, -1.0]])
    mu = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]])
    mask = torch.ones(2, 2, dtype=torch.bool)
    band = CorrectionConfig(token_band_low=0.5, token_band_high=2.0)
    _, m_band, _ = apply_corrections(pi, mu, mask, band)
    assert m_band.tolist() == [[False, True], [True, True]]
    geo = CorrectionConfig(seq_geo_low=0.5, seq_geo_high=2.0)
    _, m_geo, _ = apply_corrections(pi, mu, mask, geo)
    assert m_geo.tolist() == [[False, False], [True, True]]
    _, m_out, _ = apply_corrections(pi, mu, mask, CorrectionConfig(outlier_log_ratio=1.0))
    assert m_out.tolist() == [[False, False], [True, True]]


def test_int_mask_and_bf16_inputs():
    pi = torch.tensor([[LN(0.5), LN(0.25)]], dtype=torch.bfloat16)
    mu = torch.tensor([[LN(0.25), LN(0.25)]], dtype=torch.bfloat16)
    cfg = CorrectionConfig(tis_cap=10.0)
    w, new_mask, _ = apply_corrections(pi, mu, torch.tensor([[1, 0]]), cfg)
    assert w.dtype == torch.float32 and new_mask.dtype == torch.bool
    assert new_mask.tolist() == [[True, False]]
    assert w[0, 1].item() == 1.0
    assert w[0, 0].item() == pytest.approx(2.0, rel=2e-2)  # bf16 rounding of the log-probs


def test_shape_errors():
    cfg = CorrectionConfig()
    with pytest.raises(ValueError, match="2-D"):
        apply_corrections(torch.zeros(3), torch.zeros(3), torch.ones(3), cfg)
    with pytest.raises(ValueError, match="same shape"):
        apply_corrections(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3), cfg)


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"tis_cap": -1.0}, "tis_cap.*-1.0"),
        ({"tis_cap": 0.5}, "tis_cap.*0.5"),
        ({"tis_cap": float("nan")}, "tis_cap.*nan"),
        (
            {"token_band_low": 2.0, "token_band_high": 1.5},
            "token_band_low=2.0 > token_band_high=1.5",
        ),
        ({"token_band_low": 0.5}, "token_band_low=0.5 > token_band_high=0.0"),
        ({"token_band_low": -0.5, "token_band_high": 2.0}, "token_band_low.*-0.5"),
        ({"token_band_low": 1.2, "token_band_high": 2.0}, r"must contain 1\.0"),
        ({"seq_geo_low": 0.9, "seq_geo_high": 0.8}, "seq_geo_low=0.9 > seq_geo_high=0.8"),
        ({"seq_geo_low": 0.5, "seq_geo_high": 0.9}, r"seq_geo.*must contain 1\.0"),
        ({"seq_geo_high": -2.0}, "seq_geo_high.*-2.0"),
        ({"outlier_log_ratio": -0.1}, "outlier_log_ratio.*-0.1"),
        ({"outlier_log_ratio": "big"}, "outlier_log_ratio.*big"),
    ],
)
def test_validation_errors(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        CorrectionConfig(**kwargs)


def test_validation_rechecked_at_apply_time():
    cfg = CorrectionConfig()
    cfg.tis_cap = 0.3  # mutated after construction
    with pytest.raises(ValueError, match="tis_cap"):
        apply_corrections(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), cfg)


@pytest.mark.parametrize("fields", [dict(tis_cap=1.0), dict(tis_cap=float("inf")),
                                    dict(token_band_low=1.0, token_band_high=1.0),
                                    dict(seq_geo_low=0.0, seq_geo_high=float("inf"))])
def test_valid_edge_configs(fields):
    """The edges of each range are accepted and kept as given (the invalid side of each edge is
    refused by the tests above)."""
    cfg = CorrectionConfig(**fields)
    assert all(getattr(cfg, k) == v for k, v in fields.items())


# ----------------------------------------------------------------------------- warning


def test_warning_if_exact():
    assert warning_if_exact(CorrectionConfig(), 0.0) is None
    cfg = CorrectionConfig(tis_cap=2.0, seq_geo_low=0.5, seq_geo_high=2.0)
    assert warning_if_exact(cfg, 1e-3) is None
    msg = warning_if_exact(cfg, 0.0)
    assert msg is not None
    assert "tis_cap=2.0" in msg and "seq_geo=[0.5, 2.0]" in msg
    assert "token_band" not in msg and "outlier" not in msg
    assert "exactly 0" in msg and "delete signal" in msg
    msg = warning_if_exact(CorrectionConfig(token_band_high=3.0, outlier_log_ratio=0.5), 0.0)
    assert "token_band=[0.0, 3.0]" in msg and "outlier_log_ratio=0.5" in msg
