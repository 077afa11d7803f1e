"""matmul_norm: the bits of matmul then the fused residual rms_norm, on every path; its gradient;
a negative control (the leaves folded in another order); bad input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels.matmul_triton import triton_partial
from pallas_kernels.plan import plan_matmul
from pallas_kernels.rms_norm import rms_norm_pallas
from tests.conftest import bits, rand

BACKENDS = [("auto", False), ("triton", True)]


def unfused(x, w, g, r, *, k_shards, backend, interpret):
    y = pk.matmul(x, w, k_shards=k_shards, backend=backend, interpret=interpret)
    return pk.rms_norm(y, g, eps=1e-5, residual=r, backend=backend, interpret=interpret)


def operands(m, k, n, dtype=jnp.bfloat16):
    return rand((m, k), dtype), rand((k, n), dtype, 0.03), rand((n,), dtype), rand((m, n), dtype)


# GPU plans (interpret) of 1, 2 and 4 leaves; rows and columns that pad the matmul's tiles.
@pytest.mark.parametrize("backend,interpret", BACKENDS)
@pytest.mark.parametrize(
    "m,k,n,k_shards,leaves", [(3, 1024, 192, 1, 1), (17, 2048, 96, 1, 2), (5, 4096, 128, 2, 4)]
)
def test_same_bits_as_matmul_then_rms_norm(backend, interpret, m, k, n, k_shards, leaves):
    assert plan_matmul(k, n, jnp.bfloat16, k_shards=k_shards, platform="gpu").num_leaves == leaves
    x, w, g, r = operands(m, k, n)
    got = pk.matmul_norm(x, w, g, r, eps=1e-5, k_shards=k_shards, backend=backend, interpret=interpret)
    want = unfused(x, w, g, r, k_shards=k_shards, backend=backend, interpret=interpret)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape == (m, n)
        np.testing.assert_array_equal(bits(a), bits(b))


def test_negative_control_another_fold_order_differs():
    """The norm kernel's own combine is what makes the bits match: folding the four leaves of a
    k_shards=2 plan as one left fold (instead of two folds and a tree) changes some bits
    (float32: no rounding to a narrower output hides the difference)."""
    x, w, g, r = operands(16, 4096, 128, jnp.float32)
    plan = plan_matmul(4096, 128, jnp.float32, k_shards=2, platform="gpu")
    raw = triton_partial(
        x, w, plan=plan, num_shards=2, out_dtype=x.dtype, tiles=None, interpret=True, combine=False
    )
    assert raw.shape[0] == 4

    def norm(fold):
        return rms_norm_pallas(raw, g, r, eps=1e-5, interpret=True, fold=fold, dtype=x.dtype)[1]

    want = bits(unfused(x, w, g, r, k_shards=2, backend="triton", interpret=True)[1])
    np.testing.assert_array_equal(bits(norm(plan.split_k)), want)
    assert not np.array_equal(bits(norm(4)), want)


def test_gradient_is_the_unfused_ops_gradient():
    x, w, g, r = operands(6, 1024, 64, jnp.float32)

    def loss(fn):
        def f(x, w, g, r):
            normed, s = fn(x, w, g, r)
            return jnp.sum(normed * jnp.cos(normed)) + jnp.sum(s * s)

        return jax.grad(f, argnums=(0, 1, 2, 3))(x, w, g, r)

    fused = loss(lambda *a: pk.matmul_norm(*a, eps=1e-5, k_shards=2))
    plain = loss(lambda x, w, g, r: unfused(x, w, g, r, k_shards=2, backend="auto", interpret=False))
    for a, b in zip(fused, plain, strict=True):
        np.testing.assert_allclose(
            np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5
        )  # float32: not bit-equal (other XLA fusions)


@pytest.mark.parametrize(
    "shapes,kwargs,exc,match",
    [
        (((4, 64), (64, 32), (31,), (4, 32)), {}, ValueError, "weight shape"),
        (((4, 64), (64, 32), (32,), (3, 32)), {}, ValueError, "residual shape"),
        (((4, 64), (63, 32), (32,), (4, 32)), {}, ValueError, "matmul_norm: K mismatch"),
        (((4, 64), (64, 32), (32,), (4, 32)), {"k_shards": 3}, ValueError, "k_shards"),
        (((4, 64), (64, 32), (32,), (4, 32)), {"eps": -1.0}, ValueError, "eps"),
    ],
)
def test_bad_input(shapes, kwargs, exc, match):
    x, w, g, r = (jnp.ones(s, jnp.bfloat16) for s in shapes)
    with pytest.raises(exc, match=match):
        pk.matmul_norm(x, w, g, r, **{"eps": 1e-5, **kwargs})


def test_mixed_dtypes_are_refused():
    x, w, g, r = operands(4, 64, 32)
    with pytest.raises(TypeError, match="dtype"):
        pk.matmul_norm(x, w, g.astype(jnp.float32), r, eps=1e-5)


def test_padded_partials_are_not_read():
    """The matmul kernel's padded rows and columns (past M and N) never reach the norm: NaN
    there leaves every bit unchanged; NaN in a real column does not (the check can see it)."""
    m, k, n = 3, 2048, 96
    x, w, g, r = operands(m, k, n, jnp.float32)
    plan = plan_matmul(k, n, jnp.float32, platform="gpu")
    raw = triton_partial(
        x, w, plan=plan, num_shards=1, out_dtype=x.dtype, tiles=None, interpret=True, combine=False
    )
    assert raw.ndim == 3 and raw.shape[1] > m and raw.shape[2] > n  # leaves, padded rows and columns

    def norm(raw):
        return rms_norm_pallas(raw, g, r, eps=1e-5, interpret=True, fold=plan.split_k, dtype=x.dtype)

    want = [bits(a) for a in norm(raw)]
    padded = raw.at[:, m:, :].set(jnp.nan).at[:, :, n:].set(jnp.nan)
    for a, b in zip(norm(padded), want, strict=True):
        np.testing.assert_array_equal(bits(a), b)
    assert np.isnan(np.asarray(norm(raw.at[0, 1, n - 1].set(jnp.nan))[1][1, n - 1]))


def test_round_like_keeps_nan():
    """A NaN from the leaves stays NaN (the GPU's 0x7FFFFFFF would round to -0.0 on the bits)."""
    from pallas_kernels.plan import round_like

    nan = jnp.asarray(np.array([0x7FFFFFFF, 0xFFFFFFFF, 0x7FC00000], np.uint32).view(np.float32))
    assert np.isnan(np.asarray(round_like(nan, jnp.bfloat16))).all()
    finite = rand((4096,), jnp.float32) * 1e3
    np.testing.assert_array_equal(
        bits(round_like(finite, jnp.bfloat16)), bits(finite.astype(jnp.bfloat16).astype(jnp.float32))
    )
