"""gate_up_swiglu: the bits of the gate and up matmuls then the SwiGLU formula, fused (one
launch, the formula in its epilogue) and not; its gradient; its CUDA lowering; a negative
control; bad input."""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels.matmul_triton import GpuTiles, pair_epilogue
from pallas_kernels.plan import plan_matmul
from pallas_kernels.runtime import cuda_export
from tests.conftest import bits, rand

S = jax.ShapeDtypeStruct
BF16 = jnp.bfloat16
mlp = importlib.import_module("pallas_kernels.mlp")  # the module (pk.mlp is not exported)


@pytest.fixture
def fused():
    """``mlp.FUSED`` on for the test (jit caches do not key on it: cleared)."""
    old = mlp.FUSED
    mlp.FUSED = True
    jax.clear_caches()
    yield
    mlp.FUSED = old
    jax.clear_caches()


def unfused(x, wg, wu, **kw):
    g, u = pk.matmul(x, wg, **kw), pk.matmul(x, wu, **kw)
    return pk.swiglu(g.astype(jnp.float32), u.astype(jnp.float32)).astype(x.dtype)


def operands(m, k, n, dtype=BF16):
    # x scaled so the gate's values span both signs and the sigmoid's tails
    return rand((m, k), dtype, 4.0), rand((k, n), dtype, 0.05), rand((k, n), dtype, 0.05)


# One-leaf plans (the fused launch runs) and a two-leaf one (the matmuls, then the formula);
# rows and columns that pad the kernel's tiles.
@pytest.mark.parametrize("m,k,n,leaves", [(3, 1024, 192, 1), (17, 512, 320, 1), (5, 2048, 96, 2)])
@pytest.mark.parametrize("dtype", [BF16, jnp.float32])
def test_same_bits_as_gate_up_then_swiglu(fused, m, k, n, leaves, dtype):
    assert plan_matmul(k, n, dtype, platform="gpu").num_leaves == leaves
    x, wg, wu = operands(m, k, n, dtype)
    # the fused launch runs where the plan has one leaf (and only there)
    jaxpr = str(jax.make_jaxpr(lambda *a: pk.gate_up_swiglu(*a, backend="triton", interpret=True))(x, wg, wu))
    assert ("bijax_matmul_pair" in jaxpr) == (leaves == 1)
    for backend, interpret in (("auto", False), ("triton", True)):
        got = pk.gate_up_swiglu(x, wg, wu, backend=backend, interpret=interpret)
        want = unfused(x, wg, wu, backend=backend, interpret=interpret)
        assert got.dtype == dtype and got.shape == (m, n)
        np.testing.assert_array_equal(bits(got), bits(want))


def test_column_shards_have_the_whole_weights_bits(fused):
    """A column-parallel rank's shard (``col_blocks``, ``full_n``) gives those columns of the
    whole weights' result, in interpret mode and on CPU."""
    x, wg, wu = operands(4, 1024, 256, jnp.float32)
    for backend, interpret in (("auto", False), ("triton", True)):
        kw = dict(col_blocks=4, backend=backend, interpret=interpret)
        whole = bits(pk.gate_up_swiglu(x, wg, wu, **kw))
        shard = pk.gate_up_swiglu(x, wg[:, 128:], wu[:, 128:], full_n=256, **kw)
        np.testing.assert_array_equal(bits(shard), whole[:, 128:])


def test_negative_control_the_products_grouped_otherwise_differ():
    """The check sees a change of rounding: the epilogue with g * (sigmoid(g) * u) instead of
    (g * sigmoid(g)) * u changes some float32 bits."""
    x, wg, wu = operands(16, 1024, 256, jnp.float32)
    plan = plan_matmul(1024, 256, jnp.float32, platform="gpu")

    tiles = GpuTiles(16, plan.tile_n, 4, 3)

    def run(formula):
        def epilogue(acc_g, acc_u, out_dtype):
            return formula(acc_g, acc_u)

        return pair_epilogue(
            x, wg, wu, plan=plan, out_dtype=x.dtype, tiles=tiles, interpret=True, epilogue=epilogue
        )

    want = bits(unfused(x, wg, wu, backend="triton", interpret=True))
    np.testing.assert_array_equal(bits(run(pk.swiglu)), want)
    assert not np.array_equal(bits(run(lambda g, u: g * (jax.nn.sigmoid(g) * u))), want)


def test_the_fused_launch_needs_one_leaf():
    x, wg, wu = operands(4, 2048, 96, jnp.float32)
    plan = plan_matmul(2048, 96, jnp.float32, platform="gpu")
    with pytest.raises(ValueError, match="one leaf"):
        pair_epilogue(
            x,
            wg,
            wu,
            plan=plan,
            out_dtype=x.dtype,
            tiles=GpuTiles(16, 64, 4, 3),
            interpret=True,
            epilogue=None,
        )


def test_gradient_is_the_unfused_ops_gradient(fused):
    x, wg, wu = operands(6, 1024, 64, jnp.float32)

    def grads(fn):
        return jax.grad(lambda x, a, b: jnp.sum(jnp.sin(fn(x, a, b))), argnums=(0, 1, 2))(x, wg, wu)

    for a, b in zip(grads(pk.gate_up_swiglu), grads(unfused), strict=True):
        a, b = np.asarray(a), np.asarray(b)  # float32: not bit-equal (other XLA fusions)
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * np.abs(b).max())


def test_cuda_lowering_fuses_only_when_switched_on():
    """Exported for CUDA at a decode row (llama3-8b's gate and up): with FUSED one
    ``bijax_matmul_pair`` launch (the sigmoid inside it), and no XLA sigmoid left
    (JAX lowers it as 1 / (1 + exp(-g))); without, two ``bijax_matmul`` launches and the XLA
    formula (the check can fail)."""
    args = (S((1, 4096), BF16), S((4096, 14336), BF16), S((4096, 14336), BF16))
    old = mlp.FUSED
    try:
        texts = {}
        for on in (False, True):
            mlp.FUSED = on
            jax.clear_caches()
            texts[on] = cuda_export(pk.gate_up_swiglu, *args)
    finally:
        mlp.FUSED = old
        jax.clear_caches()
    pair, plain = 'name = "bijax_matmul_pair"', 'name = "bijax_matmul"'
    assert texts[True].count(pair) == 1 and plain not in texts[True]
    assert "stablehlo.exponential" not in texts[True]
    assert pair not in texts[False] and texts[False].count(plain) == 2
    assert "stablehlo.exponential" in texts[False]


@pytest.mark.parametrize(
    "shapes,kwargs,exc,match",
    [
        (((4, 64), (64, 32), (64, 31)), {}, ValueError, "w_gate is"),
        (((4, 64), (63, 32), (63, 32)), {}, ValueError, "gate_up_swiglu: w_gate: K mismatch"),
        (((4, 64), (64, 32), (64, 32)), {"col_blocks": 3}, ValueError, "col_blocks"),
    ],
)
def test_bad_input(shapes, kwargs, exc, match):
    x, wg, wu = (jnp.ones(s, BF16) for s in shapes)
    with pytest.raises(exc, match=match):
        pk.gate_up_swiglu(x, wg, wu, **kwargs)


def test_mixed_dtypes_are_refused():
    x, wg, wu = operands(4, 64, 32)
    with pytest.raises(TypeError, match="gate_up_swiglu: w_up"):
        pk.gate_up_swiglu(x, wg, wu.astype(jnp.float32))
