"""rope and rope_write_kv: float64 accuracy, the fused op's bits against rope + write_kv on every
path, negative controls (a fused multiply-add, a wrong slot), bad input."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from tests.conftest import bits, rand

BACKENDS = [("auto", False), ("triton", True)]


def f64_rope(x, cos_sin):
    x, cs = np.asarray(x, np.float64), np.asarray(cos_sin, np.float64)
    cos, sin = cs[:, None, 0], cs[:, None, 1]
    x1, x2 = np.split(x, 2, axis=-1)
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def angles(t, d):
    ang = np.arange(t, dtype=np.float64)[:, None] * (10000.0 ** (-np.arange(d // 2) * 2 / d))[None, :] + 0.3
    return jnp.asarray(np.stack([np.cos(ang), np.sin(ang)], axis=1), jnp.float32)


def test_rope_is_accurate():
    x, cs = rand((7, 3, 64), jnp.float32), angles(7, 64)
    np.testing.assert_allclose(np.asarray(pk.rope(x, cs)), f64_rope(x, cs), rtol=1e-6, atol=1e-6)


def test_rope_bad_input_is_named():
    """Shapes and dtypes that would broadcast or truncate silently are refused by name."""
    x, cs = rand((5, 4, 64), jnp.float32), angles(5, 64)
    for bad_x, bad_cs, err, match in (
        (
            x,
            cs[:1],
            ValueError,
            r"cos_sin must be float32 of shape \(5, 2, 32\)",
        ),  # one position for 5 tokens
        (x[:, 0], cs, ValueError, "x must be a floating \\[T, H, D\\] array"),
        (x.astype(jnp.int32), cs, TypeError, "x must be a floating"),
        (x, cs.astype(jnp.bfloat16), ValueError, "cos_sin must be float32"),
        (x[..., :63], cs, ValueError, "head dim must be even"),
    ):
        with pytest.raises(err, match=match):
            pk.rope(bad_x, bad_cs)


def inputs(t, hq, hkv, d, block_size, num_blocks, dtype=jnp.bfloat16):
    q, k, v = rand((t, hq, d), dtype), rand((t, hkv, d), dtype), rand((t, hkv, d), dtype)
    caches = [rand((num_blocks, block_size, hkv, d), dtype) for _ in range(2)]
    # real tokens in blocks 1.. (block 0 is the null block), the last token padding
    slots = jnp.asarray([block_size + 3 * i + 1 for i in range(t - 1)] + [-1], jnp.int32)
    return q, k, v, angles(t, d) * 1.7, caches, slots


# Head counts that are not powers of two (14 query heads), both head dims, bf16 and f32 caches.
@pytest.mark.parametrize("backend,interpret", BACKENDS)
@pytest.mark.parametrize(
    "t,hq,hkv,d,block_size,cache_dtype",
    [(5, 8, 2, 64, 16, jnp.bfloat16), (3, 14, 2, 128, 16, jnp.bfloat16), (4, 4, 4, 64, 64, jnp.float32)],
)
def test_rope_write_kv_is_rope_then_write_kv(backend, interpret, t, hq, hkv, d, block_size, cache_dtype):
    q, k, v, cs, (kc, vc), slots = inputs(t, hq, hkv, d, block_size, 4)
    kc, vc = kc.astype(cache_dtype), vc.astype(cache_dtype)
    want_k, want_v = pk.write_kv(
        jnp.array(kc), jnp.array(vc), pk.rope(k, cs).astype(cache_dtype), v.astype(cache_dtype), slots
    )
    q_rot, got_k, got_v = pk.rope_write_kv(
        q, k, v, cs, jnp.array(kc), jnp.array(vc), slots, backend=backend, interpret=interpret
    )
    np.testing.assert_array_equal(bits(q_rot), bits(pk.rope(q, cs)))
    # every block but the null block 0 (padding tokens' rows: written by write_kv only)
    np.testing.assert_array_equal(bits(got_k)[1:], bits(want_k)[1:])
    np.testing.assert_array_equal(bits(got_v)[1:], bits(want_v)[1:])
    assert not np.array_equal(bits(got_k)[1:], bits(kc)[1:])  # rows were written


def test_negative_controls():
    """A fused multiply-add (one rounding of x1 * cos - x2 * sin) changes some bits of float32
    rope; a token written to the wrong slot changes the cache."""
    x, cs = rand((64, 4, 128), jnp.float32), angles(64, 128) * 1.7
    cos, sin = np.asarray(cs[:, None, 0], np.float64), np.asarray(cs[:, None, 1], np.float64)
    x1, x2 = np.split(np.asarray(x, np.float64), 2, axis=-1)
    p = (np.asarray(x2, np.float32) * np.asarray(sin, np.float32)).astype(np.float64)  # rounded product
    fma = np.concatenate([(x1 * cos - p).astype(np.float32), np.asarray(pk.rope(x, cs))[..., 64:]], axis=-1)
    assert not np.array_equal(bits(pk.rope(x, cs)), fma.view(np.uint32))

    q, k, v, cs, (kc, vc), slots = inputs(3, 4, 2, 64, 16, 4)
    got = pk.rope_write_kv(q, k, v, cs, jnp.array(kc), jnp.array(vc), slots, backend="triton", interpret=True)
    moved = pk.rope_write_kv(
        q, k, v, cs, jnp.array(kc), jnp.array(vc), slots + 1, backend="triton", interpret=True
    )
    assert not np.array_equal(bits(got[1]), bits(moved[1]))


def test_bad_input():
    q, k, v, cs, (kc, vc), slots = inputs(3, 4, 2, 64, 16, 4)
    with pytest.raises(ValueError, match="cos_sin must be float32"):
        pk.rope_write_kv(q, k, v, cs[:, :, :16], kc, vc, slots)
    with pytest.raises(TypeError, match="dtypes differ"):
        pk.rope_write_kv(q.astype(jnp.float32), k, v, cs, kc, vc, slots)
    with pytest.raises(ValueError, match="two tokens write the same cache slot"):
        pk.rope_write_kv(q, k, v, cs, kc, vc, jnp.asarray([20, 20, -1], jnp.int32))
    with pytest.raises(ValueError, match="outside the cache"):
        pk.rope_write_kv(q, k, v, cs, kc, vc, jnp.asarray([20, 64, -1], jnp.int32))
    with pytest.raises(ValueError, match="do not fit cache rows"):
        pk.rope_write_kv(q, k[:, :1], v[:, :1], cs, kc, vc, slots)


def qkv_operands(t, k, hq, hkv, d, dtype, num_blocks=4, block_size=16):
    x = rand((t, k), dtype)
    ws = [rand((k, h * d), dtype, 0.03) for h in (hq, hkv, hkv)]
    _, _, _, cs, (kc, vc), slots = inputs(t, hq, hkv, d, block_size, num_blocks, dtype)
    return x, ws, cs, kc, vc, slots


def qkv_ops(x, ws, cs, kc, vc, slots, *, backend, interpret, **cols):
    d = kc.shape[-1]
    ys = pk.matmul_shared(x, ws, backend=backend, interpret=interpret, **cols)
    q, k, v = (y.reshape(x.shape[0], -1, d) for y in ys)
    return pk.rope_write_kv(q, k, v, cs, kc, vc, slots, backend=backend, interpret=interpret)


# GPU plans (interpret) of 2 and 4 leaves and of one (no partials: the results themselves), bf16
# and f32, a column-parallel shard (padded rows and heads: test_padded_rows_and_heads_are_not_read).
@pytest.mark.parametrize("backend,interpret", BACKENDS)
@pytest.mark.parametrize(
    "t,k,hq,hkv,d,dtype,shard",
    [
        (5, 2048, 4, 2, 64, jnp.bfloat16, False),
        (3, 4096, 3, 1, 64, jnp.float32, False),
        (4, 512, 2, 1, 128, jnp.bfloat16, False),
        (2, 2048, 4, 2, 64, jnp.bfloat16, True),
    ],
)
def test_qkv_rope_write_kv_is_the_projections_then_rope_write_kv(
    backend, interpret, t, k, hq, hkv, d, dtype, shard
):
    x, ws, cs, kc, vc, slots = qkv_operands(t, k, hq, hkv, d, dtype)
    cols = {}
    if shard:  # this rank's half of each weight's columns, planned as the whole (col_blocks 2)
        cols = dict(col_blocks=2, full_ns=[2 * w.shape[1] for w in ws])
    want = qkv_ops(
        x, ws, cs, jnp.array(kc), jnp.array(vc), slots, backend=backend, interpret=interpret, **cols
    )
    got = pk.qkv_rope_write_kv(
        x, ws, cs, jnp.array(kc), jnp.array(vc), slots, backend=backend, interpret=interpret, **cols
    )
    assert got[0].shape == (t, hq, d) and got[0].dtype == dtype
    np.testing.assert_array_equal(bits(got[0]), bits(want[0]))
    for g, w in zip(got[1:], want[1:], strict=True):  # the caches but the null block 0
        np.testing.assert_array_equal(bits(g)[1:], bits(w)[1:])
    assert not np.array_equal(bits(got[1])[1:], bits(kc)[1:])


def test_qkv_negative_control_another_fold_order_differs():
    """The RoPE kernel's own combine of the leaf partials is what gives the bits: folding k's 4
    leaves as a tree (instead of one left fold) changes some (float32 rows, no rounding hides it)."""
    from pallas_kernels.matmul import gpu_shared
    from pallas_kernels.rope import _qkv_rows, _rope_kv_pallas

    x, ws, cs, kc, vc, slots = qkv_operands(16, 4096, 2, 2, 64, jnp.float32)
    cols = tuple((1, w.shape[1]) for w in ws)
    outs, plans = gpu_shared(
        x, ws, out_dtype=x.dtype, cols=cols, backend="triton", interpret=True, combine=False
    )
    rows, folds = _qkv_rows(outs, plans, ws, 64)
    assert folds == (4, 4, 4)

    def kernel(folds):
        kw = dict(interpret=True, folds=folds, hq=2, dtype=x.dtype)
        return _rope_kv_pallas(*rows, cs, jnp.array(kc), jnp.array(vc), slots, **kw)

    want = qkv_ops(x, ws, cs, jnp.array(kc), jnp.array(vc), slots, backend="triton", interpret=True)
    got = kernel(folds)
    np.testing.assert_array_equal(bits(got[1])[1:], bits(want[1])[1:])
    assert not np.array_equal(bits(kernel((4, 1, 4))[1])[1:], bits(want[1])[1:])


def test_qkv_bad_input():
    x, ws, cs, kc, vc, slots = qkv_operands(3, 512, 2, 1, 64, jnp.bfloat16)
    with pytest.raises(ValueError, match=r"ws must be \(wq, wk, wv\)"):
        pk.qkv_rope_write_kv(x, ws[:2], cs, kc, vc, slots)
    with pytest.raises(ValueError, match="do not make whole heads"):
        pk.qkv_rope_write_kv(x, [ws[0], ws[1][:, :32], ws[2]], cs, kc, vc, slots)
    with pytest.raises(ValueError, match="K mismatch|contract|shape"):
        pk.qkv_rope_write_kv(x[:, :256], ws, cs, kc, vc, slots)
    with pytest.raises(ValueError, match="cos_sin must be float32"):
        pk.qkv_rope_write_kv(x, ws, cs[:2], kc, vc, slots)
    with pytest.raises(ValueError, match="two tokens write the same cache slot"):
        pk.qkv_rope_write_kv(x, ws, cs, kc, vc, jnp.asarray([20, 20, -1], jnp.int32))


def test_padded_rows_and_heads_are_not_read():
    """The RoPE kernel reads only the real tokens' real heads of leaf partials [L, T', H', D]:
    NaN in the padded rows (T' > T) and heads (H' > heads) leaves every bit unchanged; NaN in a
    real head does not (the check can see it)."""
    from pallas_kernels.rope import _rope_kv_pallas

    t, hq, hkv, d, pad_t, pad_h = 3, 3, 2, 64, 8, 4
    q_l, k_l, v_l = (rand((2, pad_t, pad_h, d), jnp.float32) for _ in range(3))
    _, _, _, cs, (kc, vc), slots = inputs(t, hq, hkv, d, 16, 4)

    def run(q_l, k_l, v_l):
        kw = dict(interpret=True, folds=(2, 2, 2), hq=hq, dtype=jnp.bfloat16)
        return _rope_kv_pallas(q_l, k_l, v_l, cs, jnp.array(kc), jnp.array(vc), slots, **kw)

    def pad_nan(a, heads):
        return a.at[:, t:].set(jnp.nan).at[:, :, heads:].set(jnp.nan)

    want = [bits(a) for a in run(q_l, k_l, v_l)]
    got = run(pad_nan(q_l, hq), pad_nan(k_l, hkv), pad_nan(v_l, hkv))
    assert got[0].shape == (t, hq, d)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(bits(a), b)
    seen = run(q_l.at[1, 0, hq - 1, 5].set(jnp.nan), k_l, v_l)[0]
    assert np.isnan(np.asarray(seen[0, hq - 1].astype(jnp.float32))).any()
