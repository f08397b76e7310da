"""What tests/test_train.py and tests/test_train_torchrun.py share: the short run's
arguments, launching `python -m titan_rl.train` (alone or under torchrun), reading its
metrics, and the uninterrupted reference run, made once per session (tests/_shared_runs.py)
for both files."""

import os
import subprocess
import sys
import time

from titan_rl.run_dir import comparable, read_metrics

import _zygote
from _shared_runs import shared_run

SHORT = ["--training.steps=6", "--algorithm.sft_steps=2", "--algorithm.prompts_per_step=4",
         "--algorithm.group_size=4", "--algorithm.sft_batch=16", "--checkpoint.interval=2"]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
# bf16, RL from the first step: alone and under torchrun, the first step samples the same
# global batch
BF16_RL = ["--model.dtype=bfloat16", "--training.steps=3", "--lr_scheduler.warmup_steps=1", "--algorithm.sft_steps=0",
           "--algorithm.prompts_per_step=2", "--algorithm.group_size=4", "--checkpoint.enable=false"]
SEPARATE = ["--rollout.placement=separate"]

_metrics, _comparable = read_metrics, comparable


def _train_cmd(run_dir, extra=()):
    return [sys.executable, "-m", "titan_rl.train", "--run-dir", str(run_dir), *SHORT, *extra]


def _train(run_dir, extra=(), timeout=300):
    return _zygote.run(_train_cmd(run_dir, extra), env=ENV, capture_output=True, text=True, timeout=timeout)


def uninterrupted_run(tmp_path_factory):
    """The SHORT run, one process, uninterrupted: (run dir, its CompletedProcess); one run per
    session, whichever of the two files needs it first."""
    run_dir, r = shared_run(tmp_path_factory, "run_a_uninterrupted", _train_cmd, ENV)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return run_dir, r


def _torchrun(run_dir, extra=(), timeout=300):
    """`torchrun --nproc_per_node=2 -m titan_rl.train`, its ranks forked from the zygote."""
    cmd = [sys.executable, "-m", "titan_rl.train", "--run-dir", str(run_dir), *extra]
    return _zygote.torchrun(2, cmd, env=ENV, timeout=timeout)


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
    p = _zygote.popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
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
