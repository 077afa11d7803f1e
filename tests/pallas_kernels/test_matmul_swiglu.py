"""matmul_swiglu: the bits of the up matmul then the SwiGLU formula, fused (the up kernel's
epilogue) and not; its gradient; its CUDA lowering; a negative control; bad input."""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels.plan import plan_matmul
from pallas_kernels.runtime import cuda_export
from tests.conftest import bits, rand

S = jax.ShapeDtypeStruct
BF16 = jnp.bfloat16
ms = importlib.import_module("pallas_kernels.matmul_swiglu")  # the module (pk.matmul_swiglu is the op)


@pytest.fixture
def fused():
    """``matmul_swiglu.FUSED`` on for the test (jit caches do not key on it: cleared)."""
    old = ms.FUSED
    ms.FUSED = True
    jax.clear_caches()
    yield
    ms.FUSED = old
    jax.clear_caches()


def unfused(x, w, g, **kw):
    u = pk.matmul(x, w, **kw).astype(jnp.float32)
    return pk.swiglu(g.astype(jnp.float32), u).astype(x.dtype)


def operands(m, k, n, dtype=BF16):
    # g spans both signs and the sigmoid's tails; u from a real matmul
    return rand((m, k), dtype), rand((k, n), dtype, 0.05), (rand((m, n), jnp.float32) * 6).astype(dtype)


# Plans of one leaf (the epilogue runs) and of two (the matmul's result, then the formula);
# rows and columns that pad the kernel's tiles.
@pytest.mark.parametrize("m,k,n,leaves", [(3, 1024, 192, 1), (17, 512, 320, 1), (5, 2048, 96, 2)])
@pytest.mark.parametrize("dtype", [BF16, jnp.float32])
def test_same_bits_as_matmul_then_swiglu(fused, m, k, n, leaves, dtype):
    assert plan_matmul(k, n, dtype, platform="gpu").num_leaves == leaves
    x, w, g = operands(m, k, n, dtype)
    for backend, interpret in (("auto", False), ("triton", True)):
        got = pk.matmul_swiglu(x, w, g, backend=backend, interpret=interpret)
        want = unfused(x, w, g, backend=backend, interpret=interpret)
        assert got.dtype == dtype and got.shape == (m, n)
        np.testing.assert_array_equal(bits(got), bits(want))


def test_negative_control_the_products_grouped_otherwise_differ(fused):
    """The check sees a change of rounding: the epilogue with g * (sigmoid(g) * u) instead of
    (g * sigmoid(g)) * u changes some float32 bits."""
    from pallas_kernels.matmul_triton import triton_partial

    x, w, g = operands(16, 1024, 256, jnp.float32)
    plan = plan_matmul(1024, 256, jnp.float32, platform="gpu")

    def run(formula):
        def epilogue(g_tile, acc, out_dtype):
            return formula(g_tile.astype(jnp.float32), acc)

        kw = dict(plan=plan, num_shards=1, out_dtype=x.dtype, tiles=None, interpret=True)
        return triton_partial(x, w, epilogue=(epilogue, g), **kw)

    want = bits(unfused(x, w, g, backend="triton", interpret=True))
    np.testing.assert_array_equal(bits(run(pk.swiglu)), want)
    assert not np.array_equal(bits(run(lambda g, u: g * (jax.nn.sigmoid(g) * u))), want)


def test_an_epilogue_needs_one_leaf():
    from pallas_kernels.matmul_triton import triton_partial

    x, w, g = operands(4, 2048, 96, jnp.float32)
    plan = plan_matmul(2048, 96, jnp.float32, platform="gpu")
    with pytest.raises(ValueError, match="one-leaf plan"):
        triton_partial(
            x, w, plan=plan, num_shards=1, out_dtype=x.dtype, tiles=None, interpret=True, epilogue=(None, g)
        )


def test_gradient_is_the_unfused_ops_gradient(fused):
    x, w, g = operands(6, 1024, 64, jnp.float32)

    def grads(fn):
        return jax.grad(lambda x, w, g: jnp.sum(jnp.sin(fn(x, w, g))), argnums=(0, 1, 2))(x, w, g)

    for a, b in zip(grads(pk.matmul_swiglu), grads(unfused), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_cuda_lowering_fuses_only_when_switched_on():
    """Exported for CUDA at a decode row (llama3-8b's up weight): with FUSED the up launch is
    ``bijax_matmul_swiglu`` and its kernel divides with ``div.rn``, and no XLA sigmoid is left (JAX
    lowers it as 1 / (1 + exp(-g))); without, a plain ``bijax_matmul`` launch and the XLA formula
    (the check can fail)."""
    args = (S((1, 4096), BF16), S((4096, 14336), BF16), S((1, 14336), BF16))
    old = ms.FUSED
    try:
        texts = {}
        for on in (False, True):
            ms.FUSED = on
            jax.clear_caches()
            texts[on] = cuda_export(pk.matmul_swiglu, *args)
    finally:
        ms.FUSED = old
        jax.clear_caches()
    fused_call, plain_call = 'name = "bijax_matmul_swiglu"', 'name = "bijax_matmul"'
    assert texts[True].count(fused_call) == 1 and plain_call not in texts[True]
    assert "stablehlo.exponential" not in texts[True] and "div.rn.f32" in texts[True]
    assert fused_call not in texts[False] and texts[False].count(plain_call) == 1
    assert "stablehlo.exponential" in texts[False] and "div.rn.f32" not in texts[False]


@pytest.mark.parametrize(
    "shapes,kwargs,exc,match",
    [
        (((4, 64), (64, 32), (4, 31)), {}, ValueError, "g's shape"),
        (((4, 64), (63, 32), (4, 32)), {}, ValueError, "matmul_swiglu: K mismatch"),
        (((4, 64), (64, 32), (4, 32)), {"col_blocks": 3}, ValueError, "col_blocks"),
    ],
)
def test_bad_input(shapes, kwargs, exc, match):
    x, w, g = (jnp.ones(s, BF16) for s in shapes)
    with pytest.raises(exc, match=match):
        pk.matmul_swiglu(x, w, g, **kwargs)


def test_mixed_dtypes_are_refused():
    x, w, g = operands(4, 64, 32)
    with pytest.raises(TypeError, match="g is float32"):
        pk.matmul_swiglu(x, w, g.astype(jnp.float32))
