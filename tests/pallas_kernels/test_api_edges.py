"""The kernels used directly, as a library: bits under ``jax.vmap`` and inside a caller's jit,
top-n over rows with -inf entries, sampling values, and argument checks (a user-level probe)."""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from tests.conftest import bits


def _blocks(seed, shape):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _differing(a, b) -> int:
    return sum(not np.array_equal(bits(x), bits(y)) for x, y in zip(a, b, strict=True))


def test_row_ops_under_vmap_keep_each_blocks_bits():
    """Under ``jax.vmap`` a block's bits equal the unbatched call's whatever the vmapped size
    (the CPU forms saw a [B, 16, H] tile and XLA reduced it in another order). Control: the
    CPU form without its batching rule differs in most blocks."""
    x, w = _blocks(16, (32, 4, 33)), _blocks(17, (33,))
    ops = {
        "rms_norm": lambda a: pk.rms_norm(a, w, eps=1e-5),
        "log_softmax": pk.log_softmax,
        "logsumexp": pk.logsumexp,
        "matmul_norm": lambda a: pk.matmul_norm(a, _blocks(18, (33, 33)), w, a, eps=1e-5)[0],
    }
    for name, op in ops.items():
        alone = [op(x[i]) for i in range(len(x))]
        assert _differing(jax.vmap(op)(x), alone) == 0, name
    unwrapped = importlib.import_module("pallas_kernels.rms_norm")._rms_norm_jnp
    raw = jax.vmap(lambda a: unwrapped(a, w, None, eps=1e-5))(x)
    assert _differing(raw, [pk.rms_norm(x[i], w, eps=1e-5) for i in range(len(x))]) > len(x) // 4


def _row0_differs(fn, logits) -> list[int]:
    alone = bits(fn(logits[:1]))[0]
    return [t for t in (16, 17) if not np.array_equal(bits(fn(logits[:t]))[0], alone)]


def test_row_ops_inside_a_callers_jit_keep_a_rows_bits(monkeypatch):
    """A caller's elementwise producer does not fuse into the CPU form (an FMA at exactly one
    16-row tile, not in the loop over several): row 0's bits are the same at 1, 16 and 17
    rows. Control: without the fence (the barrier made a no-op) log_softmax(l * c) differs."""
    logits, c, w = _blocks(18, (40, 300)), _blocks(19, (300,)), _blocks(20, (300,))
    cases = {
        "log_softmax": lambda a: pk.log_softmax(a * c),
        "rms_norm bf16": lambda a: pk.rms_norm(
            a.astype(jnp.bfloat16) * c.astype(jnp.bfloat16), w.astype(jnp.bfloat16), eps=1e-5
        ),
        "rms_norm residual": lambda a: pk.rms_norm(a * c, w, eps=1e-5, residual=a * w)[0],
    }
    for name, fn in cases.items():
        assert _row0_differs(jax.jit(fn), logits) == [], name
    softmax_module = importlib.import_module("pallas_kernels.softmax")
    monkeypatch.setattr(softmax_module.lax, "optimization_barrier", lambda x: x)
    wide, c2 = _blocks(23, (40, 301)), _blocks(24, (301,))  # (shapes not traced above)
    assert _row0_differs(jax.jit(lambda a: pk.log_softmax(a * c2)), wide)


def test_top_n_ids_are_distinct_over_minus_inf():
    ids, vals = pk.top_n(jnp.asarray([[-jnp.inf, -1.0, -jnp.inf, -2.0], [2.0, 1.0, -jnp.inf, -jnp.inf]]), 4)
    assert ids.tolist() == [[1, 3, 0, 2], [0, 1, 2, 3]]
    assert vals.tolist() == [[-1.0, -2.0, -np.inf, -np.inf], [2.0, 1.0, -np.inf, -np.inf]]
    with pytest.raises(TypeError, match="top_n: logprobs has dtype int32"):
        pk.top_n(jnp.zeros((1, 4), jnp.int32), 2)


def test_sample_refuses_values_that_keep_no_token():
    logits = jnp.zeros((1, 5), jnp.float32)
    good = dict(temperature=[1.0], top_k=[-1], top_p=[1.0], min_p=[0.0], gumbel=jnp.zeros((1, 5)))
    good = {k: jnp.asarray(v) for k, v in good.items()}
    pk.sample(logits, **good)
    for name, value, match in (
        ("min_p", [1.5], r"min_p must be in \[0, 1\]"),
        ("temperature", [float("nan")], "temperature must be finite"),
        ("top_k", [2.7], "top_k must be whole numbers"),
        ("top_p", [-1.0], r"top_p must be in \(0, 1\]"),
    ):
        with pytest.raises(ValueError, match=match):
            pk.sample(logits, **{**good, name: jnp.asarray(value)})


def test_argument_checks_name_the_problem():
    x, w = _blocks(21, (2, 8)), _blocks(22, (8, 4))
    for kw, match in (
        (dict(k_shards=2.0), "k_shards must be one of"),
        (dict(k_shards=True), "k_shards must be one of"),
        (dict(col_blocks=2.0), "col_blocks must be one of"),
        (dict(col_blocks=8), "col_blocks=8 must divide N=4"),
    ):
        with pytest.raises(ValueError, match=match):
            pk.matmul(x, w, **kw)
    with pytest.raises(TypeError, match="out_dtype must be bfloat16, float16 or float32, got float64"):
        pk.matmul(x, w, out_dtype=jnp.float64)
    with pytest.raises(ValueError, match="k_shards must be one of"):
        pk.plan_matmul(8, 4, jnp.float32, k_shards=2.0)
    plan = pk.plan_matmul(8, 4, jnp.float32, platform="cpu")
    with pytest.raises(TypeError, match="plan must be a MatmulPlan"):
        pk.matmul_partial(x, w, plan=None)
    with pytest.raises(ValueError, match="empty operands"):
        pk.matmul_partial(x[:0], w, plan=plan)
    gpu_plan = pk.plan_matmul(8, 4, jnp.float32, platform="gpu")
    with pytest.raises(ValueError, match="a gpu plan runs on a GPU"):
        pk.matmul_partial(x, w, plan=gpu_plan)
    with pytest.raises(ValueError, match="power-of-two number of parts, got 0"):
        pk.tree_sum([])
    cache = jnp.zeros((4, 2, 1, 8))
    with pytest.raises(ValueError, match=r"write_kv: k must be a \[T, Hkv, D\] array, got list"):
        pk.write_kv(cache, cache, [[0.0] * 8], jnp.zeros((1, 1, 8)), jnp.zeros((1,), jnp.int32))
