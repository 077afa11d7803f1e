"""Batch-invariant log_softmax / logsumexp over the vocabulary, in fp32.

GPU: each row is cut into fixed segments (sizes from V alone); one program per
(row, segment) takes a lane-wise max over fixed chunks (exact, order-free), then
a lane-wise sum of ``exp(x - max)`` over the chunks in ascending order and one
fixed tree over the lanes; the segments are merged in ascending order. CPU: fixed 16-row tiles of
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

from pallas_kernels import runtime
from pallas_kernels.checks import check_float_dtype, check_rank, check_rows

CHUNK = 1024  # lanes per step inside a segment
SEGMENT = 4096  # columns per program; a row is cut into fixed segments from V alone
CPU_TILE_T = 16


def _segments(v: int) -> tuple[int, int, int]:
    """(chunk, segment, num_segments) for a vocabulary of v: a function of v only."""
    chunk = min(CHUNK, pl.next_power_of_2(v))
    segment = min(SEGMENT, -(-v // chunk) * chunk)
    return chunk, segment, -(-v // segment)


def _stats_kernel(x_ref, m_ref, s_ref, *, v: int, chunk: int, segment: int):
    """One (row, segment): the segment's max and sum(exp(x - max)), lanes then a fixed tree."""
    start = pl.program_id(1) * segment
    lanes = jnp.arange(chunk)

    def load(c):
        cols = start + c * chunk + lanes
        ok = (cols < v) & (c * chunk + lanes < segment)
        return ok, pltriton.load(x_ref.at[cols], mask=ok, other=-jnp.inf).astype(jnp.float32)

    num_chunks = segment // chunk
    m = jnp.max(
        lax.fori_loop(
            0, num_chunks, lambda c, m: jnp.maximum(m, load(c)[1]), jnp.full((chunk,), -jnp.inf, jnp.float32)
        )
    )
    m_safe = jnp.where(m == -jnp.inf, 0.0, m)

    def sum_body(c, acc):
        ok, x = load(c)
        return acc + jnp.where(ok, jnp.exp(x - m_safe), 0.0)

    total = jnp.sum(lax.fori_loop(0, num_chunks, sum_body, jnp.zeros((chunk,), jnp.float32)))
    m_ref[...] = jnp.full(m_ref.shape, m, jnp.float32)
    s_ref[...] = jnp.full(s_ref.shape, total, jnp.float32)


def _row_stats_pallas(x, *, interpret: bool):
    """Per-row (max, log(sum(exp(x - max)))) in fp32; segments merged in ascending order."""
    t, v = x.shape
    chunk, segment, num_segments = _segments(v)
    one = pl.BlockSpec((pl.squeezed, 1), lambda i, j: (i, j))
    stat = jax.ShapeDtypeStruct((t, num_segments), jnp.float32)
    m, s = pl.pallas_call(
        functools.partial(_stats_kernel, v=v, chunk=chunk, segment=segment),
        grid=(t, num_segments),
        in_specs=[pl.BlockSpec((pl.squeezed, v), lambda i, j: (i, 0))],
        out_specs=[one, one],
        out_shape=[stat, stat],
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="bijax_softmax_stats",
    )(x)
    # Merge the segments: exact max, then a left fold of rescaled sums (elementwise ops only).
    mx = m[:, 0]
    for j in range(1, num_segments):
        mx = jnp.maximum(mx, m[:, j])
    mx_safe = jnp.where(mx == -jnp.inf, 0.0, mx)
    total = s[:, 0] * jnp.exp(m[:, 0] - mx_safe)
    for j in range(1, num_segments):
        total = total + s[:, j] * jnp.exp(m[:, j] - mx_safe)
    return mx_safe, jnp.log(total)


def _softmax_pallas(x, *, log_probs: bool, interpret: bool):
    m, log_s = _row_stats_pallas(x, interpret=interpret)
    if log_probs:
        return (x.astype(jnp.float32) - m[:, None]) - log_s[:, None]
    return m + log_s


def _softmax_jnp(x, *, log_probs: bool):
    return _softmax_rows(log_probs)(x)


@functools.cache
def _softmax_rows(log_probs: bool):
    return runtime.unbatched(functools.partial(_softmax_rows_jnp, log_probs=log_probs))


def _softmax_rows_jnp(x, *, log_probs: bool):
    x = lax.optimization_barrier(x)  # (see rms_norm's: a caller's multiply fused in, FMA)
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


@runtime.kernel_op("softmax", static_argnames=("log_probs", "backend", "interpret"))
def _softmax(x, *, log_probs, backend, interpret):
    return _softmax_vjp(x, log_probs, backend, interpret)


# Differentiable: the forward is the kernel (bits unchanged), the backward the VJP of the plain
# XLA reference, cast to the input's dtype.
@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _softmax_vjp(x, log_probs, backend, interpret):
    return _softmax_impl(x, log_probs, backend, interpret)


def _softmax_vjp_fwd(x, log_probs, backend, interpret):
    return _softmax_impl(x, log_probs, backend, interpret), x


def _softmax_vjp_bwd(log_probs, backend, interpret, x, g):
    ref = log_softmax_reference if log_probs else logsumexp_reference
    _, vjp = jax.vjp(ref, x)
    return vjp(g)


_softmax_vjp.defvjp(_softmax_vjp_fwd, _softmax_vjp_bwd)


def _softmax_impl(x, log_probs, backend, interpret):
    return runtime.dispatch(
        backend,
        lambda x: _softmax_jnp(x, log_probs=log_probs),
        lambda x: _softmax_pallas(x, log_probs=log_probs, interpret=interpret),
        x,
    )


def _check(op, x, backend, interpret):
    check_rank(op, "logits", x, 2)
    check_rows(op, "logits", x)
    check_float_dtype(op, logits=x)
    runtime.check_backend(backend, interpret)


def log_softmax(logits: jax.Array, *, backend: str = "auto", interpret: bool = False) -> jax.Array:
    """Batch-invariant float32 log_softmax over the last axis of logits[T, V].

    Differentiable (``jax.custom_vjp``: the backward is the VJP of ``log_softmax_reference``)."""
    _check("log_softmax", logits, backend, interpret)
    return _softmax(logits, log_probs=True, backend=backend, interpret=interpret)


def logsumexp(logits: jax.Array, *, backend: str = "auto", interpret: bool = False) -> jax.Array:
    """Batch-invariant float32 logsumexp over the last axis of logits[T, V] -> [T].

    Differentiable (``jax.custom_vjp``: the backward is the VJP of ``logsumexp_reference``)."""
    _check("logsumexp", logits, backend, interpret)
    return _softmax(logits, log_probs=False, backend=backend, interpret=interpret)


def log_softmax_reference(logits):
    """Plain XLA log_softmax in fp32 (batch-variant)."""
    return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)


def logsumexp_reference(logits):
    """Plain XLA logsumexp in fp32 (batch-variant)."""
    return jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)
