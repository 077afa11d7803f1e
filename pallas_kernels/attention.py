"""Batch-invariant paged attention: one code path for prefill chunks and decode tokens.

Inputs are a flat, ragged batch of T query tokens, each with its sequence and absolute
position, against a paged KV cache ``[num_blocks, block_size, Hkv, D]`` addressed through
a block table per sequence. A token at position p attends causally to its sequence's keys
0..p (optionally a sliding window, optionally soft-capped logits).

The reduction structure depends on the token's position and KV only:

* keys are cut into splits of ``split_size`` tokens starting at absolute multiples of the
  split size; a split is reduced on its own into an fp32 softmax state (max, sum, acc);
* GPU: inside a split, keys are read in tiles of ``max(64, block_size)`` tokens starting at
  absolute multiples, with an online softmax in fp32; CPU: one fixed-shape block per split;
* masked probabilities are exactly 0 (and masked values are zeroed, so stale cache rows
  cannot leak NaN);
* the splits are merged as a left fold in split order - also when there is only one;
* every token is its own program (GPU) or row (CPU): the group of query heads sharing a KV
  head forms the rows of the dot, so no other token can touch its arithmetic.

Shapes are static per input bucket; lengths and positions are data. Padding tokens have
position -1 and get zeros. ``write_kv`` stores new K/V rows at their cache slots.

File order: kernel -> pallas_call wrapper -> CPU formulation -> fold -> public entry
points -> reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import _platform
from pallas_kernels._validate import check_float_dtype

SPLIT_SIZE = 512
HEAD_DIMS = (64, 128)
_MIN_KV_TILE = 64
_MIN_ROWS = 16  # the GPU dot needs at least 16 rows; the head group is padded to this
CPU_TILE_T = 8


def _kv_tile(block_size: int) -> int:
    return max(_MIN_KV_TILE, block_size)


def _scores(s, *, scale: float, softcap: float | None):
    s = s * scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    return s


def _key_mask(j, pos, ctx, window: int | None):
    ok = (j <= pos) & (j < ctx)
    if window is not None:
        ok &= j > pos - window
    return ok


# --------------------------------------------------------------------------- GPU kernel


def _attention_kernel(
    seq_ref,
    pos_ref,
    ctx_ref,
    bt_ref,
    q_ref,
    k_ref,
    v_ref,
    m_out,
    l_out,
    acc_out,
    *,
    scale,
    softcap,
    window,
    split_size,
    block_size,
    max_blocks,
):
    """One (token, KV head, split): fp32 softmax state of the split, online over KV tiles."""
    t, split = pl.program_id(0), pl.program_id(2)
    seq, pos = seq_ref[t], pos_ref[t]
    ctx = ctx_ref[jnp.maximum(seq, 0)]
    rows, d = q_ref.shape
    kv_tile = _kv_tile(block_size)
    pages = kv_tile // block_size
    start = split * split_size
    q = q_ref[...]

    # Tiles of this split that hold keys the token may see (none for padding tokens).
    hi = jnp.clip(pos + 1 - start, 0, split_size)
    num_tiles = (hi + kv_tile - 1) // kv_tile
    first = 0
    if window is not None:
        first = jnp.clip((pos - window + 1 - start) // kv_tile, 0, num_tiles)

    def body(i, carry):
        m, l, acc = carry
        tile_start = start + i * kv_tile
        page = jnp.minimum(tile_start // block_size + jnp.arange(pages), max_blocks - 1)
        phys = bt_ref[jnp.maximum(seq, 0), page]
        k = k_ref[phys].reshape(kv_tile, d)
        v = v_ref[phys].reshape(kv_tile, d)
        j = tile_start + jnp.arange(kv_tile)
        ok = _key_mask(j, pos, ctx, window)
        s = jnp.dot(q, k.T, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
        s = jnp.where(ok[None, :], _scores(s, scale=scale, softcap=softcap), -jnp.inf)
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


def _attention_pallas(
    q, k_cache, v_cache, block_tables, context_lens, token_seq, token_pos, *, cfg, interpret
):
    """q[T, Hkv, G, D] -> per-split states m, l [T, Hkv, S, R], acc [T, Hkv, S, R, D] (R: G padded)."""
    t, hkv, group, d = q.shape
    rows = max(_MIN_ROWS, pl.next_power_of_2(group))
    q = jnp.pad(q, ((0, 0), (0, 0), (0, rows - group), (0, 0)))
    num_blocks, block_size = k_cache.shape[:2]
    max_blocks = block_tables.shape[1]
    splits = cfg["num_splits"]
    smem = lambda shape: pl.BlockSpec(shape, lambda i, h, s: (0,) * len(shape))
    cache = pl.BlockSpec((num_blocks, block_size, pl.squeezed, d), lambda i, h, s: (0, 0, h, 0))
    state = lambda *shape: pl.BlockSpec(
        (pl.squeezed, pl.squeezed, pl.squeezed) + shape, lambda i, h, s: (i, h, s) + (0,) * len(shape)
    )
    kernel = functools.partial(
        _attention_kernel,
        scale=cfg["scale"],
        softcap=cfg["softcap"],
        window=cfg["window"],
        split_size=cfg["split_size"],
        block_size=block_size,
        max_blocks=max_blocks,
    )
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


# --------------------------------------------------------------------------- CPU formulation


def _attention_jnp(q, k_cache, v_cache, block_tables, context_lens, token_seq, token_pos, *, cfg):
    """Same split structure; each split is one fixed-shape block; tokens in fixed tiles of CPU_TILE_T."""
    t, hkv, rows, d = q.shape
    block_size = k_cache.shape[1]
    max_blocks = block_tables.shape[1]
    split_size, splits = cfg["split_size"], cfg["num_splits"]
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
        ok = _key_mask(j[None, :], pos[:, None], ctx[:, None], cfg["window"])  # [TT, split]
        s = jnp.einsum("thrd,tkhd->thrk", qt, k, preferred_element_type=jnp.float32)
        s = jnp.where(ok[:, None, None, :], _scores(s, scale=cfg["scale"], softcap=cfg["softcap"]), -jnp.inf)
        m = jnp.max(s, axis=-1)
        m_safe = jnp.where(m == -jnp.inf, 0.0, m)
        p = jnp.where(ok[:, None, None, :], jnp.exp(s - m_safe[..., None]), 0.0)
        v = jnp.where(ok[:, :, None, None], v.astype(jnp.float32), 0.0)
        acc = jnp.einsum("thrk,tkhd->thrd", p, v, preferred_element_type=jnp.float32)
        return m, jnp.sum(p, axis=-1), acc

    def tile(args):
        qt, seq, pos = args
        ctx = context_lens[seq]
        empty = (
            jnp.full((CPU_TILE_T, hkv, rows), -jnp.inf, jnp.float32),
            jnp.zeros((CPU_TILE_T, hkv, rows), jnp.float32),
            jnp.zeros((CPU_TILE_T, hkv, rows, d), jnp.float32),
        )
        states = []
        for split in range(splits):  # splits past every token of the tile are skipped
            needed = jnp.max(pos) >= split * split_size
            states.append(lax.cond(needed, lambda s=split: one_split(qt, seq, pos, ctx, s), lambda: empty))
        return tuple(jnp.stack(x, axis=2) for x in zip(*states, strict=True))

    m, l, acc = lax.map(tile, xs) if tp > CPU_TILE_T else (x[None] for x in tile(tuple(x[0] for x in xs)))
    unt = lambda a: a.reshape((tp,) + a.shape[2:])[:t]
    return unt(m), unt(l), unt(acc)


# --------------------------------------------------------------------------- fold and entry points


def _split_used(split: int, pos, *, split_size: int, window: int | None):
    """Whether a token at ``pos`` has any visible key in ``split`` (False for padding)."""
    used = (pos >= 0) & (split * split_size <= pos)
    if window is not None:
        used &= (split + 1) * split_size > pos - window + 1
    return used


def _fold_splits(m, l, acc, pos, *, split_size: int, window: int | None):
    """Left fold of the per-split states in split order, over the splits the token uses.

    Which splits are used follows from the position alone (not from the values, so a NaN
    in the data propagates instead of being dropped); the first used split starts the fold
    as it is. Returns the normalised output [T, Hkv, R, D] (zeros for padding tokens).
    """
    started = jnp.zeros(pos.shape, bool)
    fm, fl, facc = m[:, :, 0], l[:, :, 0], acc[:, :, 0]
    for s in range(m.shape[2]):
        sm, sl, sacc = m[:, :, s], l[:, :, s], acc[:, :, s]
        if s:
            mx = jnp.maximum(fm, sm)
            mx_safe = jnp.where(mx == -jnp.inf, 0.0, mx)
            a, b = jnp.exp(fm - mx_safe), jnp.exp(sm - mx_safe)
            st = started[:, None, None]
            sm = jnp.where(st, mx, sm)
            sl = jnp.where(st, fl * a + sl * b, sl)
            sacc = jnp.where(st[..., None], facc * a[..., None] + sacc * b[..., None], sacc)
        use = _split_used(s, pos, split_size=split_size, window=window)
        u = use[:, None, None]
        fm, fl, facc = jnp.where(u, sm, fm), jnp.where(u, sl, fl), jnp.where(u[..., None], sacc, facc)
        started |= use
    st = started[:, None, None]
    return jnp.where(st[..., None], facc / jnp.where(st, fl, 1.0)[..., None], 0.0)


@_platform.kernel_op(
    "attention", static_argnames=("scale", "softcap", "window", "split_size", "backend", "interpret")
)
def _attention(
    q,
    k_cache,
    v_cache,
    block_tables,
    context_lens,
    token_seq,
    token_pos,
    *,
    scale,
    softcap,
    window,
    split_size,
    backend,
    interpret,
):
    # Padding tokens may carry any sequence index: clamp it so no read goes out of bounds.
    token_seq = jnp.clip(token_seq, 0, block_tables.shape[0] - 1)
    statics = (scale, softcap, window, split_size, backend, interpret)
    return _attention_vjp(q, k_cache, v_cache, block_tables, context_lens, token_seq, token_pos, *statics)


# Differentiable in q, k_cache and v_cache: the forward is the kernel (bits unchanged), the
# backward the VJP of the plain XLA ``attention_reference``; the integer inputs get no cotangent.
@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10, 11, 12))
def _attention_vjp(
    q, k_cache, v_cache, block_tables, context_lens, token_seq, token_pos, sc, cap, win, split, be, interp
):
    args = (q, k_cache, v_cache, block_tables, context_lens, token_seq, token_pos)
    return _attention_impl(*args, sc, cap, win, split, be, interp)


def _attention_vjp_fwd(
    q, k_cache, v_cache, block_tables, context_lens, token_seq, token_pos, sc, cap, win, split, be, interp
):
    args = (q, k_cache, v_cache, block_tables, context_lens, token_seq, token_pos)
    return _attention_impl(*args, sc, cap, win, split, be, interp), args


def _attention_vjp_bwd(scale, softcap, window, split_size, backend, interpret, res, g):
    q, k_cache, v_cache, block_tables, context_lens, token_seq, token_pos = res

    def ref(q, k, v):
        return attention_reference(
            q,
            k,
            v,
            block_tables,
            context_lens,
            token_seq,
            token_pos,
            scale=scale,
            sliding_window=window,
            logit_softcap=softcap,
        )

    _, vjp = jax.vjp(ref, q, k_cache, v_cache)
    return (*vjp(g), None, None, None, None)


_attention_vjp.defvjp(_attention_vjp_fwd, _attention_vjp_bwd)


def _attention_impl(
    q,
    k_cache,
    v_cache,
    block_tables,
    context_lens,
    token_seq,
    token_pos,
    scale,
    softcap,
    window,
    split_size,
    backend,
    interpret,
):
    t, hq, d = q.shape
    hkv = k_cache.shape[2]
    group = hq // hkv
    qg = q.reshape(t, hkv, group, d)
    cfg = dict(
        scale=scale,
        softcap=softcap,
        window=window,
        split_size=split_size,
        num_splits=-(-block_tables.shape[1] * k_cache.shape[1] // split_size),
    )
    args = (qg, k_cache, v_cache, block_tables, context_lens, token_seq, token_pos)
    fold = functools.partial(_fold_splits, pos=token_pos, split_size=split_size, window=window)
    # Both branches fold their split states themselves (platform_dependent needs equal output types).
    out = _platform.dispatch(
        backend,
        lambda *a: fold(*_attention_jnp(*a, cfg=cfg)),
        lambda *a: fold(*_attention_pallas(*a, cfg=cfg, interpret=interpret))[:, :, :group],
        *args,
    )  # [T, Hkv, G, D]
    return out.reshape(t, hq, d).astype(q.dtype)


def _concrete(a):
    if isinstance(a, jax.core.Tracer):  # (asking a tracer for its value builds a costly error)
        return None
    try:
        return np.asarray(a)
    except (TypeError, jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def _check_attention(q, k_cache, v_cache, block_tables, context_lens, token_seq, token_pos, split_size):
    for name, a, nd in (("q", q, 3), ("k_cache", k_cache, 4), ("v_cache", v_cache, 4)):
        if getattr(a, "ndim", None) != nd:
            raise ValueError(f"attention: {name} must be {nd}-D, got shape {getattr(a, 'shape', None)}")
    check_float_dtype("attention", q=q, k_cache=k_cache, v_cache=v_cache)
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise TypeError(
            f"attention: dtype mismatch q={q.dtype}, k_cache={k_cache.dtype}, v_cache={v_cache.dtype}"
        )
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"attention: k_cache {k_cache.shape} and v_cache {v_cache.shape} differ")
    t, hq, d = q.shape
    num_blocks, block_size, hkv, dk = k_cache.shape
    if t == 0:
        raise ValueError("attention: q has no tokens (T == 0)")
    if isinstance(split_size, bool) or not isinstance(split_size, (int, np.integer)) or split_size < 1:
        raise ValueError(f"attention: split_size must be a positive int, got {split_size!r}")
    if d != dk:
        raise ValueError(f"attention: head dim of q ({d}) != cache's ({dk})")
    if d not in HEAD_DIMS:
        raise ValueError(f"attention: head dim must be one of {HEAD_DIMS}, got {d}")
    if hq % hkv:
        raise ValueError(f"attention: {hq} query heads are not a multiple of {hkv} KV heads")
    if block_size & (block_size - 1) or split_size % _kv_tile(block_size):
        raise ValueError(
            f"attention: block_size must be a power of two and split_size ({split_size}) a multiple of "
            f"max(64, block_size); got block_size={block_size}"
        )
    for name, a, shape in (
        ("block_tables", block_tables, None),
        ("context_lens", context_lens, None),
        ("token_seq", token_seq, (t,)),
        ("token_pos", token_pos, (t,)),
    ):
        if not jnp.issubdtype(getattr(a, "dtype", np.float32), jnp.integer):
            raise TypeError(f"attention: {name} must be an integer array")
        if shape is not None and tuple(a.shape) != shape:
            raise ValueError(f"attention: {name} must have shape {shape}, got {tuple(a.shape)}")
    if block_tables.ndim != 2 or context_lens.shape != (block_tables.shape[0],):
        raise ValueError(
            f"attention: block_tables must be [num_seqs, max_blocks] and context_lens [num_seqs]; "
            f"got {tuple(block_tables.shape)} and {tuple(context_lens.shape)}"
        )
    ctx, pos, seq, bt = map(_concrete, (context_lens, token_pos, token_seq, block_tables))
    if ctx is not None:
        if (ctx < 0).any():
            raise ValueError(f"attention: negative context length {int(ctx.min())}")
        cap = block_tables.shape[1] * block_size
        if (ctx > cap).any():
            raise ValueError(
                f"attention: context length {int(ctx.max())} needs more than the block table's "
                f"{block_tables.shape[1]} blocks of {block_size}"
            )
    if seq is not None and pos is not None and ctx is not None:
        real = pos >= 0
        if ((seq[real] < 0) | (seq[real] >= len(ctx))).any():
            raise ValueError("attention: token_seq out of range for a real (position >= 0) token")
        if (pos[real] >= ctx[seq[real]]).any():
            raise ValueError("attention: a token's position is not below its sequence's context length")
    if bt is not None and ((bt < 0) | (bt >= num_blocks)).any():
        raise ValueError(f"attention: block_tables entries must be in [0, {num_blocks})")


def attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    block_tables: jax.Array,
    context_lens: jax.Array,
    token_seq: jax.Array,
    token_pos: jax.Array,
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    split_size: int = SPLIT_SIZE,
    backend: str = "auto",
    interpret: bool = False,
) -> jax.Array:
    """Causal paged attention for a flat, ragged batch of query tokens. Batch invariant.

    Args:
      q: [T, Hq, D] query tokens (any mix of prefill chunks and decode tokens), D in {64, 128}.
      k_cache, v_cache: [num_blocks, block_size, Hkv, D], same dtype as q; Hq % Hkv == 0.
      block_tables: int [num_seqs, max_blocks] physical block of each logical block.
      context_lens: int [num_seqs] tokens in each sequence's cache (this step's included).
      token_seq, token_pos: int [T] sequence index and absolute position of each token;
        padding tokens have position -1 (their output is zeros).
      scale: logit scale (default D ** -0.5); sliding_window: keys p - window < j <= p;
      logit_softcap: ``c * tanh(s / c)`` on the scaled logits.
      split_size: fixed split size in tokens (a multiple of max(64, block_size)); part of
        the numerics: a token's bits depend on it, never on the batch.
    Returns [T, Hq, D] in q's dtype.

    The KV of this step's tokens must already be in the cache (``write_kv``). Differentiable
    in q, k_cache and v_cache (``jax.custom_vjp``: the backward is the VJP of
    ``attention_reference``, plain XLA over each token's densely gathered keys).
    """
    _platform.check_backend(backend, interpret)
    _check_attention(q, k_cache, v_cache, block_tables, context_lens, token_seq, token_pos, split_size)
    scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    if not (np.isfinite(scale) and scale > 0):
        raise ValueError(f"attention: scale must be a finite positive number, got {scale!r}")
    if sliding_window is not None:
        if (
            isinstance(sliding_window, bool)
            or not isinstance(sliding_window, (int, np.integer))
            or sliding_window < 1
        ):
            raise ValueError(f"attention: sliding_window must be a positive int, got {sliding_window!r}")
        sliding_window = int(sliding_window)
    if logit_softcap is not None:
        ok = isinstance(logit_softcap, (int, float, np.floating)) and not isinstance(logit_softcap, bool)
        if not ok or not (np.isfinite(logit_softcap) and logit_softcap > 0):
            raise ValueError(
                f"attention: logit_softcap must be a finite positive number, got {logit_softcap!r}"
            )
    return _attention(
        q,
        k_cache,
        v_cache,
        jnp.asarray(block_tables, jnp.int32),
        jnp.asarray(context_lens, jnp.int32),
        jnp.asarray(token_seq, jnp.int32),
        jnp.asarray(token_pos, jnp.int32),
        scale=scale,
        softcap=None if logit_softcap is None else float(logit_softcap),
        window=sliding_window,
        split_size=int(split_size),
        backend=backend,
        interpret=interpret,
    )


@_platform.kernel_op("write_kv", donate_argnums=(0, 1))
def _write_kv(k_cache, v_cache, k, v, slots):
    block_size = k_cache.shape[1]
    null = jnp.arange(slots.shape[0], dtype=jnp.int32) % block_size  # padding -> reserved block 0
    slots = jnp.where(slots < 0, null, slots)
    blk, off = slots // block_size, slots % block_size
    return k_cache.at[blk, off].set(k), v_cache.at[blk, off].set(v)


def write_kv(k_cache, v_cache, k, v, slot_mapping):
    """Stores k, v [T, Hkv, D] at ``slot_mapping`` [T] (= block * block_size + offset) of the caches.

    Slots of real tokens must be unique; a negative slot marks a padding token, which writes
    into the reserved null block 0 (never read unmasked). The caches are donated.
    """
    if k.shape != v.shape or k.shape[1:] != k_cache.shape[2:]:
        raise ValueError(f"write_kv: k {k.shape} / v {v.shape} do not fit cache rows {k_cache.shape[2:]}")
    if k.dtype != k_cache.dtype or v.dtype != v_cache.dtype:
        raise TypeError(f"write_kv: dtype mismatch k={k.dtype}, cache={k_cache.dtype}")
    if tuple(getattr(slot_mapping, "shape", ())) != (k.shape[0],):
        raise ValueError(
            f"write_kv: slot_mapping must have shape ({k.shape[0]},), got {getattr(slot_mapping, 'shape', None)}"
        )
    if not jnp.issubdtype(slot_mapping.dtype, jnp.integer):
        raise TypeError(f"write_kv: slot_mapping must be an integer array, got {slot_mapping.dtype}")
    slots = _concrete(slot_mapping)
    capacity = k_cache.shape[0] * k_cache.shape[1]
    if slots is not None:
        if (slots >= capacity).any():
            raise ValueError(f"write_kv: slot {int(slots.max())} is outside the cache's {capacity} slots")
        real = slots[slots >= 0]
        if len(np.unique(real)) != len(real):
            raise ValueError("write_kv: two tokens write the same cache slot")
    return _write_kv(k_cache, v_cache, k, v, jnp.asarray(slot_mapping, jnp.int32))


def attention_reference(
    q,
    k_cache,
    v_cache,
    block_tables,
    context_lens,
    token_seq,
    token_pos,
    *,
    scale=None,
    sliding_window=None,
    logit_softcap=None,
):
    """Plain XLA attention over each token's densely gathered KV (batch-VARIANT negative control).

    The dense KV length is the longest context in the batch, so a token's reduction length
    (and with it XLA's summation order) depends on the other sequences.
    """
    t, hq, d = q.shape
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    scale = d**-0.5 if scale is None else scale
    longest = (
        int(np.max(np.asarray(context_lens)))
        if _concrete(context_lens) is not None
        else block_tables.shape[1] * block_size
    )
    nblk = max(1, -(-longest // block_size))
    phys = block_tables[token_seq][:, :nblk]  # [T, nblk]
    k = k_cache[phys].reshape(t, nblk * block_size, hkv, d)
    v = v_cache[phys].reshape(t, nblk * block_size, hkv, d)
    qg = q.reshape(t, hkv, hq // hkv, d).astype(jnp.float32)
    s = jnp.einsum("thgd,tkhd->thgk", qg, k.astype(jnp.float32)) * scale
    if logit_softcap is not None:
        s = logit_softcap * jnp.tanh(s / logit_softcap)
    j = jnp.arange(nblk * block_size)
    ok = _key_mask(j[None, :], token_pos[:, None], context_lens[token_seq][:, None], sliding_window)
    s = jnp.where(ok[:, None, None, :], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    p = jnp.where(ok[:, None, None, :], p, 0.0)
    v = jnp.where(ok[:, :, None, None], v.astype(jnp.float32), 0.0)
    out = jnp.einsum("thgk,tkhd->thgd", p, v)
    out = jnp.where((token_pos >= 0)[:, None, None, None], out, 0.0)
    return out.reshape(t, hq, d).astype(q.dtype)
