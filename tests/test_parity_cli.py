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
