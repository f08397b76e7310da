"""The RL trainer end to end on CPU (debug model, built-in task): mismatch 0 at every RL
step, the weight checksum, kill -9 and resume == an uninterrupted run, config errors."""

import hashlib
import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("vllm")

from _train_cli import ENV, SHORT  # noqa: E402
from _train_cli import train as _train  # noqa: E402

from titan_rl import config  # noqa: E402
from titan_rl.launch import free_port  # noqa: E402
from titan_rl.run_dir import comparable, read_metrics  # noqa: E402

_metrics, _comparable = read_metrics, comparable


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run_a")
    r = _train(run_dir)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return run_dir, r


def test_rl_run_has_zero_mismatch_and_equal_weights(uninterrupted):
    run_dir, r = uninterrupted
    ms = _metrics(run_dir)
    assert [m["step"] for m in ms] == list(range(1, 7))
    rl = [m for m in ms if m["phase"] == "rl"]
    assert len(rl) == 4
    for m in rl:
        assert m["max_abs_dlogp"] == 0.0 and m["bitwise_fraction"] == 1.0, m
        assert m["weights_checksum_equal"] is True
        for key in ("reward_mean", "response_length", "loss", "grad_norm", "k3_mean", "mean_abs_dlogp",
                    "rollout_tokens_per_s", "train_tokens_per_s", "rollout_sha256"):
            assert key in m
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


def test_kill_and_resume_equals_uninterrupted(uninterrupted, tmp_path):
    run_a, _ = uninterrupted
    run_b = tmp_path / "run_b"
    cmd = [sys.executable, "-m", "titan_rl.train", "--run-dir", str(run_b), *SHORT]
    p = subprocess.Popen(cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    path = run_b / "metrics.jsonl"
    while time.time() < deadline:  # kill after step 5 is logged: checkpoint step-4 exists
        if path.exists() and len(path.read_text().splitlines()) >= 5:
            break
        if p.poll() is not None:
            break
        time.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert (run_b / "checkpoint" / "step-4").exists()
    r = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)  # the same command again
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    a, b = _metrics(run_a), _metrics(run_b)
    assert [m["step"] for m in b] == list(range(1, 7))
    assert [_comparable(m) for m in a] == [_comparable(m) for m in b]


def _torchrun(run_dir, extra=(), timeout=300):
    port = free_port()
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, "--nproc_per_node=2", f"--master_port={port}", "-m", "titan_rl.train", "--run-dir",
           str(run_dir), *extra]
    return subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=timeout)


def test_elastic_resume_fsdp2_to_fsdp1_equals_uninterrupted(uninterrupted, tmp_path):
    """Deterministic reduction (the default in exact mode): a run at FSDP = 2 logs the
    uninterrupted one-process run's metrics; resumed in one process from its step-4
    checkpoint (DCP reshards weights and AdamW state), it logs them again for steps 5-6."""
    import shutil

    run_a, _ = uninterrupted
    run_b = tmp_path / "run_b"
    r = _torchrun(run_b, SHORT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    want = [_comparable(m) for m in _metrics(run_a)]
    fsdp2 = _metrics(run_b)
    assert [_comparable(m) for m in fsdp2] == want  # FSDP = 2 == one process, SFT and RL steps
    assert any(m["grad_norm"] > 1.0 for m in want)  # clipping (training.max_norm = 1) was active
    shutil.rmtree(run_b / "checkpoint" / "step-6")  # the newest checkpoint is now step 4, written at FSDP = 2
    r = _train(run_b)  # the same run, one process
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    resumed = _metrics(run_b)
    assert [m["step"] for m in resumed] == list(range(1, 7))
    assert resumed[5]["step_seconds"] != fsdp2[5]["step_seconds"]  # step 6 ran again
    assert [_comparable(m) for m in resumed] == want


def test_a_thread_count_writes_the_same_metrics(uninterrupted, tmp_path):
    """One process at 2 torch threads logs the 1-thread run's metrics (so, through
    test_elastic_resume_fsdp2_to_fsdp1_equals_uninterrupted, torchrun's 2 ranks x 1 thread's):
    every reduction of the step is thread-count invariant (kernels.fixed_sum, the self-check's
    thread comparison), with gradient clipping active."""
    run_a, _ = uninterrupted
    run_b = tmp_path / "two_threads"
    cmd = [sys.executable, "-m", "titan_rl.train", "--run-dir", str(run_b), *SHORT]
    r = subprocess.run(cmd, env=dict(ENV, OMP_NUM_THREADS="2"), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    want = [_comparable(m) for m in _metrics(run_a)]
    assert [_comparable(m) for m in _metrics(run_b)] == want
    assert any(m["grad_norm"] > 1.0 for m in want)  # clipping (training.max_norm = 1) was active


def test_an_rl_run_stops_in_one_line_when_its_engine_is_built_otherwise(tmp_path):
    """Through the real RL loop: the engine is built with another dtype than the trainer's
    (make_llm patched in a driver script; the contract check is the real one)."""
    script = tmp_path / "other_dtype.py"
    script.write_text("import sys\n"
                      "from titan_rl.vllm import engine\n"
                      "real = engine.make_llm\n"
                      "engine.make_llm = lambda folder, **kw: real(folder, **{**kw, 'dtype': 'bfloat16'})\n"
                      "from titan_rl.train import main\n"
                      "sys.exit(main(sys.argv[1:]))\n")
    cmd = [sys.executable, str(script), "--run-dir", str(tmp_path / "run"), *SHORT, "--algorithm.sft_steps=0",
           "--checkpoint.enable=false"]
    r = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stderr.strip().splitlines()[-1].startswith(
        "error: execution contract before the first rollout: trainer and engine differ in dtype (trainer 'float32', "
        "engine 'bfloat16')"), r.stderr[-2000:]


def test_ranks_that_compute_otherwise_are_refused_at_start(tmp_path):
    """torchrun 2 ranks, rank 1 with another CPU kernel set (ATEN_CPU_CAPABILITY=default,
    set before torch loads: a real difference, not a patched contract): the ranks' contracts
    are compared at start and the run stops in one line naming the entry and the rank."""
    script = tmp_path / "rank1_otherwise.py"
    script.write_text("import os, sys\n"
                      "if os.environ.get('LOCAL_RANK') == '1':\n"
                      "    os.environ['ATEN_CPU_CAPABILITY'] = 'default'\n"
                      "from titan_rl.train import main\n"
                      "sys.exit(main(sys.argv[1:]))\n")
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, "--nproc_per_node=2", f"--master_port={free_port()}", str(script), "--run-dir",
           str(tmp_path / "run"), *SHORT, "--checkpoint.enable=false"]
    r = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0, r.stdout[-3000:] + r.stderr[-3000:]
    import torch

    ours = torch.backends.cpu.get_cpu_capability()
    want = (f"error: execution contract at start: the trainer ranks differ in platform.cpu_capability "
            f"(rank 0 {ours!r}, rank 1 'DEFAULT')")
    assert want in r.stderr, r.stderr[-3000:]
    # one line per rank; the only traceback is torchrun's own report of the failed children
    ours_in_tracebacks = [ln for ln in r.stderr.splitlines() if ln.strip().startswith("File ") and "/titan_rl/" in ln]
    assert not ours_in_tracebacks, r.stderr[-3000:]


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




# -- engines in their own processes (rollout.placement = "separate") -------------------------

SEPARATE = ["--rollout.placement=separate"]


def _engine_processes(pid: int) -> list:
    """The processes under `pid` a separate engine started (not multiprocessing's tracker)."""
    import psutil

    try:
        kids = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    out = []
    for k in kids:
        try:
            if "resource_tracker" not in " ".join(k.cmdline()):
                out.append(k)
        except psutil.Error:
            pass
    return out


def _run_until(cmd, stop_at: str, act, timeout=240):
    """Run `cmd`, call act(process) once a stdout line starts with `stop_at`, then wait:
    (return code, stdout, seconds from act to exit)."""
    p = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, acted = [], None
    deadline = time.time() + timeout
    for line in p.stdout:
        out.append(line)
        if acted is None and line.startswith(stop_at):
            act(p)
            acted = time.time()
        if time.time() > deadline:
            p.kill()
    p.wait(timeout=60)
    return p.returncode, "".join(out), None if acted is None else time.time() - acted


def test_separate_engines_under_torchrun_write_the_colocated_metrics(uninterrupted, tmp_path):
    """torchrun's 2 ranks, the engine in its own process (rank 0 drives it; weights over vLLM's
    weight transfer, verified in the engine's process): the metrics of the one-process
    colocated run, wall-clock fields aside, synchronous (max_off_policy_steps = 0)."""
    run_a, _ = uninterrupted
    run_b = tmp_path / "separate"
    r = _torchrun(run_b, [*SHORT, *SEPARATE, "--rollout.engines=1", "--rollout.max_off_policy_steps=0"])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    want, got = _metrics(run_a), _metrics(run_b)
    assert [_comparable(m) for m in got] == [_comparable(m) for m in want]
    rl = [m for m in got if m["phase"] == "rl"]
    assert all(m["policy_lag"] == 0 and m["weight_sync_bytes"] > 0 for m in rl)


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
    errors = [ln for ln in out.splitlines() if ln.startswith("error:")]
    assert rc == 1 and len(errors) == 1, out[-3000:]
    assert "rollout engine 0" in errors[0] and "died" in errors[0] and "restart_engines" in errors[0], errors
    assert seconds < 20, seconds
    r = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert [_comparable(m) for m in _metrics(run_b)] == [_comparable(m) for m in _metrics(run_a)]



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
