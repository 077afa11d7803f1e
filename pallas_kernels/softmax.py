"""Batch-invariant log_softmax / logsumexp over the vocabulary, in fp32.

One row per program (GPU): a lane-wise max over fixed chunks of the row (exact,
order-free), then a lane-wise sum of ``exp(x - max)`` over the chunks in
ascending order, then one fixed tree over the lanes. CPU: fixed 16-row tiles of
the jnp formulation, so XLA's reduction always sees the same shape.
``log_softmax = (x - max) - log(sum)``, ``logsumexp = max + log(sum)``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import _platform
from pallas_kernels._validate import check_float_dtype, check_rank, check_rows

CHUNK = 2048
CPU_TILE_T = 16


def _softmax_kernel(x_ref, *out_refs, v: int, chunk: int, log_probs: bool):
    num_chunks = -(-v // chunk)
    lanes = jnp.arange(chunk)

    def load(c):
        cols = c * chunk + lanes
        x = pltriton.load(x_ref.at[cols], mask=cols < v, other=-jnp.inf)
        return cols, x.astype(jnp.float32)

    def max_body(c, m):
        return jnp.maximum(m, load(c)[1])

    m = jnp.max(lax.fori_loop(0, num_chunks, max_body, jnp.full((chunk,), -jnp.inf, jnp.float32)))
    m = jnp.where(m == -jnp.inf, 0.0, m)

    def sum_body(c, s):
        cols, x = load(c)
        return s + jnp.where(cols < v, jnp.exp(x - m), 0.0)

    log_s = jnp.log(jnp.sum(lax.fori_loop(0, num_chunks, sum_body, jnp.zeros((chunk,), jnp.float32))))
    if not log_probs:
        (o_ref,) = out_refs
        o_ref[...] = jnp.full(o_ref.shape, m + log_s, jnp.float32)
        return
    (o_ref,) = out_refs

    @pl.loop(0, num_chunks)
    def _(c):
        cols, x = load(c)
        pltriton.store(o_ref.at[cols], (x - m) - log_s, mask=cols < v)


def _softmax_pallas(x, *, log_probs: bool, interpret: bool):
    t, v = x.shape
    chunk = min(CHUNK, pl.next_power_of_2(v))
    row = pl.BlockSpec((pl.squeezed, v), lambda i: (i, 0))
    if log_probs:
        out_spec, out_shape = row, jax.ShapeDtypeStruct((t, v), jnp.float32)
    else:
        out_spec = pl.BlockSpec((pl.squeezed, 1), lambda i: (i, 0))
        out_shape = jax.ShapeDtypeStruct((t, 1), jnp.float32)
    out = pl.pallas_call(
        functools.partial(_softmax_kernel, v=v, chunk=chunk, log_probs=log_probs),
        grid=(t,),
        in_specs=[row],
        out_specs=out_spec,
        out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(num_warps=8 if chunk >= 2048 else 4, num_stages=1),
        interpret=interpret,
        name="bijax_log_softmax" if log_probs else "bijax_logsumexp",
    )(x)
    return out if log_probs else out[:, 0]


def _softmax_jnp(x, *, log_probs: bool):
    t, v = x.shape
    tp = -(-t // CPU_TILE_T) * CPU_TILE_T

    def tile(xt):
        xf = xt.astype(jnp.float32)
        m = jnp.max(xf, axis=-1, keepdims=True)
        m = jnp.where(m == -jnp.inf, 0.0, m)
        log_s = jnp.log(jnp.sum(jnp.exp(xf - m), axis=-1, keepdims=True))
        return (xf - m) - log_s if log_probs else (m + log_s)[:, 0]

    xt = jnp.pad(x, ((0, tp - t), (0, 0))).reshape(tp // CPU_TILE_T, CPU_TILE_T, v)
    y = tile(xt[0])[None] if tp == CPU_TILE_T else lax.map(tile, xt)
    return y.reshape((tp, v) if log_probs else (tp,))[:t]


@functools.partial(jax.jit, static_argnames=("log_probs", "backend", "interpret"))
def _softmax(x, *, log_probs, backend, interpret):
    return _platform.dispatch(
        backend,
        lambda x: _softmax_jnp(x, log_probs=log_probs),
        lambda x: _softmax_pallas(x, log_probs=log_probs, interpret=interpret),
        x,
    )


def _check(op, x, backend, interpret):
    check_rank(op, "logits", x, 2)
    check_rows(op, "logits", x)
    check_float_dtype(op, logits=x)
    _platform.check_backend(backend, interpret)


def log_softmax(logits: jax.Array, *, backend: str = "auto", interpret: bool = False) -> jax.Array:
    """Batch-invariant float32 log_softmax over the last axis of logits[T, V]."""
    _check("log_softmax", logits, backend, interpret)
    return _softmax(logits, log_probs=True, backend=backend, interpret=interpret)


def logsumexp(logits: jax.Array, *, backend: str = "auto", interpret: bool = False) -> jax.Array:
    """Batch-invariant float32 logsumexp over the last axis of logits[T, V] -> [T]."""
    _check("logsumexp", logits, backend, interpret)
    return _softmax(logits, log_probs=False, backend=backend, interpret=interpret)


def log_softmax_reference(logits):
    """Plain XLA log_softmax in fp32 (batch-variant)."""
    return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)


def logsumexp_reference(logits):
    """Plain XLA logsumexp in fp32 (batch-variant)."""
    return jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)
