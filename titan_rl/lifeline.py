"""An engine process dies with the trainer that started it (Linux: PR_SET_PDEATHSIG).

Here, not in titan_rl.vllm: titan_rl.train calls it at import, and an engine core imports
titan_rl.train first (spawn's __mp_main__), before anything of vLLM's runs; importing the vLLM
package there would apply its settings before the trainer's own start-up does."""

import os

# Set by titan_rl.vllm.engine for the engine processes it starts (inherited at spawn).
TRAINER_PID = "TITAN_RL_TRAINER_PID"
PARENT_PID = "TITAN_RL_ENGINE_PARENT_PID"  # set by an engine process for the workers it starts


def started_by_a_trainer() -> bool:
    """Whether this process is an engine process (engine core or worker) a trainer started."""
    return os.environ.get(TRAINER_PID, "") not in ("", str(os.getpid()))


def die_with_parent() -> None:
    """Linux's PR_SET_PDEATHSIG: SIGKILL when the process that started this one dies; and
    exit now if it already has. Called as early as this process runs our code: an engine
    core imports titan_rl.train first (spawn's __mp_main__), before vLLM's start-up handshake,
    which would otherwise wait 5 minutes for a trainer that was killed while it started. The
    parent is known by pid (the trainer's, or the engine process's for its workers), not by
    ppid 1: under a subreaper an orphan's ppid is the subreaper's."""
    import ctypes
    import signal

    if os.environ.get(PARENT_PID) == str(os.getpid()):  # done already in this process
        return
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    parent = os.environ.get(PARENT_PID) or os.environ.get(TRAINER_PID)
    if parent and os.getppid() != int(parent):  # the parent died before the prctl took effect
        os._exit(1)
    os.environ[PARENT_PID] = str(os.getpid())  # what this process's own children check
