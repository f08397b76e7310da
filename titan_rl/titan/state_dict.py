"""TorchTitan state-dict adapter: our parameter names <-> HF safetensors names.

The model definitions use Hugging Face's names (`model.layers.0.self_attn.q_proj.weight`,
`lm_head.weight`, ...), so the mapping is the identity, except:
  * tied embeddings (`tie_word_embeddings`): HF checkpoints of tied models (Qwen3-0.6B,
    1.7B, 4B) have no `lm_head.weight`. `to_hf` leaves it out; `from_hf` fills it from
    `model.embed_tokens.weight` when it is missing.
  * buffers some HF checkpoints carry and no model has (`rotary_emb.inv_freq`) are dropped.
  * a vision-language folder (Qwen3.5's) keeps the text model under other names
    (`model.language_model.layers...`): `checkpoint_names` of the model config maps them.
TorchTitan uses it to load an HF folder into the trainer (`checkpoint.initial_load_in_hf`)
and to save HF-format checkpoints (`checkpoint.last_save_in_hf`) that vLLM loads directly.
"""

from __future__ import annotations

import re
from typing import Any

from torchtitan.protocols.state_dict_adapter import StateDictAdapter

EMBED = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"
_DROP = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


def _tied(model_config) -> bool:
    cfg = model_config.arch_config() if hasattr(model_config, "arch_config") else model_config
    return bool(getattr(cfg, "tie_word_embeddings", False))


class TitanStateDictAdapter(StateDictAdapter):
    def __init__(self, model_config, hf_assets_path: str | None = None):
        super().__init__(model_config, hf_assets_path)
        self.tied = _tied(model_config)
        self.names = dict(getattr(model_config, "checkpoint_names", None) or {})
        self.ours = {v: k for k, v in self.names.items()}

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        out = {}
        for k, v in state_dict.items():
            if _DROP.search(k):
                continue
            if self.tied and k == LM_HEAD:
                if self.fqn_to_index_mapping:
                    self.fqn_to_index_mapping.pop(LM_HEAD, None)
                continue
            out[self.names.get(k, k)] = v
        return out

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        out = {self.ours.get(k, k): v for k, v in hf_state_dict.items() if not _DROP.search(k)}
        if self.tied and LM_HEAD not in out:
            if EMBED not in out:
                raise KeyError(f"tied embeddings: neither {LM_HEAD!r} nor {EMBED!r} in the checkpoint")
            out[LM_HEAD] = out[EMBED]
        return out
