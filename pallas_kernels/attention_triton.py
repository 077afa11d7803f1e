"""The GPU attention kernel (Pallas, Triton lowering): one program per (token, KV head, split).

A program reduces one split of its token's keys into an fp32 softmax state (max, sum, acc),
online over KV tiles of ``kv_tile(block_size)`` tokens at absolute multiples; the group of
query heads sharing the KV head forms the rows of the dot (padded to 16), so no other token
touches its arithmetic. The splits are folded by ``attention_math.fold_splits``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.attention_math import AttentionSpec, key_mask, kv_tile, scores

MIN_ROWS = 16  # the GPU dot needs at least 16 rows; the head group is padded to this


def _kernel(
    seq_ref, pos_ref, ctx_ref, bt_ref, q_ref, k_ref, v_ref, m_out, l_out, acc_out,
    *, spec: AttentionSpec, block_size: int, max_blocks: int,
):  # fmt: skip
    """One (token, KV head, split): fp32 softmax state of the split, online over KV tiles."""
    t, split = pl.program_id(0), pl.program_id(2)
    seq, pos = seq_ref[t], pos_ref[t]
    ctx = ctx_ref[jnp.maximum(seq, 0)]
    rows, d = q_ref.shape
    tile = kv_tile(block_size)
    pages = tile // block_size
    start = split * spec.split_size
    q = q_ref[...]

    # Tiles of this split that hold keys the token may see (none for padding tokens).
    hi = jnp.clip(pos + 1 - start, 0, spec.split_size)
    num_tiles = (hi + tile - 1) // tile
    first = 0
    if spec.window is not None:
        first = jnp.clip((pos - spec.window + 1 - start) // tile, 0, num_tiles)

    def body(i, carry):
        m, l, acc = carry
        tile_start = start + i * tile
        page = jnp.minimum(tile_start // block_size + jnp.arange(pages), max_blocks - 1)
        phys = bt_ref[jnp.maximum(seq, 0), page]
        k = k_ref[phys].reshape(tile, d)
        v = v_ref[phys].reshape(tile, d)
        j = tile_start + jnp.arange(tile)
        ok = key_mask(j, pos, ctx, spec.window)
        s = jnp.dot(q, k.T, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
        s = jnp.where(ok[None, :], scores(s, spec), -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp(m - m_safe)
        p = jnp.where(ok[None, :], jnp.exp(s - m_safe[:, None]), 0.0)
        v = jnp.where(ok[:, None], v, 0.0)
        pv = jnp.dot(
            p.astype(v.dtype), v, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32
        )
        return m_new, l * alpha + jnp.sum(p, axis=1), acc * alpha[:, None] + pv

    init = (
        jnp.full((rows,), -jnp.inf, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
        jnp.zeros((rows, d), jnp.float32),
    )
    m, l, acc = lax.fori_loop(first, num_tiles, body, init)
    m_out[...] = m
    l_out[...] = l
    acc_out[...] = acc


def split_states(q, k_cache, v_cache, index, *, spec: AttentionSpec, interpret: bool):
    """q [T, Hkv, G, D] -> per-split states m, l [T, Hkv, S, R], acc [T, Hkv, S, R, D]
    (R: G padded to at least 16 rows). ``index``: (block_tables, context_lens, token_seq, token_pos)."""
    block_tables, context_lens, token_seq, token_pos = index
    t, hkv, group, d = q.shape
    rows = max(MIN_ROWS, pl.next_power_of_2(group))
    q = jnp.pad(q, ((0, 0), (0, 0), (0, rows - group), (0, 0)))
    num_blocks, block_size = k_cache.shape[:2]
    max_blocks = block_tables.shape[1]
    splits = spec.num_splits(max_blocks * block_size)
    smem = lambda shape: pl.BlockSpec(shape, lambda i, h, s: (0,) * len(shape))
    cache = pl.BlockSpec((num_blocks, block_size, pl.squeezed, d), lambda i, h, s: (0, 0, h, 0))
    state = lambda *shape: pl.BlockSpec(
        (pl.squeezed, pl.squeezed, pl.squeezed) + shape, lambda i, h, s: (i, h, s) + (0,) * len(shape)
    )
    kernel = functools.partial(_kernel, spec=spec, block_size=block_size, max_blocks=max_blocks)
    f32 = jnp.float32
    return pl.pallas_call(
        kernel,
        grid=(t, hkv, splits),
        in_specs=[
            smem(token_seq.shape),
            smem(token_pos.shape),
            smem(context_lens.shape),
            smem(block_tables.shape),
            pl.BlockSpec((pl.squeezed, pl.squeezed, rows, d), lambda i, h, s: (i, h, 0, 0)),
            cache,
            cache,
        ],
        out_specs=[state(rows), state(rows), state(rows, d)],
        out_shape=[
            jax.ShapeDtypeStruct((t, hkv, splits, rows), f32),
            jax.ShapeDtypeStruct((t, hkv, splits, rows), f32),
            jax.ShapeDtypeStruct((t, hkv, splits, rows, d), f32),
        ],
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="bijax_attention",
    )(token_seq, token_pos, context_lens, block_tables, q, k_cache, v_cache)
