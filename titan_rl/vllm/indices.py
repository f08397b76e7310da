"""Index replay, engine side: record the key positions each computed token's indexer selected
in every indexer layer (DeepSeek sparse attention, GLM-5).

The mechanics are router replay's (titan_rl.vllm.routes): our wrapper hands every forward's
selections (per indexer layer, [T, topk] positions, ascending, -1 padded; int16 while
positions fit) to the capture, which splits the flat stream by request. Positions served from
the prefix cache are not recomputed; their selections are those of the request of the same
capture that computed that prefix (a causal model selects for position p from tokens 0..p
only, and both computations give the same bits), and `assemble` refuses when there is none.
The record per token is layers x topk x 2 bytes (int16): `bytes_per_token`.
"""

from __future__ import annotations

from titan_rl.vllm.dsa import TitanDsaForCausalLM
from titan_rl.vllm.routes import capture_sink
from titan_rl.vllm.sampling import model_runner


def capture_indices(llm):
    """with capture_indices(llm) as rec: outs = llm.generate(...); rec.assemble(outs) ->
    {request_id: positions [P + R - 1, indexer layers, topk]} (a RouteRecord of positions)."""
    model = model_runner(llm).model
    if not isinstance(model, TitanDsaForCausalLM):
        raise TypeError(f"capture_indices needs titan_rl's sparse-attention wrapper; the engine runs "
                        f"{type(model).__name__}")
    return capture_sink(llm, "indices", "capture_indices")
