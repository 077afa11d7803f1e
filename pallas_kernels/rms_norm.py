"""Batch-invariant RMSNorm: ``x * rsqrt(mean(x**2) + eps) * weight`` per row, in fp32.

One row per program, the whole row in one block (GPU); fixed 16-row tiles of a
jnp formulation (CPU). The sum of squares over H has one order, fixed by H.
With ``residual`` the op is the fused pre-norm block: ``s = x + residual`` (in
x's dtype), returns ``(rms_norm(s), s)``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import runtime
from pallas_kernels.checks import check_eps, check_float_dtype, check_rank, check_rows, check_same_dtype
from pallas_kernels.plan import leaf_value, round_like

CPU_TILE_T = 16


def _rms_norm_kernel(*refs, eps: float, h: int, has_residual: bool, fold: int | None = None):
    """One row. ``fold`` None: x's row is the input; else x holds float32 leaf partials [L, W]
    (W >= h) of a matmul's row, combined here as ``plan.leaf_result`` combines them
    (``combine_leaves``, then rounded to the output dtype) - the same bits."""
    if has_residual:
        x_ref, r_ref, w_ref, o_ref, s_ref = refs
    else:
        x_ref, w_ref, o_ref = refs
    cols = jnp.arange(pl.next_power_of_2(h))
    mask = cols < h
    if fold is None:
        xf = pltriton.load(x_ref.at[cols], mask=mask, other=0.0).astype(jnp.float32)
    else:
        parts = [pltriton.load(x_ref.at[leaf, cols], mask=mask, other=0.0) for leaf in range(x_ref.shape[0])]
        xf = leaf_value(parts, fold, o_ref.dtype)
    if has_residual:
        xf = round_like(
            xf + pltriton.load(r_ref.at[cols], mask=mask, other=0.0).astype(jnp.float32), s_ref.dtype
        )
        pltriton.store(s_ref.at[cols], xf.astype(s_ref.dtype), mask=mask)
    rstd = lax.rsqrt(jnp.sum(xf * xf) / h + eps)
    w = pltriton.load(w_ref.at[cols], mask=mask, other=0.0).astype(jnp.float32)
    pltriton.store(o_ref.at[cols], (xf * rstd * w).astype(o_ref.dtype), mask=mask)


def rms_norm_pallas(x, weight, residual, *, eps: float, interpret: bool, fold: int | None = None, dtype=None):
    """The GPU kernel on x [T, H], or with ``residual`` [T, H] on a matmul kernel's own output
    (its rows and columns may be padded past T and H): x [T', W] in the output dtype, or with
    ``fold`` float32 leaf partials [L, T', W] (see ``_rms_norm_kernel``) and ``dtype`` the
    output dtype."""
    if fold is not None and residual is None:
        raise ValueError("rms_norm_pallas: a matmul's partials (fold) need the residual (it gives T)")
    h = weight.shape[0]
    t = x.shape[-2] if residual is None else residual.shape[0]
    dtype = x.dtype if fold is None else dtype
    has_residual = residual is not None
    row = pl.BlockSpec((pl.squeezed, h), lambda i: (i, 0))
    vec = pl.BlockSpec((h,), lambda i: (0,))
    x_spec = row if fold is None else pl.BlockSpec((x.shape[0], pl.squeezed, x.shape[2]), lambda i: (0, i, 0))
    in_specs = [x_spec, row, vec] if has_residual else [x_spec, vec]
    out_shape = jax.ShapeDtypeStruct((t, h), dtype)
    out = pl.pallas_call(
        functools.partial(_rms_norm_kernel, eps=eps, h=h, has_residual=has_residual, fold=fold),
        grid=(t,),
        in_specs=in_specs,
        out_specs=[row, row] if has_residual else row,
        out_shape=[out_shape, out_shape] if has_residual else out_shape,
        compiler_params=pltriton.CompilerParams(num_warps=4 if h <= 2048 else 8, num_stages=1),
        interpret=interpret,
        name="bijax_rms_norm",
    )(*((x, residual, weight) if has_residual else (x, weight)))
    return tuple(out) if has_residual else out


def rms_norm_jnp(x, weight, residual, *, eps: float):
    return _rms_norm_rows(eps)(x, weight, residual)


@functools.cache
def _rms_norm_rows(eps: float):
    return runtime.unbatched(functools.partial(_rms_norm_jnp, eps=eps))


def _rms_norm_jnp(x, weight, residual, *, eps: float):
    # (fenced: XLA fused a caller's multiply into the single-tile reduction - FMA - but not
    # into the lax.map of several tiles, so a row's bits hung on the row count; the Triton
    # kernel's inputs come from memory)
    x, weight, residual = lax.optimization_barrier((x, weight, residual))
    t, h = x.shape
    tp = -(-t // CPU_TILE_T) * CPU_TILE_T
    wf = weight.astype(jnp.float32)

    def tile(args):
        xf = args[0].astype(jnp.float32)
        if residual is not None:
            # Round the sum to x's dtype for real: without the barrier XLA may keep the fp32
            # sum ("excess precision") and the fused op would differ from the unfused one.
            summed = xf + args[1].astype(jnp.float32)
            xf = lax.optimization_barrier(summed.astype(x.dtype)).astype(jnp.float32)
        rstd = lax.rsqrt(jnp.sum(xf * xf, axis=-1, keepdims=True) / h + eps)
        return (xf * rstd * wf).astype(x.dtype), xf.astype(x.dtype)

    def tiles(a):
        return jnp.pad(a, ((0, tp - t), (0, 0))).reshape(tp // CPU_TILE_T, CPU_TILE_T, h)

    args = (tiles(x),) if residual is None else (tiles(x), tiles(residual))
    out, summed = tile(tuple(a[0] for a in args)) if tp == CPU_TILE_T else lax.map(tile, args)
    out, summed = out.reshape(tp, h)[:t], summed.reshape(tp, h)[:t]
    return out if residual is None else (out, summed)


@runtime.kernel_op("rms_norm", static_argnames=("eps", "backend", "interpret"))
def _rms_norm(x, weight, residual, *, eps, backend, interpret):
    return _rms_norm_vjp(x, weight, residual, eps, backend, interpret)


# Differentiable: the forward is the kernel (bits unchanged), the backward the VJP of the plain
# XLA reference (``residual`` may be None: an empty pytree, whose cotangent is None).
@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _rms_norm_vjp(x, weight, residual, eps, backend, interpret):
    return _rms_norm_impl(x, weight, residual, eps, backend, interpret)


def _rms_norm_vjp_fwd(x, weight, residual, eps, backend, interpret):
    return _rms_norm_impl(x, weight, residual, eps, backend, interpret), (x, weight, residual)


def _rms_norm_vjp_bwd(eps, backend, interpret, res, g):
    _, vjp = jax.vjp(lambda x, w, r: rms_norm_reference(x, w, eps=eps, residual=r), *res)
    return vjp(g)


_rms_norm_vjp.defvjp(_rms_norm_vjp_fwd, _rms_norm_vjp_bwd)


def _rms_norm_impl(x, weight, residual, eps, backend, interpret):
    return runtime.dispatch(
        backend,
        lambda x, w, r: rms_norm_jnp(x, w, r, eps=eps),
        lambda x, w, r: rms_norm_pallas(x, w, r, eps=eps, interpret=interpret),
        x,
        weight,
        residual,
    )


def rms_norm(
    x: jax.Array,
    weight: jax.Array,
    *,
    eps: float,
    residual: jax.Array | None = None,
    backend: str = "auto",
    interpret: bool = False,
):
    """Batch-invariant RMSNorm of x[T, H] with weight[H]; fp32 math, output in x's dtype.

    With ``residual`` (same shape and dtype as x) returns ``(normed, x + residual)``.
    Differentiable (``jax.custom_vjp``: the backward is the VJP of ``rms_norm_reference``).
    """
    check_rank("rms_norm", "x", x, 2)
    check_rows("rms_norm", "x", x)
    arrays = (
        {"x": x, "weight": weight} if residual is None else {"x": x, "weight": weight, "residual": residual}
    )
    check_float_dtype("rms_norm", **arrays)
    check_same_dtype("rms_norm", **arrays)
    if tuple(weight.shape) != (x.shape[1],):
        raise ValueError(f"rms_norm: weight shape {tuple(weight.shape)} != ({x.shape[1]},)")
    if residual is not None and tuple(residual.shape) != tuple(x.shape):
        raise ValueError(f"rms_norm: residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    eps = check_eps("rms_norm", eps)
    runtime.check_backend(backend, interpret)
    return _rms_norm(x, weight, residual, eps=eps, backend=backend, interpret=interpret)


def rms_norm_reference(x, weight, *, eps: float, residual=None):
    """Plain XLA RMSNorm (same math, batch-variant reductions)."""
    if residual is not None:
        x = x + residual
    xf = x.astype(jnp.float32)
    rstd = lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    out = (xf * rstd * weight.astype(jnp.float32)).astype(x.dtype)
    return out if residual is None else (out, x)
