"""Make the Triton interpreter's tl.dot independent of the host BLAS.

Under TRITON_INTERPRET=1, tl.dot is numpy.matmul: the host BLAS, whose per-row results
can depend on the row's position in the tile (seen on this project's AMD EPYC machines:
OpenBLAS 0.3.30's Haswell sgemm in numpy 2.3.5 gave other bits for 34 of 64 rows moved
within a 64-row tile; its Sandybridge kernel did not). On a GPU, tl.dot is the MMA unit,
whose per-row arithmetic is fixed by the kernel's tile shape. The interpreter tests are
about the kernel's own structure (tile shapes, K order, masks, fixed visiting order), so
they run the dot as fp32 products summed in K order for every element (numpy's einsum
without BLAS), which does not depend on where a row sits. Used by the interpreter tests
and `scripts/gpu_check.py --cpu-interpret`.
"""

import numpy as np


class _NumpyWithOrderedMatmul:
    def __getattr__(self, name):
        return getattr(np, name)

    @staticmethod
    def matmul(a, b, dtype=None):
        return np.einsum("...ik,...kj->...ij", a, b, dtype=dtype, optimize=False)


def pin_interpreter_dot() -> None:
    import triton.runtime.interpreter as interpreter

    if not isinstance(interpreter.np, _NumpyWithOrderedMatmul):
        interpreter.np = _NumpyWithOrderedMatmul()
