"""The parity harness end to end (exact engine, small sample): max |dlogp| == 0."""

import json

import pytest

pytest.importorskip("vllm")


def test_parity_cli_exact_is_bitwise(tmp_path, capsys):
    from titan_rl.parity import main

    out = tmp_path / "p.json"
    rc = main(["--config", "train_configs/debug.toml", "--kernels", "exact", "--num-prompts", "6", "--detail",
               "--json", str(out), "--sampling.max_tokens=16", "--parity.full_vocab_prompts=1",
               "--rollout.max_num_batched_tokens=96"])
    assert rc == 0
    doc = json.loads(out.read_text())
    r = doc["results"][0]
    assert r["engine"] == "exact" and r["tokens"] == 6 * 16
    assert r["max_abs_dlogp"] == 0.0 and r["bitwise_fraction"] == 1.0
    assert r["full_vocab_max_abs_dlogp"] == 0.0 and r["full_vocab_positions"] == 16
    assert "max_abs_dlogp" in capsys.readouterr().out
    assert len(r["log_ratio"]) == 96 and set(r["log_ratio"]) == {0.0} and len(r["entropy"]) == 96
    c = r["contract"]  # both sides' execution contracts, computed from what each holds
    assert c["differs"] == [] and c["trainer"]["hash"] == c["engine"]["hash"]
    assert c["engine"]["entries"]["dtype"] == "bfloat16" and c["engine"]["entries"]["kernels"] == "exact"
    from titan_rl.report import main as report_main

    assert report_main([str(out)]) == 0  # the report reads the per-token detail
    html = (tmp_path / "p.html").read_text()
    assert "bitwise equal" in html and "<h2>Execution contract</h2>" in html


def test_parity_cli_bad_config_is_a_clear_error(capsys):
    from titan_rl.parity import main

    assert main(["--config", "train_configs/debug.toml", "--model.flavour=debug"]) == 2
    assert "did you mean 'flavor'" in capsys.readouterr().err


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_parity_on_multi_turn_episodes_is_bitwise_on_every_turn_and_stock_is_not(tmp_path, dtype):
    """parity.episodes: both engines play the built-in multi-turn environment (4 turns each,
    later turns on the prefix cache); exact: every sampled token of every turn bitwise equal;
    stock (vLLM's own model, plain-torch trainer): not. The detail records each token's turn
    and position in its reply, which the report slices by."""
    from titan_rl.parity import main
    from titan_rl.report import main as report_main

    out = tmp_path / "p.json"
    rc = main(["--config", "train_configs/debug.toml", "--kernels", "both", "--detail", "--json", str(out),
               f"--model.dtype={dtype}", "--parity.episodes=4", "--task.name=digit_turns",
               "--task.kwargs={turns = 4, min_len = 7, max_len = 11}", "--rollout.block_size=32",
               "--rollout.max_model_len=128", "--parity.full_vocab_prompts=1"])
    assert rc == 0
    exact, stock = json.loads(out.read_text())["results"]
    for r in (exact, stock):
        assert r["episodes"] == 4 and r["turns_per_episode"] == 4 and r["prefix_cached_tokens"] > 0, r
        assert sorted(set(r["turn"])) == [0, 1, 2, 3] and len(r["turn"]) == len(r["position"]) == r["tokens"]
    assert exact["max_abs_dlogp"] == 0.0 and exact["bitwise_fraction"] == 1.0
    assert exact["full_vocab_max_abs_dlogp"] == 0.0
    assert stock["max_abs_dlogp"] > 0.0  # the stock column is a real measurement
    assert report_main([str(out)]) == 0
    assert "mean |log ratio| by turn" in (tmp_path / "p.html").read_text()
