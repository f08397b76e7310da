"""The vLLM side of DeepSeek sparse attention (GLM-5, `models/glm_moe_dsa`).

Like `titan_rl.vllm.model.TitanForCausalLM` (which it subclasses for the LM head,
`embed_input_ids`, the strict `load_weights` and the weight digests) the wrapper builds the
ONE model definition and adopts its submodules. What it adds is the model's `LatentCache`
over vLLM's paged KV cache:

* one vLLM `Attention` layer per decoder layer (prefix `model.layers.{i}.self_attn.attn`), one
  kv head of `cfg.cache_head_size`, so vLLM allocates, schedules, prefix-caches and frees a
  [pages, 1, page, 2 * head_size] cache per layer. Its forward is never called: the layer
  is there for the cache and for the CPU backend's metadata (block table, slot mapping,
  query_start_loc). A token's cache row is its [c_kv | k_rope | indexer key] (the model
  computes it), written at the token's slot in the cache's dtype (the model's: the values
  the trainer reads from its own activations);
* `VllmLatents.store` writes this step's rows and returns the view the model's kernels read:
  the layer's cache as [pages, page, 2 * head_size], vLLM's block table, and each row's
  request and absolute position. The indexer's keys therefore live in vLLM's cache next to
  the latent KV: chunked prefill, decode and prefix-cache hits read them like the KV.

While titan_rl.vllm.indices.capture_indices / titan_rl.vllm.routes.capture_routes are
active, each forward's selected positions per indexer layer and MoE routes per MoE layer (the
model's choice points) go to them through the wrapper's `choice_sinks`, as for every wrapper.
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.attention.attention import get_attention_context
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from titan_rl.kernels import sparse_mla_attention
from titan_rl.models.glm_moe_dsa.model import DenseLatents, KeyView
from titan_rl.vllm.model import TitanForCausalLM


class LatentCacheImpl(CPUAttentionBackendImpl):
    """Never called: the model writes and reads the latent cache itself (VllmLatents). Named
    so the execution contract reads the engine's attention kernel from the layers."""

    kernel = staticmethod(sparse_mla_attention)

    def do_kv_cache_update(self, *args, **kwargs):
        raise RuntimeError("the latent cache is written by the GLM-5 wrapper (titan_rl.vllm.dsa), not by vLLM")

    def forward(self, *args, **kwargs):
        raise RuntimeError("GLM-5's attention runs in the model (titan_rl.vllm.dsa), not in vLLM's attention layer")


class LatentCacheBackend(CPUAttentionBackend):
    """vLLM's CPU backend for its cache allocation ([pages, Hkv, page, 2 * head_size]) and its
    metadata builder."""

    @staticmethod
    def get_impl_cls():
        return LatentCacheImpl


class VllmLatents:
    """The model's LatentCache over vLLM's paged cache, for one forward step."""

    def __init__(self, prefixes: dict[int, str], positions: torch.Tensor):
        self.prefixes, self.positions = prefixes, positions
        self._rows = None  # (row_seq, row_pos): the same for every layer of the step

    def store(self, layer_idx: int, rows: torch.Tensor) -> KeyView:
        md, _, kv_cache, slots = get_attention_context(self.prefixes[layer_idx])
        n_pages, hkv, page, width = kv_cache.shape
        cache = kv_cache.view(n_pages, page, width)  # one kv head: a page is `page` rows of `width`
        n = md.num_actual_tokens
        s = slots[:n].long()
        keep = s >= 0  # -1 marks padding tokens
        with torch.no_grad():
            cache.view(n_pages * page, width)[s[keep], : rows.shape[1]] = rows[:n][keep].to(cache.dtype)
        if self._rows is None:
            T = self.positions.shape[0]
            qsl = md.query_start_loc.long()
            counts = qsl[1:] - qsl[:-1]
            row_seq = torch.zeros(T, dtype=torch.long, device=rows.device)
            row_pos = torch.zeros(T, dtype=torch.long, device=rows.device)
            # rows past num_actual_tokens (padding) read position 0 of request 0: computed, never used
            row_seq[:n] = torch.repeat_interleave(torch.arange(counts.shape[0], device=rows.device), counts)[:n]
            row_pos[:n] = self.positions[:n].long()
            self._rows = (row_seq, row_pos)
        return KeyView(cache, md.block_table, *self._rows)


class TitanDsaForCausalLM(TitanForCausalLM):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        nn.Module.__init__(self)
        cfg = self._adopt(vllm_config)
        self.prefixes = {i: f"{prefix}model.layers.{i}.self_attn.attn" for i in range(cfg.num_hidden_layers)}
        d = cfg.cache_head_size
        self.attn = nn.ModuleDict({
            str(i): Attention(1, d, 1.0, num_kv_heads=1, cache_config=vllm_config.cache_config, prefix=name,
                              attn_backend=LatentCacheBackend)
            for i, name in self.prefixes.items()})
        self.choice_sinks: dict = {}  # as TitanForCausalLM's: routes and indices

    def _latents(self, positions: torch.Tensor):
        metadata = get_forward_context().attn_metadata
        if not isinstance(metadata, dict) or any(metadata.get(p) is None for p in self.prefixes.values()):
            # profiling / dummy run: no cache; one sequence over the stream
            return DenseLatents(1, positions.shape[0], positions.device)
        return VllmLatents(self.prefixes, positions)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        hidden = self._net.hidden_states(input_ids, positions, self._latents(positions), inputs_embeds)
        self._report_choices(positions)
        return hidden
