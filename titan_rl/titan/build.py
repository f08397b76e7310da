"""TorchTitan's Trainer.Config for an RL run, and the two components its Trainer insists
on building that an RL run does not use (a tokenizer and a data loader: the prompts,
their tokenizer and the supervised pairs come from the task)."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, replace

import torch

# Before torchtitan: importing titan_rl.titan installs the CPU shims its import needs.
from titan_rl.titan import cpu_compat

from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.components.tokenizer import BaseTokenizer
import torchtitan.trainer
from torchtitan.trainer import Trainer

from titan_rl.checkpoint import folder_names
from titan_rl.errors import CheckpointError
from titan_rl.registry import get_architecture


class _TimeWithoutTheLoneSleep:
    """`time` for torchtitan.trainer: Trainer.train ends with rank 0 sleeping 2 s "for other
    ranks to complete"; a run of one process has no other rank, and a short run (the suite
    launches about a hundred) would pay it every time. Everything else is `time` itself."""

    def __getattr__(self, name):
        return getattr(time, name)

    @staticmethod
    def sleep(seconds: float) -> None:
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            time.sleep(seconds)


torchtitan.trainer.time = _TimeWithoutTheLoneSleep()


class NullTokenizer(BaseTokenizer):
    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        vocab_size: int = 0

    def __init__(self, config, tokenizer_path=None, **kw):
        super().__init__()
        self.n = config.vocab_size

    # TorchTitan's Trainer wants a tokenizer object; titan_rl's reads text only through the
    # task's tokenizer, so these are never called (an error, not an empty result, if they are)
    def encode(self, text, **kw):
        raise RuntimeError("TorchTitan's tokenizer is not titan_rl's: prompts come from the task's tokenizer")

    def decode(self, ids, **kw):
        raise RuntimeError("TorchTitan's tokenizer is not titan_rl's: completions are decoded by the task's tokenizer")

    def get_vocab_size(self):
        return self.n


class StepLoader(BaseDataLoader):
    """Never iterated: a step's prompts are a pure function of (seed, step)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        pass

    def __init__(self, config, **kw):
        pass

    def __iter__(self):
        while True:
            yield {}, torch.zeros(1, 1, dtype=torch.long)

    def state_dict(self):
        return {}

    def load_state_dict(self, sd):
        pass


def build_titan_config(cfg, run_dir: str) -> Trainer.Config:
    """titan_rl's Config -> TorchTitan's Trainer.Config: our ModelSpec, TorchTitan's own
    sections as read from TOML, and the keys titan_rl derives."""
    from titan_rl.titan.sections import trainer_sections
    from titan_rl.titan.spec import model_spec

    fields, initial_load = {}, {}
    if cfg.model.checkpoint:  # a local HF folder: its config.json defines the model, TorchTitan loads it
        cfg_path = os.path.join(cfg.model.checkpoint, "config.json")
        if not os.path.isfile(cfg_path):
            raise CheckpointError(f"model.checkpoint = {cfg.model.checkpoint!r}: no config.json in that folder")
        with open(cfg_path) as f:
            fields["model_config"] = get_architecture(cfg.model.name).config_from_hf(json.load(f))
        fields["checkpoint_names"] = folder_names(cfg.model.checkpoint, cfg.model.name)
        # TorchTitan takes an absolute path only; a relative model.checkpoint is the launch directory's
        initial_load = dict(enable=True, initial_load_path=os.path.abspath(cfg.model.checkpoint), initial_load_in_hf=True,
                            initial_load_model_only=True)
    if cfg.model.freeze_indexer:  # GLM-5's RL setting: the indexers take no gradient
        fields["frozen"] = (".self_attn.indexer.",)
    # how the model computes; its engine gets the same options through config.json
    spec = model_spec(cfg.model.name, cfg.model.flavor, cfg.model_options(), init_seed=cfg.model.seed,
                      init_std=cfg.model.init_std, **fields)
    sections = trainer_sections(cfg)
    # the keys titan_rl derives (refused in TOML): one sequence per row, as long as the engine's
    sections["training"].local_batch_size = 1
    sections["training"].seq_len = cfg.rollout.max_model_len
    sections["training"].mixed_precision_param = cfg.model.dtype
    config = Trainer.Config(
        model_spec=spec,
        hf_assets_path=run_dir,
        dump_folder=run_dir,
        tokenizer=NullTokenizer.Config(vocab_size=spec.model.arch_config().vocab_size),
        dataloader=StepLoader.Config(),
        loss=CrossEntropyLoss.Config(),
        checkpoint=replace(cfg.checkpoint, **initial_load),
        **sections,
    )
    cpu_compat.trainer_overrides(config)
    return config
