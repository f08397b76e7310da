"""The quantized GEMM (kernels/quant/gemm.py, csrc/quant_gemm.cpp): the compiled quantizers
equal kernels.quant.quantize's payload and scales; the trainer's one-pass preparation equals
the engine's packing of those payloads and the fake-quantized weights; the kernel equals its
torch reference (the dpbf16 form, op for op) bit for bit at odd sizes; a row's bits do not
depend on the number of rows (1..130 and a few large counts, every tile path: in-register
expansion up to 16 rows, the expanded buffer beyond, chunks of 192) nor on the thread count;
the form stays within its stated distance of torchao's arithmetic; the trainer's gradients are
the dense form's; and the dense form (what CPUs without AVX512-BF16 run) still gives the
engine the trainer's bits."""

import pytest
import torch

from tests._threads import threads
from titan_rl.kernels.quant import QuantizedWeight, dequantize, fake_quantize, quantize, quantizes_activations
from titan_rl.kernels.quant import gemm as qg

RECIPES = list(qg.FORMATS)
# (K, [N_i]) per recipe: nvfp4 needs K % 16 == 0; fp8_rowwise takes any K (odd: a zero pair partner)
SHAPES = {"fp8_rowwise": [(7, [5]), (203, [37, 19]), (520, [97])],
          "nvfp4": [(16, [7]), (208, [33, 16, 19]), (528, [97])],
          "nvfp4_w4a4": [(16, [7]), (208, [33, 16, 19]), (528, [97])]}


def _form():
    if qg.quant_gemm_form() != "dpbf16":
        pytest.skip("this CPU has no AVX512-BF16 / AVX512-VBMI: quantized linears run the dense form (tested below)")


def _gen():
    g = torch.Generator()
    g.seed()  # fresh inputs on every run
    return g


def _rows(m, k, g, dtype=torch.bfloat16):
    """Rows of very different magnitudes (a scale shared across rows would show), a zero row."""
    mag = 10.0 ** (torch.rand(m, 1, generator=g) * 6 - 3)
    x = torch.randn(m, k, generator=g) * mag
    x[m // 3] = 0
    return x.to(dtype)


def _bits(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("recipe", ["fp8_rowwise", "nvfp4"])
def test_compiled_quantizers_give_quantizes_payload_and_scales(recipe, dtype):
    g = _gen()
    for k, ns in SHAPES[recipe]:
        for n in ns:
            w = _rows(n, k, g, dtype)
            got, want = qg.quantize_weight(w, recipe), quantize(w, recipe, "weight")
            assert torch.equal(_bits(got[0]), _bits(want[0])), (recipe, n, k)
            assert len(got[1]) == len(want[1])
            for a, b in zip(got[1], want[1]):
                assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b)), (recipe, n, k)


@pytest.mark.parametrize("recipe", RECIPES)
def test_trainer_preparation_is_the_engines_packing_and_the_fake_quantized_weights(recipe):
    """PackedQuant.prepare (the trainer, per call) == PackedQuant.from_parts of quantize()'s
    payloads (the engine, per load), and its dense output == fake_quantize of each part."""
    _form()
    g = _gen()
    for k, ns in SHAPES[recipe]:
        ws = [_rows(n, k, g) for n in ns]
        pq, dense = qg.PackedQuant.prepare(ws, recipe)
        ref = qg.PackedQuant.from_parts(recipe, [quantize(w, recipe, "weight") for w in ws])
        assert (pq.n, pq.k) == (ref.n, ref.k) == (sum(ns), k)
        assert torch.equal(pq.packed, ref.packed) and torch.equal(pq.col_scale, ref.col_scale)
        assert (pq.block_scales is None) == (ref.block_scales is None)
        assert pq.block_scales is None or torch.equal(pq.block_scales, ref.block_scales)
        fq = torch.cat([fake_quantize(w, recipe, "weight") for w in ws])
        assert torch.equal(dense.view(torch.int16), fq.view(torch.int16)), (recipe, k, ns)


@pytest.mark.parametrize("recipe", RECIPES)
def test_kernel_is_its_reference_bit_for_bit(recipe):
    """quant_linear == quant_linear_reference (the dpbf16 form in torch: quantize()'s payloads,
    fp32 accumulation in the instruction's order, the scales after) at odd sizes, every tile
    path (1, 5, 8 rows: one in-register tile; 13, 16: two; 37: the expanded buffer)."""
    _form()
    g = _gen()
    for k, ns in SHAPES[recipe]:
        ws = [_rows(n, k, g) for n in ns]
        pq = qg.PackedQuant.prepare(ws, recipe)[0]
        x = _rows(37, k, g)
        for m in (1, 5, 8, 13, 16, 37):
            got = qg.quant_linear(x[:m], pq)
            want = qg.quant_linear_reference(x[:m], ws, recipe)
            assert got.dtype == torch.bfloat16 and got.shape == (m, sum(ns))
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (recipe, k, ns, m)


@pytest.mark.parametrize("recipe", RECIPES)
def test_rows_threads_and_preparations_give_the_same_bits(recipe):
    """Every prefix x[:m], m = 1..130, 200, 257, 700 (chunks of 192 rows), reproduces the first
    m rows of the 700-row call; rows alone and at the end of a call too; 1 and 2 threads;
    the engine's packing (from held QuantizedWeights) and the trainer's preparation."""
    _form()
    g = _gen()
    k, ns = SHAPES[recipe][1]
    ws = [_rows(n, k, g) for n in ns]
    x = _rows(700, k, g)
    pq = qg.PackedQuant.prepare(ws, recipe)[0]
    held = qg.PackedQuant.from_parts(recipe, [(q.payload, q.scales) for q in (QuantizedWeight.of(w, recipe) for w in ws)])
    with threads(1):
        full = qg.quant_linear(x, pq)
        for m in (*range(1, 131), 200, 257):
            assert torch.equal(qg.quant_linear(x[:m], pq), full[:m]), (recipe, m)
            assert torch.equal(qg.quant_linear(x[-m:], held), full[-m:]), (recipe, m)
        for i in (0, 1, 233, 699):
            assert torch.equal(qg.quant_linear(x[i:i + 1], pq), full[i:i + 1]), (recipe, i)
    with threads(2):
        assert torch.equal(qg.quant_linear(x, held), full)
        for m in (3, 16, 17, 100):
            assert torch.equal(qg.quant_linear(x[:m], pq), full[:m]), (recipe, m)


@pytest.mark.parametrize("recipe", RECIPES)
def test_distance_to_torchaos_arithmetic(recipe):
    """The stated tolerance (docs/quantization.md): against the fp64 product of the operands
    torchao's dequantize gives (activations too, where the recipe quantizes them), every
    output within 2^-8 of its magnitude plus 2^-20 of sum_k |a_k w_k| (the bf16 output's
    rounding and the fp32 accumulation). The dense form (each operand rounded to bf16 after
    its scale, then the GEMM) is farther from it: its mean error relative to sum_k |a_k w_k|
    is not smaller (measured: about twice; per output up to 5e-2 of |y| where terms cancel)."""
    _form()
    g = _gen()
    k, ns = SHAPES[recipe][2]
    ws = [_rows(n, k, g) * 0.1 for n in ns]
    x = _rows(64, k, g)
    w_deq = torch.cat([dequantize(*quantize(w, recipe, "weight"), recipe, torch.float32) for w in ws]).double()
    x_deq = dequantize(*quantize(x, recipe, "activation"), recipe, torch.float32).double() if \
        quantizes_activations(recipe) else x.double()
    ref = x_deq @ w_deq.t()
    bound = 2**-8 * ref.abs() + 2**-20 * (x_deq.abs() @ w_deq.abs().t())
    got = qg.quant_linear(x, qg.PackedQuant.prepare(ws, recipe)[0]).double()
    assert ((got - ref).abs() <= bound).all(), ((got - ref).abs() / bound).max()
    x_fq = fake_quantize(x, recipe, "activation") if quantizes_activations(recipe) else x
    dense = (x_fq.double() @ torch.cat([fake_quantize(w, recipe, "weight") for w in ws]).double().t()).bfloat16()
    scale = x_deq.abs() @ w_deq.abs().t()
    some = scale > 0  # not the zero rows
    # "not smaller", up to one part in 2^8: on most draws the fast form's mean is 0.44-0.80 of
    # the dense form's (120 draws, 2026-12-05), but where the fp32 sums are exact the two
    # forms round the same sums and the means can differ in their last bits (seen once: 1.0000x)
    fast_err = ((got - ref).abs()[some] / scale[some]).mean()
    dense_err = ((dense.double() - ref).abs()[some] / scale[some]).mean()
    assert fast_err <= dense_err * (1 + 2**-8), (fast_err, dense_err)


@pytest.mark.parametrize("recipe", RECIPES)
def test_trainer_gradients_are_the_dense_forms(recipe):
    """Straight through: the input and weight gradients of quant_linear (q, k, v-like parts)
    equal those of the invariant linear at the fake-quantized operands, bit for bit."""
    _form()
    from titan_rl.kernels import linear

    g = _gen()
    k, ns = SHAPES[recipe][1]
    ws = [_rows(n, k, g).requires_grad_() for n in ns]
    x = _rows(29, k, g).requires_grad_()
    up = torch.randn(29, sum(ns), generator=g).to(torch.bfloat16)
    (qg.quant_linear(x, ws, recipe) * up).sum().backward()
    got = [x.grad, *(w.grad for w in ws)]
    for t in (x, *ws):
        t.grad = None
    x_fq = fake_quantize(x, recipe, "activation") if quantizes_activations(recipe) else x
    (linear(x_fq, torch.cat([fake_quantize(w, recipe, "weight") for w in ws])) * up).sum().backward()
    for a, b in zip(got, [x.grad, *(w.grad for w in ws)]):
        assert torch.equal(a, b)


def test_form_selection():
    """Which linears run the quantized GEMM: bf16 CPU operands of its three recipes, where the
    CPU has the instructions; the self-check report and the contract name the form."""
    from titan_rl.kernels.selfcheck import platform_choices

    form = qg.quant_gemm_form()
    assert form in ("dpbf16", "dense") and platform_choices()["quant_gemm"] == form
    on = form == "dpbf16"
    for recipe in RECIPES:
        assert qg.uses_quant_gemm(recipe, torch.bfloat16, "cpu") is on
        assert not qg.uses_quant_gemm(recipe, torch.float32, "cpu")
    for recipe in ("fp8_block", "mxfp8", None):
        assert not qg.uses_quant_gemm(recipe, torch.bfloat16, "cpu")


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("form", ["dpbf16", "dense"])
def test_engine_forward_equals_the_trainers_in_both_forms(recipe, form, monkeypatch):
    """The debug model, bf16: the engine's forward (payload + scales held, prepared once: the
    packed payload in the dpbf16 form, no dense copy; the dequantized weight in the dense form)
    equals the trainer's, a batch and a row alone. "dense" is forced here to test what CPUs
    without AVX512-BF16 run."""
    from titan_rl.models.layers import Linear, held_operands, prepare_for_engine
    from titan_rl.models.options import ModelOptions, Quantization
    from titan_rl.quant_weights import quantized_state, weight_recipes
    from titan_rl.registry import get_architecture

    if form == "dpbf16":
        _form()
    else:
        monkeypatch.setattr(qg, "quant_gemm_form", lambda: "dense")
    spec = get_architecture("qwen3")
    options = ModelOptions(quantization=Quantization(recipe))
    trainer = spec.build("debug", options).init_weights(3, 0.05).to(torch.bfloat16).eval()
    engine = spec.build("debug", options).to(torch.bfloat16).eval()
    state = {n: p.detach() for n, p in trainer.named_parameters()}
    covered = {f"{n}.weight": m for n, m in engine.named_modules() if isinstance(m, Linear) and m.recipe is not None}
    params = dict(engine.named_parameters())
    with torch.no_grad():
        for name, t in quantized_state(state, weight_recipes(trainer)).items():
            covered[name].load_quantized(name, t, torch.bfloat16) if name in covered else params[name].copy_(t)
    prepare_for_engine(engine)
    packed = [op for name, op in held_operands(engine) if name.endswith(("packed_qkv", "packed_gate_up"))]
    assert packed and all(isinstance(p, qg.PackedQuant) == (form == "dpbf16") for p in packed)
    tokens = torch.randint(0, trainer.cfg.vocab_size, (4, 19), generator=_gen())
    with torch.no_grad():
        full = trainer(tokens)
        assert torch.equal(engine(tokens), full)
        assert torch.equal(engine(tokens[2:3])[0], full[2])


@pytest.mark.parametrize("recipe", RECIPES)
def test_unpack_gives_back_each_parts_payload_and_scales(recipe):
    """PackedQuant.unpack (what the engine's weight checksum reads back from the bytes the GEMM
    multiplies) returns each part's quantize() payload and scales, bit for bit."""
    _form()
    g = _gen()
    k, ns = SHAPES[recipe][1]
    ws = [_rows(n, k, g) for n in ns]
    parts = [quantize(w, recipe, "weight") for w in ws]
    pq = qg.PackedQuant.from_parts(recipe, parts)
    start = 0
    for n, (payload, scales) in zip(ns, parts):
        got_p, got_s = pq.unpack(start, start + n)
        assert torch.equal(_bits(got_p), _bits(payload)) and len(got_s) == len(scales)
        for a, b in zip(got_s, scales):
            assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))
        start += n


def test_the_self_check_probes_the_quantized_gemm(monkeypatch):
    """check_platform runs the quantized GEMM's row and thread probes (bf16, where the form
    runs) and refuses a version whose rows depend on the batch."""
    _form()
    from titan_rl.kernels import selfcheck

    real = qg.quant_linear

    def broken(x, w, recipe=None):
        out = real(x, w, recipe)
        if x.shape[0] >= 100:  # the first output drifts in big calls: a batch-dependent kernel
            out = out.clone()
            out.view(-1)[0] = out.view(-1)[0] * 1.05 + 0.05
        return out

    selfcheck.clear_cache()
    try:
        monkeypatch.setattr(qg, "quant_linear", broken)
        with pytest.raises(selfcheck.PlatformNotInvariant, match="quant_linear"):
            selfcheck.check_platform(torch.bfloat16)
    finally:
        selfcheck.clear_cache()


def test_forced_triton_backend_keeps_the_dense_form(monkeypatch):
    """Under dispatch.use_backend("triton") (the GPU code path on CPU tensors) quantized linears
    run the dense form, as on CUDA: the quantized GEMM is the CPU kernels' form only."""
    from titan_rl.kernels import dispatch

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # backend_for's guard; nothing here imports triton
    with dispatch.use_backend("triton"):
        assert not qg.uses_quant_gemm("fp8_rowwise", torch.bfloat16, "cpu")
