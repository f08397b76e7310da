"""Quantizers (kernels/quant): each recipe against torchao's own tensor classes and against
the plain reference (bit for bit), row invariance (a row's payload and scales alone equal
the same row inside batches of random rows), the refusal of batch-wide activation scales,
block-shape errors, storage dtypes and bytes."""

import pytest
import torch
from torchao.prototype.mx_formats.config import ScaleCalculationMode
from torchao.prototype.mx_formats.mx_tensor import MXTensor
from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale
from torchao.quantization.granularity import PerBlock, PerRow
from torchao.quantization.quantize_.common.kernel_preference import KernelPreference
from torchao.quantization.quantize_.workflows.float8.float8_tensor import Float8Tensor

from titan_rl.kernels import quant
from titan_rl.kernels.quant.reference import dequantize_reference, quantize_reference
from titan_rl.kernels.quant.torch_impl import AMAX_EPS

RECIPES = [r for r in quant.QUANT_RECIPES if r != "none"]
# (recipe, role) pairs that quantize, with a K (and weight rows) their blocks allow
CASES = [(r, role) for r in RECIPES for role in quant.ROLES if not (r == "nvfp4" and role == "activation")]
K = {"fp8_rowwise": 7, "fp8_block": 256, "mxfp8": 96, "nvfp4": 48, "nvfp4_w4a4": 48}


def _rows(recipe, role, m):
    return 128 if recipe == "fp8_block" and role == "weight" else m


def _randn(m, k, dtype=torch.bfloat16, seed=None):
    """Rows of very different magnitudes (so a scale shared across rows would show)."""
    g = torch.Generator()
    if seed is None:
        g.seed()  # fresh inputs on every run
    else:
        g.manual_seed(seed)
    mag = 10.0 ** (torch.rand(m, 1, generator=g) * 6 - 3)
    return (torch.randn(m, k, generator=g) * mag).to(dtype)


def _bits(t):
    """Comparable bits of a tensor (float8 / e8m0 have no torch.equal on CPU)."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.is_floating_point() else t


def _same(a, b):
    return torch.equal(_bits(a), _bits(b))


def _assert_same(got, want):
    (p, s), (p2, s2) = got, want
    assert p.dtype == p2.dtype and _same(p, p2)
    assert len(s) == len(s2)
    for a, b in zip(s, s2):
        assert a.shape == b.shape and a.dtype == b.dtype and _same(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("recipe, role", CASES)
def test_matches_reference(recipe, role, dtype):
    x = _randn(_rows(recipe, role, 13), K[recipe], dtype)
    x[1] = 0  # an all-zero row: zeros, not NaN
    got = quant.quantize(x, recipe, role)
    _assert_same(got, quantize_reference(x, recipe, role))
    dq = quant.dequantize(*got, recipe, dtype)
    assert dq.dtype == dtype and torch.equal(dq, dequantize_reference(*got, recipe, dtype))
    assert not dq.isnan().any() and torch.equal(dq[1], torch.zeros_like(dq[1]))
    assert torch.equal(quant.fake_quantize(x, recipe, role), dq)


def _torchao(x, recipe, role):
    """torchao's public tensor class for the recipe: (payload, scales) and its dequantize."""
    if recipe in ("fp8_rowwise", "fp8_block"):
        gran = PerRow() if recipe == "fp8_rowwise" else PerBlock([128, 128] if role == "weight" else [1, 128])
        t = Float8Tensor.from_hp(x, granularity=gran, hp_value_lb=AMAX_EPS, kernel_preference=KernelPreference.TORCH)
        return (t.qdata, (t.scale,)), t.dequantize(x.dtype)
    if recipe == "mxfp8":
        t = MXTensor.to_mx(x, torch.float8_e4m3fn, 32, scaling_mode=ScaleCalculationMode.RCEIL)
        return (t.qdata, (t.scale,)), t.dequantize(x.dtype)
    if role == "weight":
        g = per_tensor_amax_to_scale(x.abs().amax())
        t = NVFP4Tensor.to_nvfp4(x, per_tensor_scale=g)
        return (t.qdata, (t.scale, g)), t.dequantize(x.dtype)
    # nvfp4_w4a4 activations: torchao's per-tensor NVFP4 applied to each row alone
    rows = [NVFP4Tensor.to_nvfp4(r[None], per_tensor_scale=per_tensor_amax_to_scale(r.abs().amax())) for r in x]
    payload = torch.cat([t.qdata for t in rows])
    scales = (torch.cat([t.scale for t in rows]), torch.stack([t.per_tensor_scale for t in rows])[:, None])
    return (payload, scales), torch.cat([t.dequantize(x.dtype) for t in rows])


@pytest.mark.parametrize("recipe, role", CASES)
def test_matches_torchao(recipe, role):
    """Bit-equal: the same computation as torchao's tensor classes (fp8 with torchao's own
    amax floor passed in: hp_value_lb; nvfp4 with the global scale torchao's weight-only
    config computes)."""
    x = _randn(_rows(recipe, role, 37), K[recipe])
    got = quant.quantize(x, recipe, role)
    want, want_dq = _torchao(x, recipe, role)
    _assert_same(got, want)
    assert torch.equal(quant.dequantize(*got, recipe, x.dtype), want_dq)


@pytest.mark.parametrize("m", [1, 3, 13, 37])
@pytest.mark.parametrize("recipe", [r for r, role in CASES if role == "activation"])
def test_activation_row_invariance(recipe, m):
    """A row's payload and scales alone == the same row at a random place among m - 1
    random rows of other magnitudes (fresh inputs every run)."""
    k = K[recipe]
    row = _randn(1, k)
    batch = _randn(m, k)
    at = int(torch.randint(m, ()))
    batch[at] = row[0]
    p1, s1 = quant.quantize(row, recipe, "activation")
    pm, sm = quant.quantize(batch, recipe, "activation")
    assert _same(pm[at:at + 1], p1)
    for a, b in zip(sm, s1):
        assert a.shape[0] == m and _same(a[at:at + 1], b)


def test_per_tensor_activation_scale_is_batch_variant_and_refused():
    """torchao's default NVFP4 activation scale is over the tensor: the same row's bits change
    with its neighbours. quantize refuses that scaling for every activation recipe."""
    row = _randn(1, 48, seed=1).float()
    batch = torch.cat([row, 1000 * row.abs().max() * torch.ones(1, 48)])
    alone = NVFP4Tensor.to_nvfp4(row, per_tensor_scale=per_tensor_amax_to_scale(row.abs().amax()))
    inside = NVFP4Tensor.to_nvfp4(batch, per_tensor_scale=per_tensor_amax_to_scale(batch.abs().amax()))
    assert not torch.equal(inside.qdata[:1], alone.qdata)
    for recipe in [r for r, role in CASES if role == "activation"]:
        with pytest.raises(ValueError, match=r"activation_scale = 'tensor': a per-tensor dynamic activation scale .*"
                                             r"depend on its neighbours.*exact mode refuses it"):
            quant.quantize(_randn(3, K[recipe]), recipe, "activation", activation_scale="tensor")


@pytest.mark.parametrize("recipe, role, shape", [
    ("fp8_block", "activation", (3, 200)), ("fp8_block", "weight", (100, 128)), ("fp8_block", "weight", (128, 7)),
    ("mxfp8", "activation", (3, 7)), ("mxfp8", "weight", (5, 48)),
    ("nvfp4", "weight", (3, 7)), ("nvfp4_w4a4", "activation", (13, 40)),
])
def test_shapes_that_do_not_tile_are_errors(recipe, role, shape):
    with pytest.raises(ValueError, match=rf"^{recipe} quantizes {role}s in blocks of \d+x\d+ .*shape "
                                         rf"\({shape[0]}, {shape[1]}\) does not divide into them"):
        quant.quantize(_randn(*shape), recipe, role)


@pytest.mark.parametrize("recipe, role", CASES)
def test_storage_dtypes_and_bytes(recipe, role):
    """The payload is in the recipe's storage dtype and payload + scales take fewer bytes than bf16."""
    x = _randn(_rows(recipe, role, 37), 4 * K[recipe])
    payload, scales = quant.quantize(x, recipe, role)
    fp4 = recipe.startswith("nvfp4")
    assert payload.dtype == (torch.uint8 if fp4 else torch.float8_e4m3fn)
    assert payload.shape == (x.shape[0], x.shape[1] // 2 if fp4 else x.shape[1])
    assert scales[0].dtype == {"mxfp8": torch.float8_e8m0fnu}.get(recipe, torch.float8_e4m3fn if fp4 else torch.float32)
    stored = payload.nbytes + sum(s.nbytes for s in scales)
    assert stored < x.nbytes
    assert stored < (0.3 if fp4 else 0.6) * x.nbytes


def test_recipe_errors():
    x = _randn(3, 48)
    with pytest.raises(ValueError, match=r"recipe = 'fp4' is not allowed; allowed: \['none', 'fp8_rowwise'"):
        quant.quantize(x, "fp4", "weight")
    with pytest.raises(ValueError, match=r"recipe = 'none' quantizes nothing"):
        quant.quantize(x, "none", "weight")
    with pytest.raises(ValueError, match=r"recipe 'nvfp4' quantizes weights only"):
        quant.quantize(x, "nvfp4", "activation")
    with pytest.raises(ValueError, match=r"role = 'bias' is not allowed; allowed: \['weight', 'activation'\]"):
        quant.quantize(x, "mxfp8", "bias")
    with pytest.raises(ValueError, match=r"activation_scale = 'batch' is not allowed; allowed: \['row', 'tensor'\]"):
        quant.quantize(x, "mxfp8", "activation", activation_scale="batch")
    with pytest.raises(ValueError, match=r"2D tensors"):
        quant.quantize(x[None], "mxfp8", "weight")


def test_fake_quantize_gradient_is_straight_through():
    x = _randn(5, 96).float().requires_grad_()
    y = quant.fake_quantize(x, "mxfp8", "activation")
    g = torch.randn_like(y)
    y.backward(g)
    assert torch.equal(x.grad, g)


def _bit_view(t):
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def _assert_same_bits_nan_aside(got, want, where):
    """Bits equal everywhere except NaN payloads (NaN positions must agree)."""
    assert torch.equal(got.isnan(), want.isnan()), where
    assert torch.equal(torch.where(got.isnan(), 0, _bit_view(got)), torch.where(want.isnan(), 0, _bit_view(want))), where


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("recipe, role", [("fp8_rowwise", "weight"), ("fp8_block", "weight"),
                                          ("fp8_block", "activation"), ("mxfp8", "weight")])
def test_fused_fp8_fake_quantize_is_torchaos_composition(recipe, role, dtype):
    """The compiled one-pass fp8 / mxfp8 fake quantization (csrc/fake_quant.cpp) against
    dequantize(quantize(x)) on torchao's primitives: fresh random shapes (odd K and block
    counts where the recipe's block allows), magnitudes from 1e-14 (below the amax floor)
    to 1e6 varying by row and by column block, zero rows, +-inf and NaN. A row (or a
    128-row tile) alone gives its bits inside the batch, at 1 and 2 threads."""
    from tests._threads import threads
    from titan_rl.kernels.quant import fake_quantize
    from titan_rl.kernels.quant.torch_impl import RECIPES

    impl = RECIPES[recipe]
    br, bc = impl.weight_block if role == "weight" else impl.activation_block
    g = torch.Generator()
    g.seed()
    for trial in range(40):
        nb = int(torch.randint(1, 3 if br > 1 else 70, (), generator=g))
        m = br * nb if br > 1 else int(torch.randint(1, 70, (), generator=g))
        k = int(torch.randint(2, 300, (), generator=g)) if bc == 1 else bc * int(torch.randint(1, 7, (), generator=g))
        mag = 10.0 ** (torch.rand(m, 1, generator=g) * 20 - 14) * 10.0 ** (torch.rand(1, k, generator=g) * 4 - 2)
        x = (torch.randn(m, k, generator=g) * mag).to(dtype)
        if trial % 3 == 0:
            x[0] = 0
        if trial % 5 == 0:
            x[-1, ::3] = float("inf") if trial % 2 else float("-inf")
        if trial % 7 == 0:
            x[m // 2, k // 2] = float("nan")
        want = quant.dequantize(*quant.quantize(x, recipe, role), recipe, dtype)
        got = fake_quantize(x, recipe, role)
        _assert_same_bits_nan_aside(got, want, (recipe, role, m, k))
        if m > br:
            _assert_same_bits_nan_aside(fake_quantize(x[br:2 * br], recipe, role), got[br:2 * br], (m, k))
        if trial < 4:  # the kernel splits blocks over threads: 1 and 2 threads give the same bits
            for t in (1, 2):
                with threads(t):
                    _assert_same_bits_nan_aside(fake_quantize(x, recipe, role), got, (recipe, role, m, k, t))


def test_fused_mxfp8_takes_torchs_exponent_just_above_a_power_of_two():
    """mxfp8's scale exponent is ceil(log2(amax / 448)) with torch's fp32 log2, which rounds
    to an integer when amax / 448 = 2^k (1 + j 2^-23) for small j and k >= 4 or k <= -5: the exact
    ceil would be one more. The compiled form must take torch's exponent there (fp32
    inputs; bf16 amaxes cannot land there). Blocks whose amax sits just above 448 * 2^k
    for every k of the fp32 range, the fused form against torchao's composition."""
    from titan_rl.kernels.quant import fake_quantize

    ks = torch.arange(-130, 120, dtype=torch.float64)
    js = torch.arange(0, 24, dtype=torch.float64)
    amax = (448.0 * torch.exp2(ks)[:, None] * (1 + js[None, :] * 2.0 ** -23)).flatten().float()
    amax = amax[torch.isfinite(amax) & (amax > 0)]
    x = torch.randn(amax.numel(), 32, generator=torch.Generator().manual_seed(0)).clamp(-0.99, 0.99) * amax[:, None]
    x[:, 5] = amax  # the block's amax itself
    x = x.reshape(-1, 64)
    want = quant.dequantize(*quant.quantize(x, "mxfp8", "weight"), "mxfp8", torch.float32)
    assert torch.equal(_bit_view(fake_quantize(x, "mxfp8", "weight")), _bit_view(want))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_nvfp4_fake_quantize_is_torchaos_composition(dtype):
    """The compiled nvfp4 fake quantization (csrc/fake_quant.cpp) against
    nvfp4_dequantize(nvfp4_weight(x)) / nvfp4_activation(x) on torchao's primitives: fresh
    random shapes (K a multiple of the block of 16, odd block counts), row magnitudes from
    1e-14 (below the scale floors) to 1e6, zero rows, blocks far below the row's amax; one
    global scale (weights) and one per row (nvfp4_w4a4 activations). Bits equal."""
    from titan_rl.kernels.quant import fake_quantize
    from titan_rl.kernels.quant.torch_impl import nvfp4_activation, nvfp4_dequantize, nvfp4_weight

    g = torch.Generator()
    g.seed()
    for trial in range(60):
        m, k = int(torch.randint(1, 70, (), generator=g)), 16 * int(torch.randint(1, 40, (), generator=g))
        mag = 10.0 ** (torch.rand(m, 1, generator=g) * 20 - 14)
        x = (torch.randn(m, k, generator=g) * mag).to(dtype)
        if trial % 3 == 0:
            x[0] = 0
        if trial % 4 == 0:
            x[:, :16] *= 1e-6
        for recipe, role, fn in [("nvfp4", "weight", nvfp4_weight), ("nvfp4_w4a4", "activation", nvfp4_activation)]:
            want = nvfp4_dequantize(*fn(x), dtype)
            got = fake_quantize(x, recipe, role)
            assert torch.equal(_bit_view(got), _bit_view(want)), (recipe, m, k)
        if m > 1:  # activations: a row alone gives its bits inside the batch
            assert torch.equal(_bit_view(fake_quantize(x[1:2], "nvfp4_w4a4", "activation")),
                               _bit_view(fake_quantize(x, "nvfp4_w4a4", "activation")[1:2]))
