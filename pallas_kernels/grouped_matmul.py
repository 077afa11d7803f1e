"""Batch-invariant grouped (ragged) matmul: ``y[r] = x[r] @ w[g(r)]`` for rows sorted by group.

The contract of ``jax.lax.ragged_dot``: x[M, K] holds its rows in group order, group g owning
``group_sizes[g]`` consecutive rows; w[G, K, N] holds one weight per group; rows past
``sum(group_sizes)`` give zeros. Each row's bits equal ``matmul(x[r:r+1], w[g(r)])``'s - the
same plan (``plan_matmul`` of one group's [K, N] weight, dtype and k_shards: never M, never
the group sizes) and the same reduction code - so they do not depend on how many rows share
the row's group, where the group starts, or what the other groups hold. For a mixture of
experts: a token's expert output does not depend on which other tokens chose that expert.

How: each group is padded to whole row tiles inside a static buffer of
``(M + min(G, M) * (tile_m - 1)) // tile_m`` row tiles (the non-empty groups' tiles first, in
group order; tiles past them are empty and skipped). Each row tile computes its rows against
its group's weight (the group id per row tile is an input):

* GPU (Pallas, Triton lowering): one program per (leaf, row tile, column tile) runs matmul's
  K loop (``matmul_triton.k_loop``) against ``w[group]``; leaves combine as in matmul. The row
  tile may follow the rows per group (on the GPU a row's bits do not depend on the tile).
* CPU: every row tile is matmul's fixed CPU tile (``matmul.jnp_row_tile``, ``cpu_tile_m``
  rows) against its group's weight: the same dot shapes as matmul, so the same bits.

``group_rows`` sorts rows by group (a stable counting sort: exact integer work) for callers
whose rows are not sorted yet. File order: layout -> GPU kernel -> CPU formulation -> entry
points and autodiff -> reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import runtime
from pallas_kernels.checks import check_float_dtype, check_out_dtype, check_positive_int, check_same_dtype
from pallas_kernels.matmul import jnp_row_tile
from pallas_kernels.matmul_triton import GpuTiles, gpu_tile_m, k_loop, leaf_output, swizzle
from pallas_kernels.plan import (
    GPU_MIN_TILE_N,
    H200_SMS,
    K_SHARDS,
    MatmulPlan,
    is_k_shards,
    leaf_result,
    plan_matmul,
    to_leaves,
)

# Largest GPU row tile for groups: padding costs up to tile_m - 1 rows per group.
_GPU_MAX_GROUP_TILE_M = 64

# --------------------------------------------------------------------------- padded layout


def num_row_tiles(m: int, num_groups: int, tile_m: int) -> int:
    """Row tiles that hold m rows in num_groups groups, each padded to whole tiles (static)."""
    return (m + min(num_groups, m) * (tile_m - 1)) // tile_m


def _layout(group_sizes, m: int, num_groups: int, tile_m: int):
    """Where each row goes in the padded buffer (exact integer work, in every backend alike).

    Returns (tile_group [tiles]: the group of each row tile, num_groups for an empty tile;
    src [tiles * tile_m]: the x row each buffer row copies; src_ok: whether it holds one;
    dest [m]: the buffer row of each x row; dest_ok: whether the row is in a group)."""
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    tiles = (sizes + tile_m - 1) // tile_m
    tile_ends = jnp.cumsum(tiles)
    tile_starts = tile_ends - tiles
    num_tiles = num_row_tiles(m, num_groups, tile_m)
    # The group of tile t: how many groups end at or before it (a count: exact).
    t = jnp.arange(num_tiles, dtype=jnp.int32)
    tile_group = jnp.sum((tile_ends[None, :] <= t[:, None]).astype(jnp.int32), axis=1)
    b = jnp.arange(num_tiles * tile_m, dtype=jnp.int32)
    g = tile_group[b // tile_m]
    gc = jnp.minimum(g, num_groups - 1)
    local = b - tile_starts[gc] * tile_m
    src_ok = (g < num_groups) & (local < sizes[gc])
    src = jnp.where(src_ok, starts[gc] + local, 0)
    r = jnp.arange(m, dtype=jnp.int32)
    rg = jnp.sum((ends[None, :] <= r[:, None]).astype(jnp.int32), axis=1)
    rgc = jnp.minimum(rg, num_groups - 1)
    dest_ok = rg < num_groups
    dest = jnp.where(dest_ok, tile_starts[rgc] * tile_m + r - starts[rgc], 0)
    return tile_group, src, src_ok, dest, dest_ok


def _grouped(x, group_sizes, num_groups: int, tile_m: int, run_tiles):
    """Pads x's groups into row tiles, runs ``run_tiles(xbuf, tile_group)`` and gathers the rows back."""
    m = x.shape[0]
    tile_group, src, src_ok, dest, dest_ok = _layout(group_sizes, m, num_groups, tile_m)
    xbuf = jnp.where(src_ok[:, None], x[src], jnp.zeros((), x.dtype))
    ybuf = run_tiles(xbuf, tile_group)
    return jnp.where(dest_ok[:, None], ybuf[dest], jnp.zeros((), ybuf.dtype))


# --------------------------------------------------------------------------- GPU kernel


def grouped_tiles(plan: MatmulPlan, m: int, num_groups: int) -> GpuTiles:
    """Launch shape: the row tile follows the mean rows per group (at most 64: padding is up to
    tile_m - 1 rows per group); the widest column tile that still gives the GPU enough programs.
    A row's bits do not depend on it (benchmarks/moe.py checks)."""
    tile_m = min(_GPU_MAX_GROUP_TILE_M, gpu_tile_m(max(1, m // num_groups)))
    programs = min(num_groups, m) * plan.num_leaves  # at least one tile per non-empty group
    for tile_n in (128, 64, GPU_MIN_TILE_N):
        if programs * -(-plan.n // tile_n) >= H200_SMS:
            break
    if tile_m <= 32 and tile_n <= 64:
        return GpuTiles(tile_m, tile_n, 2, 4)
    return GpuTiles(tile_m, tile_n, 4, 3)


def _grouped_kernel(group_ref, x_ref, w_ref, o_ref, *, num_groups, tile_k, leaf_k, row_tiles, col_tiles):
    """One (leaf, row tile, column tile): matmul's K loop against the tile's group's weight;
    an empty tile (group == num_groups) does nothing."""
    leaf, i, j = swizzle(pl.program_id(0), row_tiles, col_tiles)
    g = group_ref[i]
    tile_n = o_ref.shape[-1]

    @pl.when(g < num_groups)
    def _():
        k0, n0 = leaf * leaf_k, j * tile_n
        acc = k_loop(
            lambda c: x_ref[:, pl.ds(c * tile_k, tile_k)],
            lambda c: w_ref[g, pl.ds(k0 + c * tile_k, tile_k), pl.ds(n0, tile_n)],
            leaf_k // tile_k,
            o_ref.shape[-2:],
        )
        o_ref[...] = acc.astype(o_ref.dtype)


def _grouped_pallas(xbuf, tile_group, wl, *, plan, num_leaves, num_groups, out_dtype, tiles, interpret):
    """xbuf [tiles * tm, L * leaf_k], wl [G, L * leaf_k, N] (leaf layout) -> [tiles * tm, N]."""
    mp, n = xbuf.shape[0], wl.shape[2]
    tm, tn = tiles.tile_m, tiles.tile_n
    np_ = -(-n // tn) * tn
    if np_ != n:
        wl = jnp.pad(wl, ((0, 0), (0, 0), (0, np_ - n)))
    rt, ct = mp // tm, np_ // tn
    # The group ids as a power-of-two vector (Triton tensors have power-of-two shapes).
    padded = pl.next_power_of_2(rt)
    tile_group = jnp.pad(tile_group, (0, padded - rt), constant_values=num_groups)
    ids = functools.partial(swizzle, row_tiles=rt, col_tiles=ct)
    lk = plan.leaf_k

    def x_map(pid):
        leaf, i, _ = ids(pid)
        return i, leaf

    out_spec, out_shape = leaf_output(ids, num_leaves, (mp, np_), (tm, tn), out_dtype)
    out = pl.pallas_call(
        functools.partial(
            _grouped_kernel, num_groups=num_groups, tile_k=plan.tile_k, leaf_k=lk, row_tiles=rt, col_tiles=ct
        ),
        grid=(num_leaves * rt * ct,),
        in_specs=[
            pl.BlockSpec((padded,), lambda pid: (0,)),
            pl.BlockSpec((tm, lk), x_map),
            pl.BlockSpec(wl.shape, lambda pid: (0, 0, 0)),
        ],
        out_specs=out_spec,
        out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret,
        name="bijax_grouped_matmul",
    )(tile_group, xbuf, wl)
    out = out[..., :n]
    return leaf_result(out, num_leaves, plan.split_k, out_dtype)


def _gpu(x, w, group_sizes, *, plan, out_dtype, tiles, interpret):
    num_groups = w.shape[0]
    xl = to_leaves(x, plan, plan.k_shards, axis=1)
    wl = to_leaves(w, plan, plan.k_shards, axis=1)
    if tiles is None:
        # Interpret mode computes each block with the CPU's dot, whose bits depend on the
        # block shape: keep matmul's interpret tile there.
        tiles = GpuTiles(16, plan.tile_n, 4, 3) if interpret else grouped_tiles(plan, x.shape[0], num_groups)
    run = functools.partial(
        _grouped_pallas,
        wl=wl,
        plan=plan,
        num_leaves=plan.num_leaves,
        num_groups=num_groups,
        out_dtype=out_dtype,
        tiles=tiles,
        interpret=interpret,
    )
    return _grouped(xl, group_sizes, num_groups, tiles.tile_m, lambda xb, tg: run(xb, tg))


# --------------------------------------------------------------------------- CPU formulation


def _cpu(x, w, group_sizes, *, plan, out_dtype):
    num_groups, num_leaves, tm = w.shape[0], plan.num_leaves, plan.cpu_tile_m
    xl = to_leaves(x, plan, plan.k_shards, axis=1)
    wl = to_leaves(w, plan, plan.k_shards, axis=1).reshape(num_groups, num_leaves, plan.leaf_k, -1)
    n = wl.shape[-1]

    def run_tiles(xbuf, tile_group):
        xt = xbuf.reshape(-1, tm, num_leaves, plan.leaf_k)

        def tile(args):
            t, g = args
            return lax.cond(
                g < num_groups,
                lambda: jnp_row_tile(t, wl[jnp.minimum(g, num_groups - 1)], plan=plan, out_dtype=out_dtype),
                lambda: jnp.zeros((tm, n), out_dtype),
            )

        return lax.map(tile, (xt, tile_group)).reshape(-1, n)

    return _grouped(xl, group_sizes, num_groups, tm, run_tiles)


# --------------------------------------------------------------------------- entry points and autodiff


def _impl(x, w, group_sizes, out_dtype, k_shards, backend, interpret, tiles):
    k, n = w.shape[1:]

    def cpu(x, w, gs):
        plan = plan_matmul(k, n, w.dtype, k_shards=k_shards, platform="cpu")
        return _cpu(x, w, gs, plan=plan, out_dtype=out_dtype)

    def gpu(x, w, gs):
        plan = plan_matmul(k, n, w.dtype, k_shards=k_shards, platform="gpu")
        return _gpu(x, w, gs, plan=plan, out_dtype=out_dtype, tiles=tiles, interpret=interpret)

    return runtime.dispatch(backend, cpu, gpu, x, w, group_sizes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def _grouped_vjp(x, w, group_sizes, out_dtype, k_shards, backend, interpret, tiles):
    return _impl(x, w, group_sizes, out_dtype, k_shards, backend, interpret, tiles)


def _grouped_vjp_fwd(x, w, group_sizes, out_dtype, k_shards, backend, interpret, tiles):
    return _impl(x, w, group_sizes, out_dtype, k_shards, backend, interpret, tiles), (x, w, group_sizes)


def _grouped_vjp_bwd(out_dtype, k_shards, backend, interpret, tiles, res, g):
    """The VJP of float32 ``lax.ragged_dot`` (full-precision products), cast to the primal dtypes."""
    x, w, group_sizes = res
    f32 = jnp.float32

    def ref(xf, wf):
        return lax.ragged_dot(
            xf, wf, group_sizes, precision=lax.Precision.HIGHEST, preferred_element_type=f32
        )

    _, vjp = jax.vjp(ref, x.astype(f32), w.astype(f32))
    dx, dw = vjp(g.astype(f32))
    return dx.astype(x.dtype), dw.astype(w.dtype), None


_grouped_vjp.defvjp(_grouped_vjp_fwd, _grouped_vjp_bwd)


@runtime.kernel_op(
    "grouped_matmul", static_argnames=("out_dtype", "k_shards", "backend", "interpret", "tiles")
)
def _grouped_matmul(x, w, group_sizes, *, out_dtype, k_shards, backend, interpret, tiles):
    return _grouped_vjp(x, w, group_sizes, out_dtype, k_shards, backend, interpret, tiles)


def grouped_matmul(
    x: jax.Array,
    w: jax.Array,
    group_sizes: jax.Array,
    *,
    out_dtype=None,
    k_shards: int = 1,
    backend: str = "auto",
    interpret: bool = False,
    tiles: GpuTiles | None = None,
) -> jax.Array:
    """Batch-invariant ``lax.ragged_dot(x[M, K], w[G, K, N], group_sizes[G])``.

    Row r of x belongs to the group g whose rows ``sum(group_sizes[:g]) <= r <
    sum(group_sizes[:g + 1])``; its output row is ``x[r] @ w[g]``, bit-identical to
    ``matmul(x[r:r+1], w[g], k_shards=k_shards)`` whatever the group sizes and the other rows.
    Rows past ``sum(group_sizes)`` are zeros; ``sum(group_sizes)`` must not exceed M.

    Args:
      x, w: same float dtype (bfloat16, float16 or float32).
      group_sizes: int [G], rows per group (a traced value: one program serves every split).
      out_dtype: output dtype (default x's); accumulation is always float32.
      k_shards: 1, 2, 4 or 8 virtual K shards, as in ``matmul``.
      backend, interpret: as in ``matmul``.
      tiles: GPU launch-shape override (default ``grouped_tiles``).

    Differentiable (``jax.custom_vjp``): the backward is float32 ``lax.ragged_dot``'s VJP.
    """
    for name, a, rank in (("x", x, 2), ("w", w, 3), ("group_sizes", group_sizes, 1)):
        if getattr(a, "ndim", None) != rank:
            raise ValueError(
                f"grouped_matmul: {name} must be {rank}-D, got shape {getattr(a, 'shape', None)}"
            )
    check_float_dtype("grouped_matmul", x=x, w=w)
    check_same_dtype("grouped_matmul", x=x, w=w)
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise TypeError(f"grouped_matmul: group_sizes must be integers, got {group_sizes.dtype}")
    if x.shape[0] == 0:
        raise ValueError("grouped_matmul: x has no rows (M == 0)")
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"grouped_matmul: K mismatch, x is {x.shape} but w is {w.shape}")
    if x.shape[1] == 0:
        raise ValueError("grouped_matmul: the operands have no K (x has no columns)")
    if group_sizes.shape[0] != w.shape[0] or w.shape[0] == 0:
        raise ValueError(
            f"grouped_matmul: {group_sizes.shape[0]} group sizes for {w.shape[0]} weights in w (at least one)"
        )
    if w.shape[2] == 0:
        raise ValueError("grouped_matmul: w has no columns (N == 0)")
    sizes = runtime.concrete(group_sizes)
    if sizes is not None and (sizes < 0).any():
        raise ValueError(f"grouped_matmul: group_sizes must be >= 0, got {sizes.tolist()}")
    if sizes is not None and int(sizes.sum()) > x.shape[0]:
        raise ValueError(
            f"grouped_matmul: group_sizes sum to {int(sizes.sum())}, more than x's {x.shape[0]} rows"
        )
    if not is_k_shards(k_shards):
        raise ValueError(f"grouped_matmul: k_shards must be one of {K_SHARDS}, got {k_shards!r}")
    out_dtype = check_out_dtype("grouped_matmul", x.dtype if out_dtype is None else out_dtype)
    runtime.check_backend(backend, interpret)
    if tiles is not None and not isinstance(tiles, GpuTiles):
        raise TypeError(f"grouped_matmul: tiles must be a GpuTiles, got {type(tiles).__name__}")
    return _grouped_matmul(
        x,
        w,
        jnp.asarray(group_sizes, jnp.int32),
        out_dtype=out_dtype,
        k_shards=k_shards,
        backend=backend,
        interpret=interpret,
        tiles=tiles,
    )


@runtime.kernel_op("group_rows", static_argnames=("num_groups",))
def _group_rows(group_ids, *, num_groups):
    order = jnp.argsort(group_ids, stable=True).astype(jnp.int32)
    sizes = jnp.sum((group_ids[None, :] == jnp.arange(num_groups, dtype=group_ids.dtype)[:, None]), axis=1)
    return order, sizes.astype(jnp.int32)


def group_rows(group_ids: jax.Array, num_groups: int) -> tuple[jax.Array, jax.Array]:
    """Sorts rows by group for ``grouped_matmul``: group_ids int [R] in [0, num_groups) ->
    (order int32 [R]: row indices, stable by group; group_sizes int32 [num_groups]). Exact
    integer work: the result depends on the ids only."""
    if getattr(group_ids, "ndim", None) != 1 or not jnp.issubdtype(group_ids.dtype, jnp.integer):
        raise ValueError("group_rows: group_ids must be a 1-D integer array")
    check_positive_int("group_rows: num_groups", num_groups, numpy=False)
    ids = runtime.concrete(group_ids)
    if ids is not None and ((ids < 0) | (ids >= num_groups)).any():
        bad = ids[(ids < 0) | (ids >= num_groups)][0]
        raise ValueError(f"group_rows: group id {int(bad)} is outside [0, {num_groups})")
    return _group_rows(jnp.asarray(group_ids, jnp.int32), num_groups=num_groups)


def grouped_matmul_reference(
    x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, out_dtype=None
) -> jax.Array:
    """Plain XLA ``lax.ragged_dot`` with fp32 accumulation: the batch-VARIANT baseline."""
    out_dtype = x.dtype if out_dtype is None else out_dtype
    y = lax.ragged_dot(x, w, jnp.asarray(group_sizes, jnp.int32), preferred_element_type=jnp.float32)
    return y.astype(out_dtype)


__all__ = ["group_rows", "grouped_matmul", "grouped_matmul_reference", "grouped_tiles", "num_row_tiles"]
