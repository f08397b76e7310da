"""One self-contained HTML page from a training run folder or a parity JSON.

    python -m titan_rl.report PATH [--out FILE.html]

PATH is either a run folder written by `python -m titan_rl.train --run-dir DIR`
(it reads DIR/metrics.jsonl) or a JSON written by `python -m titan_rl.parity --json`.
Default output: DIR/report.html, or <json stem>.html next to the JSON.
Charts are inline SVG drawn by matplotlib (titan_rl.charts): no JavaScript, no network.
"""

from __future__ import annotations

import argparse
import html
import json
import math
import os
import sys

from titan_rl.charts import COLORS, bar_chart, finite, line_chart, scatter_chart

# ----------------------------------------------------------------------------- formatting


def fmt(v) -> str:
    """A number for a table cell: ints as is, floats to 4 significant digits, 0 as 0."""
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            return str(v)
        if v == 0:
            return "0"
        if abs(v) < 1e-3 or abs(v) >= 1e6:
            return f"{v:.3e}"
        return f"{v:.4g}"
    return html.escape(str(v))


def _esc(s) -> str:
    return html.escape(str(s))


# ----------------------------------------------------------------------------- page

CSS = """
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 24px auto; max-width: 1240px;
       color: #222; line-height: 1.45; padding: 0 12px; }
h1 { font-size: 24px; margin-bottom: 4px; } h2 { font-size: 19px; margin-top: 30px; border-bottom: 1px solid #ddd; }
h3 { font-size: 16px; margin-top: 20px; }
.src { color: #666; font-size: 13px; } .intro { background: #f5f7fa; border-left: 4px solid #1f77b4; padding: 10px 14px; }
table { border-collapse: collapse; margin: 10px 0; font-size: 14px; }
th, td { border: 1px solid #ccc; padding: 4px 10px; text-align: right; } th { background: #f0f0f0; }
td:first-child, th:first-child { text-align: left; }
.charts { display: grid; grid-template-columns: repeat(auto-fill, minmax(600px, 1fr)); gap: 14px; }
.charts svg { border: 1px solid #ddd; }
.ok { color: #2a7a2a; font-weight: bold; } .bad { color: #b22222; font-weight: bold; }
.missing { background: #fff6e0; border-left: 4px solid #e0a000; padding: 8px 12px; }
"""

INTRO = (
    "<p class='intro'>titan_rl makes the RL <b>trainer</b> and the <b>sampler</b> (vLLM) compute the same "
    "log-probabilities, to the bit. For every sampled token, <b>&pi;</b> (pi) is the trainer's log-probability "
    "of that token and <b>&mu;</b> (mu) is the log-probability the sampler reported when it drew it. The "
    "<b>log ratio</b> log&nbsp;&rho; = &pi; &minus; &mu; is 0 when the two agree exactly (&ldquo;bitwise "
    "equal&rdquo;); |&pi; &minus; &mu;| is reported as <i>max_abs_dlogp</i> / <i>mean_abs_dlogp</i>, and "
    "<i>bitwise_fraction</i> is the share of tokens with &pi; = &mu; exactly. <b>k3 mean</b> is the mean of "
    "&rho; &minus; log&nbsp;&rho; &minus; 1 over tokens, an estimate of the KL divergence between sampler and "
    "trainer (0 when they are equal, always &ge; 0). Any nonzero value means the importance ratio used by the "
    "policy-gradient loss is off by rounding differences, not by learning.</p>"
)


def page(title: str, source: str, body: list[str]) -> str:
    return "\n".join([
        "<!DOCTYPE html>", "<html lang='en'><head><meta charset='utf-8'>",
        f"<title>{_esc(title)}</title>", f"<style>{CSS}</style></head><body>",
        f"<h1>{_esc(title)}</h1>", f"<div class='src'>source: {_esc(source)}</div>", INTRO,
        *body, "</body></html>",
    ])


def table(header: list[str], rows: list[list[str]]) -> str:
    """Cells are already HTML (use fmt / _esc)."""
    h = "".join(f"<th>{c}</th>" for c in header)
    r = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{h}</tr>{r}</table>"


# ----------------------------------------------------------------------------- run folder


def _mean(xs):
    xs = [x for x in xs if finite(x)]
    return sum(xs) / len(xs) if xs else None


def run_summary(rows: list[dict]) -> list[tuple[str, object]]:
    rl = [r for r in rows if r.get("phase") == "rl"]
    dl = [(r["max_abs_dlogp"], r["step"]) for r in rl if finite(r.get("max_abs_dlogp"))]
    rewards = [r.get("reward_mean") for r in rl if finite(r.get("reward_mean"))]
    bw = [r["bitwise_fraction"] for r in rl if finite(r.get("bitwise_fraction"))]
    evals = [r for r in rows if r.get("phase") == "eval" and finite(r.get("eval_accuracy"))]
    out: list[tuple[str, object]] = [
        ("steps", sum(1 for r in rows if r.get("phase") != "eval")),
        ("last step", max((r.get("step", 0) for r in rows), default=None)),
        ("SFT steps", sum(1 for r in rows if r.get("phase") == "sft")),
        ("RL steps", len(rl)),
        ("max over steps of max_abs_dlogp", max(dl)[0] if dl else None),
    ]
    if dl and max(dl)[0] > 0:
        out.append(("  ... at step", max(dl)[1]))
    out += [
        ("min over steps of bitwise_fraction", min(bw) if bw else None),
        ("mean k3_mean", _mean([r.get("k3_mean") for r in rl])),
        (f"reward_mean, first {min(10, len(rewards))} RL steps", _mean(rewards[:10])),
        (f"reward_mean, last {min(10, len(rewards))} RL steps", _mean(rewards[-10:])),
        *([(f"eval_accuracy (held-out, greedy), weights after step {evals[0].get('weights_step')}",
             evals[0]["eval_accuracy"]),
           (f"eval_accuracy (held-out, greedy), weights after step {evals[-1].get('weights_step')}",
            evals[-1]["eval_accuracy"])] if evals else []),
        ("mean rollout tokens/s", _mean([r.get("rollout_tokens_per_s") for r in rl])),
        ("mean train tokens/s", _mean([r.get("train_tokens_per_s") for r in rows])),
        ("mean seconds per RL step", _mean([r.get("step_seconds") for r in rl])),
        *((f"  ... {name}", _mean([r.get(f"time_{key}_seconds") for r in rl]))
          for name, key in (("rollout", "rollout"), ("forward", "forward"), ("backward", "backward"),
                            ("optimizer", "optimizer"), ("weight sync", "weight_sync"))),
        *([("mean turns per episode", _mean([r.get("turns_per_episode") for r in rl])),
           ("render breaks (all steps)", sum(r.get("render_breaks", 0) for r in rl)),
           ("re-render divergence (episodes, all steps)", sum(r.get("rerender_divergence", 0) for r in rl)),
           ("mixed-version tokens (all steps)", sum(r.get("mixed_version_tokens", 0) for r in rl)),
           ("environment errors (all steps)", sum(r.get("env_errors", 0) for r in rl)),
           ("  ... of the rollout: environments' seconds per step", _mean([r.get("time_env_seconds") for r in rl]))]
          if any("turns_per_episode" in r for r in rl) else []),
        ("peak RSS of the trainer process (MiB)", max((r["peak_rss_mib"] for r in rows if finite(r.get("peak_rss_mib"))),
                                                      default=None)),
    ]
    ed = [r["expert_disagreement"] for r in rl if finite(r.get("expert_disagreement"))]
    if ed:
        out.append(("max over steps of expert_disagreement (MoE)", max(ed)))
    idx = [r["index_disagreement"] for r in rl if finite(r.get("index_disagreement"))]
    if idx:
        out.append(("max over steps of index_disagreement (sparse attention)", max(idx)))
        ib = [r["index_bytes_per_token"] for r in rl if finite(r.get("index_bytes_per_token"))]
        out.append(("index_bytes_per_token (shipped: replay's record, 0 pinned)", max(ib) if ib else None))
    checks = [r["weights_checksum_equal"] for r in rl if "weights_checksum_equal" in r]
    if checks:
        out.append(("weight sync checksum equal at every RL step", all(checks)))
    return out


def contract_table(trainer: dict, engine: dict | None = None) -> str:
    """The execution contract's entries (titan_rl.contract): one column per side, entries
    that differ marked."""
    engine = trainer if engine is None else engine
    rows = []
    for name in sorted(trainer.keys() | engine.keys()):
        t, e = trainer.get(name), engine.get(name)
        cells = [fmt(t), fmt(e)]
        if t != e:
            cells = [f"<span class='bad'>{c}</span>" for c in cells]
        rows.append([f"<code>{_esc(name)}</code>", *cells])
    return table(["entry", "trainer", "engine"], rows)


CONTRACT_INTRO = ("<p>Every choice that decides a log-prob's bits (kernel per op and source hashes, kernel mode, "
                  "dtype, tp_leaves, platform choices and thread count, self-check, package versions), as each "
                  "side computes it. The trainer refuses to sample when the two differ; in stock mode the "
                  "<code>op.*</code> entries differ by design.</p>")


def run_contract(rows: list[dict]) -> list[str]:
    """The contract entries logged in metrics.jsonl (first RL step, and every change)."""
    logged = [r for r in rows if isinstance(r.get("contract_entries"), dict)]
    if not logged:
        return ["<h2>Execution contract</h2>", "<p class='missing'>No execution contract recorded in "
                "metrics.jsonl (no RL step yet, or a run from before the contract existed).</p>"]
    out = ["<h2>Execution contract</h2>", CONTRACT_INTRO]
    for r in logged:
        out.append(f"<h3>From step {fmt(r.get('step'))}: <code>{_esc(r.get('contract'))}</code></h3>")
        out.append(contract_table(r["contract_entries"], r.get("contract_engine_entries")))
    return out


def _pts(rows, key, phase=None):
    return [(r["step"], r[key]) for r in rows if key in r and "step" in r and (phase is None or r.get("phase") == phase)]


def run_report(run_dir: str, rows: list[dict]) -> str:
    summ = run_summary(rows)
    rl = [r for r in rows if r.get("phase") == "rl"]
    dl = [r["max_abs_dlogp"] for r in rl if finite(r.get("max_abs_dlogp"))]
    if not rl:
        verdict = "<p>No RL steps recorded (only supervised warm-up steps): no mismatch measured.</p>"
    elif dl and max(dl) == 0:
        verdict = (f"<p class='ok'>Bitwise equal: at all {len(rl)} RL steps the trainer's log-probs matched "
                   "the sampler's exactly (max_abs_dlogp = 0).</p>")
    else:
        verdict = (f"<p class='bad'>Mismatch: max_abs_dlogp reached {fmt(max(dl) if dl else None)} "
                   f"over {len(rl)} RL steps.</p>")
    body = ["<h2>Summary</h2>", verdict,
            table(["quantity", "value"], [[_esc(k), fmt(v)] for k, v in summ])]
    charts = [
        line_chart([("reward_mean", _pts(rows, "reward_mean", "rl"))], "Mean reward per RL step", "step", "reward_mean"),
        line_chart([("max_abs_dlogp", _pts(rows, "max_abs_dlogp", "rl"))],
                   "Max |pi - mu| per step", "step", "max |log ratio|", log=True, zero_means_equal=True),
        line_chart([("mean_abs_dlogp", _pts(rows, "mean_abs_dlogp", "rl"))],
                   "Mean |pi - mu| per step", "step", "mean |log ratio|", log=True, zero_means_equal=True),
        line_chart([("k3_mean", _pts(rows, "k3_mean", "rl"))],
                   "k3 mean (KL estimate) per step", "step", "k3 mean", log=True, zero_means_equal=True),
        line_chart([("bitwise_fraction", _pts(rows, "bitwise_fraction", "rl"))],
                   "Fraction of tokens bitwise equal", "step", "bitwise_fraction (1 = all equal)",
                   ylim=(0.0, 1.0)),
        *([line_chart([("expert_disagreement", _pts(rows, "expert_disagreement", "rl"))],
                      "MoE expert disagreement per step (sampler vs trainer router)", "step",
                      "share of expert choices", log=True, zero_means_equal=True)]
          if any("expert_disagreement" in r for r in rl) else []),
        *([line_chart([("index_disagreement", _pts(rows, "index_disagreement", "rl"))],
                      "Sparse attention: index disagreement per step (sampler's key sets vs the trainer indexer's)",
                      "step", "share of (position, layer) sets", log=True, zero_means_equal=True)]
          if any("index_disagreement" in r for r in rl) else []),
        *([line_chart([(k, [(r["weights_step"], r[k]) for r in rows if r.get("phase") == "eval" and k in r])
                       for k in ("eval_accuracy", "eval_reward_mean")],
                      "Held-out evaluation (greedy; [eval])", "weights after step", "share of questions / mean reward",
                      ylim=(0.0, 1.0))]
          if any(r.get("phase") == "eval" for r in rows) else []),
        *([line_chart([("turns per episode", _pts(rows, "turns_per_episode", "rl")),
                       ("samples per episode", _pts(rows, "samples_per_episode", "rl"))],
                      "Episodes: replies per episode, and training samples each became (splits)", "step",
                      "per episode"),
           line_chart([("render_breaks", _pts(rows, "render_breaks", "rl")),
                       ("rerender_divergence", _pts(rows, "rerender_divergence", "rl")),
                       ("mixed_version_tokens", _pts(rows, "mixed_version_tokens", "rl")),
                       ("env_errors", [(r["step"], r.get("env_errors", 0)) for r in rl])],
                      "Episodes: template breaks, episodes a re-render would change, mixed-version tokens, "
                      "environment errors", "step", "count per step")]
          if any("turns_per_episode" in r for r in rl) else []),
        line_chart([("SFT", _pts(rows, "loss", "sft")), ("RL", _pts(rows, "loss", "rl"))],
                   "Loss (SFT warm-up, then RL policy gradient)", "step", "loss"),
        line_chart([("response_length", _pts(rows, "response_length", "rl"))],
                   "Mean response length", "step", "tokens per completion"),
        line_chart([("rollout (vLLM)", _pts(rows, "rollout_tokens_per_s")),
                    ("train", _pts(rows, "train_tokens_per_s"))],
                   "Throughput", "step", "tokens / s"),
    ]
    body += ["<h2>Per-step curves</h2>",
             "<p>SFT warm-up steps have no sampler, so the mismatch and reward curves start at the first RL step. "
             "Mismatch curves use a log scale; steps where the value is exactly 0 sit on the band marked "
             "&ldquo;0 (bitwise)&rdquo;.</p>",
             "<div class='charts'>", *charts, "</div>", *run_contract(rows)]
    return page(f"titan_rl run report: {os.path.basename(os.path.abspath(run_dir))}", os.path.abspath(run_dir), body)


# ----------------------------------------------------------------------------- parity JSON

PARITY_KEYS = [
    ("tokens", "sampled tokens compared"),
    ("bitwise_fraction", "share of tokens with pi == mu exactly"),
    ("max_abs_dlogp", "max |pi - mu|"),
    ("mean_abs_dlogp", "mean |pi - mu|"),
    ("k3_mean", "mean of rho - log rho - 1 (KL estimate)"),
    ("k3_max", "max of rho - log rho - 1"),
    ("full_vocab_positions", "positions with the full vocabulary compared"),
    ("full_vocab_max_abs_dlogp", "max |pi - mu| over the whole vocabulary"),
    ("full_vocab_bitwise_fraction", "share of full-vocabulary entries equal"),
    ("routed_positions", "MoE: positions whose experts were compared"),
    ("expert_disagreement", "MoE: share of the sampler's expert choices the trainer's router did not make"),
    ("route_bytes_per_token", "MoE: router-replay record size per token"),
    ("index_selection", "sparse attention: pinned (the trainer recomputes the key sets) or replay (the sampler's)"),
    ("indexed_positions", "sparse attention: positions whose selected key sets were compared"),
    ("index_disagreement", "sparse attention: share of the sampler's (position, layer) key sets the trainer's indexer "
                           "did not select"),
    ("index_bytes_per_token", "sparse attention: bytes per token the mode ships to the trainer (0 when pinned)"),
    ("index_record_bytes_per_token", "sparse attention: the index-replay record's size per token"),
    ("unified_vs_builtin_max_abs_dlogp", "our exact model vs vLLM's built-in one, max"),
    ("unified_vs_builtin_mean_abs_dlogp", "our exact model vs vLLM's built-in one, mean"),
    ("episodes", "episodes played (parity.episodes)"),
    ("turns_per_episode", "episodes: replies sampled per episode, mean"),
    ("prefix_cached_tokens", "episodes: prompt tokens served from the prefix cache (earlier turns' KV)"),
    ("rollout_seconds", "sampling wall time (s)"),
]
DETAIL_KEYS = ("log_ratio", "pi", "mu", "position", "entropy", "turn")
TAILS = (1e-6, 1e-4, 1e-2)


def _detail(r: dict) -> dict | None:
    """Per-token arrays of one engine result, validated; None when not recorded."""
    d = {k: r[k] for k in DETAIL_KEYS if isinstance(r.get(k), list)}
    if "log_ratio" not in d and "pi" in d and "mu" in d:
        d["log_ratio"] = [p - m for p, m in zip(d["pi"], d["mu"])]
    if "log_ratio" not in d:
        return None
    n = len(d["log_ratio"])
    for k in list(d):
        if len(d[k]) != n:
            raise ReportError(f"per-token array {k!r} of engine {r.get('engine')!r} has {len(d[k])} entries, "
                              f"log_ratio has {n}")
    return d


def _hist_log_ratio(lr: list[float], engine: str) -> str:
    """Histogram of |log rho| by decade, with exact zeros in their own 'bitwise equal' bar."""
    a = [abs(v) for v in lr if finite(v)]
    n = len(a)
    zeros = sum(1 for v in a if v == 0)
    nz = [v for v in a if v > 0]
    labels, counts, colors = ["= 0 (bitwise)"], [zeros], ["#2ca02c"]
    if nz:
        lo = max(-12, math.floor(math.log10(min(nz))))
        hi = max(lo + 1, math.ceil(math.log10(max(nz))))
        if math.log10(max(nz)) == hi:
            hi += 1
        if lo > -12 and min(nz) < 1e-12:
            lo = -12
        for e in range(lo, hi):
            c = sum(1 for v in nz if (e == lo or v >= 10.0 ** e) and v < 10.0 ** (e + 1))
            labels.append(f"1e{e}" if e > lo or min(nz) >= 10.0 ** lo else f"<1e{e + 1}")
            counts.append(c)
            colors.append(COLORS[0])
    frac = [c / n if n else 0.0 for c in counts]
    ann = [f"{100 * f:.1f}%" if c else "" for f, c in zip(frac, counts)]
    note = f"all {n} tokens bitwise equal (log ratio exactly 0)" if n and zeros == n else None
    return bar_chart(labels, frac, f"{engine}: distribution of |log ratio| = |pi - mu|",
                     "|log ratio|: bar '1e-k' counts [1e-k, 1e-k+1); exact zeros in the green bar",
                     "fraction of tokens", annotations=ann, colors=colors, note=note, rotate=len(labels) > 12)


def _bucket_chart(keys: list[float], lr: list[float], nb: int, title: str, xlabel: str, integer: bool) -> str:
    pairs = [(k, abs(v)) for k, v in zip(keys, lr) if finite(k) and finite(v)]
    if not pairs:
        return bar_chart([], [], title, xlabel, "mean |log ratio|", note="no data")
    lo, hi = min(k for k, _ in pairs), max(k for k, _ in pairs)
    if integer:
        width = max(1, math.ceil((hi - lo + 1) / nb))
        edges = [lo + i * width for i in range(nb + 1)]
    else:
        width = (hi - lo) / nb or 1.0
        edges = [lo + i * width for i in range(nb + 1)]
    sums, cnts = [0.0] * nb, [0] * nb
    for k, v in pairs:
        i = min(nb - 1, int((k - lo) // width))
        sums[i] += v
        cnts[i] += 1
    keep = [i for i in range(nb) if cnts[i]]
    if integer:
        labels = [f"{int(edges[i])}–{int(min(edges[i + 1] - 1, hi))}" if width > 1 and edges[i] < hi
                  else str(int(edges[i])) for i in keep]
    else:
        labels = [f"{edges[i]:.2g}–{edges[i + 1]:.2g}" for i in keep]
    means = [sums[i] / cnts[i] for i in keep]
    ann = [f"n={cnts[i]}" for i in keep]
    note = "bitwise equal in every bucket (all 0)" if all(m == 0 for m in means) else None
    return bar_chart(labels, means, title, xlabel, "mean |log ratio|", annotations=ann, note=note,
                     rotate=len(labels) > 10)


def _prob(v: list[float]) -> list[float]:
    """pi / mu are log-probs (<= 0); if every value is in [0, 1] and some is > 0 they are taken as probabilities."""
    vals = [x for x in v if finite(x)]
    if vals and all(0 <= x <= 1 for x in vals) and any(x > 0 for x in vals):
        return list(v)
    return [math.exp(x) if finite(x) else float("nan") for x in v]


def detail_section(r: dict, d: dict) -> list[str]:
    eng = r.get("engine", "?")
    lr = d["log_ratio"]
    a = [abs(v) for v in lr if finite(v)]
    n = len(a)
    rows = [[f"|log &rho;| &gt; {t:g}", fmt(sum(1 for v in a if v > t) / n if n else None),
             fmt(sum(1 for v in a if v > t))] for t in TAILS]
    rows.insert(0, ["|log &rho;| = 0 (bitwise equal)", fmt(sum(1 for v in a if v == 0) / n if n else None),
                    fmt(sum(1 for v in a if v == 0))])
    out = [f"<h3>Engine <code>{_esc(eng)}</code>: per-token detail ({n} tokens)</h3>",
           table(["tail", "fraction of tokens", "tokens"], rows), "<div class='charts'>", _hist_log_ratio(lr, eng)]
    if "pi" in d and "mu" in d:
        p, m = _prob(d["pi"]), _prob(d["mu"])
        eq = all(x == y for x, y in zip(d["pi"], d["mu"]))
        gap = max((abs(x - y) for x, y in zip(p, m) if finite(x) and finite(y)), default=0.0)
        out.append(scatter_chart(m, p, f"{eng}: trainer vs sampler probability of each sampled token",
                                 "sampler probability exp(mu)", "trainer probability exp(pi)",
                                 note="bitwise equal: every point on y = x exactly" if eq else
                                 "differences too small to see here: see the histogram" if gap < 0.01 else None))
    else:
        out.append(bar_chart([], [], f"{eng}: trainer vs sampler probability", "", "",
                             note="pi / mu arrays not recorded"))
    if "turn" in d:  # episodes (parity.episodes): by turn, then by position within the reply
        out.append(_bucket_chart(d["turn"], lr, max(d["turn"], default=0) + 1, f"{eng}: mean |log ratio| by turn",
                                 "the reply's turn in its episode (0: the first)", integer=True))
    if "position" in d:
        where = "its reply (its turn)" if "turn" in d else "its completion"
        out.append(_bucket_chart(d["position"], lr, 10, f"{eng}: mean |log ratio| by token position",
                                 f"position of the token within {where}", integer=True))
    else:
        out.append(bar_chart([], [], f"{eng}: mean |log ratio| by position", "", "", note="position not recorded"))
    if "entropy" in d:
        out.append(_bucket_chart(d["entropy"], lr, 8, f"{eng}: mean |log ratio| by entropy of the distribution",
                                 "entropy of the sampler's next-token distribution (nats)", integer=False))
    else:
        out.append(bar_chart([], [], f"{eng}: mean |log ratio| by entropy", "", "", note="entropy not recorded"))
    out.append("</div>")
    return out


def parity_report(path: str, doc: dict) -> str:
    results = doc["results"]
    engines = [str(r.get("engine", f"#{i}")) for i, r in enumerate(results)]
    cfg = doc.get("config") if isinstance(doc.get("config"), dict) else {}
    model = cfg.get("model", {}) if isinstance(cfg.get("model"), dict) else {}
    info = [("model", model.get("name")), ("flavor", model.get("flavor")), ("dtype", model.get("dtype")),
            ("checkpoint", model.get("checkpoint") or None), ("seed", doc.get("seed")),
            ("prompts", doc.get("num_prompts"))]
    body = ["<h2>Run</h2>", table(["setting", "value"], [[k, fmt(v)] for k, v in info if v is not None])]
    verdicts = []
    for e, r in zip(engines, results):
        m, bf, n = r.get("max_abs_dlogp"), r.get("bitwise_fraction"), r.get("tokens")
        if m == 0:
            verdicts.append(f"<li><code>{_esc(e)}</code>: <span class='ok'>bitwise equal</span> — all "
                            f"{fmt(n)} sampled tokens have &pi; = &mu; exactly.</li>")
        elif finite(m):
            verdicts.append(f"<li><code>{_esc(e)}</code>: <span class='bad'>mismatch</span> — "
                            f"{fmt(100 * bf) if finite(bf) else '?'}% of {fmt(n)} tokens equal, "
                            f"max |&pi; &minus; &mu;| = {fmt(m)}.</li>")
    body += ["<h2>Engines side by side</h2>",
             "<p><b>exact</b>: vLLM runs titan_rl's model with the same kernels as the trainer (expected: bitwise "
             "equal). <b>stock</b>: vLLM's built-in model against a plain-PyTorch trainer (what an RL stack "
             "without titan_rl sees).</p>", "<ul>", *verdicts, "</ul>"]
    known = [k for k, _ in PARITY_KEYS]
    keys = [k for k in known if any(k in r for r in results)]
    keys += sorted({k for r in results for k, v in r.items()
                    if k not in known and k not in DETAIL_KEYS and k != "engine" and finite(v)})
    desc = dict(PARITY_KEYS)
    rows = [[f"{_esc(k)}<br><small>{_esc(desc.get(k, ''))}</small>"] + [fmt(r.get(k)) for r in results] for k in keys]
    body.append(table(["metric"] + [f"<code>{_esc(e)}</code>" for e in engines], rows))
    body.append("<h2>Per-token detail</h2>")
    details = [(r, _detail(r)) for r in results]
    if not any(d for _, d in details):
        body.append("<p class='missing'>Per-token detail not recorded; rerun parity with --detail to get the "
                    "log-ratio histogram, the trainer-vs-sampler scatter and the breakdowns by position and "
                    "entropy.</p>")
    for r, d in details:
        if d is None:
            if any(dd for _, dd in details):
                body.append(f"<p class='missing'>Engine <code>{_esc(r.get('engine'))}</code>: per-token detail "
                            "not recorded; rerun parity with --detail.</p>")
            continue
        body += detail_section(r, d)
    contracts = [(e, r["contract"]) for e, r in zip(engines, results) if isinstance(r.get("contract"), dict)]
    if contracts:
        body += ["<h2>Execution contract</h2>", CONTRACT_INTRO]
    for e, c in contracts:
        differs = c.get("differs") or []
        state = (f"<span class='bad'>differs in {_esc(', '.join(differs))}</span>" if differs
                 else "<span class='ok'>equal</span>")
        body += [f"<h3>Engine <code>{_esc(e)}</code>: {state} (trainer <code>{_esc(c['trainer']['hash'])}</code>, "
                 f"engine <code>{_esc(c['engine']['hash'])}</code>)</h3>",
                 contract_table(c["trainer"]["entries"], c["engine"]["entries"])]
    return page(f"titan_rl parity report: {os.path.basename(path)}", os.path.abspath(path), body)


# ----------------------------------------------------------------------------- entry point


class ReportError(Exception):
    pass


def load(path: str) -> tuple[str, object]:
    """('run', rows) or ('parity', doc); ReportError with a message naming the path otherwise."""
    if not os.path.exists(path):
        raise ReportError(f"{path}: no such file or folder (expected a run folder or a parity JSON)")
    if os.path.isdir(path):
        mpath = os.path.join(path, "metrics.jsonl")
        if not os.path.isfile(mpath):
            raise ReportError(f"{path}: folder has no metrics.jsonl (is it a run folder from "
                              "`python -m titan_rl.train --run-dir`?)")
        rows = []
        with open(mpath) as f:
            for i, ln in enumerate(f, 1):
                if not ln.strip():
                    continue
                try:
                    row = json.loads(ln)
                except json.JSONDecodeError as e:
                    raise ReportError(f"{mpath}: line {i} is not JSON ({e.msg})") from None
                if not isinstance(row, dict) or "step" not in row:
                    raise ReportError(f"{mpath}: line {i} is not a metrics object with a 'step'")
                rows.append(row)
        if not rows:
            raise ReportError(f"{mpath}: empty (no steps recorded yet)")
        return "run", rows
    try:
        with open(path) as f:
            doc = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ReportError(f"{path}: not a JSON file ({e})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("results"), list) or not doc["results"] \
            or not all(isinstance(r, dict) for r in doc["results"]):
        raise ReportError(f"{path}: not a parity JSON (no 'results' list; write one with "
                          "`python -m titan_rl.parity --json`)")
    return "parity", doc


def default_out(path: str, kind: str) -> str:
    if kind == "run":
        return os.path.join(path, "report.html")
    return os.path.splitext(path)[0] + ".html"


def build(path: str, out: str | None = None) -> str:
    kind, data = load(path)
    try:
        text = run_report(path, data) if kind == "run" else parity_report(path, data)
    except ReportError as e:
        raise ReportError(f"{path}: {e}") from None
    out = out or default_out(path, kind)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        f.write(text)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m titan_rl.report", description=__doc__.split("\n")[0])
    ap.add_argument("path", metavar="PATH", help="a run folder (with metrics.jsonl) or a parity JSON")
    ap.add_argument("--out", default=None, help="HTML file to write (default: DIR/report.html or <json stem>.html)")
    args = ap.parse_args(argv)
    try:
        out = build(args.path, args.out)
    except ReportError as e:
        print(f"report: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
