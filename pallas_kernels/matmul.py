"""Batch-invariant matmul: ``y[M, N] = x[M, K] @ w[K, N]`` with float32 accumulation.

How the K reduction runs is planned from the weight alone (K, N, dtype, k_shards),
never from M, so a row's bits cannot depend on how many other rows share the call:

* K is cut into ``k_shards`` equal virtual shards (the last one zero-padded when
  ``k_shards`` does not divide K). On GPU a narrow-N weight also cuts each shard
  into ``split_k`` leaves (a fixed split-K); every leaf is zero-padded to a
  multiple of ``tile_k``.
* A leaf is reduced on its own, in fp32: on GPU in ``tile_k`` chunks in
  ascending order; on CPU by XLA's dot on a fixed [cpu_tile_m, leaf_k] x
  [leaf_k, N] shape (XLA's CPU dot changes a row's bits with the row count, so
  rows always go through in fixed tiles).
* A shard's split-K leaves are left-folded in order (fp32); the ``k_shards``
  shard sums are combined by a balanced binary tree of fp32 adds (no atomics). With tensor parallelism over P ranks (P
  divides k_shards), rank r holds shards r*k_shards/P ..., reduces them with the
  lower levels of that tree (``matmul_partial``), and a fixed-order collective
  does the upper levels (``tree_sum``) - every P gives the same bits.

File order: CPU formulation -> public entry points and autodiff -> reference; the GPU
kernels live in ``matmul_triton`` (Triton) and ``matmul_mgpu`` (Mosaic GPU, Hopper).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import runtime
from pallas_kernels.checks import check_float_dtype, check_out_dtype, check_same_dtype
from pallas_kernels.matmul_triton import GpuTiles, gpu_tiles, triton_partial
from pallas_kernels.plan import (
    K_SHARDS,
    MatmulPlan,
    combine_leaves,
    is_k_shards,
    plan_matmul,
    to_leaves,
    tree_sum,
)

# --------------------------------------------------------------------------- CPU formulation


def jnp_row_tile(xt, wl, *, plan, out_dtype):
    """One fixed CPU row tile: xt [cpu_tile_m, num_leaves, leaf_k] against the leaf-laid weight
    wl [num_leaves, leaf_k, N'] (N' any whole number of the plan's column blocks): one dot per
    leaf and column block, leaves combined by the fp32 tree. The one home of the CPU formula
    (``matmul`` and ``grouped_matmul`` both run it, so their rows have the same bits)."""
    width = plan.n // plan.col_blocks
    blocks = wl.shape[-1] // width

    def dot(a, i):
        if blocks == 1:
            return jnp.dot(a, wl[i], preferred_element_type=jnp.float32)
        cols = [wl[i, :, j * width : (j + 1) * width] for j in range(blocks)]
        return jnp.concatenate([jnp.dot(a, c, preferred_element_type=jnp.float32) for c in cols], axis=1)

    parts = [dot(xt[:, i], i) for i in range(wl.shape[0])]
    return combine_leaves(parts, plan.split_k).astype(out_dtype)


def _jnp_partial(x, w, *, plan, num_shards, out_dtype):
    """Fixed [cpu_tile_m, leaf_k] x [leaf_k, N / col_blocks] dots per leaf and column block,
    fp32 tree over leaves. ``w`` may hold any whole number of the plan's column blocks."""
    m = x.shape[0]
    tm = plan.cpu_tile_m
    mp = -(-m // tm) * tm
    num_leaves = num_shards * plan.split_k
    xl = to_leaves(x, plan, num_shards, axis=1)
    wl = to_leaves(w, plan, num_shards, axis=0).reshape(num_leaves, plan.leaf_k, -1)
    xl = jnp.pad(xl, ((0, mp - m), (0, 0))).reshape(mp // tm, tm, num_leaves, plan.leaf_k)

    def tile(t):
        return jnp_row_tile(t, wl, plan=plan, out_dtype=out_dtype)

    if mp == tm:  # one tile: same dot shapes, no loop
        y = tile(xl[0])[None]
    else:
        y = lax.map(tile, xl)
    return y.reshape(mp, -1)[:m]


# --------------------------------------------------------------------------- public entry points


def _check_operands(x, w, out_dtype):
    for name, a in (("x", x), ("w", w)):
        if getattr(a, "ndim", None) != 2:
            raise ValueError(f"matmul: {name} must be 2-D, got shape {getattr(a, 'shape', None)}")
    check_float_dtype("matmul", x=x, w=w)
    check_same_dtype("matmul", x=x, w=w)
    if x.shape[0] == 0:
        raise ValueError("matmul: x has no rows (M == 0)")
    if x.shape[1] != w.shape[0]:
        raise ValueError(f"matmul: K mismatch, x is {x.shape} but w is {w.shape}")
    if w.shape[1] == 0:
        raise ValueError("matmul: w has no columns (N == 0)")
    if w.shape[0] == 0:
        raise ValueError("matmul: the operands have no K (x has no columns, w no rows)")
    return check_out_dtype("matmul", x.dtype if out_dtype is None else out_dtype)


def _check_cols(op: str, name: str, n: int, col_blocks, full_n) -> None:
    """``col_blocks`` and ``full_n`` for a weight ``name`` of N = ``n`` columns (its column shard
    planned as the whole [K, full_n] weight: whole column blocks of it)."""
    if not is_k_shards(col_blocks):
        raise ValueError(f"{op}: col_blocks must be one of {K_SHARDS}, got {col_blocks!r}")
    if full_n == n and n % col_blocks:  # (full_n is N unless the caller gave a column shard's)
        raise ValueError(f"{op}: col_blocks={col_blocks} must divide N={n}")
    if isinstance(full_n, bool) or not isinstance(full_n, int) or full_n % col_blocks or full_n < n:
        raise ValueError(f"{op}: full_n={full_n!r} must be an int >= N={n} and a multiple of col_blocks")
    if n % (full_n // col_blocks):
        raise ValueError(
            f"{op}: {name}'s {n} columns are not whole column blocks of {full_n // col_blocks} (full_n={full_n})"
        )


# --------------------------------------------------------------------------- autodiff
#
# The kernels are wrapped in ``jax.custom_vjp``: the forward is the kernel itself (its bits do
# not change), the backward is plain XLA in float32 (the gradient need not be batch invariant,
# only correct). Both entry points below share it.


def _dot_bwd_f32(x, w, g):
    """float32 cotangents (dx, dw) of ``x @ w`` for the output cotangent ``g``: float32 XLA dots
    (full-precision products)."""
    f32 = jnp.float32
    gf = g.astype(f32)
    hi = lax.Precision.HIGHEST
    dx = jnp.dot(gf, w.astype(f32).T, precision=hi, preferred_element_type=f32)
    dw = jnp.dot(x.astype(f32).T, gf, precision=hi, preferred_element_type=f32)
    return dx, dw


def _dot_bwd(x, w, g):
    """``_dot_bwd_f32`` cast to the primal dtypes."""
    dx, dw = _dot_bwd_f32(x, w, g)
    return dx.astype(x.dtype), dw.astype(w.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6, 7))
def _matmul_vjp(x, w, out_dtype, k_shards, cols, backend, interpret, tiles):
    return _matmul_impl(x, w, out_dtype, k_shards, cols, backend, interpret, tiles)


def _matmul_vjp_fwd(x, w, out_dtype, k_shards, cols, backend, interpret, tiles):
    return _matmul_impl(x, w, out_dtype, k_shards, cols, backend, interpret, tiles), (x, w)


def _matmul_vjp_bwd(out_dtype, k_shards, cols, backend, interpret, tiles, res, g):
    return _dot_bwd(*res, g)


_matmul_vjp.defvjp(_matmul_vjp_fwd, _matmul_vjp_bwd)


@runtime.kernel_op(
    "matmul", static_argnames=("out_dtype", "k_shards", "cols", "backend", "interpret", "tiles")
)
def _matmul(x, w, *, out_dtype, k_shards, cols, backend, interpret, tiles):
    return _matmul_vjp(x, w, out_dtype, k_shards, cols, backend, interpret, tiles)


def _planned(w, k_shards, cols, platform) -> MatmulPlan:
    """The plan of ``w`` [K, N] for ``cols`` = (col_blocks, full_n): made for the full [K,
    full_n] weight, of which ``w`` holds whole column blocks (a column-parallel rank's shard)."""
    k, n = w.shape
    col_blocks, full_n = cols
    plan = plan_matmul(k, full_n, w.dtype, k_shards=k_shards, col_blocks=col_blocks, platform=platform)
    return plan if n == full_n else dataclasses.replace(plan, n=n, col_blocks=col_blocks * n // full_n)


def formulations(out_dtype, k_shards, cols, backend, interpret, tiles=None, combine: bool = True):
    """The op's two formulations of ``x @ w`` (``runtime.dispatch`` picks one; ``cols`` =
    (col_blocks, full_n): see ``_planned``): ``cpu(x, w)`` -> the result; ``gpu(x, w)`` ->
    (the result - with ``combine`` False the kernel's own output, before ``plan.leaf_result`` -
    and the plan). Ops that fuse a matmul with what follows (``matmul_norm``) take them from
    here."""

    def cpu(x, w):
        plan = _planned(w, k_shards, cols, "cpu")
        return _jnp_partial(x, w, plan=plan, num_shards=k_shards, out_dtype=out_dtype)

    def gpu(x, w):
        plan = _planned(w, k_shards, cols, "gpu")
        out = _gpu_partial(
            x,
            w,
            plan=plan,
            num_shards=k_shards,
            out_dtype=out_dtype,
            tiles=tiles,
            interpret=interpret,
            allow_mgpu=backend == "auto",
            combine=combine,
        )
        return out, plan

    return cpu, gpu


def _matmul_impl(x, w, out_dtype, k_shards, cols, backend, interpret, tiles):
    cpu, gpu = formulations(out_dtype, k_shards, cols, backend, interpret, tiles)
    return runtime.dispatch(backend, cpu, lambda x, w: gpu(x, w)[0], x, w)


def _gpu_partial(x, w, *, plan, num_shards, out_dtype, tiles, interpret, allow_mgpu, combine=True):
    """Hopper, bf16/f16: the Mosaic GPU kernel where it is faster (``prefer_mgpu``); it gives
    the Triton kernel's bits (same fp32 chain: one accumulator over 16-wide k-steps in
    ascending K; benchmarks/mgpu_matmul.py checks 140 shapes bit for bit on the H200), so the
    choice may follow M. Everything else: the Triton kernel. ``combine`` False: the kernel's
    own output, before ``plan.leaf_result`` (its rows and columns may be padded)."""
    from pallas_kernels import matmul_mgpu

    kw = dict(plan=plan, num_shards=num_shards, out_dtype=out_dtype, combine=combine)
    if allow_mgpu and tiles is None and not interpret and _runs_mgpu(plan, x.shape[0]):
        return matmul_mgpu.mgpu_partial(x, w, **kw)
    return triton_partial(x, w, tiles=tiles, interpret=interpret, **kw)


def matmul(
    x: jax.Array,
    w: jax.Array,
    *,
    out_dtype=None,
    k_shards: int = 1,
    col_blocks: int = 1,
    full_n: int | None = None,
    backend: str = "auto",
    interpret: bool = False,
    tiles: GpuTiles | None = None,
) -> jax.Array:
    """Batch-invariant ``x[M, K] @ w[K, N]``: each row's bits depend on that row and ``w`` only.

    Args:
      x, w: same float dtype (bfloat16, float16 or float32); any M >= 1, K, N.
      out_dtype: output dtype (default x's); accumulation is always float32.
      k_shards: 1, 2, 4 or 8 virtual K shards combined by a fixed fp32 tree; the
        same value gives the same bits at every tensor-parallel degree dividing it.
      col_blocks: 1, 2, 4 or 8 column blocks of a column-parallel weight (``MatmulPlan``);
        the same value gives the same bits at every tensor-parallel degree dividing it.
      full_n: when ``w`` is one rank's column shard, the full weight's N (the plan is made
        for it; ``w`` must hold whole column blocks); default: ``w``'s N.
      backend: "auto" (CPU: fixed-shape jnp; CUDA: Pallas Triton), "jnp" or "triton".
      interpret: run the Pallas kernel in interpret mode (CPU tests, small shapes).
      tiles: GPU launch-shape override (default ``gpu_tiles(plan, M)``); rows are
        bit-identical across launch shapes (benchmarks/kernels.py proves it on GPU).

    Differentiable (``jax.custom_vjp``): the forward is this kernel, the backward float32
    XLA dots cast to the dtypes of x and w.
    """
    out_dtype = _check_operands(x, w, out_dtype)
    if not is_k_shards(k_shards):
        raise ValueError(f"matmul: k_shards must be one of {K_SHARDS}, got {k_shards!r}")
    full_n = w.shape[1] if full_n is None else full_n
    _check_cols("matmul", "w", w.shape[1], col_blocks, full_n)
    runtime.check_backend(backend, interpret)
    if tiles is not None and not isinstance(tiles, GpuTiles):
        raise TypeError(f"matmul: tiles must be a GpuTiles, got {type(tiles).__name__}")
    return _matmul(
        x,
        w,
        out_dtype=out_dtype,
        k_shards=k_shards,
        cols=(col_blocks, full_n),
        backend=backend,
        interpret=interpret,
        tiles=tiles,
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _shared_vjp(x, ws, out_dtype, cols, backend, interpret):
    return _shared_impl(x, ws, out_dtype, cols, backend, interpret)


def _shared_vjp_fwd(x, ws, out_dtype, cols, backend, interpret):
    return _shared_impl(x, ws, out_dtype, cols, backend, interpret), (x, ws)


def _shared_vjp_bwd(out_dtype, cols, backend, interpret, res, gs):
    x, ws = res
    grads = [_dot_bwd_f32(x, w, g) for w, g in zip(ws, gs, strict=True)]
    dx = functools.reduce(lambda a, b: a + b, [d for d, _ in grads])  # summed in float32, cast once
    return dx.astype(x.dtype), tuple(dw.astype(w.dtype) for (_, dw), w in zip(grads, ws, strict=True))


_shared_vjp.defvjp(_shared_vjp_fwd, _shared_vjp_bwd)


@runtime.kernel_op("matmul_shared", static_argnames=("out_dtype", "cols", "backend", "interpret"))
def _matmul_shared(x, ws, *, out_dtype, cols, backend, interpret):
    return _shared_vjp(x, ws, out_dtype, cols, backend, interpret)


def gpu_shared(x, ws, *, out_dtype, cols, backend, interpret, combine: bool = True):
    """``matmul_shared``'s GPU form -> (outputs, plans): one launch where the weights' launch
    shapes agree, else a launch each. ``combine`` False: each output is its kernel's own
    (``plan.leaf_result``'s input: float32 leaf partials [L, M', N'] when the plan has several
    leaves, else the result [M', N']; rows and columns may be padded past M and N)."""
    from pallas_kernels import matmul_triton

    plans = [_planned(w, 1, c, "gpu") for w, c in zip(ws, cols, strict=True)]
    m, auto = x.shape[0], backend == "auto"
    if interpret:
        tiles = matmul_triton.default_tiles(plans[0], m, interpret=True)
    elif matmul_triton.SHARED_LAUNCH and not (
        auto and m > matmul_triton.SHARED_OVER_MGPU_ROWS and any(_runs_mgpu(p, m) for p in plans)
    ):
        tiles = matmul_triton.shared_tiles(plans, m)
    else:
        tiles = None
    tile_ns = None
    if matmul_triton.SHARED_TILES is not None and not interpret:  # a launch sweep's choice
        tiles, tile_ns = matmul_triton.SHARED_TILES
    if tiles is None:  # launch shapes that do not agree: a launch each (the same bits)
        outs = tuple(
            _gpu_partial(
                x,
                w,
                plan=p,
                num_shards=1,
                out_dtype=out_dtype,
                tiles=None,
                interpret=False,
                allow_mgpu=auto,
                combine=combine,
            )
            for w, p in zip(ws, plans, strict=True)
        )
    else:
        outs = tuple(
            matmul_triton.shared_partial(
                x,
                list(ws),
                plans=plans,
                num_shards=1,
                out_dtype=out_dtype,
                tiles=tiles,
                interpret=interpret,
                combine=combine,
                tile_ns=tile_ns,
            )
        )
    return outs, plans


def _shared_impl(x, ws, out_dtype, cols, backend, interpret):
    """``cols``: one (col_blocks, full_n) per weight (``_planned``)."""

    def cpu(x, *ws):
        return tuple(
            _jnp_partial(x, w, plan=_planned(w, 1, c, "cpu"), num_shards=1, out_dtype=out_dtype)
            for w, c in zip(ws, cols, strict=True)
        )

    def gpu(x, *ws):
        kw = dict(out_dtype=out_dtype, cols=cols, backend=backend, interpret=interpret)
        return gpu_shared(x, ws, **kw)[0]

    return runtime.dispatch(backend, cpu, gpu, x, *ws)


def _runs_mgpu(plan, m: int) -> bool:
    """Whether ``_gpu_partial`` (backend "auto") runs this plan at M rows on the Mosaic GPU kernel."""
    from pallas_kernels import matmul_mgpu

    return runtime.is_hopper() and matmul_mgpu.prefer_mgpu(plan, m)


def matmul_shared(
    x: jax.Array,
    ws,
    *,
    out_dtype=None,
    col_blocks: int = 1,
    full_ns=None,
    backend: str = "auto",
    interpret: bool = False,
) -> tuple[jax.Array, ...]:
    """``tuple(matmul(x, w, out_dtype=..., col_blocks=..., full_n=f) for w, f in zip(ws, full_ns))``
    with the same bits, for weights that share their input (a layer's q, k and v): on the GPU in
    one kernel launch where the weights' launch shapes agree (``matmul_triton.shared_partial``:
    each program is the program its weight's own launch runs), else a launch each.

    Args:
      x: [M, K]; ws: a sequence of [K, N_i] weights of x's dtype.
      out_dtype, col_blocks, backend, interpret: as ``matmul``'s (one k_shards: 1).
      full_ns: each weight's full N under column parallelism (``matmul``'s ``full_n``);
        default: the weights' own N.
    Differentiable like ``matmul``.
    """
    ws, out_dtype, cols = check_shared("matmul_shared", x, ws, out_dtype, col_blocks, full_ns)
    runtime.check_backend(backend, interpret)
    return _matmul_shared(x, ws, out_dtype=out_dtype, cols=cols, backend=backend, interpret=interpret)


def check_shared(op: str, x, ws, out_dtype, col_blocks, full_ns):
    """``matmul_shared``'s input checks (errors name ``op``) -> (ws as a tuple, out_dtype,
    cols: one (col_blocks, full_n) per weight)."""
    if not isinstance(ws, (list, tuple)):
        raise TypeError(f"{op}: ws must be a list or tuple of [K, N] weights, got {type(ws).__name__}")
    ws = tuple(ws)
    if not ws:
        raise ValueError(f"{op}: no weights")
    for i, w in enumerate(ws):
        if getattr(w, "ndim", None) != 2:
            raise ValueError(
                f"{op}: ws[{i}] must be a 2-D array, got {type(w).__name__} of shape {getattr(w, 'shape', None)}"
            )
    if full_ns is None:
        full_ns = tuple(w.shape[1] for w in ws)
    elif not isinstance(full_ns, (list, tuple)):
        raise TypeError(f"{op}: full_ns must be a list or tuple (one per weight), got {full_ns!r}")
    full_ns = tuple(full_ns)
    if len(full_ns) != len(ws):
        raise ValueError(f"{op}: {len(ws)} weights but {len(full_ns)} full_ns")
    for i, w in enumerate(ws):
        try:
            out_dtype = _check_operands(x, w, out_dtype)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{op}: ws[{i}]: {str(e).removeprefix('matmul: ')}") from None
    for i, (w, full_n) in enumerate(zip(ws, full_ns, strict=True)):
        _check_cols(op, f"ws[{i}]", w.shape[1], col_blocks, full_n)
    return ws, out_dtype, tuple((col_blocks, f) for f in full_ns)


def matmul_partial(
    x: jax.Array,
    w: jax.Array,
    *,
    plan: MatmulPlan,
    backend: str | None = None,
    interpret: bool = False,
) -> jax.Array:
    """One tensor-parallel rank's fp32 share of a row-parallel matmul.

    ``x[M, Kr]`` and ``w[Kr, N]`` hold ``Kr / plan.shard_k`` consecutive whole
    shards of the weight that ``plan`` was made for (``plan_matmul`` on the FULL
    shape, for the platform that runs it). Returns their fp32 sum through the lower
    levels of the k_shards tree; ``tree_sum`` over the ranks' results, in rank order,
    then a cast, equals ``matmul(x_full, w_full, k_shards=plan.k_shards)`` bit for bit.
    ``backend`` defaults to the plan's platform ("jnp" for a CPU plan, "triton" for GPU).
    Differentiable like ``matmul`` (float32 XLA dots in the backward).
    """
    if not isinstance(plan, MatmulPlan):
        raise TypeError(f"matmul_partial: plan must be a MatmulPlan (plan_matmul), got {type(plan).__name__}")
    check_float_dtype("matmul_partial", x=x, w=w)
    check_same_dtype("matmul_partial", x=x, w=w)
    if 0 in x.shape or 0 in w.shape:
        raise ValueError(f"matmul_partial: empty operands {x.shape} @ {w.shape}")
    if jnp.dtype(w.dtype).name != plan.dtype:
        raise TypeError(f"matmul_partial: operands are {w.dtype} but the plan is for {plan.dtype}")
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0] or w.shape[1] != plan.n:
        raise ValueError(f"matmul_partial: shapes {x.shape} @ {w.shape} do not fit plan N={plan.n}")
    kr = w.shape[0]
    if kr % plan.shard_k or (kr // plan.shard_k) & (kr // plan.shard_k - 1):
        raise ValueError(f"matmul_partial: K={kr} is not a power-of-two number of shards of {plan.shard_k}")
    expected = "jnp" if plan.platform == "cpu" else "triton"
    backend = expected if backend is None else backend
    runtime.check_backend(backend, interpret)
    if backend != expected:
        raise ValueError(
            f"matmul_partial: a {plan.platform} plan runs on backend={expected!r}, not {backend!r} "
            f"(make the plan with plan_matmul(..., platform=...) for the backend you run)"
        )
    if backend == "triton" and not interpret and jax.default_backend() == "cpu":
        raise ValueError(
            "matmul_partial: a gpu plan runs on a GPU; on this CPU-only host make the plan with "
            "plan_matmul(..., platform='cpu'), or pass interpret=True"
        )
    return _partial(x, w, plan=plan, num_shards=kr // plan.shard_k, backend=backend, interpret=interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _partial_vjp(x, w, plan, num_shards, backend, interpret):
    return _partial_impl(x, w, plan, num_shards, backend, interpret)


def _partial_vjp_fwd(x, w, plan, num_shards, backend, interpret):
    return _partial_impl(x, w, plan, num_shards, backend, interpret), (x, w)


def _partial_vjp_bwd(plan, num_shards, backend, interpret, res, g):
    return _dot_bwd(*res, g)


_partial_vjp.defvjp(_partial_vjp_fwd, _partial_vjp_bwd)


@runtime.kernel_op("matmul_partial", static_argnames=("plan", "num_shards", "backend", "interpret"))
def _partial(x, w, *, plan, num_shards, backend, interpret):
    return _partial_vjp(x, w, plan, num_shards, backend, interpret)


def _partial_impl(x, w, plan, num_shards, backend, interpret):
    if backend == "jnp":
        return _jnp_partial(x, w, plan=plan, num_shards=num_shards, out_dtype=jnp.float32)
    return _gpu_partial(
        x,
        w,
        plan=plan,
        num_shards=num_shards,
        out_dtype=jnp.float32,
        tiles=None,
        interpret=interpret,
        allow_mgpu=True,
    )


def matmul_reference(x: jax.Array, w: jax.Array, *, out_dtype=None) -> jax.Array:
    """Plain XLA ``x @ w`` with fp32 accumulation: the batch-VARIANT baseline / negative control."""
    out_dtype = x.dtype if out_dtype is None else out_dtype
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(out_dtype)


__all__ = [
    "GpuTiles",
    "gpu_tiles",
    "MatmulPlan",
    "matmul",
    "matmul_partial",
    "matmul_shared",
    "matmul_reference",
    "plan_matmul",
    "tree_sum",
]
