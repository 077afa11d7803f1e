"""The GPU attention kernels (Pallas, Triton lowering).

Two kernels compute the same per-row arithmetic - ``attention_math.kv_tile_step`` over KV
tiles of ``kv_tile(block_size)`` keys at absolute multiples, one fp32 online-softmax state per
split of ``split_size`` keys, splits combined by ``attention_math.fold_step`` - and differ only
in how rows are grouped into programs:

* ``tokens`` (decode): one program per (token, KV head, split); the group of query heads that
  share the KV head forms the rows of the dot (padded to 16: by XLA in HBM, or in registers
  with ``DECODE_ROWS_IN_REGISTERS``). The states of the splits a token uses go through HBM to
  a small combine kernel that folds them (many splits in flight for few, long sequences); the
  grid's other programs store nothing.
* ``tiles`` (prefill chunks, mixed steps): one program per (tile of consecutive flat tokens,
  KV head) whose rows are the tile's tokens times their query heads. It walks every split
  its rows need and folds them in registers (no HBM round trip), and for each sequence in
  the tile reads that sequence's KV tiles once for all of its rows. A KV tile a row sees
  nothing of leaves the row's state unchanged bit for bit (``kv_tile_step``), and a dot's
  rows do not depend on the other rows, so a token's bits do not depend on which kernel or
  tile it lands in - ``benchmarks/attention.py`` checks it on the H200.

Both fold in Triton with the same function, so a token's output is the same operations in
the same order on either path (an XLA fold would be a different compiler, whose choice of
fused multiply-adds need not match the kernel's).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.attention_math import (
    EX2_PTX,
    AttentionSpec,
    fold_finish,
    fold_step,
    full_tiles,
    key_mask,
    kv_tile,
    kv_tile_step,
    rounded_product,
    row_tiles,
    split_used,
    used_splits,
    walk_tiles,
)

MIN_ROWS = 16  # the GPU dot needs at least 16 rows; the head group is padded to this
TILE_ROWS = 64  # rows (tokens x padded query heads) of a ``tiles`` program
GPU_KERNELS = ("auto", "tokens", "tiles", "tiles_mgpu")
# What "auto" runs for a prefill step on the GPU (``_prefill_kernel``): "tiles_mgpu" (Mosaic
# GPU) where it can run the call, else "tiles" (Triton) - the same bits: on the H200 the Mosaic
# kernel gave the Triton kernel's bits on every check of benchmarks/attention_mgpu.py (session
# 24) and the engine's digests MATCH with it (``benchmarks/gpu_digests.py --prefill-kernel
# tiles_mgpu``, 2026-12-02); 8 x 4096-token prompts prefill ~10% faster (benchmarks/ab.py).
# "tiles" here makes "auto" run Triton everywhere (the A/B switch).
PREFILL_KERNEL = "tiles_mgpu"
# How the Mosaic GPU prefill kernel launches: ``attention_mgpu.tiles_mgpu``'s arguments of that
# name (stages, consumers, order, one_drain, q_from_smem, packing) - launch choices, never the
# bits: its interpret-mode tests compare each with the default bit for bit on CPU, and on the
# H200 every launch gave the old default's bits (benchmarks/attention_mgpu.py launches; session
# 38, RESULTS.md). Since 2026-12-05 (session 38) the row tiles go heaviest first and query
# groups of 3 and 7 are packed densely (kernel time 0.85-0.93x the old default's at D 128, 0.71x
# at 9/3). Since session 42 a program is two consumer warpgroups and a producer, a tile's
# p @ ones and p @ v are waited for once, and the split fold's accumulator waits in SMEM (3
# stages: what fits at D 128; ``stages`` is lowered to what fits elsewhere): on an H100, same
# run, 0.91 / 0.92 / 1.00 / 0.94x the one-warpgroup launch's kernel time on 1 x 4096 (32/8,
# 28/4), 8 x 1024 and 9/3 D 64; the engine's 8 x 4096-token prefill the same (161.1-162.0 ms a
# step, alternated); every bit check of benchmarks/attention_mgpu.py launches PASSes and the
# engine's four digests equal the H200 records (RESULTS.md, session 42). Since session 43 the
# programs are persistent (one an SM, each running its (tile pair, KV head) items in snake
# order through one KV ring): on an H100, same run, 0.976 / 0.982 / 0.953 / 0.963x the session-42
# launch's kernel time on the same four cases; the ten bit checks PASS (run with round-robin
# items: snake order changes only which program runs an item) and the engine's four digests,
# with snake order, equal the H200 records (RESULTS.md, session 43). Session 44 ran it against
# the session-42 launch again (another H100 host): 1.04 / 1.04 / 0.98 / 0.98x before the ex2
# change, 0.99 / 0.99 / 0.96 / 1.02x after it - within a few percent either way. The A/B switch:
# benchmarks/ab.py prefill-launch (pair-all-dense-fold: the launch before). Since session 48
# a consumer also loads its next item's q at an item's start and stores its output by TMA from
# a buffer of its own (``prefetch_q``; the buffer leaves room for 2 ring stages at D 128, not
# 3): on an H100, same run, 0.977 / 0.992 / 0.984 / 0.978x the persistent launch's kernel time
# on the four cases above; its ten bit checks PASS and the engine's four digests with it equal
# the records (RESULTS.md, session 48; not yet run on an H200). The A/B switch's side before:
# pair-all-dense-fold-persistent. Since session 52 q and the output go by TMA straight from
# and into [T, Hkv, G, D], one copy a tile each way, instead of through XLA transposes
# (``direct_io``): on an H100, same run, 0.90x / 0.90x / 0.78x / 0.94x the launch before on
# 1 x 4096 32/8, 1 x 4096 28/4, 8 x 1024 28/4 and 1 x 4096 9/3 D 64 (1.54x / 1.57x / 1.99x /
# 1.69x cuDNN); the ten bit checks of ``attention_mgpu.py launches`` PASS and the engine's four
# digests with it equal the records (RESULTS.md, session 52; not yet run on an H200). (Session
# 51's form, a copy a token, was slower than the transposes at 16 and 21 tokens a tile.) The
# A/B switch's side before: pair-all-dense-fold-persistent-prefetch-q. Since session 53 the
# walk tables (XLA work before the kernel) come from each token's first row (``token_walk``):
# on an H100, same run, 0.99x / 0.98x / 0.96x / 0.99x the launch before on the four cases (the
# tables 18.4 -> 12.9, 22.9 -> 17.4, 31.1 -> 18.7, 18.1 -> 16.6 us); its ten bit checks PASS and
# the engine's four digests with it equal the records (RESULTS.md, session 53; not yet run on
# an H200). The A/B switch's side before: direct-io. Since session 56 the full KV tiles build
# no selects and the logit scaling is ``mul.rn`` in every tile (``bare_full``, the same values):
# on an H100, same run, 0.937x / 0.938x / 0.956x / 0.918x the launch before on the four cases
# (1.42x / 1.47x / 1.81x / 1.55x cuDNN); its ten bit checks PASS (RESULTS.md, session 56) and
# the engine's four digests with it equal the records (H100, session 57; not yet run on an
# H200). Since session 57 the masked tiles build the key mask from each row's key range and
# leave out the select of p (``lean_mask``), and a walk carries the row sums' 16 columns apart
# until the split's fold (``wide_sum``) - the same values: on an H100, 0.98x / 0.98x / 0.95x /
# 0.93x the launch before on the four cases (each step timed against the one before in one
# run; 1.38x / 1.44x / 1.71x / 1.44x cuDNN); both PASS the ten bit checks and the engine's
# digests with them equal the records (RESULTS.md, session 57; not yet run on an H200). The
# A/B switch's side before: bare-full. Since session 60 each item's launch-order entry and walk
# length are read from GMEM an item ahead (``early_reads``): on an H100, two runs, 0.993 /
# 0.994-0.999 / 0.988-0.990 / 1.004-1.007x the launch before on the four cases (1.41x / 1.45x /
# 1.69x / 1.45x cuDNN); its ten bit checks PASS and the engine's four digests with it equal the
# records (RESULTS.md, session 60; not yet run on an H200). The A/B switch's side before:
# lean-wide.
MGPU_PREFILL_LAUNCH = (
    ("stages", 3),
    ("consumers", 2),
    ("order", "heaviest"),
    ("one_drain", True),
    ("packing", "dense"),
    ("fold_in_smem", True),
    ("persistent", True),
    ("prefetch_q", True),
    ("direct_io", True),
    ("token_walk", True),
    ("bare_full", True),
    ("lean_mask", True),
    ("wide_sum", True),
    ("early_reads", True),
)
# The decode kernel stores, and its combine folds, only the splits a token uses (same bits:
# the others leave the fold unchanged). False: every split of the grid, as before 2026-12-02
# (the A/B switch of benchmarks/ab.py).
STORE_USED_SPLITS_ONLY = True
# True (the default): the decode kernel pads the query-head group to the dot's 16 rows in
# registers (masked loads) and stores, combines and returns only the group's rows. False: q
# padded in HBM by an XLA pad, 16 rows stored and combined, the output sliced by XLA - the
# kernels of before 2026-12-02 op for op. The same bits either way (a dot's rows do not depend
# on the other rows, and q's padding rows are zeros either way; the padding rows' states differ
# but never reach the output). Alone (a program per split) it was 8-40% faster where a token's
# splits are all used, but slower in the engine at max_model_len 8192, where most of that grid
# is idle (RESULTS.md session 27); with lanes (below) it is the fastest of the four variants in
# every case (session 28: 1.1-2.5x the old kernel's speed, the engine-shaped 16-split cases
# included). The A/B switch of benchmarks/ab.py decode-rows / decode-kernel.
DECODE_ROWS_IN_REGISTERS = True
# An int (the default 1024): about that many decode programs in all - (token, KV head, lane)
# with ``decode_lanes`` lanes a (token, head), each walking its used splits lane, lane + lanes,
# ... one after another. None: one program per split of the block table's capacity (16 a token
# at max_model_len 8192, most with nothing to do). Each split is reduced by the same code and
# stored at its own index, so the states are the same either way (CPU tests; on the H200 the
# four variants' outputs are bit-identical, session 28). The A/B switch of benchmarks/ab.py
# decode-lanes / decode-kernel.
DECODE_PROGRAMS = 1024
# A decode launch of few tokens is latency-bound (each program walks its splits' KV tiles one
# after another): 5 pipeline stages took the H200's tokens + combine time 11-21% down at 1-4
# tokens x 4-8 KV heads, and cost the bandwidth-bound batches 2-7% (32 x 3000 at 28 / 4 heads:
# 1.7%; 64 tokens: 7%) (RESULTS.md session 39; every launch the default's bits). So a launch of
# up to this many tokens - the engine's smallest decode bucket, one to 16 streams - over a 2-byte
# cache (what was measured; a float32 cache's tiles are twice the shared memory a stage) takes
# DECODE_FEW_STAGES, any other 2. A launch choice: the same bits. 0: 2 stages everywhere
# (benchmarks/ab.py decode-stages).
DECODE_FEW_TOKENS = 16
DECODE_FEW_STAGES = 5
_BIG = 2**30


def _padded_rows(group: int) -> int:
    """The rows of a decode program's dot: the query-head group padded to a power of two, at
    least ``MIN_ROWS``."""
    return max(MIN_ROWS, pl.next_power_of_2(group))


def _row_mask(rows: int, group: int, ndim: int):
    """Which of ``rows`` padded rows are the group's: [rows] or [rows, 1] (for 2-D blocks)."""
    mask = jnp.arange(rows) < group
    return mask[:, None] if ndim == 2 else mask


def _row_load(ref, rows: int, *lead):
    """``ref[*lead]``'s leading axis (a head group) read as ``rows`` rows, the rows past it
    zeros: the dot's padding, made in registers (no padded copy of q in HBM). A block that
    has the rows already (padded in HBM) is read as it is."""
    group, ndim = ref.shape[len(lead)], len(ref.shape) - len(lead)
    if group == rows:
        return ref[lead] if lead else ref[...]
    return pltriton.load(ref.at[(*lead, pl.ds(0, rows))], mask=_row_mask(rows, group, ndim), other=0.0)


def _row_store(ref, value, *lead):
    """The leading ``ref[*lead].shape[0]`` rows of ``value`` (a padded group's real rows) into
    ``ref[*lead]``."""
    rows, group = value.shape[0], ref.shape[len(lead)]
    if group == rows:
        if lead:
            ref[lead] = value.astype(ref.dtype)
        else:
            ref[...] = value.astype(ref.dtype)
        return
    mask = _row_mask(rows, group, value.ndim)
    pltriton.store(ref.at[(*lead, pl.ds(0, rows))], value.astype(ref.dtype), mask=mask)


def decode_lanes(num_tokens: int, hkv: int, num_splits: int, programs: int | None) -> int:
    """Programs a (token, KV head) gets in the decode grid: one per split (``programs`` None), or
    enough that the grid has about ``programs`` programs, at most one per split."""
    if programs is None:
        return num_splits
    return max(1, min(num_splits, -(-programs // (num_tokens * hkv))))


def decode_stages(num_tokens: int, cache_dtype) -> int:
    """The tokens kernel's pipeline stages for a launch of ``num_tokens`` tokens over a cache of
    ``cache_dtype`` (``DECODE_FEW_TOKENS``)."""
    few = num_tokens <= DECODE_FEW_TOKENS and jnp.dtype(cache_dtype).itemsize == 2
    return DECODE_FEW_STAGES if few else 2


def _exp2(interpret: bool):
    """The kernels' 2**x (``attention_math.EX2_PTX``): that instruction as inline assembly on the
    GPU; ``jnp.exp2`` in interpret mode (the interpreter runs no PTX)."""
    if interpret:
        return jnp.exp2

    def ex2(x):
        [y] = pltriton.elementwise_inline_asm(
            f"{EX2_PTX} $0, $1;",
            args=[x],
            constraints="=f,f",
            pack=1,
            result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)],
        )
        return y

    return ex2


def _scale_mul(interpret: bool):
    """The logit scaling's product: ``*`` on the GPU (the lowered kernels are unchanged);
    ``attention_math.rounded_product`` in interpret mode, so that XLA's CPU compiler rounds it
    in every tile as the GPU does (it fused it into the full tiles' subtraction)."""
    return rounded_product if interpret else None


def _walk_args(spec: AttentionSpec, block_size: int, block_tables, bulk: bool, interpret: bool) -> dict:
    """The keyword arguments the tokens and tiles kernels share: the walk's settings and the
    tile step's hooks (``_exp2``, ``_scale_mul``) for this mode."""
    return dict(
        spec=spec,
        block_size=block_size,
        max_blocks=block_tables.shape[1],
        bulk=bulk,
        exp2=_exp2(interpret),
        scale_mul=_scale_mul(interpret),
    )


def _empty_state(rows: int, d: int):
    return (
        jnp.full((rows,), -jnp.inf, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
        jnp.zeros((rows, d), jnp.float32),
    )


def _all_visible(start, i, tile: int, lo):
    """``ok`` of a tile all of whose keys are visible: true, as a per-tile scalar broadcast
    (see ``kv_tile_step``: the selects stay, the mask is not built)."""
    return jnp.broadcast_to(start + (i + 1) * tile <= lo + 1, (1, tile))


def _load_kv(k_ref, v_ref, bt_ref, seq, tile_start, *, block_size: int, max_blocks: int, d: int):
    """The KV tile of ``kv_tile(block_size)`` keys starting at ``tile_start`` of sequence ``seq``.

    From the cache's page view [num_blocks, block_size, D]: whole pages, reshaped to the tile;
    from its row view [num_blocks * block_size, D] (``_cache_view``): one row per key, gathered
    straight into the tile's shape. The same values either way."""
    tile = kv_tile(block_size)
    if len(k_ref.shape) == 2:
        j = tile_start + jnp.arange(tile)
        row = bt_ref[seq, jnp.minimum(j // block_size, max_blocks - 1)] * block_size + j % block_size
        return k_ref[row], v_ref[row]
    page = jnp.minimum(tile_start // block_size + jnp.arange(tile // block_size), max_blocks - 1)
    phys = bt_ref[seq, page]
    return k_ref[phys].reshape(tile, d), v_ref[phys].reshape(tile, d)


def _cache_view(k_cache, v_cache, row_loads: bool):
    """(k, v, BlockSpec) of the caches as one grid program (KV head = grid axis 1) reads them:
    pages [num_blocks, block_size, D], or with ``row_loads`` (block_size below the KV tile) rows
    [num_blocks * block_size, D] - a free reshape of the same memory."""
    num_blocks, block_size, hkv, d = k_cache.shape
    if row_loads and block_size < kv_tile(block_size):
        rows = (num_blocks * block_size, hkv, d)
        spec = pl.BlockSpec((rows[0], pl.squeezed, d), lambda i, h, *_: (0, h, 0))
        return k_cache.reshape(rows), v_cache.reshape(rows), spec
    spec = pl.BlockSpec((num_blocks, block_size, pl.squeezed, d), lambda i, h, *_: (0, 0, h, 0))
    return k_cache, v_cache, spec


# --------------------------------------------------------------------------- tokens: decode


def _tokens_kernel(
    seq_ref, pos_ref, ctx_ref, bt_ref, q_ref, k_ref, v_ref, m_out, l_out, acc_out,
    *, spec: AttentionSpec, block_size: int, max_blocks: int, bulk: bool, exp2, scale_mul,
    lanes: int | None = None,
):  # fmt: skip
    """One (token, KV head, split): the fp32 softmax state of the split, for the group's rows.
    With ``lanes``: one (token, KV head, lane), each of its splits in turn (``DECODE_PROGRAMS``)."""
    t, split_or_lane = pl.program_id(0), pl.program_id(2)
    seq, pos = jnp.maximum(seq_ref[t], 0), pos_ref[t]
    ctx = ctx_ref[seq]
    kw = dict(
        spec=spec, block_size=block_size, max_blocks=max_blocks, bulk=bulk, exp2=exp2, scale_mul=scale_mul
    )
    if lanes is None:
        _one_split(
            split_or_lane, (), seq, pos, ctx, q_ref, None, bt_ref, k_ref, v_ref, m_out, l_out, acc_out, **kw
        )
        return
    q = _row_load(q_ref, _padded_rows(q_ref.shape[0]))  # once for all of the lane's splits
    lane, num_splits = split_or_lane, m_out.shape[0]
    first, last = used_splits(pos, spec, num_splits) if STORE_USED_SPLITS_ONLY else (0, num_splits)
    # this lane's splits in [first, last): lane + i * lanes for i in [lo, hi)
    lo, hi = (jnp.maximum(first - lane, 0) + lanes - 1) // lanes, (last - lane + lanes - 1) // lanes

    def body(i, carry):
        split = lane + i * lanes
        _one_split(
            split, (split,), seq, pos, ctx, q_ref, q, bt_ref, k_ref, v_ref, m_out, l_out, acc_out, **kw
        )
        return carry

    lax.fori_loop(lo, hi, body, 0)  # (none where hi <= lo: a lane with no used split)


def _one_split(
    split, lead, seq, pos, ctx, q_ref, q, bt_ref, k_ref, v_ref, m_out, l_out, acc_out,
    *, spec: AttentionSpec, block_size: int, max_blocks: int, bulk: bool, exp2, scale_mul,
):  # fmt: skip
    """The state of one split of one (token, KV head), stored at ``m_out[*lead]`` etc. where the
    combine reads it; ``q`` the group's rows padded (None: read here from ``q_ref``)."""
    group, d = q_ref.shape
    rows = _padded_rows(group)
    tile = kv_tile(block_size)
    start = split * spec.split_size
    if q is None:
        q = _row_load(q_ref, rows)
    # Tiles of this split that hold keys the token may see (none for padding tokens).
    num_tiles = (jnp.clip(pos + 1 - start, 0, spec.split_size) + tile - 1) // tile
    first = 0
    if spec.window is not None:
        first = jnp.clip((pos - spec.window + 1 - start) // tile, 0, num_tiles)

    def load(i):
        return _load_kv(
            k_ref, v_ref, bt_ref, seq, start + i * tile, block_size=block_size, max_blocks=max_blocks, d=d
        )

    def masked(i, state):
        k, v = load(i)
        ok = key_mask(start + i * tile + jnp.arange(tile), pos, ctx, spec.window)
        v = jnp.where(ok[:, None], v, 0.0)
        return kv_tile_step(state, q, k, v, ok[None, :], spec, exp2, scale_mul)

    def unmasked(i, state):  # every key visible (full_tiles)
        k, v = load(i)
        return kv_tile_step(state, q, k, v, _all_visible(start, i, tile, pos), spec, exp2, scale_mul)

    if bulk:
        full = full_tiles(start, first, num_tiles, pos, pos, tile, spec.window)
        m, l, acc = walk_tiles(first, full, num_tiles, masked, unmasked, _empty_state(rows, d))
    else:
        m, l, acc = lax.fori_loop(first, num_tiles, masked, _empty_state(rows, d))

    # Only the splits the combine folds are stored: a split the token sees nothing of (padding
    # tokens, splits past the token, before its window) is never read. With a long
    # max_model_len most of the grid is such splits, and their stores were most of the traffic.
    def store():
        _row_store(m_out, m, *lead)
        _row_store(l_out, l, *lead)
        _row_store(acc_out, acc, *lead)

    if STORE_USED_SPLITS_ONLY and not lead:  # (a lane walks only used splits)
        pl.when(split_used(split, pos, spec))(store)
    else:
        store()


def _combine_kernel(pos_ref, m_ref, l_ref, acc_ref, o_ref, *, spec: AttentionSpec, exp2):
    """One (token, KV head): the left fold of its split states. It reads only the splits the
    token uses (``used_splits``; the others were not stored, and folding them would leave the
    state unchanged - ``fold_step`` with ``use`` False)."""
    pos = pos_ref[pl.program_id(0)]
    splits, group, d = acc_ref.shape
    rows = _padded_rows(group)  # (the states' rows already, where the group was padded in HBM)

    def body(s, carry):
        use = jnp.broadcast_to(split_used(s, pos, spec), (rows,))
        split = (_row_load(m_ref, rows, s), _row_load(l_ref, rows, s), _row_load(acc_ref, rows, s))
        return fold_step(carry, split, use, exp2=exp2)

    init = _empty_state(rows, d) + (jnp.zeros((rows,), bool),)
    first, last = (0, splits) if not STORE_USED_SPLITS_ONLY else used_splits(pos, spec, splits)
    _row_store(o_ref, fold_finish(lax.fori_loop(first, last, body, init)))


def token_states(
    qg,
    k_cache,
    v_cache,
    index,
    *,
    spec: AttentionSpec,
    interpret: bool,
    num_warps: int = 2,
    num_stages: int = 2,
    bulk: bool = True,
    row_loads: bool = True,
):
    """The ``tokens`` kernel's per-split states m, l [T, Hkv, S, G'], acc [T, Hkv, S, G', D]:
    G' = the group G with ``DECODE_ROWS_IN_REGISTERS``, else G padded to the dot's rows."""
    block_tables, context_lens, token_seq, token_pos = index
    if not DECODE_ROWS_IN_REGISTERS:  # the A/B switch's old side: the group padded in HBM
        rows = _padded_rows(qg.shape[2])
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, rows - qg.shape[2]), (0, 0)))
    t, hkv, group, d = qg.shape
    block_size = k_cache.shape[1]
    num_splits = spec.num_splits(block_tables.shape[1] * block_size)
    lanes = decode_lanes(t, hkv, num_splits, DECODE_PROGRAMS)
    walk = DECODE_PROGRAMS is not None  # programs walk several splits (lanes), or one each
    whole = lambda a: pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)
    k_view, v_view, cache = _cache_view(k_cache, v_cache, row_loads)
    if walk:  # a program per lane: every split of its (token, KV head), stored at the split's index
        state = lambda *shape: pl.BlockSpec(
            (pl.squeezed, pl.squeezed, num_splits) + shape, lambda i, h, s: (i, h, 0) + (0,) * len(shape)
        )
    else:  # a program per split: its block of the states
        state = lambda *shape: pl.BlockSpec(
            (pl.squeezed, pl.squeezed, pl.squeezed) + shape, lambda i, h, s: (i, h, s) + (0,) * len(shape)
        )
    f32 = jnp.float32
    m, l, acc = pl.pallas_call(
        functools.partial(
            _tokens_kernel,
            **_walk_args(spec, block_size, block_tables, bulk, interpret),
            lanes=lanes if walk else None,
        ),
        grid=(t, hkv, lanes),
        in_specs=[
            whole(token_seq),
            whole(token_pos),
            whole(context_lens),
            whole(block_tables),
            pl.BlockSpec((pl.squeezed, pl.squeezed, group, d), lambda i, h, s: (i, h, 0, 0)),
            cache,
            cache,
        ],
        out_specs=[state(group), state(group), state(group, d)],
        out_shape=[
            jax.ShapeDtypeStruct((t, hkv, num_splits, group), f32),
            jax.ShapeDtypeStruct((t, hkv, num_splits, group), f32),
            jax.ShapeDtypeStruct((t, hkv, num_splits, group, d), f32),
        ],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="bijax_attention",
    )(token_seq, token_pos, context_lens, block_tables, qg, k_view, v_view)
    return m, l, acc


def combine(m, l, acc, token_pos, *, spec: AttentionSpec, interpret: bool, dtype):
    """The ``tokens`` kernel's split states -> normalised output [T, Hkv, G', D] in ``dtype``
    (G' as in ``token_states``)."""
    t, hkv, num_splits, group, d = acc.shape
    states = lambda *shape: pl.BlockSpec(
        (pl.squeezed, pl.squeezed) + shape, lambda i, h: (i, h) + (0,) * len(shape)
    )
    return pl.pallas_call(
        functools.partial(_combine_kernel, spec=spec, exp2=_exp2(interpret)),
        grid=(t, hkv),
        in_specs=[
            pl.BlockSpec(token_pos.shape, lambda i, h: (0,)),
            states(num_splits, group),
            states(num_splits, group),
            states(num_splits, group, d),
        ],
        out_specs=states(group, d),
        out_shape=jax.ShapeDtypeStruct((t, hkv, group, d), dtype),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="bijax_attention_combine",
    )(token_pos, m, l, acc)


# --------------------------------------------------------------------------- tiles: prefill


def _tiles_kernel(
    rseq_ref, rpos_ref, ctx_ref, bt_ref, q_ref, k_ref, v_ref, o_ref,
    *, spec: AttentionSpec, block_size: int, max_blocks: int, bulk: bool, exp2, scale_mul,
):  # fmt: skip
    """One (tile of rows, KV head): every split its rows use, folded in registers."""
    rows, d = q_ref.shape
    tile = kv_tile(block_size)
    ss, window = spec.split_size, spec.window
    q = q_ref[...]
    rseq, rpos = rseq_ref[...], rpos_ref[...]

    def more(c):
        return jnp.max(c[0].astype(jnp.int32)) > 0

    def one_sequence(c):  # the rows of one sequence (the smallest index left)
        remaining, carry = c[0], c[1:]
        seq = jnp.min(jnp.where(remaining, rseq, _BIG))
        mine = remaining & (rseq == seq)
        hi = jnp.max(jnp.where(mine, rpos, -1))
        lo = jnp.min(jnp.where(mine, rpos, _BIG))
        ctx = ctx_ref[seq]
        first_split = 0 if window is None else jnp.maximum(lo - window + 1, 0) // ss

        def one_split(split, carry):
            start = split * ss
            num_tiles = (jnp.clip(hi + 1 - start, 0, ss) + tile - 1) // tile
            first = 0
            if window is not None:
                first = jnp.clip((lo - window + 1 - start) // tile, 0, num_tiles)

            def load(i):
                return _load_kv(
                    k_ref,
                    v_ref,
                    bt_ref,
                    seq,
                    start + i * tile,
                    block_size=block_size,
                    max_blocks=max_blocks,
                    d=d,
                )

            def masked(i, state):
                k, v = load(i)
                j = start + i * tile + jnp.arange(tile)
                ok = key_mask(j[None, :], rpos[:, None], ctx, window) & mine[:, None]
                seen = key_mask(j, hi, ctx, None)  # keys some row of this sequence may see
                if window is not None:
                    seen &= j > lo - window
                v = jnp.where(seen[:, None], v, 0.0)
                return kv_tile_step(state, q, k, v, ok, spec, exp2, scale_mul)

            def unmasked(i, state):  # every key visible to every row of this sequence (full_tiles);
                k, v = load(i)  # other rows' states of this pass are dropped by the fold (use)
                return kv_tile_step(state, q, k, v, _all_visible(start, i, tile, lo), spec, exp2, scale_mul)

            empty = _empty_state(rows, d)
            if bulk:
                full = full_tiles(start, first, num_tiles, lo, hi, tile, window)
                state = walk_tiles(first, full, num_tiles, masked, unmasked, empty)
            else:
                state = lax.fori_loop(first, num_tiles, masked, empty)
            return fold_step(carry, state, split_used(split, rpos, spec) & mine, exp2=exp2)

        carry = lax.fori_loop(first_split, hi // ss + 1, one_split, carry)
        return (remaining & ~mine, *carry)

    init = (rpos >= 0, *_empty_state(rows, d), jnp.zeros((rows,), bool))
    carry = lax.while_loop(more, one_sequence, init)[1:]
    o_ref[...] = fold_finish(carry).astype(o_ref.dtype)


def _tiles(
    qg, k_cache, v_cache, index, *, spec: AttentionSpec, interpret: bool, tile_rows: int, num_warps: int,
    num_stages: int, bulk: bool, row_loads: bool, packing: str,
):  # fmt: skip
    block_tables, context_lens, token_seq, token_pos = index
    hkv, d = qg.shape[1], qg.shape[3]
    q, rpos, rseq, unpack = row_tiles(qg, token_seq, token_pos, tile_rows, packing)
    nt, rows = rpos.shape
    block_size = k_cache.shape[1]
    whole = lambda a: pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)
    per_tile = pl.BlockSpec((pl.squeezed, rows), lambda i, h: (i, 0))
    k_view, v_view, cache = _cache_view(k_cache, v_cache, row_loads)
    block = pl.BlockSpec((pl.squeezed, pl.squeezed, rows, d), lambda i, h: (i, h, 0, 0))
    out = pl.pallas_call(
        functools.partial(_tiles_kernel, **_walk_args(spec, block_size, block_tables, bulk, interpret)),
        grid=(nt, hkv),
        in_specs=[per_tile, per_tile, whole(context_lens), whole(block_tables), block, cache, cache],
        out_specs=block,
        out_shape=jax.ShapeDtypeStruct((nt, hkv, rows, d), qg.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="bijax_attention_tiles",
    )(rseq, rpos, context_lens, block_tables, q, k_view, v_view)
    return unpack(out)


def _prefill_kernel(qg, k_cache, spec: AttentionSpec) -> str:
    """The kernel "auto" runs for a prefill step on the GPU: PREFILL_KERNEL where it can run the
    call under ``MGPU_PREFILL_LAUNCH`` (Mosaic GPU: a Hopper GPU, bf16 / f16, head_dim 64 / 128,
    no softcap, pages whose KV tiles fit that launch's shared memory: up to 64 tokens at D 128
    with the pair launch's folds, 128 with one warpgroup), else the Triton ``tiles`` kernel - the
    same bits either way."""
    if PREFILL_KERNEL != "tiles_mgpu":
        return "tiles"
    from pallas_kernels import attention_mgpu

    ok = attention_mgpu.can_run(
        qg.dtype,
        qg.shape[-1],
        spec,
        block_size=k_cache.shape[1],
        group=qg.shape[2],
        launch=MGPU_PREFILL_LAUNCH,
    )
    return "tiles_mgpu" if ok else "tiles"


def attend(
    qg,
    k_cache,
    v_cache,
    index,
    *,
    spec: AttentionSpec,
    interpret: bool,
    kernel: str = "auto",
    tile_rows: int = TILE_ROWS,
    num_warps: int | None = None,
    num_stages: int | None = None,
    bulk: bool = True,
    row_loads: bool = True,
    packing: str = "pow2",
):
    """q [T, Hkv, G, D] -> normalised output [T, Hkv, G, D] in q's dtype.

    ``kernel``: "tokens", "tiles", or "auto" - tiles when the step has more tokens than
    sequence rows (prefill chunks), tokens otherwise (decode). Same bits either way on the GPU.
    In interpret mode (CPU) "auto" is always "tokens": there each block's dot is the CPU's,
    whose bits depend on the row count, so the two kernels agree only to rounding.
    The rest are launch choices, never the bits (benchmarks/attention.py checks each on the
    H200 and times them, RESULTS.md 2026-12-01):
    ``num_warps`` (tokens: 2, tiles: 4), ``num_stages`` (tokens: ``decode_stages``, tiles: 3),
    ``tile_rows``;
    ``bulk``: walk the tiles whose keys every row sees without building their mask
    (``full_tiles``; prefill 11-28% faster; decode 1-5% faster with row loads, but 26% slower
    with page loads); ``row_loads``: gather a KV tile's keys row by row into the tile instead
    of whole pages reshaped into it (block sizes below 64; decode 64 x 4096 1.24x faster,
    prefill 5%); ``packing`` (the Triton ``tiles`` kernel only; the Mosaic one takes it from
    ``MGPU_PREFILL_LAUNCH``): how a tile's rows hold tokens x query heads
    (``attention_math.row_tiles``: "pow2" or "dense").
    """
    block_tables = index[0]
    if kernel == "auto":
        prefill = qg.shape[0] > block_tables.shape[0] and not interpret
        kernel = _prefill_kernel(qg, k_cache, spec) if prefill else "tokens"
    if packing != "pow2" and kernel != "tiles":  # (the Mosaic kernel's comes from MGPU_PREFILL_LAUNCH)
        raise ValueError(f"attention: packing={packing!r} is a launch choice of the Triton tiles kernel only")
    if kernel == "tiles_mgpu":  # "auto" picks it where PREFILL_KERNEL says so
        # (imported here: Mosaic GPU's modules take ~0.3 s to import, paid only by who uses it)
        from jax.experimental.pallas import mosaic_gpu as plgpu

        from pallas_kernels import attention_mgpu

        if interpret:  # the interpreter has neither mul.rn nor a wgmma into a given accumulator
            kw = {"interpret": plgpu.InterpretGPUParams(), "pv": "add", "rounding": "compiler"}
        else:
            kw = {"pv": "into", "rounding": "two"}  # the Triton kernels' bits on the H200
        kw.update(MGPU_PREFILL_LAUNCH)
        return attention_mgpu.tiles_mgpu(qg, k_cache, v_cache, index, spec=spec, **kw)
    if kernel == "tokens":
        states = token_states(
            qg,
            k_cache,
            v_cache,
            index,
            spec=spec,
            interpret=interpret,
            num_warps=num_warps or 2,
            num_stages=num_stages or decode_stages(qg.shape[0], k_cache.dtype),
            bulk=bulk,
            row_loads=row_loads,
        )
        out = combine(*states, index[3], spec=spec, interpret=interpret, dtype=qg.dtype)
        return out[:, :, : qg.shape[2]]  # (the A/B switch's old side: its padding rows)
    return _tiles(
        qg,
        k_cache,
        v_cache,
        index,
        spec=spec,
        interpret=interpret,
        tile_rows=tile_rows,
        num_warps=num_warps or 4,
        num_stages=num_stages or 3,
        bulk=bulk,
        row_loads=row_loads,
        packing=packing,
    )
