"""Soak: an RL run with 2 separate engine processes, killed with SIGKILL at random moments and
relaunched, ends with the metrics of an uninterrupted run.

    python scripts/soak.py --kills 6 --seed 0 --json outputs/soak.json

The run (debug model, built-in task, checkpoint every 2 steps, `rollout.placement =
"separate"`, 2 engines) is first run uninterrupted. Then the same command is launched again and
again: each launch lives a random time (uniform in --min-s .. --max-s seconds) before SIGKILL
hits, at random, the trainer (its engines must die with it) or one engine process (the run must
stop in one line, exit 1); the next launch resumes from the last checkpoint. After --kills
kills it runs to the end. Passes when the final metrics.jsonl equals the uninterrupted one line
for line (wall-clock fields and where a relaunch resumed from aside) and no engine process
outlived its trainer. Prints a table, writes JSON. Not in the suite: minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

ARGS = ["--config", "train_configs/rl_debug.toml", "--algorithm.sft_steps=2", "--algorithm.prompts_per_step=4",
        "--algorithm.group_size=4", "--algorithm.sft_batch=16", "--checkpoint.interval=2",
        "--lr_scheduler.warmup_steps=1", "--rollout.placement=separate", "--rollout.engines=2"]


def _cmd(run_dir: str, steps: int) -> list[str]:
    return [sys.executable, "-m", "titan_rl.train", "--run-dir", run_dir, f"--training.steps={steps}", *ARGS]


def _engines(pid: int) -> list:
    import psutil

    try:
        return [p for p in psutil.Process(pid).children(recursive=True)
                if "resource_tracker" not in " ".join(p.cmdline())]
    except psutil.Error:
        return []


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kills", type=int, default=6)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min-s", type=float, default=8.0, help="a launch lives at least this long before its kill")
    ap.add_argument("--max-s", type=float, default=30.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import psutil

    from titan_rl.run_dir import comparable, read_metrics

    rng = random.Random(args.seed)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONUNBUFFERED="1")
    t0 = time.time()
    with tempfile.TemporaryDirectory() as work:
        ref, run = os.path.join(work, "uninterrupted"), os.path.join(work, "soaked")
        r = subprocess.run(_cmd(ref, args.steps), cwd=ROOT, env=env, capture_output=True, text=True)
        if r.returncode:
            print(r.stdout[-2000:] + r.stderr[-2000:])
            return 1
        t_ref = time.time() - t0
        events, orphans = [], 0
        while True:
            kill = len(events) < args.kills
            p = subprocess.Popen(_cmd(run, args.steps), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)
            if not kill:
                out = p.communicate()[0]
                if p.returncode:
                    print(out[-3000:])
                    return 1
                break
            wait = rng.uniform(args.min_s, args.max_s)
            try:
                p.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                pass
            if p.poll() is not None:  # finished (or failed) before its kill: relaunch and kill later
                events.append({"after_s": round(wait, 1), "target": "none (the run had ended)", "exit": p.returncode})
                p.stdout.read()
                if p.returncode == 0:
                    break
                continue
            engines = _engines(p.pid)
            target = "trainer" if rng.random() < 0.5 or not engines else "engine"
            if target == "trainer":
                p.send_signal(signal.SIGKILL)
            else:
                os.kill(rng.choice(engines).pid, signal.SIGKILL)
            try:
                out = p.communicate(timeout=120)[0]
                hung = False
            except subprocess.TimeoutExpired:  # it did not stop: a finding, recorded with its last lines
                for c in _engines(p.pid):
                    c.kill()
                p.kill()
                out, hung = p.communicate()[0], True
                print(f"HUNG after killing the {target} ({wait:.1f} s into the launch); its last lines:\n"
                      + "\n".join(out.splitlines()[-8:]), flush=True)
            gone, alive = psutil.wait_procs(engines, timeout=30)
            orphans += len(alive)
            for a in alive:
                a.kill()
            lines = len(read_metrics(run)) if os.path.exists(os.path.join(run, "metrics.jsonl")) else 0
            events.append({"after_s": round(wait, 1), "target": target, "exit": p.returncode, "lines": lines,
                           "hung": hung,
                           "stopped_in_one_line": target == "trainer" or sum(
                               ln.startswith("error:") for ln in out.splitlines()) == 1})
        want = [comparable(m) for m in read_metrics(ref)]
        got = [comparable(m) for m in read_metrics(run)]
    equal = want == got
    doc = {"kills": sum(e["target"] in ("trainer", "engine") for e in events), "events": events,
           "relaunches": len(events), "equal_metrics": equal, "orphan_engines": orphans, "steps": args.steps,
           "uninterrupted_seconds": round(t_ref, 1), "seconds": round(time.time() - t0, 1), "seed": args.seed}
    print(f"{'#':>3s} {'after s':>8s} {'killed':>8s} {'exit':>5s} {'lines':>6s}")
    for i, e in enumerate(events, 1):
        print(f"{i:>3d} {e['after_s']:>8.1f} {e['target'][:8]:>8s} {e['exit']:>5} {e.get('lines', '-'):>6}")
    print(f"kills {doc['kills']}, relaunches {doc['relaunches']}, orphan engines {orphans}, final metrics equal to the "
          f"uninterrupted run's: {equal} ({doc['seconds']} s in all)")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    ok = all(e.get("stopped_in_one_line", True) and not e.get("hung") for e in events)
    return 0 if equal and not orphans and ok else 1


if __name__ == "__main__":
    sys.exit(main())
