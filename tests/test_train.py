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

from titan_rl import config  # noqa: E402
from titan_rl.launch import free_port  # noqa: E402
from titan_rl.run_dir import comparable, read_metrics  # noqa: E402

SHORT = ["--training.steps=6", "--algorithm.sft_steps=2", "--algorithm.prompts_per_step=4",
         "--algorithm.group_size=4", "--algorithm.sft_batch=16", "--checkpoint.interval=2"]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
# bf16, RL from the first step: alone and under torchrun, the first step samples the same
# global batch
BF16_RL = ["--model.dtype=bfloat16", "--training.steps=3", "--lr_scheduler.warmup_steps=1", "--algorithm.sft_steps=0",
           "--algorithm.prompts_per_step=2", "--algorithm.group_size=4", "--checkpoint.enable=false"]


def _train(run_dir, extra=(), timeout=300):
    cmd = [sys.executable, "-m", "titan_rl.train", "--run-dir", str(run_dir), *SHORT, *extra]
    return subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=timeout)


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


@pytest.fixture(scope="module")
def bf16_alone(tmp_path_factory):
    """The RL metrics of a single-process BF16_RL run at a given model.tp_leaves (the leaf
    tree is part of the model's arithmetic: a TP run compares with one at its own), run once."""
    runs = {}

    def get(tp_leaves: int = 0) -> list[dict]:
        if tp_leaves not in runs:
            run_dir = tmp_path_factory.mktemp(f"bf16_alone_leaves{tp_leaves}")
            cmd = [sys.executable, "-m", "titan_rl.train", "--run-dir", str(run_dir), *BF16_RL,
                   f"--model.tp_leaves={tp_leaves}"]
            r = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
            assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
            runs[tp_leaves] = [m for m in _metrics(run_dir) if m["phase"] == "rl"]
        return runs[tp_leaves]

    return get


def test_single_process_bf16_rl_steps_have_zero_mismatch(bf16_alone):
    """A world of one in bf16: FSDP mixed precision on a 1-rank mesh (fp32 masters, bf16
    compute), as under torchrun; trainer and engine agree bitwise."""
    assert len(bf16_alone()) == 3
    for m in bf16_alone():
        assert m["max_abs_dlogp"] == 0.0 and m["bitwise_fraction"] == 1.0 and m["weights_checksum_equal"]


@pytest.mark.parametrize("layout", ["fsdp2", "tp2"])
def test_torchrun_2_ranks_rl_steps_have_zero_mismatch(tmp_path, layout, bf16_alone):
    """2 ranks under torchrun (gloo), bf16: FSDP over both ranks (mixed precision), or
    TP=2 with a fixed leaf tree (model.tp_leaves); each rank's engine (TP=1) and the
    sharded trainer agree bitwise at every RL step, and every metrics line equals the
    single process's at the same tp_leaves (wall-clock fields aside)."""
    port = free_port()
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, "--nproc_per_node=2", f"--master_port={port}", "-m", "titan_rl.train", "--run-dir",
           str(tmp_path), *BF16_RL]
    if layout == "tp2":
        cmd += ["--parallelism.tensor_parallel_degree=2", "--parallelism.data_parallel_shard_degree=1",
                "--model.tp_leaves=8"]
    r = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rl = [m for m in _metrics(tmp_path) if m["phase"] == "rl"]
    assert len(rl) == 3
    for m in rl:
        assert m["max_abs_dlogp"] == 0.0 and m["bitwise_fraction"] == 1.0 and m["weights_checksum_equal"]
    first, alone = rl[0], bf16_alone(8 if layout == "tp2" else 0)[0]
    assert first["rollout_sha256"] == alone["rollout_sha256"]
    assert first["reward_mean"] == pytest.approx(alone["reward_mean"], rel=1e-6, abs=1e-9)
    assert first["loss"] == pytest.approx(alone["loss"], rel=1e-5, abs=1e-7)
    # deterministic reduction (exact mode's default; TP's fixed trees with tp_leaves): every line, bit for bit
    assert [_comparable(m) for m in rl] == [_comparable(m) for m in bf16_alone(8 if layout == "tp2" else 0)]


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
    reload) and a plain torch trainer scores: the mismatch is measured and non-zero."""
    r = _train(tmp_path, ["--model.kernels=stock", "--training.steps=5", "--lr_scheduler.warmup_steps=1",
                          "--checkpoint.enable=false"])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rl = [m for m in _metrics(tmp_path) if m["phase"] == "rl"]
    assert max(m["max_abs_dlogp"] for m in rl) > 0.0 and min(m["bitwise_fraction"] for m in rl) < 1.0
    assert all(m["weights_checksum_equal"] is None for m in rl)
    # the contract's op entries differ by design in stock mode: logged, not refused
    assert all(m["contract_differs"] and all(n.startswith("op.") for n in m["contract_differs"]) for m in rl)
    assert rl[0]["contract_engine_entries"]["kernels"] == rl[0]["contract_entries"]["kernels"] == "stock"
    assert max(m["max_abs_dlogp"] for m in rl) < 1e-3  # fp32: the same function, only rounding differs


def test_truncated_sampling_recompute_equals_replay_with_zero_mismatch(tmp_path):
    """temperature 0.8, top-k 5, top-p 0.9: the trainer scores under the renormalised
    kept set, recomputed from its own logits or replayed from the sampler's record;
    both give mismatch 0 and the same run."""
    runs = {}
    for mode in ("recompute", "replay"):
        r = _train(tmp_path / mode, ["--training.steps=5", "--lr_scheduler.warmup_steps=1", "--sampling.temperature=0.8",
                                     "--sampling.top_p=0.9", "--sampling.top_k=5", f"--sampling.mask_mode={mode}",
                                     "--checkpoint.enable=false"])
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        runs[mode] = [m for m in _metrics(tmp_path / mode) if m["phase"] == "rl"]
    for m in runs["recompute"] + runs["replay"]:
        assert m["max_abs_dlogp"] == 0.0 and m["bitwise_fraction"] == 1.0
    assert all(m["kept_set_bytes_per_token"] > 0 for m in runs["replay"])
    strip = lambda m: {k: v for k, v in _comparable(m).items() if k != "kept_set_bytes_per_token"}  # noqa: E731
    assert [strip(m) for m in runs["recompute"]] == [strip(m) for m in runs["replay"]]


def test_moe_rl_router_replay_equals_own_routing_with_zero_mismatch(tmp_path):
    """The MoE debug flavor: the sampler's recorded experts (replayed into the trainer) and
    the trainer's own router agree everywhere, so replay on/off give the same run, with
    log-prob mismatch 0 and expert disagreement 0 at every RL step."""
    runs = {}
    for mode in ("off", "replay"):
        r = _train(tmp_path / mode, ["--config", "train_configs/rl_debug_moe.toml", "--training.steps=4",
                                     "--lr_scheduler.warmup_steps=1", f"--rollout.router_replay={mode}",
                                     "--checkpoint.enable=false"])
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        runs[mode] = [m for m in _metrics(tmp_path / mode) if m["phase"] == "rl"]
    for m in runs["off"] + runs["replay"]:
        assert m["max_abs_dlogp"] == 0.0 and m["expert_disagreement"] == 0.0 and m["weights_checksum_equal"]
        assert m["route_bytes_per_token"] == 8  # 4 layers x top-2, uint8
    assert len(runs["off"]) == 2
    assert [_comparable(m) for m in runs["off"]] == [_comparable(m) for m in runs["replay"]]
    with pytest.raises(config.ConfigError, match="router_replay"):
        config.load(None, ['--rollout.router_replay="replay"'])  # the dense default has no router


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


# rl_debug_fp8.toml (fp8_rowwise: the decoder linears' weights and activations in FP8), 2 SFT + 2 RL steps
FP8_RL = ["--config", "train_configs/rl_debug_fp8.toml", "--training.steps=4", "--algorithm.sft_steps=2",
          "--algorithm.prompts_per_step=4", "--algorithm.group_size=4", "--algorithm.sft_batch=16",
          "--lr_scheduler.warmup_steps=1", "--checkpoint.enable=false"]


def test_two_separate_engines_with_a_quantized_recipe_write_the_colocated_metrics(tmp_path):
    """quantization.recipe = fp8_rowwise, rollout.engines = 2: two engine processes, each
    sampling half of the step's requests with the fp8 payloads and scales sent to it over the
    weight transfer (checked in its own process), log every metrics line of the colocated run
    (one in-process engine, all requests), wall-clock fields aside; the bytes sent are the
    colocated run's once per engine. Both runs at once (one thread each: the suite's 2 cores)."""
    procs = {name: subprocess.Popen([sys.executable, "-m", "titan_rl.train", "--run-dir", str(tmp_path / name),
                                     *FP8_RL, *extra], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True)
             for name, extra in [("colocated", []), ("separate", [*SEPARATE, "--rollout.engines=2"])]}
    try:
        outs = {name: p.communicate(timeout=300)[0] for name, p in procs.items()}
    finally:
        for p in procs.values():
            p.kill()
    for name, p in procs.items():
        assert p.returncode == 0, f"{name}: {outs[name][-3000:]}"
    want, got = _metrics(tmp_path / "colocated"), _metrics(tmp_path / "separate")
    assert [m["phase"] for m in got] == ["sft", "sft", "rl", "rl"]
    assert all(m["max_abs_dlogp"] == 0.0 and m["weights_checksum_equal"] for m in got if m["phase"] == "rl")
    assert got[2]["contract_entries"]["quantization"].startswith("fp8_rowwise")
    sent = [m.get("weight_sync_bytes") for m in want]
    assert [m.get("weight_sync_bytes") for m in got] == [None if b is None else 2 * b for b in sent]
    strip = lambda m: {k: v for k, v in _comparable(m).items() if k != "weight_sync_bytes"}  # noqa: E731
    assert [strip(m) for m in got] == [strip(m) for m in want]


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
