"""Bad input is refused at start, in one line (exit code 2, no traceback), before any heavy
work; non-finite values never reach the weights; a run dir cannot be silently mixed."""

import hashlib
import json
import os
import re
import shutil
import sys
import time

import pytest

import _zygote

ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# SFT only (no vLLM engine): a finished run in seconds
SFT = ["--training.steps=4", "--algorithm.sft_steps=5", "--lr_scheduler.warmup_steps=1",
       "--algorithm.sft_batch=8", "--checkpoint.interval=1"]


def _cli(args, module="titan_rl.train", timeout=300, fork=True):
    t0 = time.perf_counter()
    r = _zygote.run([sys.executable, "-m", module, *args], env=ENV, capture_output=True, text=True,
                    timeout=timeout, cwd=ROOT, fork=fork)
    r.seconds = time.perf_counter() - t0
    return r


def _one_line_error(r, pattern, rc=2):
    assert r.returncode == rc, r.stdout[-2000:] + r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    assert re.search(pattern, lines[0]), lines[0]
    return lines[0]


def _tree_hash(path):
    """Names and bytes of every file under path (None when it does not exist)."""
    if not os.path.exists(path):
        return None
    h = hashlib.sha256()
    for root, dirs, files in sorted(os.walk(path)):
        dirs.sort()
        for f in sorted(files):
            p = os.path.join(root, f)
            h.update(os.path.relpath(p, path).encode() + b"\0")
            with open(p, "rb") as fh:
                h.update(fh.read())
    return h.hexdigest()


def _metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(ln) for ln in f if ln.strip()]


# -- config values -------------------------------------------------------------------------
@pytest.mark.parametrize("override, message", [
    ("--optimizer.lr=-1e-3", r"optimizer.lr = -0.001: must be > 0"),
    ("--optimizer.lr=nan", r"optimizer.lr = nan: must be > 0"),
    ("--optimizer.betas=[0.9, 1.0]", r"optimizer.betas = \[0.9, 1.0\]: must be two values in \[0, 1\)"),
    ("--optimizer.eps=0", r"optimizer.eps = 0.0: must be > 0"),
    ("--training.max_norm=-1", r"training.max_norm = -1.0: must be > 0"),
    ("--checkpoint.keep_latest_k=1", r"checkpoint.keep_latest_k = 1: must be 0 \(keep all\) or >= 2"),
    ("--rollout.max_num_seqs=0", r"rollout.max_num_seqs = 0: must be >= 1"),
    ("--algorithm.rl_lr_scale=0", r"algorithm.rl_lr_scale = 0.0: must be > 0"),
])
def test_out_of_range_config_values_are_refused(tmp_path, override, message):
    from titan_rl import config

    with pytest.raises(config.ConfigError, match=message):
        config.load("train_configs/rl_debug.toml", [override])


def test_negative_lr_is_refused_before_anything_is_written(tmp_path):
    run = tmp_path / "run"
    r = _cli(["--run-dir", str(run), "--optimizer.lr=-1e-3"])
    _one_line_error(r, r"^config error: optimizer.lr = -0.001: must be > 0$")
    assert not run.exists() and r.seconds < 30


# -- command line ----------------------------------------------------------------------------
def test_misspelt_options_are_named():
    r = _cli(["--config", "train_configs/debug.toml", "--num-promts", "3"], module="titan_rl.parity")
    _one_line_error(r, r"unknown option --num-promts; did you mean --num-prompts\?")
    r = _cli(["--run_dir=/tmp/x"])
    _one_line_error(r, r"unknown option --run_dir; did you mean --run-dir\?")
    r = _cli(["--allow-config-change=optimizer.lrr"])
    _one_line_error(r, r"--allow-config-change 'optimizer.lrr' is not a config key; did you mean 'optimizer.lr'\?")


# -- run dir ------------------------------------------------------------------------------------
def test_run_dir_that_is_a_file_or_cannot_be_created(tmp_path):
    f = tmp_path / "afile"
    f.write_text("keep me")
    r = _cli(["--run-dir", str(f)])
    _one_line_error(r, r"--run-dir '.*afile' is a file, not a folder")
    r = _cli(["--run-dir", str(f / "sub")])
    _one_line_error(r, r"--run-dir '.*afile/sub' cannot be created")
    assert f.read_text() == "keep me" and r.seconds < 30


# -- task ---------------------------------------------------------------------------------------
def test_task_that_cannot_be_imported_fails_in_seconds(tmp_path):
    r = _cli(["--run-dir", str(tmp_path / "run"), '--task.name="nope.mod:Task"'])
    _one_line_error(r, r"task.name = 'nope.mod:Task': cannot import module 'nope.mod'")
    assert r.seconds < 30 and not (tmp_path / "run" / "config.toml").exists()
    r = _cli(["--run-dir", str(tmp_path / "run"), '--task.name="digit_revers"'])
    _one_line_error(r, r"task.name = 'digit_revers': .*did you mean 'digit_reverse'\?")


def test_prompt_source_is_called_dry_at_start(tmp_path):
    r = _cli(["--run-dir", str(tmp_path / "run"), '--task.name="tests._bad_tasks:BrokenSampleTask"'])
    _one_line_error(r, r"task 'tests._bad_tasks:BrokenSampleTask': sample\(8, seed=\d+\) for RL step \d+ raised "
                       r"FileNotFoundError: prompts.jsonl")
    assert r.seconds < 30 and not (tmp_path / "run" / "metrics.jsonl").exists()


def test_prompt_longer_than_max_model_len_fails_before_the_sft_phase(tmp_path):
    run = tmp_path / "run"
    r = _cli(["--run-dir", str(run), "--task.kwargs={min_len = 40, max_len = 60}"])
    _one_line_error(r, r"task 'digit_reverse': example \d+ at RL step \d+ .* needs \d+ positions > "
                       r"rollout.max_model_len = 64: raise rollout.max_model_len")
    assert r.seconds < 30 and not (run / "metrics.jsonl").exists()


# -- checkpoint folders ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    import torch

    from titan_rl.checkpoint import save_hf_folder
    from titan_rl.models.qwen3 import build

    path = tmp_path_factory.mktemp("hf") / "good"
    save_hf_folder(build("debug").init_weights(0, 0.02), str(path), dtype=torch.float32)
    return path


def _break(folder, how):
    import torch
    from safetensors.torch import load_file, save_file

    st = folder / "model.safetensors"
    if how == "missing_folder":
        shutil.rmtree(folder)
    elif how == "no_config":
        (folder / "config.json").unlink()
    elif how == "unknown_architecture":
        d = json.loads((folder / "config.json").read_text())
        d["architectures"] = ["FooBarForCausalLM"]
        (folder / "config.json").write_text(json.dumps(d))
    elif how == "truncated":
        data = st.read_bytes()
        st.write_bytes(data[: len(data) // 2])
    else:
        t = load_file(str(st))
        if how == "missing_tensor":
            del t["model.norm.weight"]
        elif how == "extra_tensor":
            t["extra.weight"] = torch.zeros(3)
        elif how == "wrong_shape":
            t["model.norm.weight"] = torch.ones(255)
        save_file(t, str(st))


CHECKPOINT_CASES = {
    "missing_folder": r"checkpoint folder .*/case does not exist",
    "no_config": r"case/config.json is missing",
    "unknown_architecture": r"case/config.json: architectures = \['FooBarForCausalLM'\] is not 'qwen3'",
    "missing_tensor": r"missing key model.norm.weight: expected shape \[256\]",
    "extra_tensor": r"unexpected key extra.weight: found shape \[3\] in model.safetensors",
    "wrong_shape": r"wrong shape for model.norm.weight: expected \[256\], found \[255\] in model.safetensors",
    "truncated": r"case/model.safetensors is not a readable safetensors file",
}


@pytest.mark.parametrize("how", list(CHECKPOINT_CASES))
def test_bad_checkpoint_folder_is_one_line_for_train_and_parity(hf_folder, tmp_path, how, capsys):
    from titan_rl.parity import main as parity_main
    from titan_rl.train import main as train_main

    case = tmp_path / "case"
    shutil.copytree(hf_folder, case)
    _break(case, how)
    before = _tree_hash(case)
    run = tmp_path / "run"
    assert train_main(["--run-dir", str(run), f"--model.checkpoint={case}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and re.search(CHECKPOINT_CASES[how], err), err
    assert parity_main(["--config", "train_configs/debug.toml", f"--model.checkpoint={case}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and re.search(CHECKPOINT_CASES[how], err), err
    assert _tree_hash(case) == before and not (run / "config.toml").exists()


def test_bad_checkpoint_folder_from_the_command_line(hf_folder, tmp_path):
    case = tmp_path / "case"
    shutil.copytree(hf_folder, case)
    _break(case, "truncated")
    for module in ("titan_rl.train", "titan_rl.parity"):
        args = ["--config", "train_configs/debug.toml"] if module == "titan_rl.parity" else []
        r = _cli(args + ["--run-dir", str(tmp_path / "run")] * (module == "titan_rl.train")
                 + [f"--model.checkpoint={case}"], module=module)
        _one_line_error(r, CHECKPOINT_CASES["truncated"])


# -- the run dir remembers its config -------------------------------------------------------------
@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    run = tmp_path_factory.mktemp("finished") / "run"
    r = _cli(["--run-dir", str(run), *SFT], fork=False)  # a fresh process: its console is checked
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return run, r


def test_clean_console_and_summary_line(finished):
    run, r = finished
    assert r.stderr.strip() == "", r.stderr  # no third-party warnings
    last = r.stdout.strip().splitlines()[-1]
    assert re.match(r"done: 4 steps \(4 sft \+ 0 rl\) in \dm\d\ds; peak RSS \d+\.\d GiB; metrics .*metrics.jsonl, "
                    r"checkpoints .*checkpoint$", last), last
    assert all(ln.startswith("step ") for ln in r.stdout.strip().splitlines()[:-1]), r.stdout


def test_keep_latest_k_keeps_exactly_k(finished):
    run, _ = finished
    assert sorted(os.listdir(run / "checkpoint")) == ["step-3", "step-4"]  # keep_latest_k = 2


def test_run_dir_stores_its_config(finished):
    from titan_rl import config

    run, _ = finished
    stored = config.load(run / "config.toml")
    assert stored.training.steps == 4 and stored.algorithm.sft_steps == 5


def test_relaunching_a_finished_run_says_so(finished):
    run, _ = finished
    before = _tree_hash(run)
    r = _cli(["--run-dir", str(run), *SFT])
    assert r.returncode == 0 and r.stderr.strip() == "", r.stderr
    assert "has already finished: checkpoint at step 4 of training.steps = 4" in r.stdout
    assert r.stdout.strip().splitlines()[-1].startswith("done: 4 steps")
    assert _tree_hash(run) == before and r.seconds < 30


def test_relaunch_with_another_config_is_refused(finished):
    run, _ = finished
    before = _tree_hash(run)
    r = _cli(["--run-dir", str(run), *SFT, "--optimizer.lr=2e-3", "--algorithm.sft_batch=4"])
    _one_line_error(r, r"differing keys: algorithm.sft_batch: 8 -> 4; optimizer.lr: 0.001 -> 0.002\. .*"
                       r"--allow-config-change=algorithm.sft_batch,optimizer.lr")
    assert _tree_hash(run) == before and r.seconds < 30


def test_allowed_config_change_resumes_and_is_logged(finished, tmp_path):
    src, _ = finished
    run = tmp_path / "run"
    shutil.copytree(src, run)
    args = ["--run-dir", str(run), *SFT[1:], "--training.steps=5", "--optimizer.lr=2e-3"]
    r = _cli(args + ["--allow-config-change=training.steps,optimizer.lr"])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "WARNING: resumed at step 5 with changed config (allowed)" in r.stdout
    ms = _metrics(run)
    assert [m["step"] for m in ms] == [1, 2, 3, 4, 5]
    assert ms[-1]["config_changes"] == {"optimizer.lr": [0.001, 0.002], "training.steps": [4, 5]}
    assert "config_changes" not in ms[-2] and ms[-1]["lr"] == 0.002
    from titan_rl import config

    assert config.load(run / "config.toml").optimizer.lr == 0.002  # the next relaunch compares with this


def test_run_dir_records_its_platform_and_a_resume_elsewhere_is_refused(finished, tmp_path):
    """The run dir records the platform choices its bits came from; a relaunch where one
    differs (here: the record says another CPU kind trained it) stops in one line naming the
    choice before any work, and --allow-config-change=platform resumes it, logged."""
    import torch

    from titan_rl.kernels.selfcheck import bit_choices

    src, _ = finished
    recorded = json.loads((src / "platform.json").read_text())
    assert recorded == bit_choices(torch.float32) and "cpu_capability" in recorded and "dpbf16" not in recorded
    assert "bf16_gemm" not in recorded  # an fp32 run: the bf16 forms do not decide its bits
    run = tmp_path / "run"
    shutil.copytree(src, run)
    other = {**recorded, "cpu_capability": "OTHER", "gemm": "other"}
    (run / "platform.json").write_text(json.dumps(other))
    before = _tree_hash(run)
    args = ["--run-dir", str(run), *SFT[1:], "--training.steps=5"]
    r = _cli(args + ["--allow-config-change=training.steps"])
    _one_line_error(r, r"was trained on other platform choices .*platform.cpu_capability: 'OTHER' -> '\w+'; "
                       r"platform.gemm: 'other' -> '(onednn|mm)'.*--allow-config-change=platform")
    assert _tree_hash(run) == before and r.seconds < 30
    r = _cli(args + ["--allow-config-change=training.steps,platform"])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "platform.cpu_capability" in _metrics(run)[-1]["config_changes"]
    assert json.loads((run / "platform.json").read_text()) == recorded  # the next relaunch compares with this


# -- non-finite values ---------------------------------------------------------------------------
def test_nonfinite_loss_stops_before_the_optimizer_step(tmp_path):
    """lr = 1e30: step 1 is finite, its update blows the weights up, step 2's loss is NaN."""
    run = tmp_path / "run"
    r = _cli(["--run-dir", str(run), *SFT, "--optimizer.lr=1e30"])
    _one_line_error(r, r"^error: non-finite loss nan / grad norm nan at step 2: stopped before the optimizer step, "
                       r"so no weight changed; the last checkpoint \(step 1\) is intact", rc=1)
    assert os.listdir(run / "checkpoint") == ["step-1"]
    assert [m["step"] for m in _metrics(run)] == [1]


def test_nonfinite_loss_can_be_skipped_and_counted(tmp_path):
    run = tmp_path / "run"
    r = _cli(["--run-dir", str(run), *SFT, "--optimizer.lr=1e30", "--algorithm.on_nonfinite=skip"])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    ms = _metrics(run)
    assert [m.get("skipped_nonfinite", False) for m in ms] == [False, True, True, True]
    assert "WARNING: non-finite loss nan / grad norm nan at step 2: step skipped" in r.stdout
    assert "3 steps skipped (non-finite loss or grad norm)" in r.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("every", [1, 3])
def test_nan_reward_names_task_example_and_completion(tmp_path, every):
    pytest.importorskip("vllm")
    run = tmp_path / "run"
    r = _cli(["--run-dir", str(run), "--training.steps=2", "--algorithm.sft_steps=1", "--lr_scheduler.warmup_steps=1",
              "--algorithm.sft_batch=8", "--algorithm.prompts_per_step=2", "--algorithm.group_size=4",
              "--checkpoint.interval=1", '--task.name="tests._bad_tasks:NanRewardTask"',
              f"--task.kwargs={{every = {every}}}"])
    completion = every - 1
    _one_line_error(r, rf"^error: task 'tests._bad_tasks:NanRewardTask' returned reward nan at step 2 for example 0 "
                       rf"\(prompt 'rev:\d+='\), completion {completion} \('.*', ids \[[\d, ]+\]\): rewards must be "
                       rf"finite numbers$")
    assert os.listdir(run / "checkpoint") == ["step-1"]  # the failed step saved nothing
    assert [m["step"] for m in _metrics(run)] == [1]
    from safetensors.torch import load_file

    import torch

    engine = load_file(str(run / "engine_weights_rank0" / "model.safetensors"))  # the step-1 weights
    assert all(bool(torch.isfinite(t).all()) for t in engine.values())
