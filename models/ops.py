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


def col_mm_shared(x, ws, *, invariant: bool, col_blocks: int, tp: TensorParallel | None, out_dtype=None):
    """``[col_mm(x, w, ...) for w in ws]`` with the same bits, for weights that share x (a
    layer's q, k, v): the invariant path runs them in one kernel launch where it can
    (``pk.matmul_shared``)."""
    if not invariant:
        return [pk.matmul_reference(x, w, out_dtype=out_dtype) for w in ws]
    return list(pk.matmul_shared(x, ws, out_dtype=out_dtype, col_blocks=col_blocks, full_ns=_full_ns(ws, tp)))


def col_mm_swiglu(x, w_gate, w_up, *, col_blocks: int, tp: TensorParallel | None):
    """The invariant path's ``swiglu(col_mm(x, w_gate, ...), col_mm(x, w_up, ...))`` rounded to
    x's dtype, with the same bits (``pk.gate_up_swiglu``: on the GPU one launch at decode rows);
    under ``tp`` the weights are this rank's columns."""
    return pk.gate_up_swiglu(x, w_gate, w_up, col_blocks=col_blocks, full_n=_full_ns([w_up], tp)[0])


def _full_ns(ws, tp: TensorParallel | None):
    """Each column-parallel weight's full N: ``ws`` are whole weights, or under ``tp`` this
    rank's 1/P of their columns."""
    return [w.shape[1] * (1 if tp is None else tp.size) for w in ws]


def qkv_rope_write_kv(x, ws, cos_sin, k_cache, v_cache, slots, *, col_blocks: int, tp: TensorParallel | None):
    """The invariant path's ``col_mm_shared(x, (wq, wk, wv))`` as heads, RoPE and the KV write in
    one op (``pk.qkv_rope_write_kv``; same bits) -> (q rotated, k_cache, v_cache)."""
    return pk.qkv_rope_write_kv(
        x, ws, cos_sin, k_cache, v_cache, slots, col_blocks=col_blocks, full_ns=_full_ns(ws, tp)
    )


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


def row_mm_norm(
    x,
    w,
    norm_weight,
    residual,
    eps,
    *,
    invariant: bool,
    k_shards: int,
    tp_parts: int,
    tp: TensorParallel | None,
):
    """``norm(row_mm(x, w, ...), norm_weight, eps, residual=residual)``: a row-parallel
    projection, the residual add and the next norm -> (normed, residual stream). On one device
    the invariant path is one op (``pk.matmul_norm``: the same bits, a kernel fewer)."""
    if invariant and tp is None and tp_parts == 1:
        return pk.matmul_norm(x, w, norm_weight, residual, eps=eps, k_shards=k_shards)
    y = row_mm(x, w, invariant=invariant, k_shards=k_shards, tp_parts=tp_parts, tp=tp)
    return norm(y, norm_weight, eps, invariant=invariant, residual=residual)


def moe(x, router, w_gate, w_up, w_down, *, top_k: int, norm_topk_prob: bool, invariant: bool, k_shards: int):
    """Qwen3-MoE's sparse block on x [T, H]: router [H, E]; experts w_gate, w_up [E, H, I],
    w_down [E, I, H]. Each token goes to the ``top_k`` experts of the largest router logits,
    weighted by their softmax probabilities (renormalised over the k when ``norm_topk_prob``).

    Invariant path: float32 router logits through ``matmul``; top-k by exact selection (ties:
    the lower expert index); probabilities from the invariant ``log_softmax``; the (token,
    expert) pairs sorted by expert (``group_rows``) through ``grouped_matmul``, whose rows'
    bits do not depend on the group's size or offset; the k expert outputs combined in float32
    in a fixed order (by rank, i.e. router weight, ties by index), each product rounded before
    its add. A token's output depends on the token alone.
    XLA path: softmax, ``lax.top_k``, ``lax.ragged_dot`` and an einsum combine (the baseline).
    """
    t, e = x.shape[0], router.shape[1]
    f32 = jnp.float32
    if invariant:
        logits = pk.matmul(x, router, out_dtype=f32)  # [T, E]
        ids, _ = pk.top_n(logits, top_k)  # [T, k], descending logits, ties: lower index first
        p = jnp.exp(jnp.take_along_axis(pk.log_softmax(logits), ids, axis=1))  # [T, k]
        if norm_topk_prob:
            total = p[:, 0]
            for j in range(1, top_k):  # a left fold in rank order (no reduction op)
                total = total + p[:, j]
            p = p / total[:, None]
        order, sizes = pk.group_rows(ids.reshape(-1), e)
        mm = pk.grouped_matmul
    else:
        logits = pk.matmul_reference(x, router, out_dtype=f32)
        p, ids = lax.top_k(jax.nn.softmax(logits, axis=-1), top_k)
        if norm_topk_prob:
            p = p / jnp.sum(p, axis=-1, keepdims=True)
        flat = ids.reshape(-1)
        order = jnp.argsort(flat, stable=True).astype(jnp.int32)
        sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
        mm = lambda a, w, s, **_: pk.grouped_matmul_reference(a, w, s)  # noqa: E731
    xs = x[order // top_k]  # [T*k, H]: the pairs, sorted by expert
    g = mm(xs, w_gate, sizes).astype(f32)
    u = mm(xs, w_up, sizes).astype(f32)
    h = pk.swiglu(g, u).astype(x.dtype)  # SwiGLU in float32, rounded once
    d = mm(h, w_down, sizes, k_shards=k_shards)  # [T*k, H]
    y = jnp.zeros_like(d).at[order].set(d).reshape(t, top_k, -1).astype(f32)  # back to (token, rank)
    if not invariant:
        return jnp.einsum("tk,tkh->th", p, y).astype(x.dtype)
    # Every product rounded before its add, in every program (see ``rope``).
    prods = lax.optimization_barrier([p[:, j, None] * y[:, j] for j in range(top_k)])
    out = prods[0]
    for j in range(1, top_k):
        out = out + prods[j]
    return out.astype(x.dtype)


def norm(x, w, eps, *, invariant: bool, residual=None):
    if invariant:
        return pk.rms_norm(x, w, eps=eps, residual=residual)
    return pk.rms_norm_reference(x, w, eps=eps, residual=residual)
