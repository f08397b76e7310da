"""What the Triton test files share to run under TRITON_INTERPRET=1 (tests/test_triton_kernels.py,
tests/test_triton_glm5.py): the variable must be set before triton and every triton_impl module
are first imported, so a file runs in-process only when the variable was set from the start;
otherwise its tests are skipped and its test_in_a_fresh_interpreter_process runs the file in a
child process with the variable set.

Each file computes, before importing triton:
    _PREV = os.environ.get("TRITON_INTERPRET")
    IN_PROCESS = _PREV == "1"
and then takes its fixtures and child-process test from `harness(_PREV, IN_PROCESS, __file__)`.
"""

import os
import subprocess
import sys

import pytest


def restore(prev: str | None) -> None:
    if prev is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = prev


def harness(prev: str | None, in_process: bool, test_file: str):
    """(the module's autouse fixtures, its child-process test), to bind at module level under
    the names pytest collects: _interpreter_env, _in_process_only, test_in_a_fresh_interpreter_process."""

    @pytest.fixture(autouse=True, scope="module")
    def _interpreter_env():
        if in_process:
            os.environ["TRITON_INTERPRET"] = "1"  # the interpreter also reads it at run time
        yield
        restore(prev)

    @pytest.fixture(autouse=True)
    def _in_process_only(request):
        if not in_process and request.node.name != "test_in_a_fresh_interpreter_process":
            pytest.skip("TRITON_INTERPRET=1 was not set when this process started; "
                        "test_in_a_fresh_interpreter_process runs these tests in a child process")

    def test_in_a_fresh_interpreter_process():
        if in_process:
            pytest.skip("this process runs the Triton interpreter itself")
        env = dict(os.environ, TRITON_INTERPRET="1")
        root = os.path.dirname(os.path.dirname(os.path.abspath(test_file)))
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.abspath(test_file)],
                           cwd=root, env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, (f"Triton interpreter tests failed in the child process:\n{r.stdout[-6000:]}\n"
                                   f"{r.stderr[-3000:]}")

    return _interpreter_env, _in_process_only, test_in_a_fresh_interpreter_process
