"""What the attention paths share: the static settings, and every formula a token's bits
depend on outside the dots (logit scaling, the exponential, the key mask, the split fold).

The GPU kernel (``attention_triton``), the CPU formulation (``attention_cpu``) and the entry
points (``attention``) all take these from here, so the paths cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers

import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels.checks import check_positive_int

SPLIT_SIZE = 512
HEAD_DIMS = (64, 128)
MIN_KV_TILE = 64
LOG2E = 1.4426950408889634
# Every exponential of the online softmax and the fold is 2**(x * log2 e) (``exp``; since
# NUMERICS_VERSION 6): on the GPU 2**y is the one instruction EX2_PTX in every kernel (the
# Triton kernels' inline assembly, the Mosaic GPU kernel's inline PTX); on the CPU (and in the
# kernels' interpret mode) ``jnp.exp2``. (Before: the exact ``exp`` - libdevice's ``__nv_expf``,
# ~7 instructions an element on the GPU; the prefill kernel spent 8-15% longer with it,
# RESULTS.md session 42.) ``.ftz``: results below 2**-126 are 0, in every kernel alike;
# ex2(0) is exactly 1 and ex2(-inf) exactly 0 (the PTX ISA's special values), which
# ``kv_tile_step`` relies on. The factor log2 e is applied to x = s - m, not folded into the
# logit scale: a scale that is not a power of two made XLA's CPU code (the kernels'
# interpret mode) give a row other bits in a masked tile than in a full one.
EX2_PTX = "ex2.approx.ftz.f32"


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """The static settings of one attention call (hashable: a jit static argument).

    scale: logit scale; softcap: ``c * tanh(s / c)`` on the scaled logits (None: off);
    window: a token at p sees keys p - window < j <= p (None: all earlier keys);
    split_size: keys are reduced in splits of this many tokens starting at absolute
    multiples of it - part of the numerics: a token's bits depend on it, never on the batch.
    """

    scale: float
    softcap: float | None = None
    window: int | None = None
    split_size: int = SPLIT_SIZE

    @classmethod
    def create(
        cls, head_dim: int, *, scale=None, sliding_window=None, logit_softcap=None, split_size=SPLIT_SIZE
    ):
        """Validated settings from the public arguments (clear errors naming the argument)."""
        check_positive_int("attention: split_size", split_size)
        if scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real)):
            raise TypeError(f"attention: scale must be a finite positive number, got {scale!r}")
        scale = float(head_dim**-0.5 if scale is None else scale)
        if not (np.isfinite(scale) and scale > 0):
            raise ValueError(f"attention: scale must be a finite positive number, got {scale!r}")
        if sliding_window is not None:
            check_positive_int("attention: sliding_window", sliding_window)
        if logit_softcap is not None:
            ok = isinstance(logit_softcap, numbers.Real) and not isinstance(logit_softcap, bool)
            if not ok or not (np.isfinite(logit_softcap) and logit_softcap > 0):
                raise ValueError(
                    f"attention: logit_softcap must be a finite positive number, got {logit_softcap!r}"
                )
        return cls(
            scale=scale,
            softcap=None if logit_softcap is None else float(logit_softcap),
            window=None if sliding_window is None else int(sliding_window),
            split_size=int(split_size),
        )

    def num_splits(self, max_context: int) -> int:
        """Splits covering ``max_context`` keys (a block table's capacity)."""
        return -(-max_context // self.split_size)


def kv_tile(block_size: int) -> int:
    """GPU: keys are read in tiles of this many tokens, starting at absolute multiples."""
    return max(MIN_KV_TILE, block_size)


def scores(s, spec: AttentionSpec, scale_mul=None):
    """Scaled (and soft-capped) logits from the raw q.k dots. ``scale_mul(s, scale)``: how the
    scaling product is formed (default ``*``; the GPU kernels' interpret mode passes
    ``rounded_product``)."""
    s = s * spec.scale if scale_mul is None else scale_mul(s, spec.scale)
    if spec.softcap is not None:
        s = spec.softcap * jnp.tanh(s / spec.softcap)
    return s


def exp(x, exp2):
    """e**x as ``exp2(x * log2 e)``: the one exponential of the online softmax and the fold
    (``exp2`` is 2**x: ``EX2_PTX`` in a GPU kernel, ``jnp.exp2`` on the CPU)."""
    return exp2(x * LOG2E)


def rounded_product(a, b):
    """``a * b`` rounded to float32 on its own, kept apart from whatever adds it later: the GPU
    kernels' logit scaling as their interpret mode runs it (``scale_mul``). XLA's CPU compiler
    contracts a product and a later subtraction into one fused multiply-add when nothing stands
    between them - and a select whose predicate is one scalar (a full tile's ``ok``) does not,
    being hoisted out of the loop: the full tiles' ``s * scale - m`` became one FMA while a
    masked tile's select kept two roundings, so at a scale that is not a power of two (head_dim
    128) a row got other bits in a full tile than in a masked one. On the GPU both tiles round
    twice (Mosaic GPU's ``mul.rn`` == Triton's bits, the H100 / H200 checks)."""
    return lax.optimization_barrier(a * b)


def key_mask(j, pos, ctx, window: int | None):
    """Key j is visible to a token at ``pos`` of a sequence with ``ctx`` cached tokens."""
    ok = (j <= pos) & (j < ctx)
    if window is not None:
        ok &= j > pos - window
    return ok


def key_range(pos, ctx, window: int | None, mine):
    """``key_mask`` as each row's range of visible keys: ``(first, last)``, key j visible iff
    first <= j <= last (``mine`` False: last = -1, nothing - keys are >= 0). The same set as
    ``key_mask(j, pos, ctx, window) & mine``, built once a row instead of once a key: a masked
    tile then needs one compare a key and side (the Mosaic GPU kernel's ``lean_mask``)."""
    last = jnp.where(mine, jnp.minimum(pos, ctx - 1), -1)
    first = None if window is None else pos - window + 1
    return first, last


def split_used(split: int, pos, spec: AttentionSpec):
    """Whether a token at ``pos`` has any visible key in ``split`` (False for padding)."""
    used = (pos >= 0) & (split * spec.split_size <= pos)
    if spec.window is not None:
        used &= (split + 1) * spec.split_size > pos - spec.window + 1
    return used


def used_splits(pos, spec: AttentionSpec, num_splits: int):
    """``split_used`` as a range: the splits ``[first, last)`` of ``num_splits`` that a token at
    ``pos`` uses (empty for padding). Split s is used iff s * split_size <= pos and, with a
    window, (s + 1) * split_size > pos - window + 1."""
    last = jnp.where(pos >= 0, jnp.minimum(pos // spec.split_size + 1, num_splits), 0)
    first = 0
    if spec.window is not None:
        first = jnp.clip((pos - spec.window + 1) // spec.split_size, 0, last)
    return first, last


def full_tiles(start, first, num_tiles, lo, hi, tile: int, window: int | None):
    """Of the KV tiles ``[first, num_tiles)`` of a split that starts at key ``start``, the range
    ``[a, b)`` whose every key is visible to every position in ``[lo, hi]`` (first <= a <= b <=
    num_tiles): keys <= lo and, with a window, > hi - window. The GPU kernels walk these without
    building a key mask (``walk_tiles``); the tiles before and after them keep the mask."""
    b = jnp.clip((lo + 1 - start) // tile, first, num_tiles)
    if window is None:
        return first, b
    return jnp.clip((hi - window - start) // tile + 1, first, b), b


def walk_tiles(first, full, num_tiles, masked, unmasked, state):
    """The online softmax over tiles ``first .. num_tiles - 1`` in tile order: ``masked(i, state)``
    outside ``full`` = (a, b) (``full_tiles``), ``unmasked(i, state)`` inside. The order of the
    tiles, and so the arithmetic, is the same as one masked loop."""
    a, b = full
    state = lax.fori_loop(first, a, masked, state)
    state = lax.fori_loop(a, b, unmasked, state)
    return lax.fori_loop(b, num_tiles, masked, state)


def expand(x, like):
    """``x`` [...] broadcast along the last axis of ``like`` [..., n]: an explicit broadcast (not
    ``x[..., None]``), which the Mosaic GPU kernel can lower too - the same arithmetic."""
    return lax.broadcast_in_dim(x, like.shape, tuple(range(x.ndim)))


def softmax_step(
    state,
    s,
    ok,
    spec: AttentionSpec,
    *,
    p_dtype,
    row_sum,
    pv=None,
    update=None,
    mul_add=None,
    sum_and_update=None,
    exp2,
    scale_mul=None,
    log2_scores=False,
    select_p=True,
    wide_sum=False,
):
    """The online-softmax step over one KV tile, from the raw q.k dots ``s`` [R, N]: the one
    definition of a tile's arithmetic outside the dots (``kv_tile_step`` is it with ``jnp.dot``;
    the Mosaic GPU kernel passes wgmma dots).

    ``ok`` [R, N]: the keys a row sees; None: every key (no select built - the same values, as
    long as nothing can fuse the logit scaling into the subtraction that follows it: pass a
    ``scale_mul`` that rounds the product on its own, as the Mosaic GPU kernel's full tiles do).

    ``row_sum(p)`` -> ``p @ ones[N, 16]``. The numerator: ``pv(p)`` -> ``p @ v``, and the new acc
    is ``acc * alpha + pv`` - or ``update(acc, alpha, p)`` computes the new acc itself (the Mosaic
    GPU kernel's variants). ``mul_add(a, b, c)``: how ``l * alpha + row_sum`` is computed
    (default: as written, the compiler may fuse it; Mosaic GPU can pass an explicit fused
    multiply-add). ``sum_and_update(acc, alpha, p)`` -> (``p @ ones``, the new acc): both dots
    at once (the Mosaic GPU kernel's one wait for both wgmmas), the same values as ``row_sum``
    then ``update``. ``exp2``: 2**x (``exp``'s; required, so that no kernel can fall back to
    another exponential). ``scale_mul``: as ``scores``'. ``select_p``: False leaves out
    the select of p at keys ``ok`` hides (the Mosaic GPU kernel's ``lean_mask``): their scores are
    already -inf, and exp of -inf minus a finite or +inf max is exactly +0, the select's value (a
    row whose max is NaN is NaN either way). ``wide_sum`` (with ``sum_and_update``): l is
    [R, 16], each column of ``p @ ones`` carried on its own (``l * alpha + sums`` column by
    column) and reduced by the caller once its walk ends (``jnp.max(l, axis=1)``) - the same
    values as the max each step, the columns being the same values (each the dot of p's row and
    a column of ones), without the per-tile reduction across a row's threads (the Mosaic GPU
    kernel's ``wide_sum``). ``log2_scores`` (a timing probe's, other
    bits): the logits are already in base 2 (log2 e folded into the scale), so each exponential
    is ``exp2`` of the difference, one multiply less. Without the Mosaic hooks the operations come in the order the Triton
    kernels always had (their lowered IR changes with ``exp2`` alone).
    """
    m, l, acc = state
    s = scores(s, spec, scale_mul)
    if ok is not None:
        s = jnp.where(ok, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    e = exp2 if log2_scores else functools.partial(exp, exp2=exp2)
    alpha = e(m - m_safe)
    p = e(s - expand(m_safe, s))
    if ok is not None and select_p:
        p = jnp.where(ok, p, 0.0)
    p = p.astype(p_dtype)
    if sum_and_update is not None:
        sums, acc = sum_and_update(acc, alpha, p)
        if wide_sum:
            alpha = expand(alpha, sums)
            return m_new, l * alpha + sums if mul_add is None else mul_add(l, alpha, sums), acc
        total = jnp.max(sums, axis=1)
        return m_new, l * alpha + total if mul_add is None else mul_add(l, alpha, total), acc
    numerator = None if update is not None else pv(p)
    # Every column of p @ ones is the row sum; max picks it exactly (16: the dot's least N).
    total = jnp.max(row_sum(p), axis=1)
    l = l * alpha + total if mul_add is None else mul_add(l, alpha, total)
    if update is not None:
        return m_new, l, update(acc, alpha, p)
    return m_new, l, acc * expand(alpha, acc) + numerator


def kv_tile_step(state, q, k, v, ok, spec: AttentionSpec, exp2, scale_mul=None):
    """One online-softmax step of query rows q [R, D] over a KV tile k, v [N, D]: the GPU
    kernels' inner loop (both call exactly this).

    ``state`` = (m [R], l [R], acc [R, D]) in fp32; ``ok`` [R, N] (or [1, N]): key visible to
    the row. Every row-wise sum is a dot, never a reduction written out: the dot's rows do not
    depend on the other rows (nor on how many there are), while a Triton ``sum`` over a tile
    adds in an order that follows the tile's shape and warps (measured on the H200: the row
    sum of p over 16-row and 64-row tiles differed in ~2% of tokens). So the probabilities'
    row sum is ``p @ 1`` (the same bf16 p the numerator ``p @ v`` uses) - ``max`` over a row
    is exact in any order. A tile a row sees nothing of leaves its state unchanged bit for bit:
    its p are exactly 0 and its rescale factor is 2**(0 * log2 e) = 1 exactly (probed on the
    GPU), so a row's bits do not depend on the other rows it shares a program with.
    ``v`` must already be zero at keys no row sees (stale cache rows cannot leak NaN).

    A tile whose keys all rows see (``full_tiles``) passes ``ok`` as a per-tile scalar broadcast
    that is true (not a constant, not the mask): the selects stay where they are, so the compiler
    sees the same operations as in a masked tile (no select removed, no new multiply-add to fuse)
    and only the mask's construction is saved. (The Mosaic GPU kernel's ``bare_full`` leaves
    them out, with the scaling as ``mul.rn``, which nothing fuses: see ``softmax_step``.)
    """
    hi = lax.Precision.HIGHEST

    def dot(a, b):
        return jnp.dot(a, b, precision=hi, preferred_element_type=jnp.float32)

    return softmax_step(
        state,
        dot(q, k.T),
        ok,
        spec,
        p_dtype=v.dtype,
        row_sum=lambda p: dot(p, jnp.ones((p.shape[1], 16), v.dtype)),
        pv=lambda p: dot(p, v),
        exp2=exp2,
        scale_mul=scale_mul,
    )


def fold_step(carry, state, use, mul_add=None, mul=None, *, exp2):
    """The left fold of split states, one split: ``carry`` = (m, l, acc, started) with m, l,
    started [...] and acc [..., D]; ``state`` = the split's (m, l, acc); ``use`` [...] bool:
    whether each row uses this split. A row's first used split starts its fold as it is; a
    later one is merged by the usual rescale. The one definition of the fold: the CPU path
    (``attention_cpu.attend``), the GPU split combiner and the GPU tile kernel all call it.

    Hooks (the Mosaic GPU kernel's roundings): the merge ``x * a + y * b`` is computed as
    ``mul_add(x, a, mul(y, b))`` when ``mul_add`` is given (``mul`` defaults to ``*``); without
    ``mul_add`` it is written as is and ``mul`` must be None. ``exp2``: as ``softmax_step``'s.
    """
    if mul_add is None and mul is not None:
        raise ValueError("fold_step: mul is used only with mul_add")
    fm, fl, facc, started = carry
    sm, sl, sacc = state
    mx = jnp.maximum(fm, sm)
    mx_safe = jnp.where(mx == -jnp.inf, 0.0, mx)
    a, b = exp(fm - mx_safe, exp2), exp(sm - mx_safe, exp2)
    # (the conditional expressions keep the default path's operations in their old order)
    sm = jnp.where(started, mx, sm)
    mul = (lambda x, y: x * y) if mul is None else mul  # noqa: E731 - hook: the Mosaic kernel's mul.rn
    sl = jnp.where(started, fl * a + sl * b if mul_add is None else mul_add(fl, a, mul(sl, b)), sl)
    sacc = jnp.where(
        expand(started, sacc),
        facc * expand(a, facc) + sacc * expand(b, sacc)
        if mul_add is None
        else mul_add(facc, expand(a, facc), mul(sacc, expand(b, sacc))),
        sacc,
    )
    fm, fl, facc = jnp.where(use, sm, fm), jnp.where(use, sl, fl), jnp.where(expand(use, sacc), sacc, facc)
    return fm, fl, facc, started | use


def fold_finish(carry):
    """The folded output: acc / l for rows that used any split, zeros otherwise (padding)."""
    _, fl, facc, started = carry
    return jnp.where(expand(started, facc), facc / expand(jnp.where(started, fl, 1.0), facc), 0.0)


PACKINGS = ("pow2", "dense")  # how a tile's rows hold tokens x query heads (``row_tiles``)


def tile_tokens(group: int, tile_rows: int, packing: str) -> tuple[int, int]:
    """(tokens a tile, rows a token) of ``row_tiles``' ``packing`` for a query-head group of
    ``group``: rows a token is the group padded to a power of two ("pow2"), or the group itself
    ("dense", where that is no power of two)."""
    gp = 1 << (group - 1).bit_length()
    if packing == "dense" and group != gp and group <= tile_rows:
        return tile_rows // group, group  # (``_dense_row_tiles``)
    return max(1, tile_rows // gp), gp


def row_tiles(qg, token_seq, token_pos, tile_rows: int, packing: str = "pow2"):
    """The ``tiles`` kernels' rows: q [T, Hkv, G, D] -> q [tiles, Hkv, rows, D], and each row's
    position and sequence [tiles, rows] (position -1: a padding token, padded head or padding
    row). Returns (q, rpos, rseq, unpack); ``unpack(out)`` maps [tiles, Hkv, rows, D] back to
    [T, Hkv, G, D].

    ``packing`` (a launch choice: a row's walk and arithmetic do not depend on where in a tile
    it sits): "pow2" - row r of a tile is token r // gp, query head r % gp, the group padded to
    a power of two gp (a group of 7 fills 56 of 64 rows, of 3 48); "dense" - row r is token
    r // G, head r % G, ``tile_rows // G`` tokens a tile and the rest padding rows (63 of 64
    for groups of 7 and 3). The two are the same where G is a power of two (or above
    ``tile_rows``: one token a tile, padded to gp rows)."""
    if packing not in PACKINGS:
        raise ValueError(f"attention tiles: packing must be one of {PACKINGS}, got {packing!r}")
    t, hkv, group, d = qg.shape
    tq, gp = tile_tokens(group, tile_rows, packing)  # tokens a tile, rows a token
    if gp == group != 1 << (group - 1).bit_length():  # dense packing of a group of 3, 7, ...
        return _dense_row_tiles(qg, token_seq, token_pos, tile_rows)
    rows = tq * gp
    nt = -(-t // tq)
    pad_t = nt * tq - t
    q = jnp.pad(qg, ((0, pad_t), (0, 0), (0, gp - group), (0, 0)))
    q = q.reshape(nt, tq, hkv, gp, d).transpose(0, 2, 1, 3, 4).reshape(nt, hkv, rows, d)
    head_real = (jnp.arange(gp) < group)[None, None, :]
    rpos = jnp.pad(token_pos, (0, pad_t), constant_values=-1).reshape(nt, tq, 1)
    rpos = jnp.where(head_real, rpos, -1).reshape(nt, rows)  # padded heads: padding rows
    rseq = jnp.broadcast_to(jnp.pad(token_seq, (0, pad_t)).reshape(nt, tq, 1), (nt, tq, gp)).reshape(nt, rows)

    def unpack(out):
        out = out.reshape(nt, hkv, tq, gp, d).transpose(0, 2, 1, 3, 4).reshape(nt * tq, hkv, gp, d)
        return out[:t, :, :group]

    return q, rpos, rseq, unpack


def _dense_row_tiles(qg, token_seq, token_pos, tile_rows: int):
    """``row_tiles``' "dense" packing: ``tile_rows // G`` tokens x G heads a tile, then padding
    rows (position -1, sequence 0, q zero)."""
    t, hkv, group, d = qg.shape
    tq = tile_tokens(group, tile_rows, "dense")[0]
    used = tq * group
    nt = -(-t // tq)
    pad_t = nt * tq - t
    q = jnp.pad(qg, ((0, pad_t), (0, 0), (0, 0), (0, 0)))
    q = q.reshape(nt, tq, hkv, group, d).transpose(0, 2, 1, 3, 4).reshape(nt, hkv, used, d)
    q = jnp.pad(q, ((0, 0), (0, 0), (0, tile_rows - used), (0, 0)))
    rpos = jnp.broadcast_to(
        jnp.pad(token_pos, (0, pad_t), constant_values=-1).reshape(nt, tq, 1), (nt, tq, group)
    ).reshape(nt, used)
    rpos = jnp.pad(rpos, ((0, 0), (0, tile_rows - used)), constant_values=-1)
    tseq = jnp.pad(token_seq, (0, pad_t)).reshape(nt, tq, 1)
    rseq = jnp.broadcast_to(tseq, (nt, tq, group)).reshape(nt, used)
    rseq = jnp.pad(rseq, ((0, 0), (0, tile_rows - used)))

    def unpack(out):
        out = out[:, :, :used].reshape(nt, hkv, tq, group, d).transpose(0, 2, 1, 3, 4)
        return out.reshape(nt * tq, hkv, group, d)[:t]

    return q, rpos, rseq, unpack
