"""The vLLM side of a registered architecture: a thin wrapper, not a second model.

It builds the ONE model definition through the registry (kernels="exact") and adopts
its submodules, so parameter names are the model's own (HF names). vLLM hands it one
flat stream of scheduled tokens; the wrapper supplies the only engine-specific piece,
attention over vLLM's paged cache (titan_rl.vllm.attention), as the callable the
model's layers call. At tensor_parallel_size > 1 (make_llm: vLLM's external launcher
under torchrun) it shards the model with the trainer's TP plan and leaf tree, so every
TP degree gives the same bits.

With a quantization recipe (config.json "titan_quantization"), each covered Linear holds
its weight as payload + scales (kernels.quant.QuantizedWeight) and no dense copy: a dense
tensor given to load_weights (the checkpoint folder) is quantized on load, a
QuantizedWeight (a weight sync, titan_rl.quant_weights) is taken as shipped.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.attention import Attention

from titan_rl import layout
from titan_rl.kernels import lm_head_logits
from titan_rl.kernels.selfcheck import check_platform
from titan_rl.models.common import choice_points
from titan_rl.models.layers import LM_HEAD_OPERAND, Linear, held_operands, lm_head_operand, prepare_for_engine
from titan_rl.models.options import ModelOptions
from titan_rl.parallel.plan import apply_tp_local, local_shard
from titan_rl.registry import architecture_for_vllm
from titan_rl.vllm.attention import TitanAttentionBackend


def attention_backend(vllm_config: VllmConfig) -> type:
    """Our attention backend for the engine's device: over vLLM's CPU backend on CPU, over
    its Triton backend on CUDA (titan_rl/vllm/attention_cuda.py)."""
    if vllm_config.device_config.device_type == "cuda":
        from titan_rl.vllm.attention_cuda import TitanTritonAttentionBackend

        return TitanTritonAttentionBackend
    return TitanAttentionBackend


def _attention(cfg, vllm_config: VllmConfig, prefix: str, layer: int) -> Attention:
    """vLLM's attention layer for model layer `layer` (this TP rank's heads), with our
    backend over the paged cache."""
    d = cfg.head_dim
    tp = vllm_config.parallel_config.tensor_parallel_size
    return Attention(cfg.num_attention_heads // tp, d, 1.0 / math.sqrt(d), num_kv_heads=cfg.num_key_value_heads // tp,
                     cache_config=vllm_config.cache_config, prefix=f"{prefix}model.layers.{layer}.self_attn.attn",
                     attn_backend=attention_backend(vllm_config))


def _shard_for_tp(net: nn.Module, spec, vllm_config: VllmConfig) -> tuple[int, int, dict[str, int]]:
    """tensor_parallel_size > 1: shard the model with the trainer's TP plan and leaf tree
    (titan_rl.parallel.plan.apply_tp_local) on vLLM's TP group. Returns (rank, size,
    {parameter name: split dim}); (0, 1, {}) at TP = 1."""
    tp = vllm_config.parallel_config.tensor_parallel_size
    if tp == 1:
        return 0, 1, {}
    key = "tensor_parallel_size"
    layout.check_tp_leaves(key, tp, net.ops.tp_leaves, leaves_key="the model's tp_leaves",
                           where="config.json \"titan_tp_leaves\", model.tp_leaves in the config",
                           why="so that the engine's log-probs do not depend on the TP degree")
    layout.check_recipe(key, tp, net.ops.quant_recipe, recipe_key="the model's quantization recipe")
    layout.check_plan(key, tp, spec)
    from vllm.distributed import get_tp_group

    group = get_tp_group()
    return group.rank_in_group, tp, apply_tp_local(net, spec.tp_plan, group.device_group)


class TitanForCausalLM(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        cfg = self._adopt(vllm_config)
        self.attn = nn.ModuleDict({str(i): _attention(cfg, vllm_config, prefix, i)
                                   for i in range(cfg.num_hidden_layers)})
        # choice kind -> called with (positions, the forward's per-layer choices of that kind,
        # models/common/choice_points.py) after each forward while its capture is active
        # (titan_rl.vllm.routes.capture_sink: router and index replay)
        self.choice_sinks: dict = {}

    def _adopt(self, vllm_config: VllmConfig):
        """Build the ONE model definition from the engine's config.json and adopt its
        submodules (names stay model.* / lm_head.*). Returns the architecture config."""
        hf = vllm_config.model_config.hf_config
        spec = architecture_for_vllm(hf.architectures[0])
        cfg = spec.config_from_hf(hf.to_dict())
        # Refuse exact mode on a platform whose GEMMs break the invariance we rely on.
        check_platform(vllm_config.model_config.dtype, head_dim=getattr(cfg, "head_dim", 128),
                       device=vllm_config.device_config.device_type)
        net = spec.build(cfg, ModelOptions.from_hf(hf.to_dict(), kernels="exact"))
        self._tp_rank, self._tp, self._tp_split = _shard_for_tp(net, spec, vllm_config)
        self.cfg, self.options = cfg, net.options
        # a folder's tensor name -> ours (None: not served), the trainer's mapping
        # (ArchitectureSpec.checkpoint_key): a vision-language folder's text model
        self._checkpoint_key = spec.checkpoint_key
        self.model, self.lm_head = net.model, net.lm_head
        object.__setattr__(self, "_net", net)  # not a submodule: no duplicate parameter names
        self._lm_head_prepared: torch.Tensor | None = None
        self._dtype = vllm_config.model_config.dtype
        # parameter name -> the quantized Linear that holds it (as payload + scales once loaded)
        self._quantized = {f"{n}.weight": m for n, m in self.named_modules()
                           if isinstance(m, Linear) and m.recipe is not None}
        return cfg

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        T = positions.shape[0]

        def attn(i, q, k, v):
            return self.attn[str(i)](q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)).view(q.shape)

        hidden = self._net.hidden_states(input_ids, positions, attn, inputs_embeds)
        self._report_choices(positions)
        return hidden

    def _report_choices(self, positions: torch.Tensor) -> None:
        for kind, sink in self.choice_sinks.items():
            sink(positions, choice_points.used(self._net, kind))

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self._lm_head_prepared is None:  # no load_weights yet (a dummy load)
            self._lm_head_prepared = lm_head_operand(self._net)
        return lm_head_logits(hidden_states, self._lm_head_prepared)

    def weight_digests(self) -> dict[str, str]:
        """{name: sha256} of everything this engine's forward multiplies by, read from what it
        holds: each parameter, each held quantized weight dequantized from its own payload and
        scales (titan_rl.quant_weights.engine_weights), and each operand prepared once per load
        (models.layers.held_operands: fused q/k/v and gate/up, each Linear's GEMM weight, GLM-5's
        absorbed per-head weights; the LM head's as LM_HEAD_OPERAND), hashed as the bytes its
        kernel reads (titan_rl.weight_digests.operand_digests). The engine's side of the post-sync
        check; the trainer's is titan_rl.quant_weights.trainer_digests."""
        from titan_rl.weight_digests import operand_digests, tensor_digest
        from titan_rl.quant_weights import engine_weights

        out = {n: tensor_digest(w) for n, w in engine_weights(self).items()}
        for name, op in [*held_operands(self._net), (LM_HEAD_OPERAND, self._lm_head_prepared)]:
            out.update(operand_digests(name, op))
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Strict: unknown names and wrong shapes raise, naming the key. Weights are the
        full (unsharded) tensors; under TP each rank keeps its slice. Names are read as the
        trainer reads them (the architecture's checkpoint_key): a vision-language folder's
        `model.language_model.*` is the text model, its vision tower and MTP head are skipped
        (the trainer's load says so in one line)."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name = hf_name if self._checkpoint_key is None else self._checkpoint_key(hf_name)
            if name is None:
                continue
            if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
                name = "model.embed_tokens.weight"
            if name in self._quantized:
                self._quantized[name].load_quantized(name, tensor, self._dtype)
                loaded.add(name)
                continue
            if name not in params:
                raise ValueError(f"checkpoint key {name!r} does not exist in {type(self).__name__}")
            p = params[name]
            want = list(p.shape)
            dim = self._tp_split.get(name)
            if dim is not None:
                want[dim] *= self._tp
            if want != list(tensor.shape):
                raise ValueError(f"checkpoint key {name!r}: expected shape {tuple(want)}, found {tuple(tensor.shape)}")
            if dim is not None:
                tensor = local_shard(tensor, dim, self._tp_rank, self._tp)
            with torch.no_grad():
                p.copy_(tensor.to(p.dtype))
            loaded.add(name)
        if self.cfg.tie_word_embeddings:
            loaded.add("lm_head.weight")
        self._lm_head_prepared = None  # the old weights' copies go before the new ones are made
        self._lm_head_prepared = prepare_for_engine(self._net)
        return loaded
