"""The CPU attention formulation: the GPU kernel's split structure on fixed-shape XLA ops.

Each split is one fixed-shape block of ``split_size`` keys; tokens go through in fixed tiles
of ``CPU_TILE_T`` (XLA's CPU einsum may change a row's bits with the row count, so the row
count never varies). A tile's splits run in a loop that stops after the last split any of its
tokens reaches.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from pallas_kernels.attention_math import AttentionSpec, exp, key_mask, scores

CPU_TILE_T = 8


def split_states(q, k_cache, v_cache, index, *, spec: AttentionSpec):
    """q [T, Hkv, R, D] -> per-split states m, l [T, Hkv, S, R], acc [T, Hkv, S, R, D].
    ``index``: (block_tables, context_lens, token_seq, token_pos)."""
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
        states = (  # a split no token of the tile reaches keeps these (an empty split's state)
            jnp.full((CPU_TILE_T, hkv, splits, rows), -jnp.inf, jnp.float32),
            jnp.zeros((CPU_TILE_T, hkv, splits, rows), jnp.float32),
            jnp.zeros((CPU_TILE_T, hkv, splits, rows, d), jnp.float32),
        )

        def split_step(split, states):
            new = one_split(qt, seq, pos, ctx, split)
            return tuple(
                lax.dynamic_update_index_in_dim(a, x, split, 2) for a, x in zip(states, new, strict=True)
            )

        # a loop up to the last split a token of the tile reaches: one compiled split for every
        # context length (a Python loop over the splits compiled one copy a split: 8 s for a
        # 32k-token table at 64 tokens a step, 2 s at 1k)
        reached = jnp.clip(jnp.max(pos) // split_size + 1, 0, splits)
        return lax.fori_loop(0, reached, split_step, states)

    m, l, acc = lax.map(tile, xs) if tp > CPU_TILE_T else (x[None] for x in tile(tuple(x[0] for x in xs)))
    unt = lambda a: a.reshape((tp,) + a.shape[2:])[:t]
    return unt(m), unt(l), unt(acc)
