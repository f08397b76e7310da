"""A killed trainer leaves no engine behind, even when it is killed while its engines start.

An engine core is a spawned child of the trainer; it sets its death signal (PR_SET_PDEATHSIG)
when it imports titan_rl.train as spawn's __mp_main__, before vLLM's start-up handshake. Set
later (in the vLLM plugin, as before), an engine core whose trainer died first waited in that
handshake for vLLM's 5-minute timeout (docs/engines.md, the soak's finding)."""

import signal
import subprocess
import sys
import time

import psutil

import _zygote
from _train_runs import ENV, SEPARATE


def _engine_processes(trainer: int) -> list[psutil.Process]:
    out = []
    try:
        children = psutil.Process(trainer).children(recursive=True)
    except psutil.Error:  # the trainer already gone
        return out
    for p in children:
        try:  # a process can end between the listing and these reads
            cmd = " ".join(p.cmdline())
            if "resource_tracker" not in cmd and ("spawn_main" in cmd or "EngineCore" in p.name() + cmd):
                out.append(p)
        except psutil.Error:
            continue
    return out


def _gone(p: psutil.Process) -> bool:
    try:
        return p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_an_engine_starting_when_its_trainer_is_killed_exits_with_it(tmp_path):
    cmd = [sys.executable, "-m", "titan_rl.train", "--run-dir", str(tmp_path / "run"), "--algorithm.sft_steps=0",
           "--training.steps=2", "--lr_scheduler.warmup_steps=1", "--checkpoint.enable=false", *SEPARATE]
    p = _zygote.popen(cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline, engines = time.time() + 120, []
    while time.time() < deadline and p.poll() is None and not engines:
        engines = _engine_processes(p.pid)
        time.sleep(0.01)
    assert engines, f"no engine process appeared (trainer exit code {p.poll()})"
    p.send_signal(signal.SIGKILL)  # at once: the engine core is still importing, before its handshake
    p.wait()
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # killed while starting, before any step
    deadline = time.time() + 30  # before the fix: 300 s (vLLM's handshake timeout)
    while time.time() < deadline and not all(map(_gone, engines)):
        time.sleep(0.1)
    left = [e.pid for e in engines if not _gone(e)]
    for pid in left:  # not left behind by the test itself either
        psutil.Process(pid).kill()
    assert not left, f"engine processes {left} outlived their killed trainer"
