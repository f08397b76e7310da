"""Recorded choices across the process boundary: a separate engine records the sampler's kept
sets, the MoE routes and GLM-5's selected key indices in its own worker process (the worker
extension opens the captures there) and sends them back with each rollout; the trainer replays
them exactly as it replays an in-process engine's.

GLM-5's debug flavor makes all three kinds (routes: MoE layers; indices: sparse attention;
kept sets: top-p with mask_mode = "replay"), so one pair of runs covers every kind: the separate
run writes the colocated run's metrics lines, wall-clock aside, with the records' bytes per
token logged. Without the records the separate run's lines lose their disagreement and bytes
entries and the comparison fails; with another record (a route or a key set off by one) the
replayed forward and so the loss differ."""

import subprocess
import sys

from titan_rl.run_dir import comparable, read_metrics

import _zygote
from _train_runs import ENV, SEPARATE

GLM5_REPLAY = ["--config", "train_configs/rl_debug_glm5.toml", "--training.steps=3", "--algorithm.sft_steps=1",
               "--algorithm.sft_batch=8", "--algorithm.prompts_per_step=2", "--algorithm.group_size=4",
               "--lr_scheduler.warmup_steps=1", "--checkpoint.enable=false", "--rollout.router_replay=replay",
               "--rollout.index_selection=replay", "--sampling.mask_mode=replay", "--sampling.top_p=0.9"]


def test_a_separate_engine_sends_its_routes_key_sets_and_kept_sets_and_the_run_is_the_colocated_one(tmp_path):
    for name, extra in [("colocated", []), ("separate", SEPARATE)]:
        r = _zygote.run([sys.executable, "-m", "titan_rl.train", "--run-dir", str(tmp_path / name), *GLM5_REPLAY,
                         *extra], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
        assert r.returncode == 0, f"{name}: {r.stdout[-3000:]}"
    want, got = read_metrics(tmp_path / "colocated"), read_metrics(tmp_path / "separate")
    assert [m["phase"] for m in got] == ["sft", "rl", "rl"]
    for m in (m for m in got if m["phase"] == "rl"):
        assert m["max_abs_dlogp"] == 0.0 and m["weights_checksum_equal"], m
        assert m["expert_disagreement"] == 0.0 and m["index_disagreement"] == 0.0, m
        assert m["route_bytes_per_token"] > 0 and m["index_bytes_per_token"] > 0 and m["kept_set_bytes_per_token"] > 0
    assert [comparable(m) for m in got] == [comparable(m) for m in want]
    # the engine's digest read in its own process equals the in-process engine's, step by step
    # (a TP-1 engine reports its rank's digest; weights_sha256_* are not in `comparable`)
    digests = [[(m["weights_sha256_trainer"], m["weights_sha256_engine"]) for m in ms if m["phase"] == "rl"]
               for ms in (want, got)]
    assert digests[0] == digests[1] and all(t == e for t, e in digests[1]) and len(set(digests[1])) == 2


def test_one_step_off_policy_the_records_are_replayed_at_the_behaviour_weights(tmp_path):
    """rollout.max_off_policy_steps = 1: a rollout sampled a step ahead is rescored at the
    weights that sampled it, its records replayed there and the model's own choices at those
    weights measured against them: no mismatch, no disagreement, while policy_lag is 1."""
    r = _zygote.run([sys.executable, "-m", "titan_rl.train", "--run-dir", str(tmp_path / "k1"), *GLM5_REPLAY,
                     *SEPARATE, "--rollout.max_off_policy_steps=1"], env=ENV, stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:]
    rl = [m for m in read_metrics(tmp_path / "k1") if m["phase"] == "rl"]
    assert [m["policy_lag"] for m in rl] == [0, 1]
    for m in rl:
        assert m["max_abs_dlogp"] == 0.0 and m["expert_disagreement"] == 0.0 and m["index_disagreement"] == 0.0, m
        assert m["route_bytes_per_token"] > 0 and m["index_bytes_per_token"] > 0 and m["kept_set_bytes_per_token"] > 0
