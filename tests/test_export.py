"""`python -m titan_rl.export`: a run's trained weights as an HF folder that transformers and
stock vLLM load, with the start folder's tokenizer files, and whose tensors are the checkpoint's."""

import json
import sys

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from titan_rl import parity  # noqa: E402
from titan_rl.checkpoint import save_hf_folder  # noqa: E402
from titan_rl.export import main as export_main  # noqa: E402
from titan_rl.models.qwen3 import build  # noqa: E402

import _zygote  # noqa: E402

RUN = ["--training.steps=4", "--algorithm.sft_steps=2", "--algorithm.prompts_per_step=4", "--algorithm.group_size=4",
       "--algorithm.sft_batch=16", "--checkpoint.interval=2", "--lr_scheduler.warmup_steps=1"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    start = root / "start"
    save_hf_folder(build("debug").init_weights(7, 0.05), start, architecture="Qwen3ForCausalLM", dtype=torch.float32)
    (start / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    r = _zygote.run([sys.executable, "-m", "titan_rl.train", "--config", "train_configs/rl_debug.toml", "--run-dir",
                     str(root / "run"), f"--model.checkpoint={start}", *RUN],
                    capture_output=True, text=True, timeout=600, cwd=parity.__file__.rsplit("/titan_rl/", 1)[0])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return root


def test_the_export_holds_the_checkpoints_tensors_and_the_tokenizer(run, capsys):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from safetensors.torch import load_file

    assert export_main([str(run / "run"), str(run / "out")]) == 0
    assert capsys.readouterr().err == ""
    dcp_to_torch_save(str(run / "run" / "checkpoint" / "step-4"), str(run / "step4.pt"))  # torch's own reader
    ref = {k: v for k, v in torch.load(run / "step4.pt", weights_only=False).items() if k.startswith(("model.", "lm_head"))}
    got = load_file(str(run / "out" / "model.safetensors"))
    assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)
    start = load_file(str(run / "start" / "model.safetensors"))
    assert not torch.equal(got["lm_head.weight"], start["lm_head.weight"])  # it trained
    assert json.loads((run / "out" / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    assert (run / "out" / "tokenizer_config.json").read_text() == (run / "start" / "tokenizer_config.json").read_text()


def test_transformers_and_both_engines_load_the_export(run, monkeypatch):
    from transformers import AutoModelForCausalLM

    from titan_rl.checkpoint import load_hf_folder

    out = run / "exported"
    assert export_main([str(run / "run"), str(out), "--step", "2"]) == 0
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ours = load_hf_folder(out, kernels="exact", dtype=torch.float32)
    tokens = torch.randint(0, 19, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = ours(tokens), hf(input_ids=tokens).logits
    assert (a - b).abs().max().item() <= 5e-5  # tests/test_hf_reference.py's bound and why
    monkeypatch.chdir(parity.__file__.rsplit("/titan_rl/", 1)[0])
    res_file = run / "parity.json"
    assert parity.main(["--config", "train_configs/debug.toml", "--kernels", "both", "--num-prompts", "4",
                        "--json", str(res_file), f"--model.checkpoint={out}", "--model.dtype=float32"]) == 0
    res = {r["engine"]: r for r in json.loads(res_file.read_text())["results"]}
    assert res["exact"]["max_abs_dlogp"] == 0 and res["stock"]["tokens"] == res["exact"]["tokens"] > 0


def test_export_refusals_are_one_line(run, tmp_path, capsys):
    assert export_main([str(tmp_path), str(tmp_path / "o")]) == 2
    assert export_main([str(run / "run"), str(tmp_path / "o"), "--step", "3"]) == 2
    assert export_main([str(run / "run"), str(run / "start")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and "no config.toml" in err[0] and "complete checkpoints: [2, 4]" in err[1]
    assert "is not empty" in err[2]
