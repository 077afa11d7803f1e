"""SwiGLU's hidden activation with the up projection: ``swiglu(g, x @ w_up)`` rounded to x's
dtype, where ``g`` is the gate projection's result - with the same bits as the matmul and then
the formula, and on the GPU at decode rows in one launch: the up projection's kernel applies
SiLU(g) * u to its float32 sum in its epilogue, so a layer runs no separate SwiGLU fusion and
writes and reads no u.

``swiglu`` is the formula (the one home: the model's dense and MoE layers and this op run it).
XLA computes its sigmoid as ``1 / (1 + exp(-g))`` (its LogisticExpander) with an IEEE divide;
Pallas Triton's float32 ``/`` is ``div.full.f32`` (approximate), so the kernel's formula
(``_swiglu_triton``) divides with an inline ``div.rn.f32``. Whether the two have the same bits
on every bfloat16 g is measured on the GPU (``benchmarks/swiglu_bits.py``), and the fused op
against the unfused one by ``benchmarks/kernels.py --swiglu``; until then ``FUSED`` is off.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import runtime
from pallas_kernels.matmul import _check_cols, _check_operands, _dot_bwd, _planned, _runs_mgpu, formulations
from pallas_kernels.matmul_triton import triton_partial
from pallas_kernels.plan import round_like

F32 = jnp.float32

# True: on the GPU the up projection's Triton launch (one-leaf plans: every dense model's up
# weight) applies SwiGLU in its epilogue. False: the matmul's result, then ``swiglu`` in an XLA
# fusion - the same bits (the switch of benchmarks/ab.py swiglu). Read when a program is traced.
FUSED = False


def swiglu(g: jax.Array, u: jax.Array) -> jax.Array:
    """SiLU(g) * u = g * sigmoid(g) * u on float32 g, u (the projections' results, each rounded
    to the model's dtype first), float32 out: the one formula of a SwiGLU MLP's activation."""
    return g * jax.nn.sigmoid(g) * u


def _div_rn(a, b):
    """a / b rounded to nearest (IEEE), as XLA divides; Triton's ``/`` is ``div.full.f32``."""
    [out] = pltriton.elementwise_inline_asm(
        "div.rn.f32 $0, $1, $2;",
        args=[a, b],
        constraints="=f,f,f",
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, F32)],
    )
    return out


def _swiglu_triton(g, u):
    """``swiglu`` inside a Triton kernel: XLA's sigmoid, ``1 / (1 + exp(-g))``, with its divide."""
    return g * _div_rn(jnp.ones_like(g), 1 + jnp.exp(-g)) * u


def _epilogue(interpret: bool):
    """The up kernel's epilogue: its float32 sum rounded to the output dtype (the matmul's
    result u), then SwiGLU with the gate's tile. Interpret mode (CPU) runs XLA's formula: it
    cannot run inline PTX."""
    formula = swiglu if interpret else _swiglu_triton

    def epilogue(g_tile, acc, out_dtype):
        return formula(g_tile.astype(F32), round_like(acc, out_dtype))

    return epilogue


def _unfused(u, g, dtype):
    return swiglu(g.astype(F32), u.astype(F32)).astype(dtype)


def _impl(x, w, g, cols, backend, interpret):
    mm_cpu, mm_gpu = formulations(x.dtype, 1, cols, backend, interpret)

    def cpu(x, w, g):
        return _unfused(mm_cpu(x, w), g, x.dtype)

    def gpu(x, w, g):
        plan = _planned(w, 1, cols, "gpu")
        mgpu = backend == "auto" and not interpret and _runs_mgpu(plan, x.shape[0])
        if FUSED and plan.num_leaves == 1 and not mgpu:
            return triton_partial(
                x,
                w,
                plan=plan,
                num_shards=1,
                out_dtype=x.dtype,
                tiles=None,
                interpret=interpret,
                epilogue=(_epilogue(interpret), g),
            )
        return _unfused(mm_gpu(x, w)[0], g, x.dtype)

    return runtime.dispatch(backend, cpu, gpu, x, w, g)


# Differentiable: the forward under differentiation runs the matmul and the formula unfused
# (the same bits) and keeps u; the backward is the formula's VJP, then matmul's float32 dots -
# what autodiff of ``swiglu(g, matmul(x, w))`` gives.
@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _vjp(x, w, g, cols, backend, interpret):
    return _impl(x, w, g, cols, backend, interpret)


def _vjp_fwd(x, w, g, cols, backend, interpret):
    mm_cpu, mm_gpu = formulations(x.dtype, 1, cols, backend, interpret)
    u = runtime.dispatch(backend, mm_cpu, lambda x, w: mm_gpu(x, w)[0], x, w)
    return _unfused(u, g, x.dtype), (x, w, g, u)


def _vjp_bwd(cols, backend, interpret, res, dh):
    x, w, g, u = res
    _, vjp = jax.vjp(lambda g, u: _unfused(u, g, x.dtype), g, u)
    dg, du = vjp(dh)
    dx, dw = _dot_bwd(x, w, du)
    return dx, dw, dg


_vjp.defvjp(_vjp_fwd, _vjp_bwd)


@runtime.kernel_op("matmul_swiglu", static_argnames=("cols", "backend", "interpret"))
def _matmul_swiglu(x, w, g, *, cols, backend, interpret):
    return _vjp(x, w, g, cols, backend, interpret)


def matmul_swiglu(
    x: jax.Array,
    w: jax.Array,
    g: jax.Array,
    *,
    col_blocks: int = 1,
    full_n: int | None = None,
    backend: str = "auto",
    interpret: bool = False,
) -> jax.Array:
    """``swiglu(g, matmul(x, w, col_blocks=..., full_n=...))`` rounded to x's dtype - a SwiGLU
    MLP's hidden activation from its gate projection's result ``g`` and its up weight ``w`` -
    with the same bits; on the GPU (``FUSED``) in the up projection's kernel launch.

    Args:
      x: [M, K]; w: the up weight [K, N] (or a column-parallel rank's columns of it, with
        ``full_n``); g: the gate projection's result [M, N]; all of one float dtype.
      col_blocks, full_n, backend, interpret: as ``matmul``'s.
    Differentiable (``jax.custom_vjp``: the formula's VJP, then ``matmul``'s backward).
    """
    try:
        _check_operands(x, w, None)
    except (TypeError, ValueError) as e:
        raise type(e)(f"matmul_swiglu: {str(e).removeprefix('matmul: ')}") from None
    if not hasattr(g, "shape") or not hasattr(g, "dtype"):
        raise TypeError(f"matmul_swiglu: g must be an array, got {type(g).__name__}")
    m, n = x.shape[0], w.shape[1]
    if tuple(g.shape) != (m, n):
        raise ValueError(f"matmul_swiglu: g's shape {tuple(g.shape)} != ({m}, {n}) (x @ w)")
    if g.dtype != x.dtype:
        raise TypeError(f"matmul_swiglu: g is {g.dtype} but x is {x.dtype} (one dtype for all)")
    full_n = n if full_n is None else full_n
    _check_cols("matmul_swiglu", "w", n, col_blocks, full_n)
    runtime.check_backend(backend, interpret)
    return _matmul_swiglu(x, w, g, cols=(col_blocks, full_n), backend=backend, interpret=interpret)


__all__ = ["matmul_swiglu", "swiglu"]
