"""The kernels' custom VJPs: gradients match jax.vjp of the plain XLA references, the forward
bits do not change under differentiation, and the integer inputs get no cotangent."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels.attention import attention, attention_reference
from tests.conftest import bits, rand, rel_err

TOL = {jnp.dtype(jnp.float32): 1e-4, jnp.dtype(jnp.bfloat16): 2e-2}


def _check(fn, ref, args, tol, argnums=None):
    """vjp of fn vs vjp of ref for a random output cotangent; the primal keeps fn's bits."""
    argnums = tuple(range(len(args))) if argnums is None else argnums
    pick = lambda f: lambda *d: f(*[d[argnums.index(i)] if i in argnums else a for i, a in enumerate(args)])
    diff = [args[i] for i in argnums]
    out, vjp = jax.vjp(pick(fn), *diff)
    out_ref, vjp_ref = jax.vjp(pick(ref), *diff)
    cot = jax.tree.map(lambda o: rand(o.shape, o.dtype), out)
    for a, b, x in zip(vjp(cot), vjp_ref(cot), diff, strict=True):
        assert a.dtype == x.dtype and a.shape == x.shape
        assert rel_err(a, b) <= tol, rel_err(a, b)
    plain = fn(*args)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(plain), strict=True):
        assert np.array_equal(bits(a), bits(b))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("k_shards", [1, 4])
def test_matmul_vjp(dtype, k_shards):
    x, w = rand((37, 200), dtype), rand((200, 96), dtype, 0.1)
    _check(
        lambda x, w: pk.matmul(x, w, k_shards=k_shards, out_dtype=jnp.float32),
        lambda x, w: pk.matmul_reference(x, w, out_dtype=jnp.float32),
        (x, w),
        TOL[jnp.dtype(dtype)],
    )


def test_matmul_partial_tree_vjp():
    """The tensor-parallel path: per-rank partials combined by tree_sum."""
    x, w = rand((21, 256)), rand((256, 64), scale=0.1)
    plan = pk.plan_matmul(256, 64, jnp.float32, k_shards=4, platform="cpu")

    def parts(x, w):
        return pk.tree_sum(
            [
                pk.matmul_partial(x[:, r * 128 : (r + 1) * 128], w[r * 128 : (r + 1) * 128], plan=plan)
                for r in range(2)
            ]
        )

    _check(parts, pk.matmul_reference, (x, w), 1e-4)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_vjp(dtype, residual):
    x, w, r = rand((19, 128), dtype), rand((128,), dtype), rand((19, 128), dtype)
    if residual:
        _check(
            lambda x, w, r: pk.rms_norm(x, w, eps=1e-5, residual=r),
            lambda x, w, r: pk.rms_norm_reference(x, w, eps=1e-5, residual=r),
            (x, w, r),
            TOL[jnp.dtype(dtype)],
        )
    else:
        _check(
            lambda x, w: pk.rms_norm(x, w, eps=1e-5),
            lambda x, w: pk.rms_norm_reference(x, w, eps=1e-5),
            (x, w),
            TOL[jnp.dtype(dtype)],
        )


def test_log_softmax_logsumexp_tempered_vjp():
    x, t = rand((20, 700), scale=3.0), jnp.asarray(np.r_[np.full(19, 0.7), 0.0], jnp.float32)
    _check(pk.log_softmax, pk.log_softmax_reference, (x,), 1e-5)
    _check(pk.logsumexp, pk.logsumexp_reference, (x,), 1e-5)

    def ref_tempered(x, t):  # x / T per row, unchanged where T <= 0
        return jnp.where((t > 0)[:, None], x / jnp.where(t > 0, t, 1.0)[:, None], x)

    _check(pk.tempered, ref_tempered, (x, t), 1e-5)


def _attention_inputs(dtype):
    q = rand((14, 8, 64), dtype)
    kc, vc = rand((10, 16, 2, 64), dtype), rand((10, 16, 2, 64), dtype)
    bt = jnp.array([[1, 2, 3, 4], [5, 6, 7, 0]], jnp.int32)
    ctx = jnp.array([60, 40], jnp.int32)
    seq = jnp.array([0] * 7 + [1] * 6 + [0], jnp.int32)
    pos = jnp.array([0, 5, 16, 17, 33, 50, 59, 0, 3, 15, 16, 31, 39, -1], jnp.int32)  # last: padding
    return q, kc, vc, bt, ctx, seq, pos


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("window", [None, 20])
def test_attention_vjp(dtype, window):
    args = _attention_inputs(dtype)
    _check(
        lambda *a: attention(*a, sliding_window=window),
        lambda *a: attention_reference(*a, sliding_window=window),
        args,
        TOL[jnp.dtype(dtype)],
        argnums=(0, 1, 2),
    )


def test_attention_integer_inputs_get_no_cotangent():
    args = _attention_inputs(jnp.float32)
    _, vjp = jax.vjp(attention, *args)
    cots = vjp(jnp.ones((14, 8, 64), jnp.float32))
    for c in cots[3:]:
        assert c.dtype == jax.dtypes.float0
    dq, dk, dv = cots[:3]
    assert np.isfinite(np.asarray(dq)).all() and not np.asarray(dq)[-1].any()  # padding token: zero
    assert not np.asarray(dk)[8:].any()  # blocks no sequence uses (and the null block's unused tail)


def test_grad_under_jit_is_finite_and_equals_eager():
    x, w = rand((33, 64)), rand((64, 128), scale=0.1)
    loss = lambda x, w: jnp.sum(pk.log_softmax(pk.matmul(x, w)) ** 2)
    eager = jax.grad(loss, (0, 1))(x, w)
    jitted = jax.jit(jax.grad(loss, (0, 1)))(x, w)
    for a, b in zip(eager, jitted, strict=True):
        assert np.isfinite(np.asarray(a)).all()
        assert rel_err(a, b) <= 1e-5
