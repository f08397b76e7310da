"""RL on a real hybrid: `train_configs/rl_debug_qwen35.toml` started from a Qwen3.5 folder
transformers writes as a vision-language model (Qwen3_5ForConditionalGeneration: the text
model under `model.language_model.`, a vision tower beside it). TorchTitan loads the text
model through the state-dict adapter's names, the engine starts from exactly those
weights, and every RL step samples with max |dlogp| = 0."""

import json
import os
import sys

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402

from titan_rl.hf_reference import vl_model  # noqa: E402
from titan_rl.models.common.next import text_key  # noqa: E402

import _zygote  # noqa: E402

ROOT = os.path.join(os.path.dirname(__file__), "..")


def test_rl_from_a_vision_language_folder_has_zero_mismatch(tmp_path, seed):
    hf = tmp_path / "hf"
    vl_model(seed % 2**31, scale=0.2, max_position_embeddings=128).save_pretrained(hf)
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "titan_rl.train", "--config", "train_configs/rl_debug_qwen35.toml",
           "--run-dir", str(run), "--model.name=auto", f"--model.checkpoint={hf}", "--training.steps=3",
           "--algorithm.sft_steps=0", "--algorithm.prompts_per_step=4", "--algorithm.group_size=4",
           "--lr_scheduler.warmup_steps=1", "--checkpoint.enable=false"]
    r = _zygote.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                    timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "model.visual.* (21)" in r.stderr  # the one-line note for what is not loaded
    src = {text_key(k): v for k, v in load_file(str(hf / "model.safetensors")).items() if text_key(k)}
    eng = load_file(str(run / "engine_weights_rank0" / "model.safetensors"))
    assert src.keys() == eng.keys() and all(torch.equal(src[k], eng[k]) for k in src)
    with open(run / "metrics.jsonl") as f:
        ms = [json.loads(ln) for ln in f if ln.strip()]
    assert [m["phase"] for m in ms] == ["rl"] * 3
    for m in ms:
        assert m["max_abs_dlogp"] == 0.0 and m["bitwise_fraction"] == 1.0 and m["weights_checksum_equal"], m
