import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("OMP_NUM_THREADS", "2")
# Two xdist workers, each running 2-thread kernels or spawning 2-rank runs and engine processes,
# share 2 cores: OpenMP threads that spin while they wait for work burn the cores the other
# processes need (the suite's kernel files ran 4x slower spinning). Bits do not depend on it.
# Read when libgomp loads, so before torch; `make test` exports it for every process.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from titan_rl.kernels import cpu_features  # noqa: E402

cpu_features.apply()  # TITAN_RL_CPU=avx2 (tests/test_masked_cpu.py): before any test imports vLLM


from _seeds import draw_seed, sweep_size  # noqa: E402
from _threads import threads as thread_count  # noqa: E402


@pytest.fixture
def seed_draw():
    """The index of a seed sweep's draw (parametrized only under TITAN_RL_SEEDS > 1)."""
    return 0


@pytest.fixture
def seed(seed_draw):
    """A fresh seed each run (tests/_seeds.py), printed on failure."""
    return draw_seed()


@pytest.fixture
def rng(seed):
    """Fresh random inputs each run: a generator at the `seed` fixture's seed."""
    return torch.Generator().manual_seed(seed)


def pytest_generate_tests(metafunc):
    n = sweep_size()
    if n > 1 and "seed_draw" in metafunc.fixturenames:
        metafunc.parametrize("seed_draw", range(n), ids=lambda i: f"draw{i}")


@pytest.fixture(params=[1, 2], ids=lambda n: f"threads{n}")
def at_1_and_2_threads(request):
    """Run the test once at 1 torch thread and once at 2, set for real (tests/_threads.py): each
    run checks its own invariance (rows, batches, chunks) at that count. It does not compare
    the two runs: the cross-count comparisons are tests/test_invariance_guard.py's
    `_at_threads` tests (kernels, backward GEMMs, a training step of every architecture)."""
    with thread_count(request.param):
        yield request.param


# TITAN_RL_TOLERANCE_REPORT=FILE (with a TITAN_RL_SEEDS sweep): every assert_close records
# how much of its tolerance it used, max |a - b| / (atol + rtol |b|) per test, into FILE
# (JSON, written at the end), so a tolerance's margin over many seeds is measured, not hoped.
_USED: dict[str, float] = {}
if os.environ.get("TITAN_RL_TOLERANCE_REPORT"):
    _assert_close = torch.testing.assert_close

    def _recording_assert_close(actual, expected, *args, rtol=None, atol=None, **kwargs):
        if rtol is not None and atol is not None and isinstance(actual, torch.Tensor):
            a, b = actual.detach().double(), torch.as_tensor(expected).detach().double()
            if a.shape == b.shape and a.numel():
                ok = torch.isfinite(a) & torch.isfinite(b)
                used = ((a - b).abs() / (atol + rtol * b.abs()))[ok]
                test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0].split("[")[0]
                if used.numel():
                    _USED[test] = max(_USED.get(test, 0.0), float(used.max()))
        return _assert_close(actual, expected, *args, rtol=rtol, atol=atol, **kwargs)

    torch.testing.assert_close = _recording_assert_close


def pytest_configure(config):
    # torchrun launches retried after a runtime abort (tests/test_titan_parallel.py) are logged
    # here by every xdist worker (they inherit the variable) and counted in the summary
    if not os.environ.get("PYTEST_XDIST_WORKER") and "TITAN_RL_RETRY_LOG" not in os.environ:
        import tempfile

        fd, path = tempfile.mkstemp(prefix="titan_rl_retries_", suffix=".log")
        os.close(fd)
        os.environ["TITAN_RL_RETRY_LOG"] = path


def pytest_terminal_summary(terminalreporter):
    path = os.environ.get("TITAN_RL_RETRY_LOG")
    lines = open(path).read().splitlines() if path and os.path.exists(path) else []
    terminalreporter.write_line(f"titan_rl: {len(lines)} torchrun launch(es) retried after a runtime abort"
                                + (": " + "; ".join(lines) if lines else ""))


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("TITAN_RL_TOLERANCE_REPORT")
    if path and _USED:
        import json

        with open(path, "w") as f:
            json.dump(dict(sorted(_USED.items(), key=lambda kv: -kv[1])), f, indent=1)


# `--dist loadfile` hands files to the two workers in collection order, so the files that take
# longest (several minutes each, measured with --durations) go first; otherwise they start last
# and one worker runs alone for the final ten minutes. The order inside each file is kept.
_SLOWEST_FIRST = ("test_train_torchrun.py", "test_titan_parallel.py", "test_train.py", "test_episodes_engine.py",
                  "test_validation.py",
                  "test_hybrid.py", "test_glm5_runs.py", "test_masked_cpu.py", "test_separate_choices.py",
                  "test_separate_checks.py", "test_chat_tasks.py", "test_engine_link.py", "test_hybrids_parity.py",
                  "test_triton_kernels.py", "test_triton_glm5.py", "test_invariance_guard.py", "test_quant_vllm.py",
                  "test_hybrids_vllm.py", "test_export.py", "test_moe_vllm.py", "test_quant_cells.py",
                  "test_dispatch.py", "test_hybrids_train.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(_SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
