"""grouped_matmul: accuracy, each row's bits == matmul's for its group's weight whatever the group
sizes and offsets, the negative control (ragged_dot), group_rows, the VJP, lowering, bad input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels.grouped_matmul import num_row_tiles
from pallas_kernels.runtime import TRITON_CUSTOM_CALL, cuda_export
from tests.conftest import TOL, bits, rand, rel_err

PATHS = {"cpu": dict(backend="auto"), "interpret": dict(backend="triton", interpret=True)}


def _groups(sizes):
    ends = np.cumsum(sizes)
    return list(zip(ends - np.asarray(sizes), ends, strict=True))


def _ref64(x, w, sizes):
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    out = np.zeros((x.shape[0], w.shape[2]))
    for g, (a, b) in enumerate(_groups(sizes)):
        out[a:b] = x[a:b] @ w[g]
    return out


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("k,n,sizes", [(64, 96, (3, 0, 7, 3)), (200, 130, (1, 20, 2)), (2048, 64, (0, 5, 0))])
def test_accuracy_and_rows_past_the_groups_are_zero(path, dtype, k, n, sizes):
    e, m = len(sizes), sum(sizes) + 2
    x, w = rand((m, k), dtype), rand((e, k, n), dtype, k**-0.5)
    out = pk.grouped_matmul(x, w, jnp.asarray(sizes), **PATHS[path])
    assert out.dtype == jnp.dtype(dtype) and out.shape == (m, n)
    ref = _ref64(x, w, sizes)
    assert rel_err(out[: m - 2], ref[: m - 2]) <= TOL[jnp.dtype(dtype)]
    assert not np.asarray(out[m - 2 :], np.float32).any()


@pytest.mark.parametrize(
    "path,dtype,k_shards",
    [
        ("cpu", jnp.float32, 1),
        ("cpu", jnp.bfloat16, 1),
        ("cpu", jnp.float32, 2),
        ("interpret", jnp.float32, 1),
        ("interpret", jnp.bfloat16, 2),
    ],
)
def test_rows_equal_matmul_bits_in_groups_of_any_size_and_offset(path, dtype, k_shards):
    """A row's bits equal matmul's for its group's weight, moved between groups of 1, 5, 23 and 40
    rows at different offsets (empty groups in between), and equal to the row alone."""
    k, n, e = 256, 96, 4
    w = rand((e, k, n), dtype, k**-0.5)
    row = rand((1, k), dtype)
    kw = dict(k_shards=k_shards, **PATHS[path])
    want = bits(pk.matmul(row, w[2], **kw))
    for sizes, at in [((0, 0, 1, 0), 0), ((3, 0, 5, 0), 5), ((17, 4, 23, 1), 30), ((0, 9, 40, 8), 44)]:
        m = sum(sizes) + 3
        x = rand((m, k), dtype)
        x = x.at[at].set(row[0])
        out = pk.grouped_matmul(x, w, jnp.asarray(sizes), **kw)
        np.testing.assert_array_equal(bits(out[at : at + 1]), want)
        for g, (a, b) in enumerate(_groups(sizes)):  # every row, every group: matmul's bits
            if b > a:
                np.testing.assert_array_equal(bits(out[a:b]), bits(pk.matmul(x[a:b], w[g], **kw)))


def test_negative_control_ragged_dot_rows_depend_on_the_groups():
    """XLA's ragged_dot on this CPU: the same row alone and among many rows of its group differs
    for some shape - the check above can fail."""

    def differs(k, n):
        w = rand((3, k, n), jnp.float32, k**-0.5)
        x = rand((300, k))
        many = pk.grouped_matmul_reference(x, w, jnp.asarray([0, 300, 0]))
        few = lambda m: pk.grouped_matmul_reference(x[:m], w, jnp.asarray([0, m, 0]))  # noqa: E731
        return any(not np.array_equal(bits(few(m)), bits(many[:m])) for m in (1, 2, 7, 17))

    # (any: stops at the first shape that differs)
    assert any(differs(k, n) for k, n in [(576, 1536), (1536, 576), (100, 70)]), (
        "ragged_dot was invariant on every shape: the negative control cannot fail"
    )


def test_group_rows_is_a_stable_sort_by_group():
    ids = np.random.default_rng(0).integers(0, 6, 50).astype(np.int32)
    order, sizes = pk.group_rows(jnp.asarray(ids), 7)
    np.testing.assert_array_equal(np.asarray(order), np.argsort(ids, kind="stable"))
    np.testing.assert_array_equal(np.asarray(sizes), np.bincount(ids, minlength=7))


def test_padded_buffer_bound_holds_the_worst_case():
    # every non-empty group wastes at most tile_m - 1 rows
    for m, e, tm in [(1, 128, 16), (8, 128, 16), (512, 128, 16), (16384, 128, 64), (5, 2, 16)]:
        worst = sum(-(-s // tm) for s in [m - min(e, m) + 1] + [1] * (min(e, m) - 1))
        assert worst <= num_row_tiles(m, e, tm)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_vjp_matches_ragged_dot(dtype):
    x, w = rand((12, 64), dtype), rand((3, 64, 32), dtype, 0.1)
    sizes = jnp.asarray([4, 0, 6])
    g = rand((12, 32), jnp.float32)
    f = lambda fn: lambda x, w: jnp.sum(fn(x, w, sizes, out_dtype=jnp.float32) * g)  # noqa: E731
    got = jax.grad(f(pk.grouped_matmul), argnums=(0, 1))(x, w)
    want = jax.grad(f(pk.grouped_matmul_reference), argnums=(0, 1))(x, w)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype
        assert rel_err(a, b) <= TOL[jnp.dtype(dtype)] * 10


def test_cuda_lowering_runs_the_named_kernel_and_cpu_does_not():
    S = jax.ShapeDtypeStruct
    args = (S((8, 2048), jnp.bfloat16), S((128, 2048, 768), jnp.bfloat16), S((128,), jnp.int32))
    fn = lambda x, w, g: pk.grouped_matmul(x, w, g)  # noqa: E731
    text = cuda_export(fn, *args)
    assert TRITON_CUSTOM_CALL in text and 'name = "bijax_grouped_matmul"' in text
    assert "bijax_grouped_matmul" not in jax.jit(fn).lower(*args).as_text()
    # negative control: the name check can fail (XLA's dot exported for CUDA has no such kernel)
    assert "bijax_grouped_matmul" not in cuda_export(
        pk.matmul_reference, args[0], S((2048, 768), jnp.bfloat16)
    )


@pytest.mark.parametrize(
    "args,kwargs,exc,match",
    [
        (((2, 4), (4, 6), (1,)), {}, ValueError, "3-D"),
        (((2, 4), (2, 5, 6), (2,)), {}, ValueError, "K mismatch"),
        (((2, 4), (2, 4, 6), (3,)), {}, ValueError, "3 group sizes for 2"),
        (((0, 4), (2, 4, 6), (2,)), {}, ValueError, "M == 0"),
        (((2, 4), (2, 4, 6), (2,)), {"k_shards": 3}, ValueError, "k_shards"),
        (((2, 4), (2, 4, 6), (2,)), {"out_dtype": jnp.int8}, TypeError, "out_dtype"),
    ],
)
def test_bad_input(args, kwargs, exc, match):
    xs, ws, gs = args
    with pytest.raises(exc, match=match):
        pk.grouped_matmul(np.ones(xs, np.float32), np.ones(ws, np.float32), np.ones(gs, np.int32), **kwargs)


def test_bad_dtypes():
    x, w = np.ones((2, 4), np.float32), np.ones((2, 4, 6), np.float32)
    with pytest.raises(TypeError, match="integers"):
        pk.grouped_matmul(x, w, np.ones(2, np.float32))
    with pytest.raises(TypeError, match="mixed dtypes"):
        pk.grouped_matmul(x, w.astype(jnp.bfloat16), np.ones(2, np.int32))
    with pytest.raises(ValueError, match="num_groups"):
        pk.group_rows(jnp.zeros(3, jnp.int32), 0)


def test_concrete_group_values_are_checked():
    """Ids outside [0, G) and negative or too many group sizes are named (they would silently
    put rows in the wrong group); the same values in range pass."""
    with pytest.raises(ValueError, match=r"group id -1 is outside \[0, 3\)"):
        pk.group_rows(jnp.asarray([2, -1, 0, 1]), 3)
    with pytest.raises(ValueError, match=r"group id 5 is outside \[0, 3\)"):
        pk.group_rows(jnp.asarray([2, 5, 0]), 3)
    order, sizes = pk.group_rows(jnp.asarray([2, 1, 0, 2]), 3)
    assert order.tolist() == [2, 1, 0, 3] and sizes.tolist() == [1, 1, 2]
    x, w = np.ones((4, 4), np.float32), np.ones((3, 4, 6), np.float32)
    with pytest.raises(ValueError, match="group_sizes must be >= 0"):
        pk.grouped_matmul(x, w, np.array([-2, 5, 1], np.int32))
    with pytest.raises(ValueError, match="sum to 5, more than x's 4 rows"):
        pk.grouped_matmul(x, w, np.array([2, 2, 1], np.int32))
