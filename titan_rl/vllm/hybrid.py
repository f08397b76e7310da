"""The vLLM side of a hybrid (GDN linear attention + full attention) architecture.

Like `titan_rl.vllm.model.TitanForCausalLM` (which it subclasses for the LM head,
`embed_input_ids` and the strict `load_weights`), the wrapper builds the ONE model
definition and adopts its submodules; it adds the two engine-specific pieces the model
takes as arguments:

* attention: one vLLM `Attention` (our `TitanAttentionBackend`) per full-attention layer,
  prefix `model.layers.{i}.self_attn.attn`;
* recurrent state: one `TitanGDNState` per GDN layer, prefix `model.layers.{i}.linear_attn`:
  a parameter-free vLLM `MambaBase` layer of the LINEAR mamba type (vLLM's simplest
  state backend: its metadata builder gives `state_indices_tensor`, `query_start_loc`,
  `seq_lens`, `num_prefills`, `num_decodes` and runs on CPU). Its per-sequence pages hold
  the conv state [C, K-1] and the recurrent state [Hv, dk, dv], both fp32 (at
  tensor_parallel_size t > 1: the rank's C/t channels and Hv/t heads). `VllmLinearState`
  hands the model, per layer, the cached states of the sequences that have context
  (seq_len > query_len) and zeros for new ones, and writes the final states back into the
  same pages.

Prefix caching: vLLM's mamba cache mode "align" (set by `make_llm` for architectures with
`ArchitectureSpec.recurrent_state`; vLLM also defaults to it) keeps a request's running state in
the page of its last block, checkpoints it at block boundaries (prefill chunks are cut
there) and on a prefix hit copies the boundary state into the new request's page before
the step (copy funcs: whole pages). vLLM unifies the page sizes itself (attention block
size raised until an attention page holds a state page). `llm.reset_prefix_cache()`
(engine.update_weights) drops the cached states with the cached KV.
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.layers.mamba.mamba_utils import get_temporal_copy_spec
from vllm.model_executor.models.interfaces import HasInnerState, IsHybrid
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

from titan_rl.models.common.gdn import FreshState, carried_states, store_states
from titan_rl.registry import architecture_for_vllm
from titan_rl.vllm.model import TitanForCausalLM, _attention

STATE_DTYPES = (torch.float32, torch.float32)  # conv state, recurrent state


def _arch_config(vllm_config: VllmConfig):
    hf = vllm_config.model_config.hf_config
    return architecture_for_vllm(hf.architectures[0]).config_from_hf(hf.to_dict())


class TitanGDNState(nn.Module, MambaBase):
    """vLLM's handle on one GDN layer's per-sequence state (no parameters, no math)."""

    def __init__(self, shapes, prefix: str, vllm_config: VllmConfig):
        nn.Module.__init__(self)
        self.prefix = prefix
        self._shapes = tuple(tuple(s) for s in shapes)
        self.kv_cache = ()
        ctx = vllm_config.compilation_config.static_forward_context
        if prefix in ctx:
            raise ValueError(f"duplicate layer name {prefix!r} in vLLM's forward context")
        ctx[prefix] = self

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        return MambaAttentionBackendEnum.LINEAR

    def get_state_shape(self):
        return self._shapes

    def get_state_dtype(self):
        return STATE_DTYPES


class VllmLinearState:
    """The hybrids' LinearState (models/common/gdn.py) over vLLM's state cache, for one forward step."""

    def __init__(self, layers: dict[int, TitanGDNState], metadata: dict):
        self.layers = layers
        self._rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        cu = None
        for i, layer in layers.items():
            md = metadata[layer.prefix]
            n = md.num_prefills + md.num_decodes
            qsl = md.query_start_loc[: n + 1].to(torch.int64)
            if cu is None:
                cu = qsl
            elif not torch.equal(cu, qsl):
                raise RuntimeError(f"{layer.prefix}: query_start_loc differs between GDN layers")
            context = md.seq_lens[:n].to(torch.int64) - (qsl[1:] - qsl[:-1])
            self._rows[i] = (md.state_indices_tensor[:n].to(torch.int64), context > 0)
        self.cu_seqlens = cu

    def initial(self, layer_idx: int):
        idx, has_context = self._rows[layer_idx]
        return carried_states(*self.layers[layer_idx].kv_cache, idx, has_context)

    def store(self, layer_idx: int, conv_state: torch.Tensor, rec_state) -> None:
        store_states(*self.layers[layer_idx].kv_cache, self._rows[layer_idx][0], conv_state, rec_state)


class TitanHybridForCausalLM(TitanForCausalLM, HasInnerState, IsHybrid):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        nn.Module.__init__(self)
        cfg = self._adopt(vllm_config)
        full = [i for i in range(cfg.num_hidden_layers) if cfg.is_full_attention(i)]
        self.attn = nn.ModuleDict({str(i): _attention(cfg, vllm_config, prefix, i) for i in full})
        shapes = cfg.linear_state_shapes(self._tp)
        self.linear_state = nn.ModuleDict({
            str(i): TitanGDNState(shapes, f"{prefix}model.layers.{i}.linear_attn", vllm_config)
            for i in range(cfg.num_hidden_layers) if i not in full
        })
        self.choice_sinks: dict = {}  # MoE hybrids: as TitanForCausalLM's (router replay)

    # -- vLLM's hybrid-model interface ---------------------------------------------------
    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig):
        return _arch_config(vllm_config).linear_state_shapes(vllm_config.parallel_config.tensor_parallel_size)

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig):
        return STATE_DTYPES

    @classmethod
    def get_mamba_state_copy_func(cls):
        # align-mode prefix caching copies a whole page per state (no speculative decoding)
        return (get_temporal_copy_spec, get_temporal_copy_spec)

    # -- the step ------------------------------------------------------------------------
    def _linear_state(self, T: int):
        metadata = get_forward_context().attn_metadata
        layers = {int(i): m for i, m in self.linear_state.items()}
        if not isinstance(metadata, dict) or any(metadata.get(m.prefix) is None for m in layers.values()):
            # profiling / dummy run: no cache (cu_seqlens on the engine's device, CPU or CUDA)
            return FreshState(torch.tensor([0, T], dtype=torch.int64, device=self.lm_head.weight.device))
        return VllmLinearState(layers, metadata)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        T = positions.shape[0]

        def attn(i, q, k, v):
            return self.attn[str(i)](q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)).view(q.shape)

        hidden = self._net.hidden_states(input_ids, positions, attn, inputs_embeds, state=self._linear_state(T))
        self._report_choices(positions)
        return hidden
