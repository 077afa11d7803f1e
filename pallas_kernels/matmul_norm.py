"""A row-parallel matmul and the fused residual RMSNorm after it, as one op:
``rms_norm(matmul(x, w, k_shards=k), weight, eps=eps, residual=residual)`` with the same bits.

A transformer layer's o and down projections are each followed by the residual add and the
next norm. On the GPU the matmul's kernel writes float32 leaf partials when its plan has more
than one leaf (narrow N: every decode row count), and ``plan.leaf_result`` combines them in an
XLA fusion before the norm kernel reads the result. Here the norm kernel reads the partials and
combines them itself with the same function (``plan.combine_leaves``, then the same rounding),
so a step runs one launch and one HBM round trip fewer per projection. The CPU formulation is
the two ops' own formulations, one after the other.
"""

from __future__ import annotations

import functools

import jax

from pallas_kernels import runtime
from pallas_kernels.checks import check_eps, check_same_dtype
from pallas_kernels.matmul import _check_operands, _dot_bwd, formulations
from pallas_kernels.plan import K_SHARDS, is_k_shards
from pallas_kernels.rms_norm import rms_norm_jnp, rms_norm_pallas, rms_norm_reference

# True (the default): on the GPU the norm kernel combines the matmul's leaf partials. False: the
# matmul's own result (leaves combined by an XLA fusion), then the norm kernel - the two ops one
# after the other, the same bits (the A/B switch of benchmarks/ab.py fusions).
FUSED = True


def _impl(x, w, weight, residual, eps, k_shards, backend, interpret):
    mm_cpu, mm_gpu = formulations(x.dtype, k_shards, (1, w.shape[1]), backend, interpret, combine=not FUSED)

    def cpu(x, w, weight, residual):
        return rms_norm_jnp(mm_cpu(x, w), weight, residual, eps=eps)

    def gpu(x, w, weight, residual):
        raw, plan = mm_gpu(x, w)
        fold = None if raw.ndim == 2 else plan.split_k  # one leaf (or not FUSED): the result already
        return rms_norm_pallas(raw, weight, residual, eps=eps, interpret=interpret, fold=fold, dtype=x.dtype)

    return runtime.dispatch(backend, cpu, gpu, x, w, weight, residual)


# Differentiable: the forward is the kernels (bits unchanged), the backward the two ops' own
# backwards in a row - the VJP of ``rms_norm_reference`` at the sum s = x @ w + residual (which
# the forward returns), then matmul's float32 dots.
@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _vjp(x, w, weight, residual, eps, k_shards, backend, interpret):
    return _impl(x, w, weight, residual, eps, k_shards, backend, interpret)


def _vjp_fwd(x, w, weight, residual, eps, k_shards, backend, interpret):
    normed, s = _impl(x, w, weight, residual, eps, k_shards, backend, interpret)
    return (normed, s), (x, w, weight, s)


def _vjp_bwd(eps, k_shards, backend, interpret, res, g):
    x, w, weight, s = res
    g_normed, g_s = g
    _, vjp = jax.vjp(lambda s, wt: rms_norm_reference(s, wt, eps=eps), s, weight)
    ds, dweight = vjp(g_normed)
    ds = ds + g_s  # the sum's two uses: the norm, and the residual stream it returns
    dx, dw = _dot_bwd(x, w, ds)
    return dx, dw, dweight, ds


_vjp.defvjp(_vjp_fwd, _vjp_bwd)


@runtime.kernel_op("matmul_norm", static_argnames=("eps", "k_shards", "backend", "interpret"))
def _matmul_norm(x, w, weight, residual, *, eps, k_shards, backend, interpret):
    return _vjp(x, w, weight, residual, eps, k_shards, backend, interpret)


def matmul_norm(
    x: jax.Array,
    w: jax.Array,
    weight: jax.Array,
    residual: jax.Array,
    *,
    eps: float,
    k_shards: int = 1,
    backend: str = "auto",
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """``rms_norm(matmul(x, w, k_shards=k_shards), weight, eps=eps, residual=residual)`` - that
    is ``(rms_norm(s), s)`` with ``s = x @ w + residual`` - with the same bits, in one kernel
    fewer on the GPU (the norm combines the matmul's float32 leaf partials itself).

    Args:
      x: [M, K]; w: [K, N] (a whole row-parallel weight: o, down); weight: the norm's [N];
        residual: [M, N]; all of one float dtype (the output's).
      eps, k_shards, backend, interpret: as ``rms_norm``'s and ``matmul``'s.
    Differentiable (``jax.custom_vjp``: the backward is ``rms_norm``'s, then ``matmul``'s).
    """
    try:
        _check_operands(x, w, None)
    except (TypeError, ValueError) as e:
        raise type(e)(f"matmul_norm: {str(e).removeprefix('matmul: ')}") from None
    if not is_k_shards(k_shards):
        raise ValueError(f"matmul_norm: k_shards must be one of {K_SHARDS}, got {k_shards!r}")
    for name, a in (("weight", weight), ("residual", residual)):
        if not hasattr(a, "shape") or not hasattr(a, "dtype"):
            raise TypeError(f"matmul_norm: {name} must be an array, got {type(a).__name__}")
    check_same_dtype("matmul_norm", x=x, weight=weight, residual=residual)
    m, n = x.shape[0], w.shape[1]
    if tuple(weight.shape) != (n,):
        raise ValueError(f"matmul_norm: weight shape {tuple(weight.shape)} != ({n},) (w's columns)")
    if tuple(residual.shape) != (m, n):
        raise ValueError(f"matmul_norm: residual shape {tuple(residual.shape)} != ({m}, {n}) (x @ w)")
    eps = check_eps("matmul_norm", eps)
    runtime.check_backend(backend, interpret)
    return _matmul_norm(
        x, w, weight, residual, eps=eps, k_shards=k_shards, backend=backend, interpret=interpret
    )


__all__ = ["matmul_norm"]
