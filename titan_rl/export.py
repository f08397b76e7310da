"""A run's trained weights as a Hugging Face folder: `python -m titan_rl.export RUN_DIR OUT_DIR`.

    python -m titan_rl.export runs/rl_smollm2 out/smollm2-rl [--step N] [--dtype float32|bfloat16] [--force]

Reads the run's resolved config (RUN_DIR/config.toml), builds its model, loads the model's
tensors from the DCP checkpoint of step N (default: the newest complete one) and writes
config.json + model.safetensors under the stock architecture's name (`hf_architecture`: what
transformers and vLLM's own classes load), plus the tokenizer files of the run's
`model.checkpoint` folder (tokenizer, its chat template, generation config) when it has them.
The default dtype is float32, the trainer's masters: titan_rl's exact engine and trainer then
compute the run's own logits from the folder, bit for bit (tests/test_export.py).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
import warnings
from pathlib import Path

import torch

from titan_rl.errors import UserError

# what a tokenizer folder may hold besides the weights and config.json (transformers' names)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json",
                   "generation_config.json")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def export(run_dir: str | Path, out_dir: str | Path, step: int | None = None, dtype: str = "float32",
           force: bool = False) -> Path:
    """Write step `step` (None: the newest) of the run in `run_dir` as an HF folder `out_dir`."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import load as dcp_load

    from titan_rl import config as config_mod
    from titan_rl.checkpoint import save_hf_folder
    from titan_rl.registry import get_architecture
    from titan_rl.run_dir import latest_checkpoint_step

    run_dir, out_dir = Path(run_dir), Path(out_dir)
    if dtype not in DTYPES:
        raise UserError(f"--dtype = {dtype!r}; allowed: {sorted(DTYPES)}")
    stored = run_dir / "config.toml"
    if not stored.is_file():
        raise UserError(f"{run_dir} is not a titan_rl run dir (no config.toml)")
    cfg = config_mod.load(stored)
    newest = latest_checkpoint_step(cfg, str(run_dir))
    step = newest if step is None else step
    ckpt = run_dir / cfg.checkpoint.folder / f"step-{step}"
    if step <= 0 or not (ckpt / ".metadata").is_file():
        have = sorted(int(p.name[5:]) for p in (run_dir / cfg.checkpoint.folder).glob("step-*")
                      if (p / ".metadata").is_file()) if (run_dir / cfg.checkpoint.folder).is_dir() else []
        raise UserError(f"{run_dir}: no complete checkpoint of step {step}; complete checkpoints: {have or 'none'}")
    if out_dir.exists() and any(out_dir.iterdir()) and not force:
        raise UserError(f"{out_dir} exists and is not empty; pass --force to write into it")

    source = Path(cfg.model.checkpoint) if cfg.model.checkpoint else None
    if source is not None and not source.is_dir():
        raise UserError(f"the run's model.checkpoint {str(source)!r} (its tokenizer files) is not a folder from "
                        f"{os.getcwd()}: run from the directory the run was launched in")
    spec = get_architecture(cfg.model.name)
    model = spec.build(config_mod.model_config(cfg), cfg.model_options())
    saved = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    # a tied LM head is saved once, under the embedding's name
    state = {k: v.detach().clone() for k, v in model.state_dict().items() if k in saved}
    missing = sorted(set(model.state_dict()) - set(state) - {"lm_head.weight"})
    if missing:
        raise UserError(f"{ckpt} lacks the model's tensors {missing[:3]}{' ...' if len(missing) > 3 else ''}")
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp_load(state, storage_reader=FileSystemReader(str(ckpt)))
    model.load_state_dict(state, strict=False)
    save_hf_folder(model, out_dir, architecture=spec.hf_architecture, dtype=DTYPES[dtype], arch=spec.name)
    for name in TOKENIZER_FILES if source else ():
        if (source / name).is_file():
            shutil.copy2(source / name, out_dir / name)
    return out_dir


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m titan_rl.export", description=__doc__.split("\n")[0])
    ap.add_argument("run_dir")
    ap.add_argument("out_dir")
    ap.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the newest)")
    ap.add_argument("--dtype", default="float32", help="float32 (the trainer's masters, default) or bfloat16")
    ap.add_argument("--force", action="store_true", help="write into a non-empty OUT_DIR")
    args = ap.parse_args(argv)
    from titan_rl.errors import report_error

    t = time.perf_counter()
    try:
        out = export(args.run_dir, args.out_dir, args.step, args.dtype, args.force)
    except UserError as e:
        return report_error(e)
    print(f"exported {args.run_dir} -> {out} ({time.perf_counter() - t:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
