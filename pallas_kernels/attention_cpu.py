"""The CPU attention formulation: the GPU kernel's split structure on fixed-shape XLA ops.

Each split is one fixed-shape block of ``split_size`` keys; tokens go through in fixed tiles
of ``CPU_TILE_T`` (XLA's CPU einsum may change a row's bits with the row count, so the row
count never varies). A tile's splits run in a loop that stops after the last split any of its
tokens reaches, each folded into the tile's carry as it is computed.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from pallas_kernels.attention_math import (
    AttentionSpec,
    exp,
    fold_finish,
    fold_step,
    key_mask,
    scores,
    split_used,
)

CPU_TILE_T = 8


def attend(q, k_cache, v_cache, index, *, spec: AttentionSpec):
    """q [T, Hkv, R, D] -> the folded fp32 output [T, Hkv, R, D] (zeros for padding tokens).
    ``index``: (block_tables, context_lens, token_seq, token_pos).

    Each split's state is folded into its tile's carry as soon as it is computed
    (``attention_math.fold_step``, the one definition of the fold, in split order over the
    splits each token uses): nothing is stored per split, and a tile runs only the splits its
    tokens reach. (Until 2026-12-07 every split's state was stored, [T, Hkv, S, R, D] with S the
    block table's splits, then folded over all S: memory T x S - 7 GB for a 16k-token
    ``bijax.logprobs`` row - and a decode step's time grew with max_model_len. The same bits:
    the same operations in the same order.)"""
    block_tables, context_lens, token_seq, token_pos = index
    t, hkv, rows, d = q.shape
    block_size = k_cache.shape[1]
    max_blocks = block_tables.shape[1]
    split_size = spec.split_size
    splits = spec.num_splits(max_blocks * block_size)
    pages = split_size // block_size
    tp = -(-t // CPU_TILE_T) * CPU_TILE_T
    pad = tp - t
    tiles = lambda a, fill: jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1), constant_values=fill).reshape(
        (tp // CPU_TILE_T, CPU_TILE_T) + a.shape[1:]
    )
    xs = (tiles(q, 0), tiles(token_seq, 0), tiles(token_pos, -1))

    def one_split(qt, seq, pos, ctx, split):
        page = jnp.minimum(split * pages + jnp.arange(pages), max_blocks - 1)
        phys = block_tables[seq[:, None], page[None, :]]  # [TT, pages]
        k = k_cache[phys].reshape(CPU_TILE_T, split_size, hkv, d)
        v = v_cache[phys].reshape(CPU_TILE_T, split_size, hkv, d)
        j = split * split_size + jnp.arange(split_size)
        ok = key_mask(j[None, :], pos[:, None], ctx[:, None], spec.window)  # [TT, split]
        s = jnp.einsum("thrd,tkhd->thrk", qt, k, preferred_element_type=jnp.float32)
        s = jnp.where(ok[:, None, None, :], scores(s, spec), -jnp.inf)
        m = jnp.max(s, axis=-1)
        m_safe = jnp.where(m == -jnp.inf, 0.0, m)
        p = jnp.where(ok[:, None, None, :], exp(s - m_safe[..., None], jnp.exp2), 0.0)
        v = jnp.where(ok[:, :, None, None], v.astype(jnp.float32), 0.0)
        acc = jnp.einsum("thrk,tkhd->thrd", p, v, preferred_element_type=jnp.float32)
        return m, jnp.sum(p, axis=-1), acc

    def tile(args):
        qt, seq, pos = args
        ctx = context_lens[seq]
        shape = (CPU_TILE_T, hkv, rows)
        carry = (  # (a row that uses no split never reads these: ``fold_finish`` gives zeros)
            jnp.full(shape, -jnp.inf, jnp.float32),
            jnp.zeros(shape, jnp.float32),
            jnp.zeros(shape + (d,), jnp.float32),
            jnp.zeros(shape, bool),
        )

        def split_step(split, carry):
            use = jnp.broadcast_to(split_used(split, pos, spec)[:, None, None], shape)
            return fold_step(carry, one_split(qt, seq, pos, ctx, split), use, exp2=jnp.exp2)

        # a loop up to the last split a token of the tile reaches: one compiled split for every
        # context length (a Python loop over the splits compiled one copy a split: 8 s for a
        # 32k-token table at 64 tokens a step, 2 s at 1k; unrolled, XLA also fused the fold
        # differently for each split count - NUMERICS_VERSION 7)
        reached = jnp.clip(jnp.max(pos) // split_size + 1, 0, splits)
        return fold_finish(lax.fori_loop(0, reached, split_step, carry))

    out = lax.map(tile, xs) if tp > CPU_TILE_T else tile(tuple(x[0] for x in xs))[None]
    return out.reshape((tp,) + out.shape[2:])[:t]
