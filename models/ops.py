"""The model's ops, each in its two forms: the batch-invariant kernels (``invariant=True``) or
plain XLA (``invariant=False``: the baseline and negative control), and under tensor
parallelism the per-rank form (``TensorParallel``). ``models.llama`` composes them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

import pallas_kernels as pk


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """The model runs inside ``jax.shard_map`` over mesh axis ``axis`` of ``size`` ranks, each
    holding its shards of the weights and KV cache (``models.sharding``)."""

    axis: str
    size: int


def col_mm(x, w, *, invariant: bool, col_blocks: int, tp: TensorParallel | None, out_dtype=None):
    """Column-parallel x[M, K] @ w[K, N]: ``w`` is the whole weight, or under ``tp`` this
    rank's N/P columns (planned for the whole weight: same bits as one device)."""
    if not invariant:
        return pk.matmul_reference(x, w, out_dtype=out_dtype)
    full_n = w.shape[1] * (1 if tp is None else tp.size)
    return pk.matmul(x, w, out_dtype=out_dtype, col_blocks=col_blocks, full_n=full_n)


def row_mm(x, w, *, invariant: bool, k_shards: int, tp_parts: int, tp: TensorParallel | None):
    """Row-parallel x[M, K] @ w[K, N] (o, down): ``w`` is the whole weight, or under ``tp`` this
    rank's K/P rows. Each rank reduces its k_shards/P shards (the tree's lower levels), the
    ranks' float32 partials meet in ``tree_psum`` (its upper levels). ``tp_parts`` > 1 runs
    the same split on one device (a check of k_shards without a mesh)."""
    if tp is not None:
        if not invariant:  # the baseline: the library's all-reduce, in whatever order it likes
            y = jax.lax.psum(jnp.dot(x, w, preferred_element_type=jnp.float32), tp.axis)
            return y.astype(x.dtype)
        plan = pk.plan_matmul(w.shape[0] * tp.size, w.shape[1], w.dtype, k_shards=k_shards)
        return pk.tree_psum(pk.matmul_partial(x, w, plan=plan), tp.axis).astype(x.dtype)
    if not invariant:
        return pk.matmul_reference(x, w)
    if tp_parts == 1:
        return pk.matmul(x, w, k_shards=k_shards)
    k, n = w.shape
    plan = pk.plan_matmul(k, n, w.dtype, k_shards=k_shards)
    per = plan.shard_k * (k_shards // tp_parts)
    parts = [
        pk.matmul_partial(x[:, r * per : (r + 1) * per], w[r * per : (r + 1) * per], plan=plan)
        for r in range(tp_parts)
    ]
    return pk.tree_sum(parts).astype(x.dtype)


def norm(x, w, eps, *, invariant: bool, residual=None):
    if invariant:
        return pk.rms_norm(x, w, eps=eps, residual=residual)
    return pk.rms_norm_reference(x, w, eps=eps, residual=residual)


def rope(x, cos_sin):
    """x [T, H, D] rotated by the half-split convention (HF's rotate_half), in float32."""
    cos, sin = cos_sin[:, None, 0], cos_sin[:, None, 1]  # [T, 1, D/2]
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    # The products are rounded before the add, in every program: without the barrier XLA may
    # fuse a product into the add (one rounding, an FMA) in one program and not in another
    # (a trainer's grad step keeps them for the backward), and a bit would differ.
    a, b, c, d = lax.optimization_barrier((x1 * cos, x2 * sin, x2 * cos, x1 * sin))
    out = jnp.concatenate([a - b, c + d], axis=-1)
    return out.astype(x.dtype)
