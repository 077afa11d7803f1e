"""Batch-invariant sampling over the vocabulary: the tempered log_softmax, argmax, top-k, top-p,
min-p and Gumbel-max, and the top-n logprobs.

Sampling needs, per row: the tempered log_softmax, an argmax, the k-th largest value (top-k)
and a probability-mass threshold (top-p). Max, argmax and integer counts are exact, so any
reduction order gives the same bits; every float sum goes through the invariant logsumexp of
``softmax``. Thresholds are found by a bitwise search over the float32 total order (32 steps),
never by sorting.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels import runtime
from pallas_kernels.checks import check_float_dtype, check_rank, check_rows
from pallas_kernels.softmax import log_softmax, logsumexp


def _order_key(x):
    """float32 -> uint32 with the same order (-inf < ... < -0.0 < +0.0 < ... < +inf)."""
    b = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return jnp.where((b >> 31) == 1, ~b, b | jnp.uint32(0x80000000))


def _largest_key(ok, rows: int):
    """Per row, the largest uint32 t with ok(t) True, for ok monotone non-increasing in t
    with ok(0) True (a bitwise search from the top bit: 32 exact steps)."""

    def step(i, t):  # a loop, not 32 unrolled copies: a fraction of the compile time
        cand = t | (jnp.uint32(1) << (31 - i).astype(jnp.uint32))
        return jnp.where(ok(cand), cand, t)

    return lax.fori_loop(0, 32, step, jnp.zeros((rows,), jnp.uint32))


def _argmax_rows(x):
    """First index of the row maximum (exact; order-free)."""
    return jnp.argmax(x, axis=-1).astype(jnp.int32)


@runtime.kernel_op("argmax")
def _argmax(x):
    return _argmax_rows(x)


def argmax(x: jax.Array) -> jax.Array:
    """Row-wise argmax of x[T, V] (the first index on ties) -> int32 [T]."""
    check_rank("argmax", "x", x, 2)
    check_rows("argmax", "x", x)
    check_float_dtype("argmax", x=x)
    return _argmax(x)


def greedy_rows(temperature) -> jax.Array:
    """The rule every sampling and scoring path follows: a row with temperature <= 0 is greedy
    (argmax, raw log_softmax); others sample from log_softmax(logits / T)."""
    return jnp.asarray(temperature) <= 0


def _inverse_temperature(t) -> jax.Array:
    """float32 1 / T per row, 1 for greedy rows."""
    hot = ~greedy_rows(t)
    return jnp.where(hot, 1.0 / jnp.where(hot, t, 1.0), 1.0).astype(jnp.float32)


def _tempered(logits, temperature):
    """logits * (1 / T) per row in float32 (T <= 0: the logits unchanged), stored once.

    A multiply by the rounded reciprocal, behind an optimization barrier: XLA may turn a
    division by a broadcast into a reciprocal multiply in one program and not in another,
    and may fuse the scaling into its consumers; this way every program (sampling, scoring,
    a trainer's step) gets the same bits.
    """
    inv = _inverse_temperature(temperature.astype(jnp.float32))
    return lax.optimization_barrier(logits.astype(jnp.float32) * inv[:, None])


@jax.custom_vjp
def _tempered_vjp(logits, temperature):
    return _tempered(logits, temperature)


def _tempered_vjp_fwd(logits, temperature):
    return _tempered(logits, temperature), (logits, temperature)


def _tempered_vjp_bwd(res, g):
    """d/dlogits = g / T; d/dT = -sum(g * logits) / T**2 (0 for rows with T <= 0)."""
    logits, temperature = res
    t = temperature.astype(jnp.float32)
    hot = ~greedy_rows(t)
    inv = _inverse_temperature(t)
    gf = g.astype(jnp.float32)
    d_logits = (gf * inv[:, None]).astype(logits.dtype)
    d_t = jnp.where(hot, -jnp.sum(gf * logits.astype(jnp.float32), axis=-1) * inv * inv, 0.0)
    return d_logits, d_t.astype(temperature.dtype)


_tempered_vjp.defvjp(_tempered_vjp_fwd, _tempered_vjp_bwd)


def tempered(logits: jax.Array, temperature) -> jax.Array:
    """The tempered logits sampling and scoring use: float32 ``logits * (1 / T)`` per row of
    logits[R, V] (rows with T <= 0 unchanged). Differentiable in logits and temperature
    (``jax.custom_vjp``; the forward bits are those of sampling)."""
    check_rank("tempered", "logits", logits, 2)
    check_float_dtype("tempered", logits=logits)
    if tuple(jnp.shape(temperature)) != (logits.shape[0],):
        raise ValueError(f"tempered: temperature must have shape ({logits.shape[0]},)")
    return _tempered_vjp(logits, jnp.asarray(temperature, jnp.float32))


def tempered_log_softmax(logits: jax.Array, temperature) -> jax.Array:
    """float32 log_softmax(logits / T) per row of logits[R, V] (raw log_softmax for greedy
    rows): the logprobs ``sample`` reports, and what scoring and a trainer's logprobs use -
    the same kernels in the same order, so their bits are the sampler's. Differentiable."""
    return log_softmax(tempered(logits, temperature))


@runtime.kernel_op("sample", static_argnames=("filters",))
def _sample(logits, temperature, top_k, top_p, min_p, gumbel, *, filters):
    r, v = logits.shape
    greedy = greedy_rows(temperature)
    z = _tempered(logits, temperature)
    lp = log_softmax(z)
    keep = jnp.ones((r, v), bool)
    # Top-k and top-p run for every row when ``filters`` (rows that do not use a filter keep
    # every token explicitly), for none otherwise - so a row that uses neither gets the same
    # bits either way, and the choice is static: no branch on device values, which on a GPU
    # makes the host wait for the device (see ``sample``).
    # top-k: the k-th largest scaled logit, by counting (exact).
    use_k = (top_k > 0) & (top_k < v) & ~greedy

    def top_k_mask():
        zkey = _order_key(z)
        kth = _largest_key(lambda t: jnp.sum((zkey >= t[:, None]).astype(jnp.int32), axis=-1) >= top_k, r)
        return ~use_k[:, None] | (zkey >= kth[:, None])

    # top-p over what top-k kept: the largest threshold whose mass still reaches top_p.
    use_p = (top_p < 1.0) & ~greedy

    def top_p_mask():
        lp_key = _order_key(lp)
        kept_lse = logsumexp(jnp.where(keep, lp, -jnp.inf))
        target = jnp.log(jnp.clip(top_p, 1e-30, 1.0)).astype(jnp.float32) + kept_lse

        def mass_reaches(t):
            sel = keep & (lp_key >= t[:, None])
            return logsumexp(jnp.where(sel, lp, -jnp.inf)) >= target

        thr = _largest_key(mass_reaches, r)
        return ~use_p[:, None] | (lp_key >= thr[:, None])

    if filters:
        keep = top_k_mask()
        keep = keep & top_p_mask()
    # min-p: probability at least min_p times the most likely token's.
    lp_max = jnp.max(lp, axis=-1)
    keep = keep & ((min_p <= 0)[:, None] | (lp >= (jnp.log(jnp.maximum(min_p, 1e-30)) + lp_max)[:, None]))
    # Gumbel-max over the kept tokens = a draw from softmax(z) restricted to them.
    score = jnp.where(greedy[:, None], z, jnp.where(keep, z + gumbel, -jnp.inf))
    return _argmax_rows(score), lp


def uses_filters(temperature, top_k, top_p) -> bool:
    """Whether any row of a step uses top-k or top-p (host numpy values): ``sample``'s
    ``filters`` for those rows. The one home of that rule."""
    hot = np.asarray(temperature) > 0
    return bool((hot & (np.asarray(top_k) > 0)).any() or (hot & (np.asarray(top_p) < 1.0)).any())


def sample(logits, *, temperature, top_k, top_p, min_p, gumbel, filters: bool = True):
    """One token per row of logits[R, V], batch invariant; also the row's float32 logprobs.

    Per row: ``temperature`` (0 = greedy argmax), ``top_k`` (-1 = off), ``top_p`` (1 = off),
    ``min_p`` (0 = off), ``gumbel`` [R, V] noise. The logits are scaled by 1 / T (``tempered``);
    top-k keeps the k largest; top-p keeps the most likely tokens whose probability mass
    (within what top-k kept) reaches top_p; min-p keeps tokens at least min_p times as likely
    as the most likely one; the token is the argmax of scaled logits + noise over the kept
    set. Returns (tokens int32 [R], log_softmax(tempered logits) float32 [R, V]; raw log_softmax
    for greedy rows) - the distribution before truncation.

    ``filters`` (static): False skips the top-k and top-p masks (32-step searches over the
    vocabulary) when no row uses them - ``uses_filters`` of the rows' host values says; a row
    that uses neither gets the same bits either way. The choice is the caller's, on the host:
    a device-side branch (``lax.cond``) made an H200 decode step's host wait for the whole
    forward to finish before it could launch the rest, leaving the GPU idle ~2.8 ms per step.
    """
    check_rank("sample", "logits", logits, 2)
    check_rows("sample", "logits", logits)
    check_float_dtype("sample", logits=logits)
    r, v = logits.shape
    for name, a in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p), ("min_p", min_p)):
        if tuple(np.shape(a)) != (r,):
            raise ValueError(f"sample: {name} must have shape ({r},), got {tuple(np.shape(a))}")
    if tuple(jnp.shape(gumbel)) != (r, v):
        raise ValueError(f"sample: gumbel must have shape ({r}, {v}), got {tuple(jnp.shape(gumbel))}")
    # concrete values are checked (traced ones are the caller's: SamplingParams checks the
    # engine's): a value outside these ranges kept no token, and the row sampled token 0
    for name, a, ok, want in (
        ("temperature", temperature, np.isfinite, "finite (<= 0: greedy)"),
        ("top_k", top_k, lambda k: k == np.round(k), "whole numbers (<= 0: off)"),
        ("top_p", top_p, lambda p: (p > 0) & (p <= 1), "in (0, 1]"),
        ("min_p", min_p, lambda p: (p >= 0) & (p <= 1), "in [0, 1]"),
    ):
        c = runtime.concrete(a)
        if c is not None and not np.all(ok(c.astype(np.float64))):
            raise ValueError(f"sample: {name} must be {want}, got {c.tolist()}")
    return _sample(
        logits,
        jnp.asarray(temperature, jnp.float32),
        jnp.asarray(top_k, jnp.int32),
        jnp.asarray(top_p, jnp.float32),
        jnp.asarray(min_p, jnp.float32),
        jnp.asarray(gumbel, jnp.float32),
        filters=bool(filters),
    )


@runtime.kernel_op("top_n", static_argnames=("n",))
def _top_n(lp, *, n):
    ids, vals = [], []
    x = lp.astype(jnp.float32)
    rows = jnp.arange(x.shape[0])
    # Order keys (-0.0 made +0.0: the float order ties them); a taken entry's key becomes 0,
    # below every value's, -inf's included: a row whose remaining entries are all -inf takes
    # them in index order, never one twice (as the float argmax over -inf-marked entries did).
    keys = _order_key(jnp.where(x == 0, 0.0, x))
    for _ in range(n):
        i = jnp.argmax(keys, axis=-1).astype(jnp.int32)
        ids.append(i)
        vals.append(x[rows, i])
        keys = keys.at[rows, i].set(jnp.uint32(0))
    return jnp.stack(ids, axis=1), jnp.stack(vals, axis=1)


def top_n(logprobs: jax.Array, n: int):
    """The n largest entries of each row of logprobs[R, V] (ties: lower index first) ->
    (ids int32 [R, n], values float32 [R, n]); exact selection, batch invariant."""
    check_rank("top_n", "logprobs", logprobs, 2)
    check_float_dtype("top_n", logprobs=logprobs)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= logprobs.shape[1]:
        raise ValueError(f"top_n: n must be an int in [1, {logprobs.shape[1]}], got {n!r}")
    return _top_n(logprobs, n=n)
