"""Fixed-order reductions across the ranks of a ``jax.shard_map`` axis.

``lax.psum`` leaves the order of the additions to the collective library (NCCL picks ring or
tree algorithms, and their splits, from the message size and the topology), so a sum's bits
can change with the number of tokens in a step. ``tree_psum`` never lets a library add: it
only moves data (all_gather, all_to_all) and adds the ranks' values itself, in fp32, by the
balanced binary tree of ``matmul.tree_sum`` over the ranks in rank order. Rank r of P holds
the sum of virtual K shards r*k_shards/P ... (the lower levels of the k_shards tree,
``matmul_partial``), so this is exactly the upper levels of that tree: every P dividing
k_shards gives the bits of one device.

Two data movements, same bits (each element is the same tree over the same values):

* ``"gather"``: all_gather every rank's whole partial, then every rank adds all P of them.
  One collective; each rank receives (P-1) x the message. Best for P = 2 and small messages
  (decode steps).
* ``"scatter"``: all_to_all hands rank j the j-th 1/P of every rank's partial; rank j adds
  those P pieces; all_gather puts the P sums together. Two collectives, each rank receives
  2 (P-1)/P x the message: a reduce-scatter + all-gather without the library's arithmetic.

``"auto"`` takes "gather" for P = 2 or messages up to ``GATHER_MAX_BYTES``, else "scatter".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.plan import tree_sum

# Per-rank partials up to this size are combined after one all_gather (P x the data, one hop).
GATHER_MAX_BYTES = 1 << 20
METHODS = ("auto", "gather", "scatter")


def _axis_size(axis_name) -> int:
    try:
        return lax.axis_size(axis_name)
    except NameError:
        raise ValueError(
            f"tree_psum: no mesh axis named {axis_name!r} here (call it inside jax.shard_map)"
        ) from None


def tree_psum(x: jax.Array, axis_name: str, *, method: str = "auto") -> jax.Array:
    """Sum of ``x`` over the ranks of ``axis_name`` in a fixed order; every rank gets the same bits.

    Use inside ``jax.shard_map``. ``x``: this rank's float32 partial (any shape; the ranks'
    shapes are equal). The result is float32, equal bit for bit to
    ``matmul.tree_sum([x_rank0, x_rank1, ...])`` on one device, whatever the shape, the
    message size or ``method`` ("auto", "gather" or "scatter"; see the module docstring).
    The number of ranks must be a power of two (the tree is balanced).
    """
    if method not in METHODS:
        raise ValueError(f"tree_psum: method must be one of {METHODS}, got {method!r}")
    if not isinstance(x, jax.Array) and not hasattr(x, "dtype"):
        raise TypeError(f"tree_psum: x must be an array, got {type(x).__name__}")
    if jnp.dtype(x.dtype) != jnp.float32:
        raise TypeError(f"tree_psum: x must be float32 (partials are combined in fp32), got {x.dtype}")
    p = _axis_size(axis_name)
    if p & (p - 1):
        raise ValueError(f"tree_psum: the axis {axis_name!r} has {p} ranks; the tree needs a power of two")
    if p == 1:
        return x
    if method == "auto":
        method = "gather" if p == 2 or x.size * 4 <= GATHER_MAX_BYTES else "scatter"
    if method == "gather":
        every = lax.all_gather(x, axis_name)  # [P, ...], in rank order
        return tree_sum([every[r] for r in range(p)])
    flat = x.reshape(-1)
    chunk = -(-flat.size // p)
    flat = jnp.pad(flat, (0, chunk * p - flat.size)).reshape(p, chunk)
    # Row j of the result on rank r is rank j's r-th chunk: the P values of my elements.
    mine = lax.all_to_all(flat, axis_name, split_axis=0, concat_axis=0)
    total = tree_sum([mine[j] for j in range(p)])
    every = lax.all_gather(total, axis_name, tiled=True)  # [P * chunk], chunk r from rank r
    return every[: x.size].reshape(x.shape)


def gather_last(x: jax.Array, axis_name: str) -> jax.Array:
    """The ranks' ``x [..., n]`` side by side along the last axis, in rank order ([..., P*n]):
    what a vocabulary-parallel LM head needs; no arithmetic at all."""
    return lax.all_gather(x, axis_name, axis=x.ndim - 1, tiled=True)


__all__ = ["GATHER_MAX_BYTES", "METHODS", "gather_last", "tree_psum"]
