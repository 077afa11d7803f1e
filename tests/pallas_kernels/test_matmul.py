"""matmul: accuracy, bitwise batch invariance, the k_shards tree, negative control, bad input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels.matmul import GpuTiles, gpu_tiles, plan_matmul
from tests.conftest import TOL, bits, position_mismatch, prefix_mismatches, rand, rel_err

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
PREFIXES = (1, 2, 7, 16, 17, 64, 255)


def f64(x, w):
    return np.asarray(x, np.float64) @ np.asarray(w, np.float64)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "m,k,n", [(1, 576, 1536), (7, 1536, 576), (255, 576, 1000), (3, 100, 70), (33, 4096, 64)]
)
@pytest.mark.parametrize("k_shards", [1, 2, 8])
def test_accuracy_cpu(dtype, m, k, n, k_shards):
    x, w = rand((m, k), dtype), rand((k, n), dtype, k**-0.5)
    out = pk.matmul(x, w, k_shards=k_shards)
    assert out.dtype == jnp.dtype(dtype) and out.shape == (m, n)
    assert rel_err(out, f64(x, w)) <= TOL[jnp.dtype(dtype)]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(
    "m,k,n,k_shards", [(5, 192, 96, 1), (20, 200, 130, 2), (3, 2048, 64, 1), (9, 512, 64, 8)]
)
def test_accuracy_pallas_interpret(dtype, m, k, n, k_shards):
    x, w = rand((m, k), dtype), rand((k, n), dtype, k**-0.5)
    out = pk.matmul(x, w, k_shards=k_shards, backend="triton", interpret=True)
    assert out.shape == (m, n)
    assert rel_err(out, f64(x, w)) <= TOL[jnp.dtype(dtype)]


def test_out_dtype_and_fp32_accumulation():
    x, w = rand((4, 4096), jnp.bfloat16), rand((4096, 32), jnp.bfloat16)
    out = pk.matmul(x, w, out_dtype=jnp.float32)
    assert out.dtype == jnp.float32
    # fp32 accumulation: far closer to float64 than bf16 accumulation could be
    assert rel_err(out, f64(x, w)) <= 1e-5


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(
    "k,n,k_shards",  # each shape at two shard counts, each count on two shapes (CI time)
    [
        (576, 1536, 1),
        (576, 1536, 2),
        (1536, 576, 4),
        (1536, 576, 8),
        (100, 70, 1),
        (100, 70, 8),
        (4096, 64, 2),
        (4096, 64, 4),
    ],
)
def test_batch_invariance_cpu(dtype, k, n, k_shards):
    x, w = rand((300, k), dtype), rand((k, n), dtype, k**-0.5)
    fn = lambda xs: pk.matmul(xs, w, k_shards=k_shards)
    assert prefix_mismatches(fn, x, PREFIXES + (299,)) == []
    assert not position_mismatch(fn, x, 5)


def test_batch_invariance_lm_head_cpu():
    """The large-weight plan (taller CPU row tiles) is invariant too."""
    x, w = rand((70, 576), jnp.float32), rand((576, 49152), jnp.float32, 0.04)
    assert plan_matmul(576, 49152, jnp.float32, platform="cpu").cpu_tile_m > 16
    assert prefix_mismatches(lambda xs: pk.matmul(xs, w), x, (1, 8, 65)) == []


@pytest.mark.parametrize("k_shards", [1, 8])
def test_batch_invariance_pallas_interpret(k_shards):
    x, w = rand((40, 256), jnp.float32), rand((256, 64), jnp.float32)
    fn = lambda xs: pk.matmul(xs, w, k_shards=k_shards, backend="triton", interpret=True)
    assert prefix_mismatches(fn, x, (1, 7, 17)) == []
    assert not position_mismatch(fn, x, 3)


def test_negative_control_xla_dot_is_not_invariant_here():
    """The same check on XLA's plain x @ w finds a difference on this CPU: the check can fail."""

    def differs(k, n):
        x, w = rand((300, k)), rand((k, n))
        return prefix_mismatches(lambda xs: pk.matmul_reference(xs, w), x, PREFIXES, first=True)

    # (any: stops at the first shape that differs)
    assert any(differs(k, n) for k, n in [(576, 1536), (1536, 576), (100, 70)]), (
        "XLA's dot was batch invariant on every shape: the negative control cannot fail"
    )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("k,n", [(256, 512), (576, 1536), (768, 256)])
def test_column_shards_reproduce_full_result(dtype, k, n):
    """A column-parallel rank's N/P columns (planned for the whole weight, col_blocks=8) equal
    those columns of the one-device result, for P = 1, 2, 4, 8 and any row count."""
    w = rand((k, n), dtype)
    for m in (1, 5, 40):
        x = rand((m, k), dtype)
        full = bits(pk.matmul(x, w, col_blocks=8))
        for p in (1, 2, 4, 8):
            c = n // p
            for r in range(p):
                part = pk.matmul(x, w[:, r * c : (r + 1) * c], col_blocks=8, full_n=n)
                np.testing.assert_array_equal(
                    bits(part), full[:, r * c : (r + 1) * c], err_msg=f"P={p} r={r}"
                )


def test_column_shards_negative_control():
    """Without column blocks, XLA's CPU dot gives a narrow slice of the columns other bits than
    the whole weight's dot (so the check above can fail)."""
    found = []
    for k, n in [(256, 512), (576, 1536), (768, 256)]:
        x, w = rand((40, k)), rand((k, n))
        full = bits(pk.matmul(x, w))
        c = n // 8
        found += [(k, n)] if (bits(pk.matmul(x, w[:, :c])) != full[:, :c]).any() else []
    assert found, "a column slice gave the full dot's bits on every shape: the control cannot fail"


@pytest.mark.parametrize("backend,interpret", [("jnp", False), ("triton", True)])
@pytest.mark.parametrize("k,n", [(512, 96), (200, 64)])
def test_k_shards_partials_reproduce_full_result(backend, interpret, k, n):
    """Each TP rank's share (lower tree levels) + tree_sum across ranks == matmul(k_shards=8)."""
    platform = "cpu" if backend == "jnp" else "gpu"
    plan = plan_matmul(k, n, jnp.float32, k_shards=8, platform=platform)
    x, w = rand((9, k)), rand((k, n))
    full = bits(pk.matmul(x, w, k_shards=8, backend=backend, interpret=interpret))
    if k % 8:  # uneven K: the caller lays out the zero-padded shards
        pad = 8 * plan.shard_k - k
        x, w = jnp.pad(x, ((0, 0), (0, pad))), jnp.pad(w, ((0, pad), (0, 0)))
    for p in (1, 2, 4, 8):
        kr = x.shape[1] // p
        parts = [
            pk.matmul_partial(
                x[:, r * kr : (r + 1) * kr],
                w[r * kr : (r + 1) * kr],
                plan=plan,
                backend=backend,
                interpret=interpret,
            )
            for r in range(p)
        ]
        assert all(part.dtype == jnp.float32 for part in parts)
        np.testing.assert_array_equal(bits(pk.tree_sum(parts).astype(jnp.float32)), full, err_msg=f"P={p}")


def test_k_shards_change_bits_only_through_the_tree():
    """Different k_shards are different (documented) reduction orders; each is self-consistent."""
    x, w = rand((64, 4096)), rand((4096, 128))
    a, b = bits(pk.matmul(x, w, k_shards=1)), bits(pk.matmul(x, w, k_shards=8))
    assert not np.array_equal(a, b)  # the tree is real: it changes the sum's order
    np.testing.assert_array_equal(bits(pk.matmul(x, w, k_shards=8)), b)


def test_tree_sum_is_a_balanced_neighbour_tree():
    parts = [jnp.float32(v) for v in (1e8, 1.0, -1e8, 1.0)]
    # ((1e8 + 1) + (-1e8 + 1)) in fp32 = 0 + ... : order matters, and it is this one
    expect = (np.float32(1e8) + np.float32(1.0)) + (np.float32(-1e8) + np.float32(1.0))
    assert float(pk.tree_sum(parts)) == float(expect)
    with pytest.raises(ValueError, match="power-of-two"):
        pk.tree_sum(parts[:3])


def test_plan_depends_on_the_weight_only():
    narrow = plan_matmul(14336, 4096, jnp.bfloat16, platform="gpu")
    wide = plan_matmul(4096, 28672, jnp.bfloat16, platform="gpu")
    assert narrow.split_k > 1, "narrow-N weights get a fixed split-K"
    assert wide.split_k == 1
    assert plan_matmul(14336, 4096, jnp.bfloat16, k_shards=8, platform="gpu").num_leaves >= 8
    assert plan_matmul(100, 64, jnp.float32).platform == "cpu"  # default: this machine
    assert plan_matmul(576, 49152, jnp.float32, platform="cpu").split_k == 1
    # the launch shape may follow M on GPU; the reduction plan never does
    assert gpu_tiles(narrow, 1) != gpu_tiles(narrow, 4096)
    assert isinstance(gpu_tiles(narrow, 1), GpuTiles)


def test_tiles_override_is_checked():
    x, w = rand((4, 64)), rand((64, 64))
    with pytest.raises(TypeError, match="GpuTiles"):
        pk.matmul(x, w, tiles=(16, 64, 4, 3))


@pytest.mark.parametrize(
    "x,w,kwargs,exc,match",
    [
        (np.ones((2, 3, 4), np.float32), np.ones((4, 5), np.float32), {}, ValueError, "2-D"),
        (np.ones((2, 4), np.float32), np.ones((5, 6), np.float32), {}, ValueError, "K mismatch"),
        (np.ones((2, 4), np.float32), np.ones((4, 6), jnp.bfloat16), {}, TypeError, "mixed dtypes"),
        (np.ones((2, 4), np.int32), np.ones((4, 6), np.int32), {}, TypeError, "int32"),
        (np.ones((0, 4), np.float32), np.ones((4, 6), np.float32), {}, ValueError, "M == 0"),
        (np.ones((2, 4), np.float32), np.ones((4, 6), np.float32), {"k_shards": 3}, ValueError, "k_shards"),
        (
            np.ones((2, 4), np.float32),
            np.ones((4, 6), np.float32),
            {"backend": "cuda"},
            ValueError,
            "backend",
        ),
        (
            np.ones((2, 4), np.float32),
            np.ones((4, 6), np.float32),
            {"out_dtype": jnp.int8},
            TypeError,
            "out_dtype",
        ),
        ([[1.0]], np.ones((1, 6), np.float32), {}, ValueError, "2-D"),
        (
            np.ones((2, 4), np.float32),
            np.ones((4, 6), np.float32),
            {"col_blocks": 3},
            ValueError,
            "col_blocks",
        ),
        (
            np.ones((2, 4), np.float32),
            np.ones((4, 6), np.float32),
            {"col_blocks": 4},
            ValueError,
            "col_blocks=4 must divide N=6",
        ),
        (np.ones((2, 4), np.float32), np.ones((4, 6), np.float32), {"full_n": 4}, ValueError, "full_n"),
        (
            np.ones((2, 0), np.float32),
            np.ones((0, 6), np.float32),
            {},
            ValueError,
            "matmul: the operands have no K",
        ),
        (
            np.ones((2, 4), np.float32),
            np.ones((4, 6), np.float32),
            {"col_blocks": 4, "full_n": 16},
            ValueError,
            "whole column blocks",
        ),
    ],
)
def test_bad_input(x, w, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        pk.matmul(x, w, **kwargs)


def test_matmul_partial_rejects_a_slice_that_is_not_whole_shards():
    plan = plan_matmul(512, 64, jnp.float32, k_shards=8, platform="cpu")
    x, w = rand((2, 100)), rand((100, 64))
    with pytest.raises(ValueError, match="shards"):
        pk.matmul_partial(x, w, plan=plan)


def test_matmul_partial_defaults_reproduce_the_full_result():
    """plan_matmul's and matmul_partial's defaults agree with matmul on this machine."""
    x, w = rand((4, 4096)), rand((4096, 64))
    full = bits(pk.matmul(x, w, k_shards=2))
    plan = pk.plan_matmul(4096, 64, jnp.float32, k_shards=2)
    parts = [
        pk.matmul_partial(x[:, r * 2048 : (r + 1) * 2048], w[r * 2048 : (r + 1) * 2048], plan=plan)
        for r in range(2)
    ]
    np.testing.assert_array_equal(bits(pk.tree_sum(parts).astype(jnp.float32)), full)


def test_matmul_partial_refuses_a_plan_for_another_platform_or_dtype():
    x, w = rand((2, 200)), rand((200, 64))
    cpu_plan = plan_matmul(200, 64, jnp.float32, platform="cpu")
    with pytest.raises(ValueError, match="cpu plan runs on backend='jnp'"):
        pk.matmul_partial(x, w, plan=cpu_plan, backend="triton", interpret=True)
    with pytest.raises(TypeError, match="plan is for float32"):
        pk.matmul_partial(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), plan=cpu_plan)


def test_runs_under_jit_and_vmap_free_tracing():
    w = rand((576, 96))
    f = jax.jit(lambda x: pk.matmul(x, w) * 2)
    x = rand((5, 576))
    np.testing.assert_array_equal(bits(f(x)), bits(pk.matmul(x, w) * 2))


# --------------------------------------------------------------------------- weights sharing x


def _shared_case():
    """x and three weights whose GPU plans differ: one leaf (N 4352), two leaves (N 64, 128)."""
    k = 2048
    x = rand((3, k), jnp.bfloat16)
    ws = [rand((k, n), jnp.bfloat16, k**-0.5) for n in (4352, 64, 128)]
    leaves = [plan_matmul(k, w.shape[1], w.dtype, platform="gpu").split_k for w in ws]
    assert leaves == [1, 2, 2]
    return x, ws


@pytest.mark.parametrize("backend,interpret", [("triton", True), ("jnp", False)])
def test_shared_launch_gives_each_weight_its_own_bits(backend, interpret):
    """matmul_shared's outputs are matmul's, weight by weight, bit for bit: on the CPU's path and
    through the one-launch kernel (interpret mode), with weights of different plans in one grid.
    Control: the same comparison against matmul with another reduction tree fails."""
    x, ws = _shared_case()
    f32 = dict(out_dtype=jnp.float32, backend=backend, interpret=interpret)
    got = pk.matmul_shared(x, ws, **f32)
    assert [g.shape for g in got] == [(3, w.shape[1]) for w in ws]
    for g, w in zip(got, ws, strict=True):
        np.testing.assert_array_equal(bits(g), bits(pk.matmul(x, w, **f32)))
    assert not np.array_equal(bits(got[1]), bits(pk.matmul(x, ws[1], k_shards=8, **f32)))
    got = pk.matmul_shared(x, ws, backend=backend, interpret=interpret)  # the input's dtype out
    assert [g.dtype for g in got] == [jnp.bfloat16] * 3
    np.testing.assert_array_equal(
        bits(got[0]), bits(pk.matmul(x, ws[0], backend=backend, interpret=interpret))
    )


def test_shared_launch_column_shards_and_float32_out():
    """A column-parallel rank's shards (``full_ns``) and a float32 output give matmul's bits."""
    x, ws = _shared_case()
    shards = [w[:, : w.shape[1] // 2] for w in ws]
    full_ns = [w.shape[1] for w in ws]
    got = pk.matmul_shared(x, shards, out_dtype=jnp.float32, col_blocks=2, full_ns=full_ns)
    for g, w, n in zip(got, shards, full_ns, strict=True):
        assert g.dtype == jnp.float32
        want = pk.matmul(x, w, out_dtype=jnp.float32, col_blocks=2, full_n=n)
        np.testing.assert_array_equal(bits(g), bits(want))


def test_shared_launch_gradients_are_each_weights():
    x, ws = _shared_case()
    ws = ws[1:]

    def loss(fn):
        return lambda x, ws: sum(jnp.sum(y.astype(jnp.float32) ** 2) for y in fn(x, ws))

    got = jax.grad(loss(pk.matmul_shared), argnums=(0, 1))(x, ws)
    want = jax.grad(loss(lambda x, ws: [pk.matmul(x, w) for w in ws]), argnums=(0, 1))(x, ws)
    for a, b in zip(got[1], want[1], strict=True):  # each weight's gradient: the same formula
        np.testing.assert_array_equal(bits(a), bits(b))
    # x's: the weights' parts summed in float32 and rounded once (within bf16 of float64)
    ys = [np.asarray(y, np.float64) for y in pk.matmul_shared(x, ws)]
    ref = sum(2 * y @ np.asarray(w, np.float64).T for y, w in zip(ys, ws, strict=True))
    assert rel_err(got[0], ref) <= TOL[jnp.dtype(jnp.bfloat16)]


def test_shared_launch_many_row_tiles_padded_leaves_and_folds():
    """More row tiles than a swizzle group (M 130), K padded per leaf (4160), weights of 1 and 4
    leaves in one grid: each output has matmul's bits (float32: the leaves' fold order shows)."""
    k = 4160
    x = rand((130, k))
    ws = [rand((k, n), jnp.float32, k**-0.5) for n in (4352, 64)]
    plans = [plan_matmul(k, w.shape[1], w.dtype, platform="gpu") for w in ws]
    assert [p.split_k for p in plans] == [1, 4] and plans[1].split_k * plans[1].leaf_k > k
    got = pk.matmul_shared(x, ws, backend="triton", interpret=True)
    for g, w in zip(got, ws, strict=True):
        np.testing.assert_array_equal(bits(g), bits(pk.matmul(x, w, backend="triton", interpret=True)))


def test_mosaic_gpu_rows_and_launch_boundaries():
    """On Hopper, bf16 rows above 64 go to the Mosaic GPU kernel (33-64 only for narrow long-K
    weights), and 129-256 rows take 128 x 128 CTAs where 128 x 256 ones would not fill the SMs."""
    from pallas_kernels import matmul_mgpu as mg

    down = plan_matmul(14336, 4096, jnp.bfloat16, platform="gpu")
    lm_head = plan_matmul(4096, 128256, jnp.bfloat16, platform="gpu")
    assert [mg.prefer_mgpu(down, m) for m in (16, 33, 64, 65, 511)] == [False, True, True, True, True]
    assert [mg.prefer_mgpu(lm_head, m) for m in (64, 65)] == [False, True]
    assert not mg.prefer_mgpu(plan_matmul(4096, 4096, jnp.float32, platform="gpu"), 256)
    leaves = down.num_leaves
    assert mg.mgpu_tiles(4096, leaves, 256) == mg._MID_256
    assert mg.mgpu_tiles(4096, leaves, 128) != mg._MID_256
    assert mg.mgpu_tiles(4096, leaves, 384) == mg._WIDE_M[0][0]
    assert mg.mgpu_tiles(28672, 1, 256) == mg._WIDE_M[0][0]  # 224 CTAs of 128 x 256 fill the SMs


@pytest.mark.parametrize(
    "ws,kwargs,exc,match",
    [
        ([], {}, ValueError, "no weights"),
        (np.ones((4, 6), np.float32), {}, TypeError, "list or tuple"),
        ([np.ones((4, 6), np.float32), None], {}, ValueError, r"ws\[1\] must be a 2-D array"),
        (
            [np.ones((4, 6), np.float32), np.ones((5, 6), np.float32)],
            {},
            ValueError,
            r"ws\[1\]: .*K mismatch",
        ),
        ([np.ones((4, 6), np.float32)], {"full_ns": [6, 6]}, ValueError, "1 weights but 2 full_ns"),
        ([np.ones((4, 6), np.float32)], {"full_ns": 6}, TypeError, "full_ns must be a list"),
        ([np.ones((4, 6), np.float32)], {"full_ns": [4]}, ValueError, "full_n"),
        ([np.ones((4, 6), np.float32)], {"col_blocks": 3}, ValueError, "col_blocks"),
    ],
)
def test_shared_bad_input(ws, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        pk.matmul_shared(np.ones((2, 4), np.float32), ws, **kwargs)
