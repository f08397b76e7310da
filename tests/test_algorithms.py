"""Hand-computed checks of titan_rl.algorithms: group advantages and the PG loss."""

import math

import pytest
import torch

from titan_rl.algorithms import PGLossConfig, group_advantages, policy_gradient_loss

# ----------------------------------------------------------------------------- advantages


def test_group_advantages_std_two_groups():
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 4.0])
    # group 0: [1, 0, 1, 0], mean 0.5, deviations [.5, -.5, .5, -.5],
    #          population var = 4 * 0.25 / 4 = 0.25, std 0.5 -> [1, -1, 1, -1]
    # group 1: [0, 0, 0, 4], mean 1, deviations [-1, -1, -1, 3],
    #          population var = (1 + 1 + 1 + 9) / 4 = 3, std sqrt(3)
    #          -> [-1/sqrt3, -1/sqrt3, -1/sqrt3, 3/sqrt3 = sqrt3]
    #          (the unbiased std would be 2 and give [-0.5, -0.5, -0.5, 1.5])
    s3 = math.sqrt(3.0)
    expected = torch.tensor([1.0, -1.0, 1.0, -1.0, -1 / s3, -1 / s3, -1 / s3, s3])
    torch.testing.assert_close(group_advantages(rewards, 4, eps=0.0), expected)
    # default eps = 1e-6 only shifts the values by about 1e-6 relative
    torch.testing.assert_close(group_advantages(rewards, 4), expected, rtol=1e-5, atol=1e-5)


def test_group_advantages_scale_none():
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 4.0])
    expected = torch.tensor([0.5, -0.5, 0.5, -0.5, -1.0, -1.0, -1.0, 3.0])
    torch.testing.assert_close(group_advantages(rewards, 4, scale="none"), expected)


def test_group_advantages_constant_group_is_zero():
    out = group_advantages(torch.tensor([3.0, 3.0, 1.0, 2.0]), 2)
    assert torch.equal(out[:2], torch.zeros(2))
    assert torch.isfinite(out).all()


@pytest.mark.parametrize(
    "n, group_size, scale, needle",
    [(7, 4, "std", "7"), (8, 0, "std", "0"), (8, 4, "mad", "mad")],
)
def test_group_advantages_errors(n, group_size, scale, needle):
    with pytest.raises(ValueError, match=needle):
        group_advantages(torch.zeros(n), group_size, scale=scale)


# ----------------------------------------------------------------------------- loss

# The tiny example: B = 2 sequences, T = 3, eps = 0.2 (so the clip range is [0.8, 1.2]).
#   seq 0: A = +1, ratios [1.5, 1.0, 0.9], all valid
#          objective = min(r*A, clip(r)*A) = [min(1.5, 1.2), 1.0, 0.9] = [1.2, 1.0, 0.9]
#          (token 0: clipped branch active)
#   seq 1: A = -2, ratios [0.5, 1.1, pad]
#          token 0: min(0.5*-2, 0.8*-2) = min(-1.0, -1.6) = -1.6  (clipped branch active)
#          token 1: min(1.1*-2, 1.1*-2) = -2.2
# token_mean: sum = 1.2 + 1.0 + 0.9 - 1.6 - 2.2 = -0.7 over 5 tokens -> loss = 0.7/5 = 0.14
# seq_mean:   seq 0 mean = 3.1/3 = 31/30, seq 1 mean = -3.8/2 = -57/30
#             mean = (31/30 - 57/30)/2 = -13/30 -> loss = 13/30
# gradient d loss / d logp: d(r*A)/d logp = r*A on an unclipped token, 0 on a clipped one
#   token_mean (weight -1/5):           [[0, -1.0/5, -0.9/5], [0, 2.2/5, 0]]
#   seq_mean (weights -1/6 and -1/4):   [[0, -1.0/6, -0.9/6], [0, 2.2/4, 0]]
# stats: clip_fraction 2/5, ratio mean (1.5+1+0.9+0.5+1.1)/5 = 1.0, max 1.5, min 0.5,
#        log_ratio_abs_max = |ln 0.5| = ln 2, tokens 5.


def _tiny(pad_mu=float("-inf"), pad_logp=0.0):
    ratios = torch.tensor([[1.5, 1.0, 0.9], [0.5, 1.1, 1.0]], dtype=torch.float64)
    mu = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, pad_mu]], dtype=torch.float64)
    logp = mu + ratios.log()
    logp[1, 2] = pad_logp
    mask = torch.tensor([[True, True, True], [True, True, False]])
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    return logp.requires_grad_(), mu, adv, mask


@pytest.mark.parametrize(
    "agg, loss_expected, grad_expected",
    [
        ("token_mean", 0.14, [[0.0, -1.0 / 5, -0.9 / 5], [0.0, 2.2 / 5, 0.0]]),
        ("seq_mean", 13 / 30, [[0.0, -1.0 / 6, -0.9 / 6], [0.0, 2.2 / 4, 0.0]]),
    ],
)
def test_loss_and_grad_by_hand(agg, loss_expected, grad_expected):
    logp, mu, adv, mask = _tiny()
    loss, stats = policy_gradient_loss(logp, mu, adv, mask, PGLossConfig(clip_eps=0.2, agg=agg))
    (grad,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(loss, torch.tensor(loss_expected, dtype=torch.float64))
    torch.testing.assert_close(grad, torch.tensor(grad_expected, dtype=torch.float64))
    assert stats["clip_fraction"] == pytest.approx(0.4)
    assert stats["ratio_mean"] == pytest.approx(1.0)
    assert stats["ratio_max"] == pytest.approx(1.5)
    assert stats["ratio_min"] == pytest.approx(0.5)
    assert stats["log_ratio_abs_max"] == pytest.approx(math.log(2.0))
    assert stats["tokens"] == 5
    assert all(isinstance(v, float) for v in stats.values())


# One token, eps = 0.2: (ratio, A, clipped branch active?, objective by hand)
@pytest.mark.parametrize(
    "ratio, adv, clipped, objective",
    [
        (1.5, 1.0, True, 1.2),  # A > 0, ratio above 1+eps: clipped at 1.2 * 1
        (0.5, 1.0, False, 0.5),  # A > 0, ratio below 1-eps: not clipped, 0.5 * 1
        (0.5, -1.0, True, -0.8),  # A < 0, ratio below 1-eps: clipped at 0.8 * -1
        (1.5, -1.0, False, -1.5),  # A < 0, ratio above 1+eps: not clipped, 1.5 * -1
        (1.1, 1.0, False, 1.1),  # inside the range: not clipped
        (0.9, -1.0, False, -0.9),
    ],
)
def test_clipping_both_signs(ratio, adv, clipped, objective):
    logp = torch.tensor([[math.log(ratio)]], dtype=torch.float64, requires_grad=True)
    mu = torch.zeros(1, 1, dtype=torch.float64)
    loss, stats = policy_gradient_loss(
        logp, mu, torch.tensor([adv], dtype=torch.float64), torch.ones(1, 1), PGLossConfig(0.2)
    )
    (grad,) = torch.autograd.grad(loss, logp)
    assert loss.item() == pytest.approx(-objective)
    assert stats["clip_fraction"] == (1.0 if clipped else 0.0)
    # a clipped token carries no gradient; an unclipped one d(-r*A)/d logp = -r*A
    assert grad.item() == pytest.approx(0.0 if clipped else -ratio * adv)


def test_clip_eps_high_and_no_clipping():
    logp = torch.tensor([[math.log(1.25), math.log(1.3)]], dtype=torch.float64)
    mu = torch.zeros(1, 2, dtype=torch.float64)
    adv, mask = torch.tensor([1.0], dtype=torch.float64), torch.ones(1, 2)
    # range [0.8, 1.28]: 1.25 is kept, 1.3 clipped to 1.28 -> loss = -(1.25 + 1.28)/2
    loss, stats = policy_gradient_loss(logp, mu, adv, mask, PGLossConfig(0.2, clip_eps_high=0.28))
    assert loss.item() == pytest.approx(-(1.25 + 1.28) / 2)
    assert stats["clip_fraction"] == 0.5
    # no clipping at all: loss = -(1.25 + 1.3)/2
    loss, stats = policy_gradient_loss(logp, mu, adv, mask, PGLossConfig(clip_eps=None))
    assert loss.item() == pytest.approx(-(1.25 + 1.3) / 2)
    assert stats["clip_fraction"] == 0.0


@pytest.mark.parametrize("pad_mu", [float("-inf"), 0.0, float("nan")])
@pytest.mark.parametrize("pad_logp", [0.0, float("-inf")])
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int64, torch.float32])
def test_masked_padding_makes_no_nan(pad_mu, pad_logp, mask_dtype):
    logp, mu, adv, mask = _tiny(pad_mu=pad_mu, pad_logp=pad_logp)
    loss, stats = policy_gradient_loss(logp, mu, adv, mask.to(mask_dtype), PGLossConfig())
    (grad,) = torch.autograd.grad(loss, logp)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert grad[1, 2] == 0
    assert loss.item() == pytest.approx(0.14)  # same as the hand-computed example
    assert all(math.isfinite(v) for v in stats.values())


def test_all_masked_gives_zero_loss():
    logp = torch.zeros(2, 3, requires_grad=True)
    mu = torch.full((2, 3), float("-inf"))
    for agg in ("token_mean", "seq_mean"):
        loss, stats = policy_gradient_loss(
            logp, mu, torch.ones(2), torch.zeros(2, 3, dtype=torch.bool), PGLossConfig(agg=agg)
        )
        (grad,) = torch.autograd.grad(loss, logp)
        assert loss.item() == 0.0 and torch.equal(grad, torch.zeros(2, 3))
        assert stats["tokens"] == 0 and stats["clip_fraction"] == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_ratio_exactly_one_on_policy(dtype):
    gen = torch.Generator().manual_seed(0)
    logp = (-5 * torch.rand(4, 7, generator=gen)).to(dtype).requires_grad_()
    mu = logp.detach().clone()
    adv = torch.tensor([1.0, -0.5, 2.0, 0.0])
    mask = torch.ones(4, 7, dtype=torch.bool)
    mask[2, 5:] = False
    loss, stats = policy_gradient_loss(logp, mu, adv, mask, PGLossConfig())
    assert stats["ratio_mean"] == 1.0 and stats["ratio_max"] == 1.0 and stats["ratio_min"] == 1.0
    assert stats["log_ratio_abs_max"] == 0.0 and stats["clip_fraction"] == 0.0
    # on policy the gradient is -A / n_tokens on every valid token
    (grad,) = torch.autograd.grad(loss, logp)
    expected = torch.where(mask, -adv.unsqueeze(1) / mask.sum(), torch.zeros(()))
    torch.testing.assert_close(grad, expected.to(dtype))  # dtype-aware tolerance (bf16)


def test_loss_input_errors():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="agg"):
        policy_gradient_loss(x, x, torch.zeros(2), x.bool(), PGLossConfig(agg="sum"))
    with pytest.raises(ValueError, match="shape"):
        policy_gradient_loss(x, torch.zeros(2, 4), torch.zeros(2), x.bool(), PGLossConfig())
    with pytest.raises(ValueError, match="advantages"):
        policy_gradient_loss(x, x, torch.zeros(3), x.bool(), PGLossConfig())
