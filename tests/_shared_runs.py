"""A run that tests in several files compare against, made once per test session, also
under pytest-xdist: the workers of one session share their base temp folder's parent, and a
file lock lets the first worker that needs the run make it while any other waits and then
reads it (the pattern pytest-xdist documents for session fixtures)."""

import json
import os
import subprocess

from filelock import FileLock


def shared_run(tmp_path_factory, name: str, cmd_for, env: dict, timeout: int = 300):
    """Run `cmd_for(run_dir)` once per session in a folder named `name`: (run_dir, the
    CompletedProcess: its return code, stdout and stderr, as the run that made it saw them)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # shared by the session's workers
    run_dir, record = root / name, root / f"{name}.result.json"
    with FileLock(str(root / f"{name}.lock")):
        if not record.exists():
            cmd = cmd_for(run_dir)
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
            record.write_text(json.dumps({"args": cmd, "returncode": r.returncode, "stdout": r.stdout,
                                          "stderr": r.stderr}))
    d = json.loads(record.read_text())
    return run_dir, subprocess.CompletedProcess(d["args"], d["returncode"], d["stdout"], d["stderr"])
