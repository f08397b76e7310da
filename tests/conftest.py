import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture
def rng():
    """Fresh random inputs each run: the seed is drawn from the OS and printed on failure."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed={seed}")
    return torch.Generator().manual_seed(seed)


@pytest.fixture(params=[1, 2], ids=lambda n: f"threads{n}")
def threads(request):
    """Run the test at torch thread counts 1 and 2 (invariance must hold at both)."""
    old = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(old)
