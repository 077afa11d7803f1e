"""log_softmax / logsumexp over the vocabulary: accuracy, bitwise batch invariance, negative control."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from tests.conftest import position_mismatch, prefix_mismatches, rand, rel_err

BACKENDS = [("auto", False), ("triton", True)]


def f64_log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    lse = m + np.log(np.exp(x - m).sum(-1, keepdims=True))
    return x - lse, lse[:, 0]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("backend,interpret", BACKENDS)
@pytest.mark.parametrize("t,v", [(1, 100), (7, 5000), (3, 9000)])
def test_accuracy(dtype, backend, interpret, t, v):
    x = rand((t, v), dtype, 4.0)
    ref_lsm, ref_lse = f64_log_softmax(x)
    out = pk.log_softmax(x, backend=backend, interpret=interpret)
    lse = pk.logsumexp(x, backend=backend, interpret=interpret)
    assert out.dtype == jnp.float32 and lse.dtype == jnp.float32 and lse.shape == (t,)
    assert rel_err(out, ref_lsm) <= 1e-5
    assert rel_err(lse, ref_lse) <= 1e-5


def test_accuracy_vocab_152k():
    x = rand((3, 151936), jnp.float32, 5.0)
    ref_lsm, ref_lse = f64_log_softmax(x)
    assert rel_err(pk.log_softmax(x), ref_lsm) <= 1e-5
    assert rel_err(pk.logsumexp(x), ref_lse) <= 1e-5


@pytest.mark.parametrize("backend,interpret", BACKENDS)
def test_masked_logits(backend, interpret):
    """-inf logits (masked vocabulary) get probability exactly 0 and do not poison the row."""
    x = np.array(rand((2, 3000)))
    x[:, 1000:] = -np.inf
    out = np.asarray(pk.log_softmax(jnp.asarray(x), backend=backend, interpret=interpret))
    assert np.all(out[:, 1000:] == -np.inf) and np.all(np.isfinite(out[:, :1000]))
    assert rel_err(out[:, :1000], f64_log_softmax(x[:, :1000])[0]) <= 1e-5


@pytest.mark.parametrize("v", [100, 577, 1000, 49152])
def test_batch_invariance_cpu(v):
    x = rand((300, v), jnp.float32, 3.0)
    for fn in (pk.log_softmax, pk.logsumexp):
        assert prefix_mismatches(fn, x, (1, 2, 3, 7, 16, 17, 255)) == []
        assert not position_mismatch(fn, x, 3)


def test_batch_invariance_pallas_interpret():
    x = rand((20, 9000), jnp.bfloat16, 3.0)  # 3 segments, last one ragged
    for fn in (pk.log_softmax, pk.logsumexp):
        f = lambda xs, fn=fn: fn(xs, backend="triton", interpret=True)
        assert prefix_mismatches(f, x, (1, 7, 17)) == []


def test_negative_control_xla_log_softmax_is_not_invariant_here():
    def differs(v):
        x = rand((300, v), jnp.float32, 3.0)
        refs = (pk.log_softmax_reference, pk.logsumexp_reference)
        return any(prefix_mismatches(ref, x, (1, 2, 3, 7, 8, 16, 17), first=True) for ref in refs)

    # (any: stops at the first shape that differs)
    assert any(differs(v) for v in (100, 577, 1000)), (
        "XLA's log_softmax was batch invariant everywhere: the negative control cannot fail"
    )


@pytest.mark.parametrize("fn", [pk.log_softmax, pk.logsumexp])
def test_bad_input(fn):
    with pytest.raises(ValueError, match="2-D"):
        fn(np.ones((4,), np.float32))
    with pytest.raises(ValueError, match="no rows"):
        fn(np.ones((0, 4), np.float32))
    with pytest.raises(TypeError, match="int32"):
        fn(np.ones((2, 4), np.int32))
    with pytest.raises(ValueError, match="backend"):
        fn(np.ones((2, 4), np.float32), backend="tpu")
    with pytest.raises(ValueError, match="interpret"):
        fn(np.ones((2, 4), np.float32), interpret=True)
