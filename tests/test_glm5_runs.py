"""GLM-5 through the command lines: the issue's parity command on a folder transformers writes
(`--model.name=auto --kernels both`): exact is bitwise (sampled tokens, full vocabulary) with
index and expert disagreement 0, pinned (nothing shipped) and replay (the record shipped), while
the stock column (transformers' cached decode vs its full forward: vLLM's CPU build has no
sparse-attention backend) is not; and a short RL run (`rl_debug_glm5.toml`, frozen indexer, index
replay) with max |dlogp| 0 and index disagreement 0 at every step."""

import json
import os
import sys

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from titan_rl import parity  # noqa: E402
from titan_rl.hf_reference import hf_model  # noqa: E402

import _zygote  # noqa: E402

ROOT = os.path.join(os.path.dirname(__file__), "..")


# (bf16 with replay: transformers' decode and forward then agree on most tokens, bitwise on all of
# a sample this small at times, so its stock column is checked in fp32)
@pytest.mark.parametrize("dtype,mode", [("float32", "replay"), ("bfloat16", "pinned")])
def test_the_issue_command_is_bitwise_with_a_nonzero_stock_column(tmp_path, seed, monkeypatch, dtype, mode):
    monkeypatch.chdir(ROOT)
    hf_model("glm_moe_dsa", seed % 2**31, scale=0.2).save_pretrained(tmp_path / "hf")
    out = tmp_path / "parity.json"
    rc = parity.main(["--config", "train_configs/debug_glm5.toml", "--model.name=auto",
                      f"--model.checkpoint={tmp_path / 'hf'}", "--kernels", "both", "--num-prompts", "4",
                      "--seed", str(seed % 1000), "--json", str(out), f"--model.dtype={dtype}",
                      f"--rollout.index_selection={mode}", "--sampling.max_tokens=16", "--parity.prompt_len_min=20",
                      "--parity.prompt_len_max=60", "--rollout.max_model_len=512", "--rollout.max_num_seqs=8"])
    assert rc == 0
    res = {r["engine"]: r for r in json.loads(out.read_text())["results"]}
    exact, stock = res["exact"], res["stock"]
    assert exact["tokens"] == 64 and exact["full_vocab_positions"] > 0
    assert exact["bitwise_fraction"] == 1 and exact["max_abs_dlogp"] == 0 and exact["full_vocab_max_abs_dlogp"] == 0
    assert exact["index_disagreement"] == 0 and exact["expert_disagreement"] == 0
    assert exact["index_selection"] == mode and exact["index_record_bytes_per_token"] == 3 * 16 * 2
    assert exact["index_bytes_per_token"] == (96 if mode == "replay" else 0)
    assert exact["contract"]["differs"] == []
    assert stock["stock_source"].startswith("transformers decode vs forward: vLLM's CPU build has no sparse-attention")
    assert stock["tokens"] == 64 and stock["max_abs_dlogp"] > 0 and stock["bitwise_fraction"] < 1
    assert 0 <= stock["index_disagreement"] <= 1 and stock["indexed_positions"] == exact["indexed_positions"]


# a short RL run with index replay (1 SFT + 2 RL steps); tp_leaves = 8: the trainer's TP 2 pieces
RL = ["--config", "train_configs/rl_debug_glm5.toml", "--training.steps=3", "--algorithm.sft_steps=1",
      "--algorithm.prompts_per_step=2", "--algorithm.group_size=4", "--lr_scheduler.warmup_steps=1",
      "--checkpoint.enable=false", "--rollout.index_selection=replay", "--model.tp_leaves=8"]
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def _metrics(run) -> list[dict]:
    with open(run / "metrics.jsonl") as f:
        return [json.loads(ln) for ln in f if ln.strip()]


@pytest.fixture(scope="module")
def alone(tmp_path_factory):
    """{freeze: the one-process run's metrics lines}, run on first use."""
    runs: dict = {}

    def get(freeze: str) -> list[dict]:
        if freeze not in runs:
            run = tmp_path_factory.mktemp(f"glm5_rl_{freeze}") / "run"
            cmd = [sys.executable, "-m", "titan_rl.train", *RL, "--run-dir", str(run), f"--model.freeze_indexer={freeze}"]
            r = _zygote.run(cmd, env=ENV, capture_output=True, text=True, timeout=600, cwd=ROOT)
            assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
            runs[freeze] = _metrics(run)
        return runs[freeze]

    return get


@pytest.mark.parametrize("freeze", ["true", "false"])
def test_rl_with_index_replay_has_zero_mismatch_with_the_indexer_frozen_or_trained(alone, freeze):
    """The record travels and is applied without breaking bitwise RL, with the indexer frozen or
    trained by its loss (logged as indexer_loss; its moved weights reach the engine). The
    trainer's own sets equal the engine's here, so this run cannot show the override is used:
    test_glm5_vllm's test_the_rl_step_scores_the_samplers_policy_only_with_both_replays_on_a_perturbed_trainer does."""
    rl = [m for m in alone(freeze) if m["phase"] == "rl"]
    assert len(rl) == 2
    for m in rl:
        assert m["max_abs_dlogp"] == 0.0 and m["bitwise_fraction"] == 1.0 and m["weights_checksum_equal"], m
        assert m["index_disagreement"] == 0.0 and m["expert_disagreement"] == 0.0, m
        assert m["index_bytes_per_token"] == 96, m  # 3 indexer layers x 16 positions x int16
        assert ("indexer_loss" in m) == (freeze == "false") and m.get("indexer_loss", 1) > 0, m


def test_trainer_and_engine_at_tp_2_write_the_one_process_metrics(alone, tmp_path):
    """GLM-5 at trainer TP 2 under torchrun (each rank: its MLA heads, a slice of every expert;
    the latent rows, the indexer and the router whole), the indexer trained by its loss, with a
    separate engine at TP 2 (two vLLM workers, each its heads from its rows of kv_b_proj over
    the whole latent cache; the key sets and routes it records replayed): every metrics line
    equals the one-process colocated run's at the same tp_leaves (wall-clock aside), the
    gradients clipped. Both trainer layouts add the heads' parts of the latent rows' gradient
    and of the indexer loss's target by the same fixed tree (models/glm_moe_dsa/parallelize.py).
    Reversing the order of the ranks' head parts in the trainer, or a worker's heads in the
    engine, fails it (checked by hand); scripts/matrix.py runs trainer TP 2 with engines at TP 1."""
    from titan_rl.run_dir import comparable

    cmd = [sys.executable, "-m", "titan_rl.train", *RL,
           "--run-dir", str(tmp_path / "tp2"), "--model.freeze_indexer=false",
           "--parallelism.tensor_parallel_degree=2", "--parallelism.data_parallel_shard_degree=1",
           "--rollout.placement=separate", "--rollout.engine_tp=2"]
    r = _zygote.torchrun(2, cmd, env=ENV, timeout=600, cwd=ROOT)  # torchrun --nproc_per_node=2
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    got, want = _metrics(tmp_path / "tp2"), alone("false")
    assert [comparable(m) for m in got] == [comparable(m) for m in want]
    assert any(m["grad_norm"] > 1.0 for m in want)  # max_norm = 1: the clipping acted
    assert all(m.get("indexer_loss", 0) > 0 and m["weights_checksum_equal"] and m["index_bytes_per_token"] == 96
               for m in got if m["phase"] == "rl")
