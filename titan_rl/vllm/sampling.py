"""vLLM's top-k/top-p goes through our kernel; the sampler's kept sets can be captured.

install(): replaces the module-level `vllm.v1.sample.ops.topk_topp_sampler.apply_top_k_top_p`
(looked up at call time by TopKTopPSampler.forward_cpu / forward_native) with
`titan_rl.kernels.sampling.apply_top_k_top_p`, so the sampler and the trainer mask with
the same function. Idempotent. (vLLM modules that imported the name directly -- the
rejection sampler, the GPU model runner v2, watermarking -- keep vLLM's; none runs on
our CPU path, and capture refuses speculative decoding.)

capture_kept_sets(llm): replay mode. Row -> request mapping: while active, the engine's
model runner's `_sample(logits, spec_decode_metadata)` is wrapped on the instance. At
that call the logits rows are exactly `input_batch.req_ids[:num_reqs]` in order (one
row per scheduled request, no speculative decoding), and `discard_request_mask` marks
rows whose sample vLLM throws away (partial chunked prefills). Inside the call our
installed apply_top_k_top_p records the kept mask (finite after masking) of the
temperature-scaled logits; after it the sampled tokens are read from the
SamplerOutput. Each non-discarded row appends (encoded kept set, sampled token) to its
request. This reads vLLM internals (GPUModelRunner._sample, input_batch.req_ids,
discard_request_mask of vLLM 0.32) and needs the in-process engine
(VLLM_ENABLE_V1_MULTIPROCESSING=0); a missing attribute fails loudly.

Encoding of one kept set over a vocabulary of V: 1 tag byte, then either a packed
bitmap (ceil(V/8) bytes, little bit order) or the kept ids as little-endian int32,
whichever is smaller (bitmap on a tie).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import numpy as np
import torch

from titan_rl.kernels import log_softmax_fp32
from titan_rl.kernels.sampling import apply_top_k_top_p as _kernel_apply_top_k_top_p

_TAG_BITMAP = 0
_TAG_IDS = 1


# ---------------------------------------------------------------- encoding

def encoded_size(num_kept: int, vocab_size: int) -> int:
    return 1 + min((vocab_size + 7) // 8, 4 * num_kept)


def encode(mask_row) -> bytes:
    """bool [V] -> bytes: the smaller of a packed bitmap and an int32 id list (+1 tag byte)."""
    m = np.asarray(torch.as_tensor(mask_row).cpu().numpy(), dtype=bool).reshape(-1)
    V = m.size
    ids = np.flatnonzero(m)
    if 4 * ids.size < (V + 7) // 8:
        return bytes([_TAG_IDS]) + ids.astype("<i4").tobytes()
    return bytes([_TAG_BITMAP]) + np.packbits(m, bitorder="little").tobytes()


def decode(data: bytes, vocab_size: int) -> torch.Tensor:
    """bytes -> bool [V]."""
    if not data:
        raise ValueError("empty kept-set encoding")
    tag, body = data[0], data[1:]
    if tag == _TAG_BITMAP:
        if len(body) != (vocab_size + 7) // 8:
            raise ValueError(f"bitmap of {len(body)} bytes for V={vocab_size}")
        bits = np.unpackbits(np.frombuffer(body, dtype=np.uint8), count=vocab_size, bitorder="little")
        return torch.from_numpy(bits.astype(bool))
    if tag == _TAG_IDS:
        if len(body) % 4:
            raise ValueError(f"id list of {len(body)} bytes is not a multiple of 4")
        ids = np.frombuffer(body, dtype="<i4").astype(np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            raise ValueError(f"kept id outside [0, {vocab_size})")
        out = torch.zeros(vocab_size, dtype=torch.bool)
        out[torch.from_numpy(ids)] = True
        return out
    raise ValueError(f"unknown kept-set tag {tag}")


# ---------------------------------------------------------------- install

def _installed_apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None):
    out = _kernel_apply_top_k_top_p(logits, k, p)
    cap = _ACTIVE
    if cap is not None and cap._in_step:
        cap._step_masks.append((out != float("-inf")).cpu())
    return out


_installed_apply_top_k_top_p._titan_rl = True  # type: ignore[attr-defined]


_VLLM_OWN: list = []  # vLLM's apply_top_k_top_p, kept by install()


def install() -> None:
    """Make vLLM's top-k/top-p (CPU and native paths) call our kernel. Idempotent."""
    import vllm.v1.sample.ops.topk_topp_sampler as m

    if getattr(m.apply_top_k_top_p, "_titan_rl", False):
        return
    _VLLM_OWN[:] = [m.apply_top_k_top_p]
    m.apply_top_k_top_p = _installed_apply_top_k_top_p


@contextlib.contextmanager
def vllm_own_top_k_top_p():
    """Inside: vLLM's own top-k/top-p again (after install()), for a stock engine that
    shares the process with an exact one (benchmarks comparing the two side by side)."""
    import vllm.v1.sample.ops.topk_topp_sampler as m

    if not _VLLM_OWN or not getattr(m.apply_top_k_top_p, "_titan_rl", False):
        yield
        return
    m.apply_top_k_top_p = _VLLM_OWN[0]
    try:
        yield
    finally:
        m.apply_top_k_top_p = _installed_apply_top_k_top_p


def install_logprobs() -> None:
    """Make vLLM's Sampler record its log-probs with the kernels' dispatched
    `log_softmax_fp32`, the function the trainer scores with: on CPU that is the very
    expression vLLM's own `compute_logprobs` evaluates, on CUDA the Triton kernel
    (kernels/dispatch.py). Process-wide and idempotent, like `install`."""
    import vllm.v1.sample.sampler as sampler

    sampler.Sampler.compute_logprobs = staticmethod(log_softmax_fp32)
    if not torch.cuda.is_available():
        # The sampled token's rank is an integer count, the same bits eager or compiled;
        # vLLM's torch.compile of it costs every engine process ~3.5 s on CPU (dynamo plus
        # inductor's ISA probe) on its first generate, more than any short run samples.
        sampler.batched_count_greater_than = _count_at_least


def _count_at_least(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """vLLM's `batched_count_greater_than`, eager: per row, the entries >= its value."""
    return (x >= values).sum(-1)


def installed() -> bool:
    import vllm.v1.sample.ops.topk_topp_sampler as m

    return bool(getattr(m.apply_top_k_top_p, "_titan_rl", False))


# ---------------------------------------------------------------- capture

def external_request_id(internal_id: str) -> str:
    """vLLM 0.32 runs request "<id>" as "<id>-<8 random chars>" (input_processor)."""
    head, sep, tail = internal_id.rpartition("-")
    return head if sep and len(tail) == 8 else internal_id


@dataclass
class KeptSets:
    """Captured kept sets: per request (vLLM's external id, as in RequestOutput.request_id),
    one encoded kept set and the sampled token per generated token, in order."""

    vocab_size: int = 0
    encoded: dict[str, list[bytes]] = field(default_factory=dict)
    tokens: dict[str, list[int]] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(len(b) for v in self.encoded.values() for b in v)

    def bytes_of(self, request_id: str) -> int:
        return sum(len(b) for b in self.encoded.get(request_id, ()))

    def kept(self, request_id: str) -> torch.Tensor:
        """bool [T, V]: the kept set of each generated token of `request_id`."""
        rows = self.encoded[request_id]
        if not rows:
            return torch.zeros(0, self.vocab_size, dtype=torch.bool)
        return torch.stack([decode(b, self.vocab_size) for b in rows])

    def kept_for(self, request_id: str, token_ids) -> torch.Tensor:
        """kept(request_id), after checking the captured samples are `token_ids`."""
        got = self.tokens.get(request_id)
        if got is None:
            raise KeyError(f"no kept sets captured for request {request_id!r}")
        if list(token_ids) != got:
            raise ValueError(f"request {request_id!r}: captured tokens {got} != output tokens {list(token_ids)}")
        return self.kept(request_id)


class _Capture:
    def __init__(self, runner):
        self.runner = runner
        self.result = KeptSets()
        self._internal: dict[str, str] = {}
        self._in_step = False
        self._step_masks: list[torch.Tensor] = []
        self.errors: list[str] = []

    def sample(self, orig, logits, spec_decode_metadata, *args, **kwargs):
        if spec_decode_metadata is not None:
            self.errors.append("speculative decoding is not supported by kept-set capture")
            return orig(logits, spec_decode_metadata, *args, **kwargs)
        ib = self.runner.input_batch
        n = ib.num_reqs
        req_ids = list(ib.req_ids[:n])
        discard = np.asarray(self.runner.discard_request_mask.np[:n], dtype=bool).copy()
        self._step_masks = []
        self._in_step = True
        try:
            out = orig(logits, spec_decode_metadata, *args, **kwargs)
        finally:
            self._in_step = False
        masks, self._step_masks = self._step_masks, []
        live = [i for i in range(n) if not discard[i]]
        if not live:
            return out
        if len(masks) != 1 or masks[0].shape[0] != n:
            self.errors.append(f"step with requests {[req_ids[i] for i in live]}: expected one top-k/top-p call "
                               f"over {n} rows, got {[tuple(m.shape) for m in masks]} (all-greedy batch?)")
            return out
        mask = masks[0]
        sampled = out.sampled_token_ids[:, 0].tolist()
        V = mask.shape[1]
        self.result.vocab_size = V
        for i in live:
            rid, tok = req_ids[i], int(sampled[i])
            ext = external_request_id(rid)
            if self._internal.setdefault(ext, rid) != rid:
                self.errors.append(f"two requests map to external id {ext!r}: {self._internal[ext]!r}, {rid!r}")
                continue
            if not bool(mask[i, tok]):
                self.errors.append(f"request {ext!r}: sampled token {tok} outside its kept set")
            self.result.encoded.setdefault(ext, []).append(encode(mask[i]))
            self.result.tokens.setdefault(ext, []).append(tok)
        return out


_ACTIVE: _Capture | None = None


def model_runner(llm):
    """The model runner of an in-process engine `llm`; a model runner is itself (inside an
    engine's worker process the captures are opened on it: titan_rl.vllm.worker_extension)."""
    if hasattr(llm, "input_batch"):
        return llm
    core = llm.llm_engine.engine_core
    core = getattr(core, "engine_core", core)
    return core.model_executor.driver_worker.worker.model_runner


@contextlib.contextmanager
def capture_kept_sets(llm):
    """with capture_kept_sets(llm) as ks: llm.generate(...) -> ks: KeptSets.

    Installs our top-k/top-p into vLLM if needed. Raises RuntimeError on exit if a step
    could not be attributed (all-greedy batch, speculative decoding, id clash) or a
    sampled token fell outside its kept set. One capture at a time."""
    global _ACTIVE
    if _ACTIVE is not None:
        raise RuntimeError("capture_kept_sets is already active")
    install()
    runner = model_runner(llm)
    for attr in ("_sample", "input_batch", "discard_request_mask"):
        if not hasattr(runner, attr):
            raise RuntimeError(f"vLLM model runner has no {attr!r}: kept-set capture needs vLLM 0.32's GPUModelRunner")
    cap = _Capture(runner)
    orig = runner._sample

    def _sample(logits, spec_decode_metadata, *args, **kwargs):
        return cap.sample(orig, logits, spec_decode_metadata, *args, **kwargs)

    runner._sample = _sample
    _ACTIVE = cap
    try:
        yield cap.result
    finally:
        _ACTIVE = None
        if runner.__dict__.get("_sample") is _sample:
            del runner._sample
    if cap.errors:
        raise RuntimeError("kept-set capture failed: " + "; ".join(cap.errors[:5]))
