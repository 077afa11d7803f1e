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
* The ``k_shards * split_k`` leaf partials are combined by a balanced binary
  tree of fp32 adds (no atomics). With tensor parallelism over P ranks (P
  divides k_shards), rank r holds shards r*k_shards/P ..., reduces them with the
  lower levels of that tree (``matmul_partial``), and a fixed-order collective
  does the upper levels (``tree_sum``) - every P gives the same bits.

File order: kernel -> pallas_call wrapper -> CPU formulation -> public entry
points -> reference.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import _platform
from pallas_kernels._validate import check_float_dtype, check_same_dtype

K_SHARDS = (1, 2, 4, 8)
TILE_K = 64
# Output tiles that keep the SMs of a Hopper GPU busy without split-K.
_GPU_BUSY_TILES = 264
# Below this many K elements per leaf a further split costs more than it gains.
_MIN_LEAF_K = 1024
# GPU row tiles chosen from M (rows are bit-identical across these; proven on
# the H200 by benchmarks/kernels.py, which compares every choice bit for bit).
GPU_TILE_M = (16, 32, 64, 128)
# CPU: weights larger than this go through in taller row tiles (fewer passes).
_CPU_BIG_WEIGHT_BYTES = 16 * 2**20


@dataclasses.dataclass(frozen=True)
class MatmulPlan:
    """How the K reduction of one weight runs; a function of (K, N, dtype, k_shards, platform).

    Attributes:
      k, n: the full, unsharded weight shape.
      dtype: the weight's dtype name.
      k_shards: virtual K shards combined by the fp32 tree (TP-size invariance).
      split_k: leaves per shard (fixed split-K for narrow N on GPU; 1 on CPU).
      leaf_k: K length of one leaf after zero padding.
      tile_k: reduction chunk inside a leaf (GPU).
      tile_n: output columns per program (GPU).
      cpu_tile_m: rows per fixed tile on CPU.
    """

    k: int
    n: int
    dtype: str
    k_shards: int
    split_k: int
    leaf_k: int
    tile_k: int
    tile_n: int
    cpu_tile_m: int

    @property
    def shard_k(self) -> int:
        return -(-self.k // self.k_shards)

    @property
    def num_leaves(self) -> int:
        return self.k_shards * self.split_k

    @property
    def padded_n(self) -> int:
        return -(-self.n // self.tile_n) * self.tile_n


def plan_matmul(k: int, n: int, dtype, *, k_shards: int = 1, platform: str = "gpu") -> MatmulPlan:
    """Plans the reduction for a [k, n] weight. Give the FULL (unsharded) shape under TP."""
    if k_shards not in K_SHARDS:
        raise ValueError(f"k_shards must be one of {K_SHARDS}, got {k_shards!r}")
    if platform not in ("gpu", "cpu"):
        raise ValueError(f"platform must be 'gpu' or 'cpu', got {platform!r}")
    if k < 1 or n < 1:
        raise ValueError(f"weight shape must be positive, got ({k}, {n})")
    dtype = jnp.dtype(dtype)
    shard_k = -(-k // k_shards)
    tile_n = 128 if n % 128 == 0 or n % 64 != 0 else 64
    if platform == "cpu":
        big = k * n * dtype.itemsize > _CPU_BIG_WEIGHT_BYTES
        tile_m = (32 if dtype.itemsize < 4 else 64) if big else 16
        return MatmulPlan(k, n, dtype.name, k_shards, 1, shard_k, TILE_K, tile_n, tile_m)
    # GPU: enough leaves that narrow-N weights still fill the machine at small M.
    leaves = 1
    col_tiles = -(-n // tile_n)
    while col_tiles * leaves * 2 <= _GPU_BUSY_TILES and k // (leaves * 2) >= _MIN_LEAF_K:
        leaves *= 2
    split_k = max(1, leaves // k_shards)
    chunks = -(-shard_k // TILE_K)
    leaf_k = -(-chunks // split_k) * TILE_K
    return MatmulPlan(k, n, dtype.name, k_shards, split_k, leaf_k, TILE_K, tile_n, 16)


def _to_leaves(a: jax.Array, plan: MatmulPlan, num_shards: int, axis: int) -> jax.Array:
    """Lays the K axis of ``a`` (``num_shards`` whole shards) out as zero-padded leaves."""
    k_real = a.shape[axis]
    if plan.split_k * plan.leaf_k == plan.shard_k and k_real == num_shards * plan.shard_k:
        return a
    pad = [(0, 0)] * a.ndim
    pad[axis] = (0, num_shards * plan.shard_k - k_real)
    a = jnp.pad(a, pad)
    shape = a.shape[:axis] + (num_shards, plan.shard_k) + a.shape[axis + 1 :]
    a = a.reshape(shape)
    pad = [(0, 0)] * a.ndim
    pad[axis + 1] = (0, plan.split_k * plan.leaf_k - plan.shard_k)
    a = jnp.pad(a, pad)
    return a.reshape(a.shape[:axis] + (-1,) + a.shape[axis + 2 :])


def tree_sum(parts):
    """Balanced binary tree of fp32 adds over ``parts`` (a power-of-two count), pairing neighbours."""
    parts = list(parts)
    if len(parts) & (len(parts) - 1):
        raise ValueError(f"tree_sum needs a power-of-two number of parts, got {len(parts)}")
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] for i in range(0, len(parts), 2)]
    return parts[0]


# --------------------------------------------------------------------------- GPU kernel


def _matmul_kernel(x_ref, w_ref, o_ref, *, tile_k: int, num_chunks: int):
    """One (leaf, row tile, column tile): fp32 sum over the leaf in tile_k chunks, in order."""
    tile_m, tile_n = o_ref.shape[-2:]

    def body(c, acc):
        xk = x_ref[:, pl.ds(c * tile_k, tile_k)]
        wk = w_ref[pl.ds(c * tile_k, tile_k), :]
        return acc + jnp.dot(xk, wk, preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, num_chunks, body, jnp.zeros((tile_m, tile_n), jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def gpu_tile_m(m: int) -> int:
    """Row tile for the GPU kernel: the smallest of GPU_TILE_M that covers m, else the largest."""
    for t in GPU_TILE_M:
        if m <= t:
            return t
    return GPU_TILE_M[-1]


def _matmul_pallas(x, w, *, plan: MatmulPlan, num_leaves: int, out_dtype, tile_m: int, interpret: bool):
    """x[M, L*leaf_k], w[L*leaf_k, N] (leaf layout) -> [L, M, N] fp32 partials, or [M, N] if L == 1."""
    m, n = x.shape[0], w.shape[1]
    mp, np_ = -(-m // tile_m) * tile_m, plan.padded_n
    if mp != m:
        x = jnp.pad(x, ((0, mp - m), (0, 0)))
    if np_ != n:
        w = jnp.pad(w, ((0, 0), (0, np_ - n)))
    tn, lk = plan.tile_n, plan.leaf_k
    grid = (np_ // tn, mp // tile_m, num_leaves)
    kernel = functools.partial(_matmul_kernel, tile_k=plan.tile_k, num_chunks=lk // plan.tile_k)
    in_specs = [
        pl.BlockSpec((tile_m, lk), lambda j, i, leaf: (i, leaf)),
        pl.BlockSpec((lk, tn), lambda j, i, leaf: (leaf, j)),
    ]
    if num_leaves == 1:
        out_spec = pl.BlockSpec((tile_m, tn), lambda j, i, leaf: (i, j))
        out_shape = jax.ShapeDtypeStruct((mp, np_), out_dtype)
    else:
        out_spec = pl.BlockSpec((pl.squeezed, tile_m, tn), lambda j, i, leaf: (leaf, i, j))
        out_shape = jax.ShapeDtypeStruct((num_leaves, mp, np_), jnp.float32)
    out = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_spec,
        out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(num_warps=8 if tile_m >= 128 else 4, num_stages=3),
        interpret=interpret,
        name="bijax_matmul",
    )(x, w)
    return out[..., :m, :n]


def _triton_partial(x, w, *, plan, num_shards, out_dtype, tile_m, interpret):
    xl = _to_leaves(x, plan, num_shards, axis=1)
    wl = _to_leaves(w, plan, num_shards, axis=0)
    num_leaves = num_shards * plan.split_k
    if tile_m is None:
        tile_m = 16 if interpret else gpu_tile_m(x.shape[0])
    out = _matmul_pallas(
        xl, wl, plan=plan, num_leaves=num_leaves, out_dtype=out_dtype, tile_m=tile_m, interpret=interpret
    )
    if num_leaves == 1:
        return out
    return tree_sum([out[i] for i in range(num_leaves)]).astype(out_dtype)


# --------------------------------------------------------------------------- CPU formulation


def _jnp_partial(x, w, *, plan, num_shards, out_dtype):
    """Fixed [cpu_tile_m, leaf_k] x [leaf_k, N] dots per leaf, fp32 tree over leaves."""
    m = x.shape[0]
    tm = plan.cpu_tile_m
    mp = -(-m // tm) * tm
    num_leaves = num_shards * plan.split_k
    xl = _to_leaves(x, plan, num_shards, axis=1)
    wl = _to_leaves(w, plan, num_shards, axis=0).reshape(num_leaves, plan.leaf_k, -1)
    xl = jnp.pad(xl, ((0, mp - m), (0, 0))).reshape(mp // tm, tm, num_leaves, plan.leaf_k)

    def tile(t):
        parts = [jnp.dot(t[:, i], wl[i], preferred_element_type=jnp.float32) for i in range(num_leaves)]
        return tree_sum(parts).astype(out_dtype)

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
    out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
    if not jnp.issubdtype(out_dtype, jnp.floating):
        raise TypeError(f"matmul: out_dtype must be a float dtype, got {out_dtype}")
    return out_dtype


@functools.partial(
    jax.jit, static_argnames=("out_dtype", "k_shards", "backend", "interpret", "tile_m")
)
def _matmul(x, w, *, out_dtype, k_shards, backend, interpret, tile_m):
    k, n = w.shape

    def cpu(x, w):
        plan = plan_matmul(k, n, w.dtype, k_shards=k_shards, platform="cpu")
        return _jnp_partial(x, w, plan=plan, num_shards=k_shards, out_dtype=out_dtype)

    def gpu(x, w):
        plan = plan_matmul(k, n, w.dtype, k_shards=k_shards, platform="gpu")
        return _triton_partial(
            x, w, plan=plan, num_shards=k_shards, out_dtype=out_dtype, tile_m=tile_m, interpret=interpret
        )

    return _platform.dispatch(backend, cpu, gpu, x, w)


def matmul(
    x: jax.Array,
    w: jax.Array,
    *,
    out_dtype=None,
    k_shards: int = 1,
    backend: str = "auto",
    interpret: bool = False,
    tile_m: int | None = None,
) -> jax.Array:
    """Batch-invariant ``x[M, K] @ w[K, N]``: each row's bits depend on that row and ``w`` only.

    Args:
      x, w: same float dtype (bfloat16, float16 or float32); any M >= 1, K, N.
      out_dtype: output dtype (default x's); accumulation is always float32.
      k_shards: 1, 2, 4 or 8 virtual K shards combined by a fixed fp32 tree; the
        same value gives the same bits at every tensor-parallel degree dividing it.
      backend: "auto" (CPU: fixed-shape jnp; CUDA: Pallas Triton), "jnp" or "triton".
      interpret: run the Pallas kernel in interpret mode (CPU tests, small shapes).
      tile_m: GPU row tile override (default: chosen from M among GPU_TILE_M).
    """
    out_dtype = _check_operands(x, w, out_dtype)
    if k_shards not in K_SHARDS:
        raise ValueError(f"matmul: k_shards must be one of {K_SHARDS}, got {k_shards!r}")
    _platform.check_backend(backend, interpret)
    if tile_m is not None and tile_m not in GPU_TILE_M:
        raise ValueError(f"matmul: tile_m must be one of {GPU_TILE_M}, got {tile_m!r}")
    return _matmul(
        x, w, out_dtype=out_dtype, k_shards=k_shards, backend=backend, interpret=interpret, tile_m=tile_m
    )


def matmul_partial(
    x: jax.Array,
    w: jax.Array,
    *,
    plan: MatmulPlan,
    backend: str = "jnp",
    interpret: bool = False,
) -> jax.Array:
    """One tensor-parallel rank's fp32 share of a row-parallel matmul.

    ``x[M, Kr]`` and ``w[Kr, N]`` hold ``Kr / plan.shard_k`` consecutive whole
    shards of the weight that ``plan`` was made for (``plan_matmul`` on the FULL
    shape). Returns their fp32 sum through the lower levels of the k_shards tree;
    ``tree_sum`` over the ranks' results, in rank order, then a cast, equals
    ``matmul(x_full, w_full, k_shards=plan.k_shards)`` bit for bit.
    """
    check_float_dtype("matmul_partial", x=x, w=w)
    check_same_dtype("matmul_partial", x=x, w=w)
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0] or w.shape[1] != plan.n:
        raise ValueError(f"matmul_partial: shapes {x.shape} @ {w.shape} do not fit plan N={plan.n}")
    kr = w.shape[0]
    if kr % plan.shard_k or (kr // plan.shard_k) & (kr // plan.shard_k - 1):
        raise ValueError(
            f"matmul_partial: K={kr} is not a power-of-two number of shards of {plan.shard_k}"
        )
    _platform.check_backend(backend, interpret)
    if backend == "auto":
        raise ValueError("matmul_partial: the plan is platform specific; pass backend='jnp' or 'triton'")
    num_shards = kr // plan.shard_k
    if backend == "jnp":
        return _jnp_partial(x, w, plan=plan, num_shards=num_shards, out_dtype=jnp.float32)
    return _triton_partial(
        x, w, plan=plan, num_shards=num_shards, out_dtype=jnp.float32, tile_m=None, interpret=interpret
    )


def matmul_reference(x: jax.Array, w: jax.Array, *, out_dtype=None) -> jax.Array:
    """Plain XLA ``x @ w`` with fp32 accumulation: the batch-VARIANT baseline / negative control."""
    out_dtype = x.dtype if out_dtype is None else out_dtype
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(out_dtype)


__all__ = [
    "MatmulPlan",
    "matmul",
    "matmul_partial",
    "matmul_reference",
    "plan_matmul",
    "tree_sum",
]
