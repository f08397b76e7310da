"""Batch-invariant linear on CPU.

Why (measured, docs/kernels.md): BLAS and oneDNN pick kernels, K-blocking and thread
splits from the call's M, so with plain F.linear a row's bits depend on how many rows
share the call. What is invariant on the project's CPUs (guard test, 1 and 2 threads,
M = 1..130 and 200/257/512/2000, odd K and N): ONE GEMM call with M zero-padded up to a
multiple of ROW_MULTIPLE (fewer rows take another kernel) and, for N < MIN_N, the weight
zero-padded to MIN_N rows (fp32 with an odd K and N <= 11 varied otherwise).

The GEMM (`GEMM`, chosen once per platform and reported by the self-check):
  "onednn": oneDNN's matmul on a weight reordered once into its blocked layout
            (torch.ops.mkldnn._reorder_linear_weight / _linear_pointwise, what vLLM's
            CPU linears use): faster than torch.mm in fp32 (docs/kernels.md has the
            figures), invariant under the rule above;
  "mm":     torch.mm (BLAS), where torch has no oneDNN.
bf16 (`bf16_gemm()`): "native" bf16 GEMMs where the CPU has bf16 instructions; else "fp32":
operands upcast to fp32 (exact), an fp32 GEMM, rounded to bf16 (faster than a bf16 GEMM
without those instructions: docs/kernels.md).

The engine prepares each weight once per load (`gemm_weight`: reordered); the
trainer's weights change every step: in fp32 `linear` runs oneDNN's arithmetic on its own
kernel (csrc/f32_chain.cpp, on a copy packed per call; wherever `_few_rows_exact` finds it
equal to oneDNN at that K), else hands oneDNN the plain weight, which it reorders inside the
call: the same bits either way (`PackedWeight`).
The backward's two GEMMs (`grad_input`, `grad_weight`) are fixed too: torch.mm's own
choice depends on the thread count (measured: fp32 grad @ W at M = 5..11 rows, bf16
grad^T @ x at M = 2048, 1 vs 2 threads), and a training step must give the same bits at
any thread count (the layout tests and the contract compare ranks that may run different
counts). `grad_weight` is a compiled GEMM of its own (the reduction
runs over the rows, which oneDNN's linear would need transposed copies of both operands for:
10% of a bf16 step); in bf16 `grad_input` is the same GEMM on grad read transposed, in fp32
csrc/f32_chain.cpp's chains on the weight's column blocks.
The fixed pieces below also fix their backward's shapes, for TP-invariant gradients.

Few rows (decode at batch <= FEW_ROWS, the tail of every rollout): padded to 8 rows, oneDNN
computes 8 rows' products to keep 1 (bf16, 10 layers of the small flavor: 9.6 ms a token where
oneDNN on the row alone takes 4.5 ms, with other bits). oneDNN's GEMM computes each output as
chains in order from +0 (bf16: vdpbf16ps over k-pairs; fp32: FMAs over k), K cut in chunks
(`onednn_k_chunk`) whose sums are added in order, then rounded to the output dtype. The LM
head's dot-product kernel (csrc/bf16_logits.cpp) and csrc/f32_chain.cpp compute that given
the chunk, so the engine's weights also carry their packed copy and 1-4 rows run there: the
same bits (tests/test_kernels.py; `_few_rows_exact` checks each K and dtype on this platform,
the chunk boundaries included, before the copy is made) at 0.3-0.7x the padded call's time,
for one more copy of each weight in the engine.
"""

from __future__ import annotations

import torch

from titan_rl.kernels.cpu_ext import ops as _ops
from titan_rl.kernels.matmul import blocks

ROW_MULTIPLE = 8
MIN_N = 16  # narrower weights are zero-padded to this many output columns
FEW_ROWS = 4  # calls of at most this many rows run on the engine weight's few-rows copy


def _native_bf16() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def _native_bf16_invariant() -> bool:
    """Whether oneDNN's bf16 GEMM keeps a row's bits whatever the row count, probed where AMX
    broke it (K 1024, N 384: rows 24-25 of 33 differ from those rows alone; titan_rl caps
    oneDNN below AMX at import, titan_rl/onednn_cap.py, and this catches a cap that came
    after oneDNN's first GEMM). A few milliseconds, on one thread: processes fork engine
    workers and test ranks, and a child forked after an OpenMP region ran on several
    threads hangs at its first parallel region."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(384, 1024, generator=g).bfloat16()
        x = torch.randn(40, 1024, generator=g).bfloat16()
        pw = torch.ops.mkldnn._reorder_linear_weight(w, None)
        whole = torch.ops.mkldnn._linear_pointwise(x, pw, None, "none", [], "")
        return all(torch.equal(torch.ops.mkldnn._linear_pointwise(x[r:r + 8].contiguous(), pw, None, "none", [], ""),
                               whole[r:r + 8]) for r in (0, 24, 32))
    finally:
        torch.set_num_threads(n)


GEMM = "onednn" if torch.backends.mkldnn.is_available() else "mm"
BF16_GEMM = None  # "native" or "fp32": bf16_gemm() decides it at the first question, not at import


def bf16_gemm() -> str:
    """The bf16 GEMM form here: "native" (oneDNN's bf16 GEMM, where the CPU has bf16
    instructions and it is batch-invariant) or "fp32" (operands upcast)."""
    global BF16_GEMM
    if BF16_GEMM is None:
        BF16_GEMM = "native" if GEMM == "onednn" and _native_bf16() and _native_bf16_invariant() else "fp32"
    return BF16_GEMM


def gemm_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the GEMM of a `dtype` linear runs in on this platform."""
    return torch.float32 if dtype == torch.bfloat16 and bf16_gemm() == "fp32" else dtype


def onednn_k_chunk(k: int) -> int:
    """How oneDNN's GEMM (brgemm; bf16 native and fp32 alike) sums K, as measured here
    (tests/test_kernels.py reads it back): K <= 512 one chain (0 here); else chunks of 512
    (K <= 1024) or 1024 columns, each chunk's chain from +0, the chunks added in order in fp32."""
    return 0 if k <= 512 else 512 if k <= 1024 else 1024


def boundary_probe(k: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Rows that read a GEMM's K-chunk boundaries off its outputs (weights all 1): row r holds
    a sum in the columns before s = 32 (r + 1) and, in up to 32 columns from s, terms under
    half that sum's ulp. One chain absorbs each term; a chunk starting at s sums them apart
    and adds them, and the row's output changes. bf16: 1024 and 4 (1028, bf16's rounding
    midpoint between 1024 and 1032, a tie that rounds to 1024), terms of 7/16 of its fp32 ulp:
    the row is 1032 exactly where a chunk starts at s. fp32: 1, terms of 3/8 ulp: the row
    is above 1 exactly there. (Chunks of 2 or more terms; one term rounds the same either way.)"""
    starts = list(range(32, k, 32))
    x = torch.zeros(len(starts), k)
    for r, s in enumerate(starts):
        if dtype == torch.bfloat16:
            x[r, s - 2], x[r, s - 1] = 1024.0, 4.0
            x[r, s:s + 32] = 7 * 2.0**-17
        else:
            x[r, s - 1] = 1.0
            x[r, s:s + 32] = 3 * 2.0**-26
    return x.to(dtype)


_FEW_ROWS_K: dict[tuple[int, torch.dtype], bool] = {}


def _few_rows_form(dtype: torch.dtype) -> bool:
    """Whether this platform has the few-rows kernel of `dtype`'s GEMM: bf16 where oneDNN's bf16
    GEMM is native (AVX512-BF16; the LM head's dot-product kernel), fp32 where the kernel's
    AVX-512 form is built (csrc/f32_chain.cpp)."""
    if GEMM != "onednn":
        return False
    if dtype == torch.bfloat16:
        return bf16_gemm() == "native" and _ops().bf16_logits_available() and _ops().dpbf16_implementation() == "avx512bf16"
    return dtype == torch.float32 and _ops().few_rows_f32_form() == "avx512"


def _few_rows_pack(w: torch.Tensor) -> torch.Tensor:
    return _ops().bf16_logits_pack(w) if w.dtype == torch.bfloat16 else _ops().few_rows_f32_pack(w)


def _few_rows_call(x2: torch.Tensor, packed: torch.Tensor, n: int, k_chunk: int) -> torch.Tensor:
    if x2.dtype == torch.bfloat16:
        return _ops().bf16_logits(x2, packed, n, k_chunk).to(torch.bfloat16)
    return _ops().few_rows_f32(x2, packed, n, k_chunk)


def _few_rows_exact(k: int, dtype: torch.dtype) -> bool:
    """Whether the few-rows kernel, K chunked as `onednn_k_chunk(k)` says, gives oneDNN's bits
    in `dtype` for 1..FEW_ROWS rows at this K here: on `boundary_probe`'s rows and on random
    ones, against the padded call (once per K and dtype; one thread, as
    `_native_bf16_invariant`)."""
    key = (k, dtype)
    if key not in _FEW_ROWS_K:
        ok = _few_rows_form(dtype)
        if ok:
            n = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                g = torch.Generator().manual_seed(k)
                w = torch.cat([torch.ones(16, k), torch.randn(17, k, generator=g)]).to(dtype)
                x = torch.cat([boundary_probe(k, dtype), torch.randn(FEW_ROWS, k, generator=g).to(dtype)])
                whole = _gemm(x, PackedWeight(w))
                packed, chunk = _few_rows_pack(w), onednn_k_chunk(k)
                ok = all(torch.equal(_few_rows_call(x[r:r + FEW_ROWS], packed, 33, chunk), whole[r:r + FEW_ROWS])
                         for r in range(0, x.shape[0], FEW_ROWS))
                if dtype == torch.float32:  # the trainer's form: the same chains at any row count
                    ok = ok and torch.equal(_ops().chain_f32(x, packed, 33, chunk), whole)
            finally:
                torch.set_num_threads(n)
        _FEW_ROWS_K[key] = ok
    return _FEW_ROWS_K[key]


class PackedWeight:
    """A [N, K] weight prepared for the GEMM: in the GEMM dtype, N padded to MIN_N, and
    (GEMM = "onednn", `reorder`) reordered into oneDNN's layout; `few_rows`: the chain kernel's
    packed copy (where `_few_rows_exact`), read by calls of 1..FEW_ROWS rows (engine weights)
    or, `all_rows`, by every call (the trainer's fp32 weights), else None. Opaque: only
    `linear` reads it.

    `reorder=False` (the trainer's per-call weights): oneDNN's GEMM takes the plain weight and
    reorders it inside the call, with the same bits (plain == reordered at M 8..136, 512, 2048,
    K 64..2049, N 16..1003, fp32 and native bf16, 1 and 2 threads, AVX-512 and AVX2: 2,736
    cases, tests/test_kernels.py pins it) and without the separate reorder call's fixed cost,
    about 150 us per weight whatever its size (Intel Xeon, 2026-12-06: a [64, 64] weight's
    reorder + GEMM of 40 rows 191 us, the plain call 29 us). The engine reorders once per load."""

    __slots__ = ("data", "few_rows", "k_chunk", "all_rows", "n", "k", "gemm", "bf16_gemm")

    def __init__(self, weight: torch.Tensor, few_rows: bool = False, reorder: bool = True):
        w = weight.detach().to(gemm_dtype(weight.dtype)).contiguous()
        self.n, self.k = w.shape
        # the trainer's fp32 weights: every call on the packed copy (csrc/f32_chain.cpp), oneDNN's bits
        fp32_trainer = not reorder and w.dtype == torch.float32
        packed = (few_rows or fp32_trainer) and _few_rows_exact(self.k, w.dtype)  # False for a dtype without the kernel
        self.all_rows = fp32_trainer and packed
        self.few_rows = _few_rows_pack(w) if packed else None
        self.k_chunk = onednn_k_chunk(self.k) if packed else None
        if self.n < MIN_N and not self.all_rows:  # the packed copy pads its own last block
            w = torch.cat([w, w.new_zeros(MIN_N - self.n, self.k)])
        self.gemm, self.bf16_gemm = GEMM, bf16_gemm()
        self.data = torch.ops.mkldnn._reorder_linear_weight(w, None) if GEMM == "onednn" and reorder else w

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype


def gemm_weight(weight: torch.Tensor) -> PackedWeight:
    """The engine's prepared weight (once per load): the GEMM's, with the few-rows copy
    decode at small batches reads."""
    return PackedWeight(weight, few_rows=True)


def _gemm(x2: torch.Tensor, pw: PackedWeight) -> torch.Tensor:
    """x2 [M, K] (in the GEMM dtype) @ weight^T -> [M, N], M padded inside one call."""
    if (pw.gemm, pw.bf16_gemm) != (GEMM, bf16_gemm()):
        raise RuntimeError("PackedWeight was made under another GEMM choice; pack it again")
    m = x2.shape[0]
    if pw.all_rows:
        return _ops().chain_f32(x2, pw.few_rows, pw.n, pw.k_chunk)
    if pw.few_rows is not None and 0 < m <= FEW_ROWS:
        return _few_rows_call(x2, pw.few_rows, pw.n, pw.k_chunk)
    pad = (-m) % ROW_MULTIPLE if m else ROW_MULTIPLE
    if pad:
        x2 = torch.cat([x2, x2.new_zeros(pad, pw.k)])
    if pw.gemm == "onednn":
        y = torch.ops.mkldnn._linear_pointwise(x2.contiguous(), pw.data, None, "none", [], "")
    else:
        y = torch.mm(x2, pw.data.t())
    return y[:m, : pw.n]


def _invariant_mm(x2: torch.Tensor, weight) -> torch.Tensor:
    """x2 [M, K] @ weight^T in x2's dtype; `weight` a tensor or a PackedWeight."""
    pw = weight if isinstance(weight, PackedWeight) else PackedWeight(weight, reorder=False)
    g = pw.dtype
    y = _gemm(x2 if x2.dtype == g else x2.to(g), pw)
    return y if y.dtype == x2.dtype else y.to(x2.dtype)


def grad_input(grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """grad [M, N] @ weight [N, K] -> [M, K] in grad's dtype, each row's bits independent of M.
    bf16: the weight gradient's FMA-chain GEMM (kernels/csrc/weight_grad.cpp) on grad read as a
    transposed view, one fp32 chain over N per output under DAZ / FTZ (two terms a vdpbf16ps
    where the CPU has it): 1.3-1.9x faster than oneDNN's bf16 GEMM with the transposed weight's
    copy and reorder (Intel Xeon, M 256-2048), and the same bits on every CPU kind. fp32: the fp32 chain GEMM (kernels/csrc/f32_chain.cpp) on the weight's
    column blocks, one chain over N per output (no transposed weight): 0.92-0.97x the time of
    oneDNN's GEMM on the transposed weight at SmolLM2's shapes (M 2048, Intel Xeon), the same
    bits on every CPU kind."""
    if grad.dtype == torch.bfloat16:
        return _ops().weight_grad(grad.t(), weight.to(grad.dtype)).to(grad.dtype)
    return _ops().chain_f32_plain(grad, weight.to(grad.dtype))


def grad_weight(grad: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
    """grad [M, N]^T @ x2 [M, K] -> [N, K] in grad's dtype: the compiled weight-gradient GEMM
    (kernels/csrc/weight_grad.cpp), one fp32 FMA per row in row order for every output, read
    from the operands as they lie (fp32 or bf16 each, widened exactly: no converted copy); both
    bf16: under DAZ / FTZ over an even row count, which vdpbf16ps computes two rows at a time
    (reference.weight_grad_bf16). Its bits depend on the operands' values only: not on the
    thread count, the CPU kind, or which slice of N or K a call holds."""
    ok = (torch.float32, torch.bfloat16)
    g = grad if grad.dtype in ok else grad.float()
    return _ops().weight_grad(g, x2 if x2.dtype in ok else x2.float()).to(grad.dtype)


class _InvariantLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, weight):
        ctx.save_for_backward(x2, weight)
        return _invariant_mm(x2, weight)

    @staticmethod
    def backward(ctx, grad):
        x2, weight = ctx.saved_tensors
        grad = grad.to(x2.dtype)
        gx = grad_input(grad, weight) if ctx.needs_input_grad[0] else None
        gw = grad_weight(grad, x2).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return gx, gw


def linear(x: torch.Tensor, weight) -> torch.Tensor:
    """y = x @ weight^T in x's dtype, each output row independent of the number of rows.
    `weight`: [N, K] tensor, or a PackedWeight (engine, no autograd)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if isinstance(weight, PackedWeight):
        y = _invariant_mm(x2, weight)
        n = weight.n
    else:
        n = weight.shape[0]
        if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
            y = _InvariantLinear.apply(x2, weight)
        else:
            y = _invariant_mm(x2, weight)
    return y.reshape(*lead, n)


# -- fixed-shape pieces: the same bits for any tensor-parallel degree ---------------------
#
# Tensor parallelism (TP = t) gives each rank a slice of a linear. Two things then change
# a token's bits unless every GEMM call has a shape that does not depend on t:
#   * column-parallel (q/k/v/gate/up, output columns split): `linear` pins M, not N, and
#     MKL/oneDNN choose blocking and thread splits from N, so a rank's N/t-column call can
#     round differently from the full call. `linear_n_blocks` cuts N into L fixed blocks,
#     one call each; a rank holding L/t whole blocks issues the same calls.
#   * row-parallel (o/down, reduction dim K split): summing the ranks' partial GEMMs adds
#     in another order than one GEMM. `linear_k_leaves` cuts K into L leaves (one `linear`
#     call each on a contiguous [rows, K/L] x [K/L, N] problem, upcast to fp32) combined
#     by a balanced pairwise tree ((l0+l1)+(l2+l3))+...; a rank owns L/t consecutive
#     leaves = one whole subtree, and the ranks finish the same tree
#     (titan_rl/parallel/tp_linear.py).
# L (the model's `tp_leaves`) does not depend on t, so TP = 1, 2, ..., L and the rollout
# engine (TP = 1) compute identical bits. Both forms stay batch-invariant: every piece is
# a call of `linear`, and the tree adds elementwise.

def tree_sum(parts: torch.Tensor) -> torch.Tensor:
    """Balanced pairwise sum over dim 0 (length a power of two): level by level,
    neighbours added elementwise. Elementwise adds are exact IEEE operations, so the
    result depends only on the values and the (fixed) tree, never on the layout."""
    n = parts.shape[0]
    if n & (n - 1):
        raise ValueError(f"tree_sum needs a power-of-two count, got {n}")
    while parts.shape[0] > 1:
        parts = parts[0::2] + parts[1::2]
    return parts[0]


# the pieces themselves, composed of this form's GEMMs (kernels/matmul/blocks.py, shared
# with the Triton form)
GEMMS = blocks.Gemms(linear=linear, mm=_invariant_mm, grad_input=grad_input, grad_weight=grad_weight,
                     tree_sum=tree_sum)


def leaf_partials(x: torch.Tensor, weight: torch.Tensor, n_leaves: int) -> torch.Tensor:
    return blocks.leaf_partials(GEMMS, x, weight, n_leaves)


def linear_k_leaves(x: torch.Tensor, weight: torch.Tensor, k_leaves: int) -> torch.Tensor:
    return blocks.linear_k_leaves(GEMMS, x, weight, k_leaves)


def linear_n_blocks(x: torch.Tensor, weight: torch.Tensor, n_blocks: int, finish=None) -> torch.Tensor:
    return blocks.linear_n_blocks(GEMMS, x, weight, n_blocks, finish)
