"""The HTML report (titan_rl.report) from a tiny run folder and tiny parity JSONs: no browser."""

import json
import re

import pytest

from titan_rl import charts, report

import _zygote


def _run_dir(tmp_path, mismatch=True):
    d = tmp_path / "run"
    d.mkdir()
    rows = [{"step": s, "phase": "sft", "loss": 5.0 - s, "grad_norm": 1.0, "lr": 1e-3, "train_tokens_per_s": 900.0}
            for s in (1, 2)]
    for s in range(3, 25):
        dl = (0.0 if s % 3 else 2.5e-3 * s) if mismatch else 0.0
        rows.append({"step": s, "phase": "rl", "loss": -0.01, "grad_norm": 0.5, "lr": 1e-3,
                     "reward_mean": 0.1 if s < 13 else 0.5, "response_length": 6.0,
                     "bitwise_fraction": 1.0 if dl == 0 else 0.75, "max_abs_dlogp": dl, "mean_abs_dlogp": dl / 10,
                     "k3_mean": dl * dl / 2, "clip_fraction": 0.0, "weights_checksum_equal": True,
                     "rollout_tokens_per_s": 1200.0, "train_tokens_per_s": 3000.0, "time_rollout_seconds": 0.1})
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


def _parity(tmp_path, detail: bool, name="p.json"):
    results = [
        {"engine": "exact", "tokens": 6, "bitwise_fraction": 1.0, "max_abs_dlogp": 0.0, "mean_abs_dlogp": 0.0,
         "k3_mean": 0.0, "k3_max": 0.0, "full_vocab_max_abs_dlogp": 0.0},
        {"engine": "stock", "tokens": 6, "bitwise_fraction": 1 / 3, "max_abs_dlogp": 0.0234, "mean_abs_dlogp": 0.0061,
         "k3_mean": 3.5e-5, "k3_max": 2.7e-4, "full_vocab_max_abs_dlogp": 0.0377},
    ]
    if detail:
        mu = [-0.1, -1.0, -2.0, -0.5, -3.0, -0.01]
        results[0].update(pi=list(mu), mu=mu, log_ratio=[0.0] * 6, position=[0, 1, 2, 0, 1, 2],
                          entropy=[0.1, 0.5, 1.0, 2.0, 3.0, 4.0])
        lr = [0.0, 0.0, 2e-5, -3e-3, 0.0234, -5e-7]
        results[1].update(pi=[m + r for m, r in zip(mu, lr)], mu=mu, log_ratio=lr, position=[0, 1, 2, 0, 1, 2],
                          entropy=[0.1, 0.5, 1.0, 2.0, 3.0, 4.0])
    doc = {"config": {"model": {"name": "qwen3", "flavor": "debug", "dtype": "bfloat16"}}, "seed": 0,
           "num_prompts": 2, "results": results, **results[0]}
    p = tmp_path / name
    p.write_text(json.dumps(doc))
    return p


def _self_contained(text):
    assert text.startswith("<!DOCTYPE html>") and text.rstrip().endswith("</html>")
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", text, re.I)
    assert "<script" not in text.lower()


def test_run_folder_report(tmp_path, capsys):
    d = _run_dir(tmp_path)
    assert report.main([str(d)]) == 0
    out = d / "report.html"
    assert str(out) in capsys.readouterr().out
    text = out.read_text()
    _self_contained(text)
    for title in ("Summary", "Per-step curves", "Mean reward per RL step", "Max |pi - mu| per step",
                  "Mean |pi - mu| per step", "k3 mean (KL estimate) per step", "Fraction of tokens bitwise equal",
                  "Loss (SFT warm-up, then RL policy gradient)", "Mean response length", "Throughput"):
        assert title in text, title
    assert text.count("<svg") == 8
    assert "<td>RL steps</td><td>22</td>" in text and "<td>steps</td><td>24</td>" in text
    assert "<td>0.06</td>" in text  # max over steps of max_abs_dlogp (step 24)
    assert "first 10 RL steps</td><td>0.1</td>" in text and "last 10 RL steps</td><td>0.5</td>" in text
    assert "0 (bitwise)" in text  # log axis with exact zeros on their own band
    assert "Mismatch" in text


def test_run_folder_all_zero_says_bitwise_equal(tmp_path):
    d = _run_dir(tmp_path, mismatch=False)
    out = tmp_path / "sub" / "r.html"
    assert report.main([str(d), "--out", str(out)]) == 0
    text = out.read_text()
    assert "bitwise equal: exactly 0 at all 22 points" in text
    assert "Bitwise equal: at all 22 RL steps" in text


def test_run_folder_with_held_out_evaluations(tmp_path):
    """[eval] lines ("phase": "eval", titan_rl.rl.evaluation): one chart over the weights'
    step, the first and last accuracy in the summary, not counted as steps."""
    d = _run_dir(tmp_path)
    path = d / "metrics.jsonl"
    evals = [{"step": s + 1 if s == 2 else s, "phase": "eval", "weights_step": s, "eval_accuracy": a,
              "eval_reward_mean": a, "eval_response_length": 5.0, "eval_n": 8} for s, a in ((2, 0.25), (12, 0.5))]
    path.write_text(path.read_text() + "".join(json.dumps(r) + "\n" for r in evals))
    assert report.main([str(d)]) == 0
    text = (d / "report.html").read_text()
    assert "Held-out evaluation (greedy; [eval])" in text and text.count("<svg") == 9
    assert "<td>steps</td><td>24</td>" in text
    assert "weights after step 2</td><td>0.25</td>" in text and "weights after step 12</td><td>0.5</td>" in text


def test_parity_without_detail(tmp_path):
    p = _parity(tmp_path, detail=False)
    assert report.main([str(p)]) == 0
    text = (tmp_path / "p.html").read_text()
    _self_contained(text)
    for s in ("Engines side by side", "<code>exact</code>", "<code>stock</code>", "0.0234", "3.500e-05",
              "0.0377", "bitwise equal", "mismatch",
              "Per-token detail not recorded; rerun parity with --detail"):
        assert s in text, s
    assert "<svg" not in text


def test_parity_with_detail(tmp_path):
    p = _parity(tmp_path, detail=True)
    out = tmp_path / "d.html"
    assert report.main([str(p), "--out", str(out)]) == 0
    text = out.read_text()
    _self_contained(text)
    assert "not recorded" not in text
    for s in ("distribution of |log ratio|", "trainer vs sampler probability", "by token position",
              "by entropy", "all 6 tokens bitwise equal", "bitwise equal: every point on y = x exactly",
              "&gt; 1e-06", "&gt; 0.0001", "&gt; 0.01", "= 0 (bitwise)"):
        assert s in text, s
    assert text.count("<svg") == 8
    # stock tails: |lr| > 1e-6: 3 of 6, > 1e-4: 2, > 1e-2: 1; zeros: 2
    stock = text[text.index("Engine <code>stock</code>"):]
    assert "&gt; 1e-06</td><td>0.5</td><td>3</td>" in stock
    assert "&gt; 0.0001</td><td>0.3333</td><td>2</td>" in stock
    assert "&gt; 0.01</td><td>0.1667</td><td>1</td>" in stock


def test_parity_detail_from_pi_mu_only(tmp_path):
    doc = json.loads(_parity(tmp_path, detail=True).read_text())
    for r in doc["results"]:
        del r["log_ratio"], r["entropy"]
    p = tmp_path / "q.json"
    p.write_text(json.dumps(doc))
    assert report.main([str(p)]) == 0
    text = (tmp_path / "q.html").read_text()
    assert "distribution of |log ratio|" in text and "entropy not recorded" in text


@pytest.mark.parametrize("kind", ["missing", "empty_dir", "not_json", "not_parity", "bad_jsonl", "bad_arrays"])
def test_bad_path_is_a_clear_error(tmp_path, capsys, kind):
    if kind == "missing":
        path = tmp_path / "nope"
    elif kind == "empty_dir":
        path = tmp_path / "empty"
        path.mkdir()
    elif kind == "not_json":
        path = tmp_path / "x.json"
        path.write_text("{not json")
    elif kind == "not_parity":
        path = tmp_path / "x.json"
        path.write_text('{"a": 1}')
    elif kind == "bad_jsonl":
        path = tmp_path / "run"
        path.mkdir()
        (path / "metrics.jsonl").write_text('{"step": 1}\nnot json\n')
    else:
        path = _parity(tmp_path, detail=True)
        doc = json.loads(path.read_text())
        doc["results"][1]["position"] = [0]
        path.write_text(json.dumps(doc))
    assert report.main([str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("report: error:") and str(path) in err
    if kind == "bad_arrays":
        assert "'position'" in err


def test_cli_module_exit_code(tmp_path):
    import sys

    p = _zygote.run([sys.executable, "-m", "titan_rl.report", str(tmp_path / "missing")], capture_output=True, text=True)
    assert p.returncode == 2 and str(tmp_path / "missing") in p.stderr


def test_nice_ticks_cover_range():
    t = charts.nice_ticks(0.0, 1.15)
    assert t[0] <= 0.0 and t[-1] >= 1.15
    assert all(float(x).is_integer() for x in charts.nice_ticks(3, 24, 6, integer=True))


def _svgs(text):
    svgs = re.findall(r"<svg\b.*?</svg>", text, re.S)
    assert len(svgs) == text.count("<svg")
    return svgs


RUN_TITLES = ("Mean reward per RL step", "Max |pi - mu| per step", "Mean |pi - mu| per step",
              "k3 mean (KL estimate) per step", "Fraction of tokens bitwise equal",
              "Loss (SFT warm-up, then RL policy gradient)", "Mean response length", "Throughput")


def test_each_chart_is_an_inline_svg_with_its_title(tmp_path):
    d = _run_dir(tmp_path)
    assert report.main([str(d)]) == 0
    text = (d / "report.html").read_text()
    assert "<?xml" not in text and "<!DOCTYPE svg" not in text  # inlined, not a standalone SVG file
    svgs = _svgs(text)
    assert len(svgs) == len(RUN_TITLES)
    for title, svg in zip(RUN_TITLES, svgs):
        escaped = title.replace("&", "&amp;")
        assert f'aria-label="{escaped}"' in svg, title
        assert re.search(r"<text\b[^>]*>" + re.escape(escaped) + "</text>", svg), title
    p = _parity(tmp_path, detail=True)
    assert report.main([str(p)]) == 0
    svgs = _svgs((tmp_path / "p.html").read_text())
    for i, engine in enumerate(("exact", "stock")):
        for j, title in enumerate(("distribution of |log ratio|", "trainer vs sampler probability",
                                   "by token position", "by entropy")):
            assert re.search(r"<text\b[^>]*>" + re.escape(f"{engine}: ") + r"[^<]*" + re.escape(title),
                             svgs[4 * i + j]), (engine, title)


def test_chart_ids_are_unique_in_the_page(tmp_path):
    p = _parity(tmp_path, detail=True)
    assert report.main([str(p)]) == 0
    text = (tmp_path / "p.html").read_text()
    ids = re.findall(r'\bid="([^"]+)"', text)
    assert ids and len(ids) == len(set(ids))
    refs = set(re.findall(r'(?:url\(#|href="#)([^)"]+)', text))
    assert refs and refs <= set(ids)


def test_rendering_is_deterministic(tmp_path):
    d = _run_dir(tmp_path)
    p = _parity(tmp_path, detail=True)
    for path in (d, p):
        a, b = tmp_path / "a.html", tmp_path / "b.html"
        assert report.main([str(path), "--out", str(a)]) == 0
        assert report.main([str(path), "--out", str(b)]) == 0
        assert a.read_bytes() == b.read_bytes(), path


ENTRIES = {"dtype": "float32", "kernels": "exact", "op.linear": "titan_rl.kernels.matmul.torch_impl.linear",
           "tp_leaves": 0}


def _with_contract(d, engine_entries=None):
    path = d / "metrics.jsonl"
    rows = [json.loads(ln) for ln in path.read_text().splitlines()]
    for r in rows[2:]:  # the RL steps
        r["contract"] = "c0ffee"
    rows[2]["contract_entries"] = ENTRIES
    if engine_entries is not None:
        rows[2]["contract_engine_entries"] = engine_entries
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_run_folder_shows_the_contract(tmp_path):
    d = _run_dir(tmp_path)
    assert report.main([str(d)]) == 0
    assert "No execution contract recorded" in (d / "report.html").read_text()
    _with_contract(d)
    assert report.main([str(d)]) == 0
    text = (d / "report.html").read_text()
    _self_contained(text)
    assert "<h2>Execution contract</h2>" in text and "From step 3: <code>c0ffee</code>" in text
    assert "<td><code>dtype</code></td><td>float32</td><td>float32</td>" in text
    assert "<td><code>tp_leaves</code></td><td>0</td><td>0</td>" in text
    assert "<span class='bad'>" not in text


def test_run_folder_contract_marks_what_differs(tmp_path):
    d = _run_dir(tmp_path)
    _with_contract(d, {**ENTRIES, "op.linear": "vllm built-in Qwen3ForCausalLM"})
    assert report.main([str(d)]) == 0
    text = (d / "report.html").read_text()
    assert ("<td><code>op.linear</code></td><td><span class='bad'>titan_rl.kernels.matmul.torch_impl.linear</span>"
            "</td><td><span class='bad'>vllm built-in Qwen3ForCausalLM</span></td>") in text
    assert "<td><code>dtype</code></td><td>float32</td><td>float32</td>" in text


def test_parity_shows_each_engines_contract(tmp_path):
    p = _parity(tmp_path, detail=False)
    doc = json.loads(p.read_text())
    stock_t, stock_e = {**ENTRIES, "op.linear": "torch.nn.functional.linear"}, {**ENTRIES, "op.linear": "vllm X"}
    doc["results"][0]["contract"] = {"trainer": {"hash": "h1", "entries": ENTRIES},
                                     "engine": {"hash": "h1", "entries": ENTRIES}, "differs": []}
    doc["results"][1]["contract"] = {"trainer": {"hash": "h2", "entries": stock_t},
                                     "engine": {"hash": "h3", "entries": stock_e}, "differs": ["op.linear"]}
    p.write_text(json.dumps(doc))
    assert report.main([str(p)]) == 0
    text = (tmp_path / "p.html").read_text()
    _self_contained(text)
    assert "Engine <code>exact</code>: <span class='ok'>equal</span> (trainer <code>h1</code>" in text
    assert "Engine <code>stock</code>: <span class='bad'>differs in op.linear</span>" in text
    assert "<span class='bad'>vllm X</span>" in text


def test_run_summary_has_time_by_phase_and_peak_rss():
    rows = [{"step": s, "phase": "rl", "step_seconds": 2.0 * s, "time_backward_seconds": 1.0 * s,
             "peak_rss_mib": 100.0 + s} for s in (1, 2, 3)]
    got = dict(report.run_summary(rows))
    assert got["mean seconds per RL step"] == 4.0 and got["  ... backward"] == 2.0 and got["  ... rollout"] is None
    assert got["peak RSS of the trainer process (MiB)"] == 103.0
