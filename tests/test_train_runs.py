"""The RL trainer end to end on CPU, runs that stand alone (each its own short run, or the
bf16 single-process run a torchrun layout compares with): bf16 under torchrun (FSDP 2, TP 2),
an HF folder, several updates per batch, corrections, stock mode, truncated sampling, MoE
router replay, two separate engines with a quantized recipe. tests/test_train.py holds the
runs compared with its one uninterrupted run; the two files are apart so the suite's two
workers (pytest-xdist, one file each) run them at once."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

from _train_cli import BF16_RL, ENV  # noqa: E402
from _train_cli import train as _train  # noqa: E402

from titan_rl import config  # noqa: E402
from titan_rl.launch import free_port  # noqa: E402
from titan_rl.run_dir import comparable as _comparable  # noqa: E402
from titan_rl.run_dir import read_metrics as _metrics  # noqa: E402

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


SEPARATE = ["--rollout.placement=separate"]

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
