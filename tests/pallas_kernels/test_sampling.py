"""The sampling kernels: pk.sample / pk.argmax / pk.top_n against numpy, bit invariance by row."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from tests.conftest import bits

V = 1000


def _np_sample(x, t, k, p, m, g):
    """The documented semantics in float64 numpy (sort-based top-k / top-p)."""
    z = x * np.float64(np.float32(1) / np.float32(t)) if t > 0 else x
    lp = z - z.max() - np.log(np.exp(z - z.max()).sum())
    if t <= 0:
        return int(np.argmax(z)), lp
    keep = np.ones(len(z), bool)
    if 0 < k < len(z):
        keep &= z >= np.sort(z)[::-1][k - 1]
    if p < 1:
        q = np.where(keep, np.exp(lp), 0.0)
        q /= q.sum()
        order = np.argsort(-q, kind="stable")
        before = np.cumsum(q[order]) - q[order]
        kk = np.zeros(len(z), bool)
        kk[order[before < p]] = True
        keep &= kk
    if m > 0:
        keep &= lp >= np.log(m) + lp.max()
    return int(np.argmax(np.where(keep, z + g, -np.inf))), lp


def _params(r, rng):
    t = rng.choice([0.0, 0.5, 1.0, 1.7], r).astype(np.float32)
    k = rng.choice([-1, 1, 5, 40], r).astype(np.int32)
    p = rng.choice([1.0, 0.9, 0.5, 0.05], r).astype(np.float32)
    m = rng.choice([0.0, 0.0, 0.05], r).astype(np.float32)
    return t, k, p, m


def test_sample_matches_numpy_semantics():
    rng = np.random.default_rng(0)
    r = 48
    x = (rng.standard_normal((r, V)) * 3).astype(np.float32)
    g = np.asarray(jax.random.gumbel(jax.random.key(1), (r, V)))
    t, k, p, m = _params(r, rng)
    tok, lp = pk.sample(jnp.asarray(x), temperature=t, top_k=k, top_p=p, min_p=m, gumbel=g)
    for i in range(r):
        want, want_lp = _np_sample(x[i].astype(np.float64), t[i], k[i], p[i], m[i], g[i])
        assert int(tok[i]) == want, (i, t[i], k[i], p[i], m[i])
        np.testing.assert_allclose(np.asarray(lp[i]), want_lp, atol=2e-5)


def test_sample_rows_are_batch_invariant():
    rng = np.random.default_rng(1)
    r = 37
    x = jnp.asarray((rng.standard_normal((r, V)) * 3).astype(np.float32))
    g = jax.random.gumbel(jax.random.key(2), (r, V))
    t, k, p, m = _params(r, rng)
    full_tok, full_lp = pk.sample(x, temperature=t, top_k=k, top_p=p, min_p=m, gumbel=g)
    for lo, hi in ((0, 1), (3, 4), (5, 22), (30, 37)):
        tok, lp = pk.sample(
            x[lo:hi], temperature=t[lo:hi], top_k=k[lo:hi], top_p=p[lo:hi], min_p=m[lo:hi], gumbel=g[lo:hi]
        )
        np.testing.assert_array_equal(np.asarray(tok), np.asarray(full_tok[lo:hi]))
        np.testing.assert_array_equal(bits(lp), bits(full_lp[lo:hi]))


def test_rows_without_top_k_or_top_p_sample_the_same_with_or_without_the_filter_masks():
    """``filters=False`` (no row of the step uses top-k / top-p: ``uses_filters``) skips the
    masks; a row that uses neither gets the same token and logprob bits either way - so the
    engine may pick the program by the other rows. Control: rows that do use a filter change."""
    rng = np.random.default_rng(5)
    r = 24
    x = jnp.asarray((rng.standard_normal((r, V)) * 3).astype(np.float32))
    g = jax.random.gumbel(jax.random.key(3), (r, V))
    t, k, p, m = _params(r, rng)
    k[: r // 2], p[: r // 2] = -1, 1.0  # the first half: no filter (greedy rows, min-p allowed)
    k[r // 2 :], p[r // 2 :], t[r // 2 :] = 2, 0.3, 1.0  # the second half: both filters, sampled
    assert not pk.uses_filters(t[: r // 2], k[: r // 2], p[: r // 2]) and pk.uses_filters(t, k, p)
    assert not pk.uses_filters(np.zeros(2), [3, 5], [0.5, 0.5])  # greedy rows ignore filters
    args = dict(temperature=t, top_k=k, top_p=p, min_p=m, gumbel=g)
    on_tok, on_lp = pk.sample(x, **args, filters=True)
    off_tok, off_lp = pk.sample(x, **args, filters=False)
    h = r // 2
    np.testing.assert_array_equal(np.asarray(on_tok[:h]), np.asarray(off_tok[:h]))
    np.testing.assert_array_equal(bits(on_lp), bits(off_lp))  # logprobs never depend on filters
    assert (np.asarray(on_tok[h:]) != np.asarray(off_tok[h:])).any()  # the control
    want = [
        _np_sample(np.asarray(x[i], np.float64), t[i], k[i], p[i], m[i], np.asarray(g[i]))[0]
        for i in range(r)
    ]
    assert np.asarray(on_tok).tolist() == want


def test_negative_control_xla_sampler_varies_with_batch():
    """The same check on the engine's plain-XLA sampler (XLA log_softmax, sort + cumsum
    top-p) finds rows whose logprob bits change with the batch size: the check can fail."""
    from bijax.sampler import sample_reference

    rng = np.random.default_rng(4)

    def differs(v):
        r = 300
        x = jnp.asarray((rng.standard_normal((r, v)) * 3).astype(np.float32))
        g = jax.random.gumbel(jax.random.key(5), (r, v))
        t, k, p, m = (jnp.asarray(a) for a in _params(r, rng))
        ref = jax.jit(sample_reference)
        _, full = ref(x, t, k, p, m, g)
        return any(
            not np.array_equal(bits(ref(x[:n], t[:n], k[:n], p[:n], m[:n], g[:n])[1]), bits(full[:n]))
            for n in (1, 2, 3, 7, 8, 16, 17)
        )

    # (any: stops at the first difference)
    assert any(differs(v) for v in (577, 1000)), (
        "XLA's sampler was batch invariant everywhere: the negative control cannot fail"
    )


def test_xla_sampler_skips_its_sort_when_no_row_filters():
    """The baseline sorts each row only for top-k / top-p: rows that use neither (greedy,
    temperature with min_p) get the same tokens and logprob bits without the sort, and its
    program has no sort. Control: a row with top-p makes ``uses_filters`` true, and that
    program sorts."""
    from bijax.sampler import sample_reference

    rng = np.random.default_rng(6)
    r, v = 6, 700
    x = jnp.asarray((rng.standard_normal((r, v)) * 3).astype(np.float32))
    g = jax.random.gumbel(jax.random.key(7), (r, v))
    t = jnp.asarray([0.0, 0.7, 1.0, 1.3, 0.0, 0.9], jnp.float32)
    k, p = jnp.full(r, -1, jnp.int32), jnp.ones(r, jnp.float32)
    m = jnp.asarray([0.0, 0.05, 0.0, 0.2, 0.0, 0.0], jnp.float32)
    assert not pk.uses_filters(t, k, p)
    sort = jax.jit(sample_reference)
    skip = jax.jit(functools.partial(sample_reference, filters=False))
    want, got = sort(x, t, k, p, m, g), skip(x, t, k, p, m, g)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_array_equal(bits(got[1]), bits(want[1]))
    assert "sort" not in skip.lower(x, t, k, p, m, g).as_text()
    assert pk.uses_filters(t, k, p.at[1].set(0.9))
    assert "sort" in sort.lower(x, t, k, p, m, g).as_text()


def test_argmax_and_top_n():
    x = jnp.asarray([[1.0, 5.0, 5.0, -2.0], [0.0, -1.0, 3.0, 3.5]])
    np.testing.assert_array_equal(np.asarray(pk.argmax(x)), [1, 3])  # ties: the first index
    ids, vals = pk.top_n(x, 3)
    np.testing.assert_array_equal(np.asarray(ids), [[1, 2, 0], [3, 2, 0]])
    np.testing.assert_array_equal(np.asarray(vals), [[5.0, 5.0, 1.0], [3.5, 3.0, 0.0]])


def test_sample_bad_input():
    x = jnp.zeros((2, 8))
    ok = dict(
        temperature=np.ones(2),
        top_k=-np.ones(2, np.int32),
        top_p=np.ones(2),
        min_p=np.zeros(2),
        gumbel=np.zeros((2, 8)),
    )
    with pytest.raises(ValueError, match="temperature"):
        pk.sample(x, **dict(ok, temperature=np.ones(3)))
    with pytest.raises(ValueError, match="gumbel"):
        pk.sample(x, **dict(ok, gumbel=np.zeros((2, 7))))
    with pytest.raises(ValueError, match="n must be"):
        pk.top_n(x, 9)
