"""The Mosaic GPU interpreter's matrix products, made independent of the CPU's BLAS.

JAX's Mosaic GPU interpret mode runs each wgmma as ``acc + np.matmul(a, b, dtype=float32)``:
NumPy's BLAS, whose kernels are picked by the CPU (OpenBLAS's AVX-512 ones on a Zen 4) and
whose bits for a row can depend on where the row sits in the operand - measured: q and the
output of a 7-head group packed 9 tokens a tile ("dense") instead of 8 (the group padded to 8)
gave 1-3 bf16 outputs 1 ulp apart on that CPU, data-dependent, never on a GPU (where wgmma
gives both packings the same bits: benchmarks/attention_mgpu.py). The interpret-mode tests
compare bits between launches, so they must not rest on a BLAS: here each product is summed in
ascending K, one float32 multiply and add at a time (NumPy's elementwise operations round each
element on its own, wherever it sits), the same bits on every CPU. Only the interpreter's
``np.matmul`` is replaced; everything else in its module is NumPy's.
"""

from __future__ import annotations

import numpy as np
import pytest


def ascending_k_matmul(a, b, dtype=None):
    """``np.matmul(a, b, dtype=np.float32)`` ([..., M, K] @ [K, N]) with a fixed order: the K
    products added to a float32 zero one at a time, in ascending K. Only float32 accumulation
    (what every wgmma of the interpreter asks for): anything else is refused, never computed
    another way."""
    if np.dtype(dtype) != np.float32:
        raise TypeError(f"ascending_k_matmul: accumulates in float32 only, asked for {dtype}")
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    if b.ndim != 2 or a.ndim < 2 or a.shape[-1] != b.shape[0]:
        raise ValueError(f"ascending_k_matmul: shapes {a.shape} @ {b.shape}")
    out = np.zeros(a.shape[:-1] + b.shape[1:], np.float32)
    for k in range(b.shape[0]):
        out += a[..., k : k + 1] * b[k]
    return out


class _NumpyWithOrderedMatmul:
    """NumPy as the interpreter's module sees it, with ``matmul`` = ``ascending_k_matmul``."""

    matmul = staticmethod(ascending_k_matmul)

    def __getattr__(self, name):
        return getattr(np, name)


@pytest.fixture(autouse=True, scope="session")
def _ordered_interpreter_matmul():
    import inspect

    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    # (if a JAX upgrade computes wgmma otherwise, replacing ``np`` would do nothing: say so)
    assert "np.matmul(" in inspect.getsource(gpu_callbacks), "the interpreter no longer calls np.matmul"
    if gpu_callbacks.np is not np:  # (a process that runs this twice)
        yield
        return
    gpu_callbacks.np = _NumpyWithOrderedMatmul()
    yield
    gpu_callbacks.np = np
