"""Build (or check) the compiled CPU kernels: `python -m titan_rl.kernels.build [-v]`."""

import sys
import time

from titan_rl.kernels.cpu_ext import build_dir, load

if __name__ == "__main__":
    t = time.perf_counter()
    load(verbose="-v" in sys.argv)
    print(f"[setup] titan_rl CPU kernels ready in {build_dir()} ({time.perf_counter() - t:.0f} s)")
