"""The RL trainer under torchrun (2 ranks: FSDP, TP, a separate engine, ranks that
compute otherwise) and the elastic resume to one process; bf16 alone; and, to balance this
file's time against tests/test_train.py's under `pytest -n 2 --dist loadfile`, the
single-process runs compared in pairs (fp8 with separate engines, MoE router replay,
truncated sampling). The tests that compare with the uninterrupted reference run come last:
it is made once per session for both files (tests/_train_runs.py), usually by the other file
meanwhile."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

from titan_rl import config  # noqa: E402
from titan_rl.launch import free_port  # noqa: E402

import _zygote  # noqa: E402
from _train_runs import (  # noqa: E402
    BF16_RL, ENV, SEPARATE, SHORT, _comparable, _metrics, _torchrun, _train, uninterrupted_run,
)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return uninterrupted_run(tmp_path_factory)


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
            r = _zygote.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
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
    extra = [*BF16_RL]
    if layout == "tp2":
        extra += ["--parallelism.tensor_parallel_degree=2", "--parallelism.data_parallel_shard_degree=1",
                  "--model.tp_leaves=8"]
    r = _torchrun(tmp_path, extra)
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


# rl_debug_fp8.toml (fp8_rowwise: the decoder linears' weights and activations in FP8), 2 SFT + 2 RL steps
FP8_RL = ["--config", "train_configs/rl_debug_fp8.toml", "--training.steps=4", "--algorithm.sft_steps=2",
          "--algorithm.prompts_per_step=4", "--algorithm.group_size=4", "--algorithm.sft_batch=16",
          "--lr_scheduler.warmup_steps=1", "--checkpoint.enable=false"]


def test_two_separate_engines_with_a_quantized_recipe_write_the_colocated_metrics(tmp_path):
    """quantization.recipe = fp8_rowwise, rollout.engines = 2: two engine processes, each
    sampling half of the step's requests with the fp8 payloads and scales sent to it over the
    weight transfer (checked in its own process), log every metrics line of the colocated run
    (one in-process engine, all requests), wall-clock fields aside; the bytes sent are the
    colocated run's once per engine. The two runs one after the other (the suite's 2 cores
    are also the other xdist worker's)."""
    for name, extra in [("colocated", []), ("separate", [*SEPARATE, "--rollout.engines=2"])]:
        r = _zygote.run([sys.executable, "-m", "titan_rl.train", "--run-dir", str(tmp_path / name), *FP8_RL, *extra],
                        env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
        assert r.returncode == 0, f"{name}: {r.stdout[-3000:]}"
    want, got = _metrics(tmp_path / "colocated"), _metrics(tmp_path / "separate")
    assert [m["phase"] for m in got] == ["sft", "sft", "rl", "rl"]
    assert all(m["max_abs_dlogp"] == 0.0 and m["weights_checksum_equal"] for m in got if m["phase"] == "rl")
    assert got[2]["contract_entries"]["quantization"].startswith("fp8_rowwise")
    sent = [m.get("weight_sync_bytes") for m in want]
    assert [m.get("weight_sync_bytes") for m in got] == [None if b is None else 2 * b for b in sent]
    strip = lambda m: {k: v for k, v in _comparable(m).items() if k != "weight_sync_bytes"}  # noqa: E731
    assert [strip(m) for m in got] == [strip(m) for m in want]


@pytest.mark.parametrize("dtype, leaves", [("float32", 8), ("bfloat16", 8)])
def test_moe_rl_router_replay_equals_own_routing_under_expert_parallel_with_zero_mismatch(tmp_path, dtype, leaves):
    """The MoE debug flavor, two runs that must write the same metrics.jsonl (wall-clock aside):
    one process with the sampler's recorded experts replayed into the trainer, and torchrun
    2 ranks with expert parallelism 2 (each rank 4 of the 8 experts, run for both ranks'
    tokens) and the trainer's own router. The sampler and the router agree everywhere (log-prob
    mismatch 0, expert disagreement 0 at every RL step), and EP 2 has the bits of one process:
    8 gradient leaves (each rank's experts add four leaves of each source rank in the tree), fp32
    and bf16 mixed precision; fresh seeds; the SFT steps clipped. The control (fp32): each
    source's leaves in a running sum instead of the tree must change the bits (in bf16 the
    leaves' gradients are bf16 values, whose sums of four fp32 holds exactly either way)."""
    from _seeds import draw_seed

    seed = draw_seed()
    args = ["--config", "train_configs/rl_debug_moe.toml", "--training.steps=4", "--lr_scheduler.warmup_steps=1",
            "--checkpoint.enable=false", f"--parallelism.gradient_leaves={leaves}", f"--model.dtype={dtype}",
            f"--model.seed={seed % 10_000}", f"--training.seed={seed}"]
    r = _train(tmp_path / "replay", [*args, "--rollout.router_replay=replay"])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    r = _torchrun(tmp_path / "ep2", [*SHORT, *args, "--rollout.router_replay=off",
                                     "--parallelism.expert_parallel_degree=2"])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    want, got = _metrics(tmp_path / "replay"), _metrics(tmp_path / "ep2")
    rl = [m for m in want + got if m["phase"] == "rl"]
    assert len(rl) == 4
    for m in rl:
        assert m["max_abs_dlogp"] == 0.0 and m["expert_disagreement"] == 0.0 and m["weights_checksum_equal"]
        assert m["route_bytes_per_token"] == 8  # 4 layers x top-2, uint8
    assert [_comparable(m) for m in got] == [_comparable(m) for m in want]
    assert any(m["grad_norm"] > 1.0 for m in got)  # max_norm = 1: the clipping acted
    if dtype == "float32":  # the control: each source's leaves in a running sum, not the tree, changes the bits
        r = _zygote.torchrun(2, [sys.executable, "-m", "titan_rl.train", "--run-dir", str(tmp_path / "control"), *SHORT,
                                 *args, "--rollout.router_replay=off", "--parallelism.expert_parallel_degree=2"],
                             env=dict(ENV, TITAN_RL_EP_CONTROL="running_sum"), timeout=300)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        control = _metrics(tmp_path / "control")
        assert [_comparable(m) for m in control] != [_comparable(m) for m in want]
    with pytest.raises(config.ConfigError, match="router_replay"):
        config.load(None, ['--rollout.router_replay="replay"'])  # the dense default has no router


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


# -- against the uninterrupted one-process run (made once per session) ----------------------


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
    # resumed after checkpoint 4, the FSDP = 2 lines of steps 1-4 kept as written
    assert resumed[:4] == fsdp2[:4] and resumed[4]["resumed_from_step"] == 4


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
