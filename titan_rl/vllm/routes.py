"""Router replay, engine side: record the experts each computed token was sent to.

capture_routes(llm): while active, our vLLM wrapper hands every forward's routes
(per MoE layer, compact [T, k] expert ids of the flat token stream: uint8 for <= 256
experts) to the capture, which splits the stream by request. Row -> request mapping:
at forward time the model runner's `input_batch.req_ids[:num_reqs]` and
`query_start_loc.np[:num_reqs + 1]` describe the scheduled stream (vLLM 0.32, in-process
engine); each row's absolute position comes with the forward's `positions`.

The engine computes positions 0 .. P+R-2 of a request (prompt P, R sampled tokens: the
last sampled token is never fed back), exactly the positions whose outputs the trainer
scores. Positions served from the prefix cache are not recomputed; their routes are
those of the request that computed that prefix (a causal model routes position p from
tokens 0..p only, and parity makes both computations the same bits), so `assemble`
copies them from a request in the same capture with the same token prefix. With none
such it raises instead of guessing.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import numpy as np
import torch

from titan_rl.vllm.model import TitanForCausalLM
from titan_rl.vllm.sampling import external_request_id, model_runner


@dataclass
class RouteRecord:
    """Captured routes per request (vLLM's external id): position -> [layers, k] ids."""

    by_request: dict[str, dict[int, torch.Tensor]] = field(default_factory=dict)
    dtype: torch.dtype = torch.uint8
    num_layers: int = 0
    k: int = 0

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * self.k * torch.empty(0, dtype=self.dtype).element_size()

    def assemble(self, outputs) -> dict[str, torch.Tensor]:
        """RequestOutputs -> {request_id: routes [P+R-1, layers, k]} for every output, prefix
        -cache positions filled from a request with the same token prefix."""
        seqs = {o.request_id: list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outputs}
        out = {}
        for rid, seq in seqs.items():
            n = len(seq) - 1
            rec = self.by_request.get(rid, {})
            missing = [p for p in range(n) if p not in rec]
            if missing:
                need = max(missing) + 1
                donors = [d for d, s in seqs.items() if d != rid and s[:need] == seq[:need]]
                for p in missing:
                    donor = next((d for d in donors if p in self.by_request.get(d, {})), None)
                    if donor is None:
                        raise RuntimeError(f"request {rid!r}: no route recorded for position {p} (prefix-cache hit "
                                           "with no request in this capture that computed that prefix)")
                    rec[p] = self.by_request[donor][p]
            out[rid] = torch.stack([rec[p] for p in range(n)]) if n else torch.zeros(
                0, self.num_layers, self.k, dtype=self.dtype)
        return out


class _Capture:
    def __init__(self, runner):
        self.runner = runner
        self.record = RouteRecord()

    def __call__(self, positions: torch.Tensor, routes: list[torch.Tensor]) -> None:
        ib = self.runner.input_batch
        n = ib.num_reqs
        req_ids = list(ib.req_ids[:n])
        qsl = np.asarray(self.runner.query_start_loc.np[: n + 1]).tolist()
        stacked = torch.stack(routes, 1)  # [T, layers, k]
        rec = self.record
        rec.dtype, rec.num_layers, rec.k = stacked.dtype, stacked.shape[1], stacked.shape[2]
        pos = positions.tolist()
        for i, rid in enumerate(req_ids):
            d = rec.by_request.setdefault(external_request_id(rid), {})
            for row in range(qsl[i], qsl[i + 1]):
                d[pos[row]] = stacked[row]


def _stock_hooks(model, k: int, cap: "_Capture"):
    """vLLM's built-in MoE (stock engine, for the comparison only): hook each layer's
    router gate, and take the top-k of its logits the way vLLM's CPU router does
    (torch.topk of the gate logits), so the stock engine's choices are observed, not
    assumed. Returns the hook handles."""
    gates = [(n, m) for n, m in model.named_modules() if n.endswith(".mlp.gate")]
    if not gates:
        raise RuntimeError(f"{type(model).__name__} has no '*.mlp.gate' modules: not an MoE model")
    step: dict = {"logits": {}, "positions": None}

    def on_gate(name):
        def hook(_mod, _inp, out):
            logits = out[0] if isinstance(out, tuple) else out
            step["logits"][name] = logits.detach()
        return hook

    def pre(_mod, args, kwargs):
        positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
        # a vision-language model's M-RoPE positions are [3, T]: for text all three are equal
        step["positions"] = positions[0] if positions is not None and positions.ndim == 2 else positions
        step["logits"] = {}

    def post(_mod, _args, _kwargs, _out):
        routes = []
        for name, _ in gates:
            ids = torch.topk(step["logits"][name], k=k, dim=-1, sorted=False).indices
            routes.append(ids.sort(-1).values.to(torch.uint8 if ids.max() < 256 else torch.int16))
        cap(step["positions"], routes)

    handles = [m.register_forward_hook(on_gate(n)) for n, m in gates]
    handles.append(model.register_forward_pre_hook(pre, with_kwargs=True))
    handles.append(model.register_forward_hook(post, with_kwargs=True))
    return handles


@contextlib.contextmanager
def capture_sink(llm, kind: str, what: str):
    """with capture_sink(llm, "routes", "capture_routes") as rec: our wrapper hands each
    forward's per-layer choices of `kind` (its model's choice points) to the capture while
    active (one capture per kind)."""
    runner = model_runner(llm)
    sinks = runner.model.choice_sinks
    if kind in sinks:
        raise RuntimeError(f"{what} is already active")
    cap = _Capture(runner)
    sinks[kind] = cap
    try:
        yield cap.record
    finally:
        del sinks[kind]


@contextlib.contextmanager
def capture_routes(llm):
    """with capture_routes(llm) as rec: outs = llm.generate(...); rec.assemble(outs).
    Our wrapper reports its routes (its choice_sinks); vLLM's built-in MoE models are observed
    through hooks on their router gates (_stock_hooks)."""
    runner = model_runner(llm)
    if isinstance(runner.model, TitanForCausalLM):
        with capture_sink(llm, "routes", "capture_routes") as record:
            yield record
        return
    cap = _Capture(runner)
    # the text model's config (a vision-language folder's sits under text_config)
    handles = _stock_hooks(runner.model, int(runner.model_config.hf_text_config.num_experts_per_tok), cap)
    try:
        yield cap.record
    finally:
        for h in handles:
            h.remove()
