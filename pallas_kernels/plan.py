"""The reduction plan of the batch-invariant matmul and its fixed fp32 tree: how a weight's K
axis is cut into ``k_shards`` virtual shards and leaves, and how the partial sums combine.

Planned from the weight alone (K, N, dtype, k_shards, platform), never from M. Imported by the
Triton kernel (``matmul``), the Mosaic GPU kernel (``matmul_mgpu``) and the fixed-order
collectives (``collectives``): the one home of these rules.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.checks import is_int

K_SHARDS = (1, 2, 4, 8)


def is_k_shards(value) -> bool:
    """Whether ``value`` is one of ``K_SHARDS`` as an integer (2.0 or True is none: they passed
    ``in K_SHARDS`` and failed later, deep in tracing)."""
    return is_int(value) and int(value) in K_SHARDS


TILE_K = 64
# Programs that keep the 132 SMs of an H200 busy.
H200_SMS = 132
# Narrowest output tile the GPU kernel uses; split-K is planned for what is left.
GPU_MIN_TILE_N = 32
# Below this many K elements per leaf a further split costs more than it gains.
_MIN_LEAF_K = 1024
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
      platform: "gpu" or "cpu" - the implementation the plan is for.
      col_blocks: CPU: the N columns go through as this many equal blocks, one dot each
        (XLA's CPU dot changes a column's bits with the column count, so a tensor-parallel
        rank holding N/P columns must see the same dot widths as one device holding N).
        The GPU kernel's column tiles are independent already; there it only checks shapes.
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
    platform: str = "gpu"
    col_blocks: int = 1

    @property
    def shard_k(self) -> int:
        return -(-self.k // self.k_shards)

    @property
    def num_leaves(self) -> int:
        return self.k_shards * self.split_k

    @property
    def padded_n(self) -> int:
        return -(-self.n // self.tile_n) * self.tile_n


def plan_matmul(
    k: int, n: int, dtype, *, k_shards: int = 1, col_blocks: int = 1, platform: str | None = None
) -> MatmulPlan:
    """Plans the reduction for a [k, n] weight. Give the FULL (unsharded) shape under TP.

    ``col_blocks`` (1, 2, 4 or 8, dividing n): column blocks of a column-parallel weight
    (see ``MatmulPlan``). ``platform``: "gpu" or "cpu"; default: this process's default
    JAX backend.
    """
    if platform is None:
        platform = "cpu" if jax.default_backend() == "cpu" else "gpu"
    if not is_k_shards(k_shards):
        raise ValueError(f"k_shards must be one of {K_SHARDS}, got {k_shards!r}")
    if platform not in ("gpu", "cpu"):
        raise ValueError(f"platform must be 'gpu' or 'cpu', got {platform!r}")
    if k < 1 or n < 1:
        raise ValueError(f"weight shape must be positive, got ({k}, {n})")
    if not is_k_shards(col_blocks) or n % col_blocks:
        raise ValueError(f"col_blocks must be one of {K_SHARDS} and divide N={n}, got {col_blocks!r}")
    dtype = jnp.dtype(dtype)
    shard_k = -(-k // k_shards)
    tile_n = 128 if n % 128 == 0 or n % 64 != 0 else 64
    if platform == "cpu":
        big = k * n * dtype.itemsize > _CPU_BIG_WEIGHT_BYTES
        tile_m = (32 if dtype.itemsize < 4 else 64) if big else 16
        return MatmulPlan(k, n, dtype.name, k_shards, 1, shard_k, TILE_K, tile_n, tile_m, "cpu", col_blocks)
    # GPU: narrow-N weights get enough leaves that one row tile of the narrowest
    # column tiles still fills the machine (M = 1 decode).
    leaves = 1
    col_tiles = -(-n // GPU_MIN_TILE_N)
    while col_tiles * leaves * 2 <= 2 * H200_SMS and k // (leaves * 2) >= _MIN_LEAF_K:
        leaves *= 2
    split_k = max(1, leaves // k_shards)
    chunks = -(-shard_k // TILE_K)
    leaf_k = -(-chunks // split_k) * TILE_K
    return MatmulPlan(k, n, dtype.name, k_shards, split_k, leaf_k, TILE_K, tile_n, 16, "gpu", col_blocks)


def to_leaves(a: jax.Array, plan: MatmulPlan, num_shards: int, axis: int) -> jax.Array:
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
    if not parts or len(parts) & (len(parts) - 1):
        raise ValueError(f"tree_sum needs a power-of-two number of parts, got {len(parts)}")
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] for i in range(0, len(parts), 2)]
    return parts[0]


def combine_leaves(parts, fold: int):
    """Left-folds each run of ``fold`` consecutive leaf partials (one shard's splits), then tree_sum."""
    shards = []
    for i in range(0, len(parts), fold):
        total = parts[i]
        for p in parts[i + 1 : i + fold]:
            total = total + p
        shards.append(total)
    return tree_sum(shards)


def round_like(xf, dtype):
    """float32 values rounded to ``dtype``'s precision (kept in float32) in a way no compiler
    elides: the value of ``xf.astype(dtype).astype(float32)``. bfloat16: round-to-nearest-even
    on the bits (XLA CPU, and so Pallas interpret mode, may otherwise skip the round trip), NaN
    kept NaN. Others: a cast."""
    if jnp.dtype(dtype) == jnp.bfloat16:
        u = jax.lax.bitcast_convert_type(xf, jnp.uint32)
        u = (u + jnp.uint32(0x7FFF) + ((u >> 16) & jnp.uint32(1))) & jnp.uint32(0xFFFF0000)
        return jnp.where(xf != xf, xf, jax.lax.bitcast_convert_type(u, jnp.float32))
    return xf.astype(dtype).astype(jnp.float32)


def leaf_value(parts, fold: int, dtype):
    """Inside a kernel that reads a matmul's float32 leaf partials (``parts``): the value
    ``leaf_result`` gives - ``combine_leaves``, rounded to the matmul's output ``dtype`` - kept
    in float32."""
    return round_like(combine_leaves(parts, fold), dtype)


def leaf_result(out, num_leaves: int, split_k: int, out_dtype):
    """A GPU matmul kernel's output as the op's result: with one leaf ``out`` is the [M, N]
    result already; else ``out`` holds the fp32 [L, M, N] leaf partials, combined by
    ``combine_leaves`` and cast to ``out_dtype``."""
    if num_leaves == 1:
        return out
    return combine_leaves([out[g] for g in range(num_leaves)], split_k).astype(out_dtype)
