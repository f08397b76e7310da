"""The RL trainer end to end on CPU (debug model, built-in task), one trainer process: mismatch
0 at every RL step, the weight checksum, kill -9 and resume == an uninterrupted run, engines
in their own processes, config errors. The torchrun runs (and, to balance the two files'
time under `pytest -n 2 --dist loadfile`, some single-process pair comparisons) are in
tests/test_train_torchrun.py; the uninterrupted reference run is made once for both
(tests/_train_runs.py)."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("vllm")

from titan_rl import config  # noqa: E402

import _zygote  # noqa: E402
from _train_runs import (  # noqa: E402
    ENV, SEPARATE, SHORT, _comparable, _engine_processes, _metrics, _run_until, _train, uninterrupted_run,
)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return uninterrupted_run(tmp_path_factory)


def test_rl_run_has_zero_mismatch_and_equal_weights(uninterrupted):
    run_dir, r = uninterrupted
    ms = _metrics(run_dir)
    assert [m["step"] for m in ms] == list(range(1, 7))
    rl = [m for m in ms if m["phase"] == "rl"]
    assert len(rl) == 4
    for m in rl:
        assert m["max_abs_dlogp"] == 0.0 and m["bitwise_fraction"] == 1.0, m
        assert m["weights_checksum_equal"] is True
        # the two sides' digests, each computed where its weights live: equal, and moving
        # with the weights from one sync to the next
        assert len(m["weights_sha256_trainer"]) == 64 and m["weights_sha256_engine"] == m["weights_sha256_trainer"]
        for key in ("reward_mean", "response_length", "loss", "grad_norm", "k3_mean", "mean_abs_dlogp",
                    "rollout_tokens_per_s", "train_tokens_per_s", "rollout_sha256"):
            assert key in m
    assert len({m["weights_sha256_engine"] for m in rl}) == len(rl)
    # the execution contract: its hash on every RL line, its entries on the first (titan_rl.contract)
    from titan_rl.contract import canonical_json

    assert len({m["contract"] for m in rl}) == 1 and not any("contract_differs" in m for m in rl)
    entries = rl[0]["contract_entries"]
    assert entries["kernels"] == "exact" and entries["dtype"] == "float32" and entries["selfcheck"] == "passed"
    assert rl[0]["contract"] == hashlib.sha256(canonical_json(entries).encode()).hexdigest()
    assert not any("contract_entries" in m for m in rl[1:])
    assert "rl   reward" in r.stdout  # the console progress line
    assert r.stderr.strip() == "", r.stderr  # known-harmless third-party noise is filtered
    lines = r.stdout.strip().splitlines()
    assert all(ln.startswith("step ") for ln in lines[:-1]), r.stdout
    assert lines[-1].startswith("done: 6 steps (2 sft + 4 rl)") and "max |dlogp| 0 over 4 rl steps" in lines[-1]
    assert "; s per rl step " in lines[-1] and "backward " in lines[-1] and "; peak RSS " in lines[-1], lines[-1]


@pytest.fixture(scope="module")
def killed_and_resumed(tmp_path_factory):
    """The SHORT run at 2 torch threads, killed (-9) after step 5 is logged (checkpoint step-4
    exists), then the same command again: (run dir, the metrics lines the killed process had
    written). One run serves the kill-and-resume test and the thread-count test."""
    run_b = tmp_path_factory.mktemp("killed") / "run_b"
    cmd = [sys.executable, "-m", "titan_rl.train", "--run-dir", str(run_b), *SHORT]
    env = dict(ENV, OMP_NUM_THREADS="2")
    p = _zygote.popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 600  # a safety net only: a loaded machine at 2 threads can be slow to step 5
    path = run_b / "metrics.jsonl"
    while time.time() < deadline:  # kill after step 5 is logged: checkpoint step-4 exists
        if path.exists() and len(path.read_text().splitlines()) >= 5:
            break
        if p.poll() is not None:
            break
        time.sleep(0.05)
    lines = len(path.read_text().splitlines()) if path.exists() else 0
    p.send_signal(signal.SIGKILL)
    p.wait()
    # killed mid-run (not finished, not crashed, not timed out): the relaunch resumes
    assert p.returncode == -signal.SIGKILL and lines >= 5, (p.returncode, lines)
    assert (run_b / "checkpoint" / "step-4").exists() and not (run_b / "checkpoint" / "step-6").exists()
    before_kill = [json.loads(ln) for ln in path.read_text().splitlines(keepends=True) if ln.endswith("\n")]
    r = _zygote.run(cmd, env=env, capture_output=True, text=True, timeout=300)  # the same command again
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return run_b, before_kill


def test_kill_and_resume_equals_uninterrupted(uninterrupted, killed_and_resumed):
    """kill -9 after step 5 and the same command again: resumed from checkpoint step-4, the
    run's metrics are the uninterrupted run's (this run is at 2 threads, the reference at 1:
    test_a_thread_count_writes_the_same_metrics)."""
    run_a, _ = uninterrupted
    run_b, before_kill = killed_and_resumed
    a, b = _metrics(run_a), _metrics(run_b)
    assert [m["step"] for m in b] == list(range(1, 7))
    assert [_comparable(m) for m in a] == [_comparable(m) for m in b]
    # a resume, not a restart: the first process's lines of steps 1-4 kept as written (their
    # wall-clock fields too), and the relaunch's first line says it began after checkpoint 4
    assert b[:4] == before_kill[:4]
    assert b[4]["resumed_from_step"] == 4 and not any("resumed_from_step" in m for m in b[:4] + b[5:])


def test_a_thread_count_writes_the_same_metrics(uninterrupted, killed_and_resumed):
    """One process at 2 torch threads logs the 1-thread run's metrics (so, through
    test_elastic_resume_fsdp2_to_fsdp1_equals_uninterrupted, torchrun's 2 ranks x 1 thread's):
    every reduction of the step is thread-count invariant (kernels.fixed_sum, the self-check's
    thread comparison), with gradient clipping active. The 2-thread run is the killed and
    resumed one: the lines its first process wrote before the kill (steps 1-5, no resume in
    them) equal the reference's, and so does the whole file after the resume."""
    run_a, _ = uninterrupted
    run_b, before_kill = killed_and_resumed
    want = [_comparable(m) for m in _metrics(run_a)]
    assert len(before_kill) >= 5
    assert [_comparable(m) for m in before_kill] == want[:len(before_kill)]
    assert [_comparable(m) for m in _metrics(run_b)] == want
    assert any(m["grad_norm"] > 1.0 for m in want)  # clipping (training.max_norm = 1) was active


def test_an_rl_run_stops_in_one_line_when_its_engine_is_built_otherwise(tmp_path):
    """Through the real RL loop: the engine is built with another dtype than the trainer's
    (make_llm patched in a driver script; the contract check is the real one)."""
    script = tmp_path / "other_dtype.py"
    script.write_text("import dataclasses, sys\n"
                      "from titan_rl.vllm import engine\n"
                      "real = engine.make_llm\n"
                      "engine.make_llm = lambda folder, settings: real(folder, dataclasses.replace(settings, "
                      "dtype='bfloat16'))\n"
                      "from titan_rl.train import main\n"
                      "sys.exit(main(sys.argv[1:]))\n")
    cmd = [sys.executable, str(script), "--run-dir", str(tmp_path / "run"), *SHORT, "--algorithm.sft_steps=0",
           "--checkpoint.enable=false"]
    r = _zygote.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stderr.strip().splitlines()[-1].startswith(
        "error: execution contract before the first rollout: trainer and engine differ in dtype (trainer 'float32', "
        "engine 'bfloat16')"), r.stderr[-2000:]


def test_config_errors():
    with pytest.raises(config.ConfigError, match=r"unknown key 'algorithm.grop_size'.*did you mean 'group_size'"):
        config.load(None, ["--algorithm.grop_size=4"])
    with pytest.raises(config.ConfigError, match=r"training.steps = 'ten': expected int"):
        config.load(None, ['--training.steps="ten"'])
    with pytest.raises(config.ConfigError, match=r"algorithm.group_size = 1: GRPO needs >= 2"):
        config.load(None, ["--algorithm.group_size=1"])
    with pytest.raises(config.ConfigError, match=r"lr_scheduler.warmup_steps = 10 must be < training.steps = 4"):
        config.load(None, ["--training.steps=4", "--lr_scheduler.warmup_steps=10"])
    with pytest.raises(config.ConfigError, match=r"lr_scheduler.decay_type = 'step' is not allowed"):
        config.load(None, ['--lr_scheduler.decay_type="step"'])


def test_print_config_shows_every_section(capsys):
    from titan_rl.train import main

    assert main(["--print-config"]) == 0
    out = capsys.readouterr().out
    for section in ("[model]", "[task]", "[algorithm]", "[training]", "[optimizer]", "[checkpoint]", "[parallelism]"):
        assert section in out
    assert config.load(None, []).task.name == "digit_reverse"


def test_starts_from_a_local_hf_checkpoint_folder(tmp_path):
    """model.checkpoint = a local HF folder: TorchTitan loads it (HF names through our
    state-dict adapter) and the engine starts from exactly those weights."""
    import torch
    from safetensors.torch import load_file

    from titan_rl.checkpoint import save_hf_folder
    from titan_rl.models.qwen3 import build

    hf = tmp_path / "hf"
    save_hf_folder(build("debug").init_weights(1234, 0.05), str(hf), dtype=torch.float32)
    run = tmp_path / "run"
    r = _train(run, [f"--model.checkpoint={hf}", "--algorithm.sft_steps=0", "--training.steps=2",
                     "--lr_scheduler.warmup_steps=1"])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    src = load_file(str(hf / "model.safetensors"))
    eng = load_file(str(run / "engine_weights_rank0" / "model.safetensors"))
    assert src.keys() == eng.keys() and all(torch.equal(src[k], eng[k]) for k in src)
    assert _metrics(run)[0]["max_abs_dlogp"] == 0.0


def test_several_updates_per_batch_report_policy_lag_apart(tmp_path):
    r = _train(tmp_path, ["--algorithm.updates_per_batch=2", "--training.steps=3", "--lr_scheduler.warmup_steps=1",
                          "--metrics.enable_tensorboard=true",
                          "--checkpoint.enable=false"])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rl = [m for m in _metrics(tmp_path) if m["phase"] == "rl"]
    assert all(m["max_abs_dlogp"] == 0.0 for m in rl)  # measured before the first update
    assert all(m["policy_lag_log_ratio_abs_max"] > 0.0 for m in rl)  # the second update sees the first
    assert any(p.name.startswith("events") for p in (tmp_path / "tb").rglob("*"))  # TensorBoard when enabled


def test_corrections_log_their_fractions_and_warn_when_parity_is_exact(tmp_path):
    r = _train(tmp_path, ["--training.steps=4", "--lr_scheduler.warmup_steps=1", "--correction.tis_cap=2.0", "--correction.token_band_low=0.5",
                          "--correction.token_band_high=2.0", "--checkpoint.enable=false"])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "can only delete signal" in r.stdout
    rl = [m for m in _metrics(tmp_path) if m["phase"] == "rl"]
    for m in rl:
        assert m["max_abs_dlogp"] == 0.0
        assert m["tis_clipped_fraction"] == 0.0 and m["token_band_masked_fraction"] == 0.0
        assert m["tokens_kept_fraction"] == 1.0
    with pytest.raises(config.ConfigError, match="token_band_low"):
        config.load(None, ["--correction.token_band_low=2.0", "--correction.token_band_high=1.5"])


def test_stock_mode_shows_the_mismatch_titan_rl_removes(tmp_path):
    """kernels = stock: vLLM's built-in Qwen3 samples (weights synced by vLLM's in-place
    reload) and a plain torch trainer scores: the mismatch is measured and non-zero. The same
    stock engine in its own process (placement = separate: the weights go over our gloo
    backend into vLLM's layerwise reload) writes the same metrics, line by line: the stock
    column exists for separate runs too, and is the colocated one."""
    stock = ["--model.kernels=stock", "--training.steps=5", "--lr_scheduler.warmup_steps=1",
             "--checkpoint.enable=false"]
    r = _train(tmp_path / "colocated", stock)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    r = _train(tmp_path / "separate", [*stock, *SEPARATE])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rl = [m for m in _metrics(tmp_path / "colocated") if m["phase"] == "rl"]
    assert [_comparable(m) for m in _metrics(tmp_path / "separate")] == \
        [_comparable(m) for m in _metrics(tmp_path / "colocated")]
    assert max(m["max_abs_dlogp"] for m in rl) > 0.0 and min(m["bitwise_fraction"] for m in rl) < 1.0
    assert all(m["weights_checksum_equal"] is None for m in rl)
    # the contract's op entries differ by design in stock mode: logged, not refused
    assert all(m["contract_differs"] and all(n.startswith("op.") for n in m["contract_differs"]) for m in rl)
    assert rl[0]["contract_engine_entries"]["kernels"] == rl[0]["contract_entries"]["kernels"] == "stock"
    assert max(m["max_abs_dlogp"] for m in rl) < 1e-3  # fp32: the same function, only rounding differs


# -- engines in their own processes (rollout.placement = "separate") -------------------------


def test_killed_engines_and_trainers_stop_cleanly_and_the_relaunch_continues(uninterrupted, tmp_path):
    """kill -9 of the trainer: its engine processes die with it. kill -9 of the engine
    process: the run stops within seconds, in one line naming the engine (exit 1). Each
    relaunch resumes from the last checkpoint, and the run ends with the uninterrupted
    run's metrics."""
    import psutil

    run_a, _ = uninterrupted
    run_b = tmp_path / "faults"
    cmd = [sys.executable, "-m", "titan_rl.train", "--run-dir", str(run_b), *SHORT, *SEPARATE]
    engines = []

    def kill_trainer(p):
        engines.extend(_engine_processes(p.pid))
        p.send_signal(signal.SIGKILL)

    rc, _, _ = _run_until(cmd, "step    3/6 rl", kill_trainer)
    assert rc == -signal.SIGKILL and engines
    gone = psutil.wait_procs(engines, timeout=20)[1]
    assert not gone, f"engine processes outlived their trainer: {[e.pid for e in gone]}"

    def kill_engine(p):
        os.kill(_engine_processes(p.pid)[0].pid, signal.SIGKILL)

    rc, out, seconds = _run_until(cmd, "step    3/6 rl", kill_engine)  # resumed at step 3 (checkpoint step 2)
    assert "resumed from the checkpoint of step 2 (kept its 2 metrics lines)" in out, out[-3000:]
    errors = [ln for ln in out.splitlines() if ln.startswith("error:")]
    assert rc == 1 and len(errors) == 1, out[-3000:]
    assert "rollout engine 0" in errors[0] and "died" in errors[0] and "restart_engines" in errors[0], errors
    assert seconds < 20, seconds
    r = _zygote.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    final = _metrics(run_b)
    assert [_comparable(m) for m in final] == [_comparable(m) for m in _metrics(run_a)]
    # the last relaunch's first line, and only it, says which checkpoint it began after
    marked = [m for m in final if "resumed_from_step" in m]
    assert len(marked) == 1 and marked[0]["step"] == marked[0]["resumed_from_step"] + 1 > 1, marked


def test_one_step_off_policy_keeps_the_operator_mismatch_at_zero_through_an_engine_restart(uninterrupted, tmp_path):
    """max_off_policy_steps = 1: the engine samples step t+1 while the trainer trains step t.
    Every RL line has its policy lag (0 on the first, then 1), max |dlogp| against the
    behaviour weights (the trainer rescoring with the rollout's version) exactly 0, and the
    off-policy movement apart (lag_abs_dlogp > 0 at lag 1). A killed engine is restarted
    (restart_engines), re-sent the weights, and the run goes on with the same bits."""
    run_a, _ = uninterrupted
    run_b = tmp_path / "k1"
    cmd = [sys.executable, "-m", "titan_rl.train", "--run-dir", str(run_b), *SHORT, *SEPARATE,
           "--rollout.max_off_policy_steps=1", "--rollout.restart_engines=true", "--checkpoint.enable=false"]

    def kill_engine(p):
        os.kill(_engine_processes(p.pid)[0].pid, signal.SIGKILL)

    rc, out, _ = _run_until(cmd, "step    4/6 rl", kill_engine)
    assert rc == 0, out[-3000:]
    assert "restarting it (rollout.restart_engines = true)" in out
    rl = [m for m in _metrics(run_b) if m["phase"] == "rl"]
    assert [m["policy_lag"] for m in rl] == [0, 1, 1, 1]
    assert all(m["max_abs_dlogp"] == 0.0 and m["bitwise_fraction"] == 1.0 for m in rl), rl
    assert rl[0]["lag_abs_dlogp"] == 0.0 and all(m["lag_abs_dlogp"] > 0 for m in rl[1:])
    assert rl[-1]["engine_restarts"] == 1
    first = [m for m in _metrics(run_a) if m["phase"] == "rl"][0]
    assert _comparable(rl[0]) == _comparable(first)  # lag 0: the synchronous run's step
