"""rms_norm: accuracy, fused residual, bitwise batch invariance, negative control, bad input."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from tests.conftest import TOL, bits, position_mismatch, prefix_mismatches, rand, rel_err

BACKENDS = [("auto", False), ("triton", True)]


def f64_rms(x, g, eps, residual=None):
    x = np.asarray(x, np.float64)
    if residual is not None:
        x = x + np.asarray(residual, np.float64)
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * np.asarray(g, np.float64)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("backend,interpret", BACKENDS)
@pytest.mark.parametrize("t,h", [(1, 576), (37, 576), (5, 1000)])
def test_accuracy(dtype, backend, interpret, t, h):
    x, g = rand((t, h), dtype), rand((h,), dtype)
    out = pk.rms_norm(x, g, eps=1e-6, backend=backend, interpret=interpret)
    assert out.dtype == jnp.dtype(dtype) and out.shape == (t, h)
    assert rel_err(out, f64_rms(x, g, 1e-6)) <= TOL[jnp.dtype(dtype)]


@pytest.mark.parametrize("backend,interpret", BACKENDS)
def test_fused_residual(backend, interpret):
    x, r, g = rand((9, 576), jnp.bfloat16), rand((9, 576), jnp.bfloat16), rand((576,), jnp.bfloat16)
    out, summed = pk.rms_norm(x, g, eps=1e-5, residual=r, backend=backend, interpret=interpret)
    np.testing.assert_array_equal(bits(summed), bits(x + r))
    assert rel_err(out, f64_rms(summed, g, 1e-5)) <= 1e-2
    # fused == unfused on the summed stream, bit for bit
    np.testing.assert_array_equal(
        bits(out), bits(pk.rms_norm(summed, g, eps=1e-5, backend=backend, interpret=interpret))
    )


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("backend,interpret", BACKENDS)
def test_fused_residual_keeps_subnormal_sums(dtype, backend, interpret):
    """x + residual is rounded to x's dtype like XLA's add - subnormals included, none flushed."""
    tiny = float(jnp.finfo(dtype).smallest_normal) / 2
    x = jnp.full((2, 64), 3 * tiny, dtype)
    r = jnp.full((2, 64), -2 * tiny, dtype)
    g = jnp.ones((64,), dtype)
    out, summed = pk.rms_norm(x, g, eps=0.0, residual=r, backend=backend, interpret=interpret)
    np.testing.assert_array_equal(bits(summed), bits(x + r))
    if dtype == jnp.float16:  # f16 subnormals are normal fp32 numbers: they must survive
        assert float(summed[0, 0]) != 0.0
    np.testing.assert_array_equal(
        bits(out), bits(pk.rms_norm(summed, g, eps=0.0, backend=backend, interpret=interpret))
    )


@pytest.mark.parametrize(  # (each width once or twice, each dtype twice: CI time)
    "h,dtype", [(576, jnp.float32), (576, jnp.bfloat16), (1536, jnp.bfloat16), (4096, jnp.float32)]
)
def test_batch_invariance_cpu(dtype, h):
    x, r, g = rand((300, h), dtype), rand((300, h), dtype), rand((h,), dtype)
    fn = lambda xs: pk.rms_norm(xs, g, eps=1e-5)
    assert prefix_mismatches(fn, x, (1, 2, 3, 7, 16, 17, 255)) == []
    assert not position_mismatch(fn, x, 3)
    both = lambda xs: jnp.concatenate(pk.rms_norm(xs[:, :h], g, eps=1e-5, residual=xs[:, h:]), axis=1)
    assert prefix_mismatches(both, jnp.concatenate([x, r], axis=1), (1, 7, 17)) == []


def test_batch_invariance_pallas_interpret():
    x, g = rand((24, 576)), rand((576,))
    fn = lambda xs: pk.rms_norm(xs, g, eps=1e-5, backend="triton", interpret=True)
    assert prefix_mismatches(fn, x, (1, 7, 17)) == []


def test_negative_control_xla_rms_norm_is_not_invariant_here():
    """XLA's CPU rms_norm differs with the row count only at a few small prefixes (about 1 in 40
    of them), so the data are fixed here: with ``rand``'s (a new seed per call, so they depend
    on what ran before in the process) the control found nothing in one CI worker."""
    found = []
    for seed in (100, 101):  # (576 columns: 8 of these 32 prefixes differ)
        rng = np.random.default_rng(seed)
        for h in (576,):
            x = jnp.asarray(rng.standard_normal((300, h), dtype=np.float32))
            g = jnp.asarray(rng.standard_normal(h, dtype=np.float32))
            found += prefix_mismatches(
                lambda xs, g=g: pk.rms_norm_reference(xs, g, eps=1e-5), x, tuple(range(1, 17))
            )
    assert found, "XLA's rms_norm was batch invariant everywhere: the negative control cannot fail"


@pytest.mark.parametrize(
    "x,g,kwargs,exc,match",
    [
        (np.ones((4,), np.float32), np.ones((4,), np.float32), {}, ValueError, "2-D"),
        (np.ones((0, 4), np.float32), np.ones((4,), np.float32), {}, ValueError, "no rows"),
        (np.ones((2, 4), np.float32), np.ones((5,), np.float32), {}, ValueError, r"weight shape \(5,\)"),
        (np.ones((2, 4), np.float32), np.ones((4,), jnp.bfloat16), {}, TypeError, "mixed dtypes"),
        (np.ones((2, 4), np.int32), np.ones((4,), np.int32), {}, TypeError, "int32"),
        (np.ones((2, 4), np.float32), np.ones((4,), np.float32), {"eps": float("nan")}, ValueError, "eps"),
        (np.ones((2, 4), np.float32), np.ones((4,), np.float32), {"eps": float("inf")}, ValueError, "eps"),
        (np.ones((2, 4), np.float32), np.ones((4,), np.float32), {"eps": "1e-5"}, TypeError, "eps"),
        (
            np.ones((2, 4), np.float32),
            np.ones((4,), np.float32),
            {"residual": np.ones((3, 4), np.float32)},
            ValueError,
            "residual shape",
        ),
    ],
)
def test_bad_input(x, g, kwargs, exc, match):
    kwargs.setdefault("eps", 1e-5)
    with pytest.raises(exc, match=match):
        pk.rms_norm(x, g, **kwargs)


def test_a_numpy_eps_is_the_same_eps():
    x, g = rand((3, 8), jnp.float32), rand((8,), jnp.float32)
    a = pk.rms_norm(x, g, eps=np.float32(1e-5))
    assert np.array_equal(bits(a), bits(pk.rms_norm(x, g, eps=float(np.float32(1e-5)))))
