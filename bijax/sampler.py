"""Per-row sampling inside the jitted step: keys, Gumbel noise, the invariant sampling kernel.

key = fold_in(fold_in(PRNGKey(request seed), sample_index), position): a token's randomness
depends on its request alone. With ``invariant=False`` the same math runs on plain XLA ops
(sort-based top-k/top-p, XLA's log_softmax): the baseline and negative control.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import pallas_kernels as pk


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingRows:
    """Per-row sampling inputs of one step (numpy on the host, arrays under jit; a pytree).

    temperature float32 [S] (<= 0: greedy), top_k int32 (-1: off), top_p float32 (1: off),
    min_p float32 (0: off), seed uint32, sample_index int32 (which of a request's n samples),
    position int32 (the sampled token's position: keys ``row_keys``).
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    seed: jax.Array
    sample_index: jax.Array
    position: jax.Array

    @classmethod
    def greedy(cls, num_rows: int) -> SamplingRows:
        """``num_rows`` rows with every filter off, greedy (padding rows keep these); fill in place."""
        return cls(
            temperature=np.zeros(num_rows, np.float32),
            top_k=np.full(num_rows, -1, np.int32),
            top_p=np.ones(num_rows, np.float32),
            min_p=np.zeros(num_rows, np.float32),
            seed=np.zeros(num_rows, np.uint32),
            sample_index=np.zeros(num_rows, np.int32),
            position=np.zeros(num_rows, np.int32),
        )


def row_keys(seeds, sample_index, positions):
    def one(s, i, p):
        return jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(s), i), p)

    return jax.vmap(one)(seeds, sample_index, positions)


def sample_reference(logits, temperature, top_k, top_p, min_p, gumbel, filters: bool = True):
    """The baseline's sampling (``invariant=False``): XLA's log_softmax, and top-k / top-p by a
    sort of each row. ``filters`` False (``uses_filters``: no sampled row uses top-k or top-p)
    skips the sort - every token is kept then either way, so the same tokens, without the ~1.4 ms
    of sorting 64 rows of 128k logits that made the baseline slower than it need be."""
    r, v = logits.shape
    z = pk.tempered(logits, temperature)
    lp = jax.nn.log_softmax(z, axis=-1)
    keep = jnp.ones((r, v), bool)
    if filters:
        order = jnp.argsort(-z, axis=-1)
        zs = jnp.take_along_axis(z, order, axis=-1)
        k = jnp.where((top_k < 0) | (top_k >= v), v, top_k)
        keep_sorted = jnp.arange(v)[None, :] < k[:, None]
        ps = jax.nn.softmax(jnp.where(keep_sorted, zs, -jnp.inf), axis=-1)
        before = jnp.cumsum(ps, axis=-1) - ps
        keep_sorted &= (top_p[:, None] >= 1.0) | (before < top_p[:, None])
        keep = jnp.zeros((r, v), bool).at[jnp.arange(r)[:, None], order].set(keep_sorted)
    keep &= (min_p <= 0)[:, None] | (lp >= (jnp.log(jnp.maximum(min_p, 1e-30)) + lp.max(-1))[:, None])
    score = jnp.where(pk.greedy_rows(temperature)[:, None], z, jnp.where(keep, z + gumbel, -jnp.inf))
    return jnp.argmax(score, axis=-1).astype(jnp.int32), lp


def uses_filters(rows: SamplingRows) -> bool:
    """Whether a step's rows (host values) need top-k / top-p masks: ``sample_rows``' ``filters``."""
    return pk.uses_filters(rows.temperature, rows.top_k, rows.top_p)


def sample_rows(logits, rows: SamplingRows, *, invariant: bool, num_logprobs: int, filters: bool = True):
    """-> (tokens int32 [R], their logprobs float32 [R], (top ids [R, n], top logprobs) or None)
    with n = ``num_logprobs`` (0: None). ``filters``: ``uses_filters(rows)`` (``pk.sample``; False
    is only for rows that use no top-k / top-p - the same bits, less work)."""
    r, v = logits.shape
    keys = row_keys(rows.seed, rows.sample_index, rows.position)
    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (v,), jnp.float32))(keys)
    params = dict(temperature=rows.temperature, top_k=rows.top_k, top_p=rows.top_p, min_p=rows.min_p)
    if invariant:
        tok, lp = pk.sample(logits, **params, gumbel=gumbel, filters=filters)
    else:
        tok, lp = sample_reference(logits, **params, gumbel=gumbel, filters=filters)
    tok_lp = lp[jnp.arange(r), tok]
    top = None
    if num_logprobs:
        if invariant:
            top = pk.top_n(lp, num_logprobs)
        else:
            vals, ids = lax.top_k(lp, num_logprobs)
            top = (ids.astype(jnp.int32), vals)
    return tok, tok_lp, top


def tempered_logprobs(logits, temperature, *, invariant):
    """log_softmax(logits / T) per row (raw for greedy rows), float32 [R, V]: the one home of
    the formula that makes scoring and trainer logprobs equal generate's
    (``pk.tempered_log_softmax``); ``invariant=False``: XLA's log_softmax on the same scaling."""
    if invariant:
        return pk.tempered_log_softmax(logits, temperature)
    return jax.nn.log_softmax(pk.tempered(logits, temperature), axis=-1)


def target_logprobs(logits, targets, temperature, *, invariant):
    """Logprob of ``targets`` [R] under ``tempered_logprobs``: what ``score`` returns."""
    lp = tempered_logprobs(logits, temperature, invariant=invariant)
    return lp[jnp.arange(lp.shape[0]), targets]
