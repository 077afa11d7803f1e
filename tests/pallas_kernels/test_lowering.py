"""The path that claims a kernel runs it: named pallas_calls in the CUDA lowering, none on CPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import pallas_kernels as pk
from pallas_kernels._platform import TRITON_CUSTOM_CALL, cuda_export

S = jax.ShapeDtypeStruct
BF16 = jnp.bfloat16

CASES = {
    "matmul_decode": (
        lambda x, w: pk.matmul(x, w),
        (S((1, 4096), BF16), S((4096, 128256), BF16)),
        "bijax_matmul",
    ),
    "matmul_split_k_8_shards": (
        lambda x, w: pk.matmul(x, w, k_shards=8),
        (S((255, 14336), BF16), S((14336, 4096), BF16)),
        "bijax_matmul",
    ),
    "matmul_odd": (
        lambda x, w: pk.matmul(x, w),
        (S((7, 1536), jnp.float32), S((1536, 576), jnp.float32)),
        "bijax_matmul",
    ),
    "rms_norm_residual": (
        lambda x, g, r: pk.rms_norm(x, g, eps=1e-5, residual=r),
        (S((7, 1536), BF16), S((1536,), BF16), S((7, 1536), BF16)),
        "bijax_rms_norm",
    ),
    "log_softmax": (pk.log_softmax, (S((7, 151936), jnp.float32),), "bijax_softmax_stats"),
    "logsumexp": (pk.logsumexp, (S((3, 49152), BF16),), "bijax_softmax_stats"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_cuda_export_contains_the_named_kernel(name):
    fn, args, kernel = CASES[name]
    text = cuda_export(fn, *args)
    assert TRITON_CUSTOM_CALL in text
    assert f'name = "{kernel}"' in text


@pytest.mark.parametrize("name", sorted(CASES))
def test_cpu_lowering_uses_the_fixed_shape_formulation(name):
    fn, args, kernel = CASES[name]
    text = jax.jit(fn).lower(*args).as_text()
    assert TRITON_CUSTOM_CALL not in text and kernel not in text


def test_negative_control_the_name_check_can_fail():
    """XLA's own dot, exported for CUDA, has no bijax kernel in it."""
    text = cuda_export(pk.matmul_reference, S((1, 64), BF16), S((64, 64), BF16))
    assert "bijax_matmul" not in text
