"""Shared helpers of the HF-folder tests: an edited copy of a folder, and a refusal that both
entry points (train and parity) must give in one line before any work starts."""

import json
import os
import re

from safetensors.torch import load_file, save_file

from titan_rl.parity import main as parity_main
from titan_rl.train import main as train_main


def edit_config_in_place(folder, **keys):
    """Set `keys` in the folder's config.json (an engine's folder, edited before it is built)."""
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        d = json.load(f)
    d.update(keys)
    with open(path, "w") as f:
        json.dump(d, f)


def edited_copy(src, dst, edit_config=None, edit_tensors=None):
    """Copy of the folder `src` at `dst`; edit_config(cfg) edits config.json (its text_config
    where the folder has one), edit_tensors(dict) the safetensors."""
    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    if edit_config:
        edit_config(cfg.get("text_config", cfg))
    (dst / "config.json").write_text(json.dumps(cfg))
    t = load_file(str(src / "model.safetensors"))
    if edit_tensors:
        edit_tensors(t)
    save_file(t, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def both_refuse(train_config, parity_config, args, pattern, capsys, tmp_path):
    """Train and parity both exit 2 with one stderr line matching `pattern`, and the run dir
    holds no config (nothing started)."""
    for run in (lambda: train_main(["--config", train_config, "--run-dir", str(tmp_path / "run"), *args]),
                lambda: parity_main(["--config", parity_config, *args])):
        capsys.readouterr()
        assert run() == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and re.search(pattern, err), err
    assert not (tmp_path / "run" / "config.toml").exists()
