"""A "gloo" backend for vLLM's weight-transfer mechanism: trainer -> engine processes on CPU.

vLLM's weight transfer (vllm.distributed.weight_transfer) is a registry of backends, each a
worker-side `WeightTransferEngine` (inside the engine's worker process) and a trainer-side
`TrainerWeightTransferEngine`, driven by the four calls every vLLM engine exposes:
init_weight_transfer_engine -> start_weight_update -> update_weights -> finish_weight_update.
Its built-in backends move CUDA tensors (NCCL, CUDA IPC); this one moves CPU tensors over a
gloo process group of its own (the trainer's sender at rank 0, the engine's workers at
1..tp), rendezvous on a TCPStore the trainer hosts. Registered by the plugin in every vLLM
process and by `titan_rl.rl.separate_engines` in the trainer.

What goes over the wire is what the engine multiplies by: the trainer's weights in the
compute dtype, or under a quantization recipe the payload and scales of each quantized
linear (kernels.quant.QuantizedWeight), packed into buckets of `bucket_bytes`. The update's
metadata (names, dtypes, shapes, recipes) rides `update_weights`; the tensors ride the
broadcasts, which both sides run at the same time (the trainer sends while the engine's
update_weights call receives). The engine loads a whole update at once (our wrapper's
strict `load_weights`, which prepares the engine's packed weights once).
"""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from collections.abc import Iterator
from typing import Any, ClassVar

import torch

from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo, TrainerWeightTransferEngine, WeightTransferEngine, WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from titan_rl.dtypes import dtype_name

BACKEND = "gloo"
BUCKET_BYTES = 64 << 20
PART = "::"  # name::payload, name::scale0, ...: the pieces of a quantized weight


def register() -> None:
    """Register the backend with vLLM's two factories (idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, GlooWeightTransferEngine)
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, GlooTrainerWeightTransferEngine)


def _group(host: str, port: int, rank: int, world_size: int, timeout_s: float, is_master: bool):
    store = torch.distributed.TCPStore(host, port, world_size, is_master=is_master,
                                       timeout=timedelta(seconds=timeout_s))
    prefixed = torch.distributed.PrefixStore("titan_rl_weights", store)
    return store, torch.distributed.ProcessGroupGloo(prefixed, rank, world_size, timedelta(seconds=timeout_s))


# -- what is sent -----------------------------------------------------------------------

@dataclass
class Piece:
    name: str  # the parameter's name, or name::payload / name::scaleN of a quantized weight
    dtype: str
    shape: list[int]


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"gloo weight transfer: unknown dtype {name!r}")
    return dtype


def pieces_of(state: dict) -> tuple[list[Piece], list[torch.Tensor], dict[str, list]]:
    """The wire form of a state dict whose values are tensors or QuantizedWeights: the pieces,
    their tensors (contiguous), and per quantized weight [recipe, dtype, number of scales]."""
    from titan_rl.kernels.quant import QuantizedWeight

    meta, tensors, quantized = [], [], {}
    for name, value in state.items():
        if isinstance(value, QuantizedWeight):
            parts = value.tensors()
            quantized[name] = [value.recipe, dtype_name(value.dtype), len(value.scales)]
            items = [(f"{name}{PART}{k}", t) for k, t in parts.items()]
        else:
            items = [(name, value)]
        for n, t in items:
            t = t.detach().contiguous()
            meta.append(Piece(n, dtype_name(t.dtype), list(t.shape)))
            tensors.append(t)
    return meta, tensors, quantized


def buckets(meta: list[Piece], limit: int) -> list[list[int]]:
    """Consecutive piece indices grouped into buckets of at most `limit` bytes (a larger
    piece travels alone)."""
    out, cur, size = [], [], 0
    for i, p in enumerate(meta):
        n = _nbytes(p)
        if cur and size + n > limit:
            out.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += n
    if cur:
        out.append(cur)
    return out


def _nbytes(p: Piece) -> int:
    n = 1
    for d in p.shape:
        n *= d
    return n * _dtype(p.dtype).itemsize


def _pack(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors]) if tensors else torch.empty(0, dtype=torch.uint8)


def _unpack(buf: torch.Tensor, meta: list[Piece]) -> Iterator[tuple[str, torch.Tensor]]:
    at = 0
    for p in meta:
        n, dtype = _nbytes(p), _dtype(p.dtype)
        raw = buf[at:at + n]
        if at % dtype.itemsize:  # a view needs an aligned offset (pieces are packed back to back)
            raw = raw.clone()
        yield p.name, raw.view(dtype).reshape(p.shape)
        at += n


def assemble(pairs: Iterator[tuple[str, torch.Tensor]], quantized: dict[str, list]) -> dict:
    """The state dict back from its pieces: quantized weights rebuilt from payload + scales."""
    from titan_rl.kernels.quant import QuantizedWeight

    out: dict = {}
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in pairs:
        base, sep, part = name.partition(PART)
        if sep:
            parts.setdefault(base, {})[part] = t
        else:
            out[name] = t
    for name, (recipe, dtype, n_scales) in quantized.items():
        p = parts[name]
        out[name] = QuantizedWeight(recipe, p["payload"], tuple(p[f"scale{i}"] for i in range(n_scales)), _dtype(dtype))
    return out


# -- the engine's side (a worker process) -------------------------------------------------

@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    host: str
    port: int
    world_size: int  # 1 trainer sender + the engine's workers
    timeout_s: float = 120.0


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    pieces: list[list]  # [name, dtype, shape] per piece, in send order
    buckets: list[list[int]]
    quantized: dict[str, list] = field(default_factory=dict)


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group = None
        self.store = None
        self.received_bytes = 0

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        rank = 1 + self.parallel_config.rank
        self.store, self.group = _group(init_info.host, init_info.port, rank, init_info.world_size,
                                        init_info.timeout_s, is_master=False)

    def start_weight_update(self) -> None:
        self.received_bytes = 0
        if self._builtin():
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        if self._builtin():
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self.model, self.model_config)

    def _builtin(self) -> bool:
        """vLLM's own model (kernels = 'stock'): its CPU linears repack what they load, so an
        update goes through vLLM's layerwise reload, as its own checkpoint-format backends do;
        our wrapper loads in place."""
        from titan_rl.vllm.model import TitanForCausalLM

        return not isinstance(self.model, TitanForCausalLM)

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("gloo weight transfer: init_weight_transfer_engine was not called")
        meta = [Piece(n, d, list(s)) for n, d, s in update_info.pieces]
        pairs = []
        for idx in update_info.buckets:
            chunk = [meta[i] for i in idx]
            buf = torch.empty(sum(map(_nbytes, chunk)), dtype=torch.uint8)
            self.group.broadcast(buf, 0).wait()
            self.received_bytes += buf.numel()
            pairs.extend(_unpack(buf, chunk))
        self.model.load_weights(assemble(iter(pairs), update_info.quantized).items())

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # the base class ends with torch.accelerator.synchronize(); a CPU engine has nothing to wait for
        self.receive_weights(self.parse_update_info(update_info))

    def shutdown(self) -> None:
        self.group = self.store = None


# -- the trainer's side -----------------------------------------------------------------------

@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = BACKEND
    host: str = "127.0.0.1"
    port: int = 0
    engine_workers: int = 1
    bucket_bytes: int = BUCKET_BYTES
    timeout_s: float = 120.0


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """The sender. `send_state(state, version)` is the round trip: start, the metadata with
    update_weights (in a thread) while the buckets are broadcast, finish with the version."""

    init_info_cls = GlooTrainerInitInfo

    def __init__(self, *, client, source=None, is_sender=True, bucket_bytes=BUCKET_BYTES):
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.bucket_bytes = bucket_bytes
        self.group = self.store = None
        self.sent_bytes = 0

    @classmethod
    def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client, source=None):
        engine = cls(client=client, source=source, is_sender=True, bucket_bytes=init_info.bucket_bytes)
        world = 1 + init_info.engine_workers
        worker = GlooInitInfo(init_info.host, init_info.port, world, init_info.timeout_s)
        # the workers block in the rendezvous inside their init call: both sides at once
        with ThreadPoolExecutor(max_workers=1) as exe:
            future = exe.submit(client.init_weight_transfer_engine, dataclasses.asdict(worker))
            engine.store, engine.group = _group(init_info.host, init_info.port, 0, world, init_info.timeout_s,
                                                is_master=True)
            future.result()
        return engine

    def send_weights(self) -> None:
        if self.source is None:
            raise ValueError("gloo weight transfer: send_weights needs a source; use send_state(state, version)")
        self.send_state(dict(self.source), None)

    def send_state(self, state: dict, version: str | None) -> int:
        """Send `state` (name -> tensor or QuantizedWeight); the bytes sent."""
        meta, tensors, quantized = pieces_of(state)
        groups = buckets(meta, self.bucket_bytes)
        info = {"pieces": [[p.name, p.dtype, p.shape] for p in meta], "buckets": groups, "quantized": quantized}
        self.client.start_weight_update()
        failed: list[BaseException] = []

        def receive():
            try:
                self.client.update_weights(info)
            except BaseException as e:  # noqa: BLE001  (re-raised below, in the caller's thread)
                failed.append(e)

        t = threading.Thread(target=receive, name="titan_rl-weights-rpc", daemon=True)
        t.start()
        sent = 0
        for idx in groups:
            buf = _pack([tensors[i] for i in idx])
            self.group.broadcast(buf, 0).wait()
            sent += buf.numel()
        t.join()
        if failed:
            raise failed[0]
        self.client.finish_weight_update(version)
        self.sent_bytes = sent
        return sent

    def shutdown(self) -> None:
        self.group = self.store = None


class LLMClient:
    """vLLM's VLLMWeightSyncClient protocol over an `LLM` object (the offline engine, whose
    own methods take request dicts): the four calls, through its collective RPC."""

    def __init__(self, llm) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)
