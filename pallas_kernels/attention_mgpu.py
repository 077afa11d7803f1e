"""Mosaic GPU (Hopper: wgmma, TMA) version of the attention ``tiles`` kernel - meant to give the
same bits as the Triton one (``attention_triton``), faster.

The rows and the walk are the Triton ``tiles`` kernel's: a program takes a tile of 64 rows
(consecutive flat tokens x their padded query-head group, ``attention_math.row_tiles``) and one
KV head; for each sequence in the tile (its "segments", ascending), every split its rows use, and
in each split the KV tiles of ``kv_tile(block_size)`` keys in ascending order, with the tiles
whose every key every row of the sequence sees (``full_tiles``) taken without building the key
mask. The arithmetic per KV tile is ``attention_math.softmax_step`` - the Triton kernel's own
function - with wgmma dots: ``q @ k.T``, ``p @ v`` and the row sum ``p @ ones`` as chains of k16
wgmma steps in ascending K, like Triton's Hopper dot; splits fold with ``fold_step``.

What differs is the machinery:

* K/V tiles arrive by TMA, one copy per cache page (a 64-key tile of 16-token blocks is four
  copies straight from the paged cache), into a ring of ``stages`` SMEM slots. The walk is
  dynamic (segments, splits, window), so the prefetch runs a second cursor over the same walk,
  ``stages - 1`` tiles ahead of the compute (``_Walk.advance``); a slot is refilled only after
  the step that read it has finished its wgmmas.
* q stays in registers (wgmma's A operand), so a program needs only the ring, the ones matrix
  and no q buffer: at 3 stages two programs fit an SM, and the warp schedulers overlap one
  program's softmax with the other's wgmmas.
* V rows no row of the tile sees are zeroed in SMEM (a masked tile only), as the Triton kernel
  zeroes them in registers: stale cache rows cannot leak NaN through ``0 * v``.
* ``overlap``: each step issues the next tile's ``q @ k.T`` wgmma before its own softmax, so the
  tensor cores work while the CUDA cores do the exps (FlashAttention-3's intra-warpgroup
  overlap); the same operations either way.

Launch choices (``tiles_mgpu``'s ``consumers``, ``order`` and ``packing``; never the bits): with
``consumers=2`` a program is FlashAttention-3-shaped - two compute warpgroups, each on its own
64-row tile, walk the union of their tiles' walks (a row's extra tiles and splits are exact
no-ops for it, as for the rows of one tile), and a producer warpgroup issues the block-table
reads and the TMA loads; a slot is refilled once both consumers have arrived on its "consumed"
barrier. One program per SM, so each KV tile in shared memory serves 128 rows. ``order=
"heaviest"`` launches the programs with the most keys to walk first. ``packing="dense"``
puts 9 tokens of a 7-head group (21 of a 3-head group) in a tile's 64 rows instead of 8 (16)
with the group padded to a power of two: fewer tiles for the same rows. ``fold_in_smem`` keeps
the split fold's fp32 accumulator in shared memory between folds instead of 64 registers a
thread: no launch spills then (session 41, H100); it made the pair launch 2.6% faster at D 128
(session 42). In interpret mode all give the default launch's bits (tests), and on the H200
every one gave the bits of the launch measured since session 24 (2026-12-05, RESULTS.md; the
fold launches on an H100, session 42). The engine's launch (``attention_triton.
MGPU_PREFILL_LAUNCH``) is, since session 42, the pair: two consumers, heaviest first, one
drain, dense rows, the fold in SMEM; since session 43 with persistent programs (``persistent``:
one an SM, each running its (tile pair, KV head) items through one ring); since session 48
with ``prefetch_q`` (a consumer loads its next item's q while it walks the current one).

Status: runs in Mosaic GPU interpret mode on CPU (the tests: accuracy, NaN-filled stale cache,
padding, a token's bits alone / in chunks / among other sequences, ``overlap`` and stages as
launch choices) and lowers for CUDA (interpret mode has no wgmma with A in registers, so there q
and p go through SMEM). On the H200 (session 24, ``benchmarks/attention_mgpu.py``, RESULTS.md)
the variant ``pv="into", rounding="two"`` (the defaults) gives the Triton ``tiles`` kernel's bits
on every check that script runs (one / two tiles, two splits, a chunk among decode tokens ==
the ``tokens`` kernel, 2 / 3 stages, overlapped scores, a window, 28/4 and 9/3 heads, D 64,
64-token pages, a whole 4096-token prompt), and its prefill kernel time is 0.81-0.96x Triton's
(2.3-3.1x cuDNN's). ``rounding`` says how each ``a * b + c`` of the tile step and the fold is
rounded: "compiler" leaves it to Mosaic GPU's compiler (probed on the H200: it fuses them, one
rounding), "fma" an explicit fused multiply-add, "two" a ``mul.rn`` then an add (two roundings:
what the Triton kernels and XLA get on the H200). ``pv`` selects how the rescaled accumulator
meets ``p @ v``: the dot accumulating into ``acc * alpha`` ("into": what Triton makes of
``acc * alpha + dot``) or a separate dot then ``acc * alpha + pv`` ("add"). Since 2026-12-02
"auto" runs it for prefill steps wherever ``can_run`` holds (``attention_triton.PREFILL_KERNEL``):
the engine's digests matched the records with it on the H200 (``benchmarks/gpu_digests.py
--prefill-kernel tiles_mgpu``) and 8 x 4096-token prompts prefilled ~10% faster.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.attention_math import (
    EX2_PTX,
    LOG2E,
    AttentionSpec,
    fold_finish,
    fold_step,
    full_tiles,
    key_mask,
    key_range,
    kv_tile,
    rounded_product,
    row_tiles,
    softmax_step,
    split_used,
    tile_tokens,
)
from pallas_kernels.checks import is_int
from pallas_kernels.plan import H200_SMS

ROWS = 64  # rows of a program: one warpgroup's wgmma M
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
PV_VARIANTS = ("add", "into")
_SUM_N = 16  # columns of the row-sum dot (wgmma's least N), as in softmax_step's p @ ones
_SMEM_BYTES = 227 * 1024 // 2 - 1024  # two programs per SM
_SMEM_BYTES_ALONE = 227 * 1024 - 1024  # one (warp-specialized) program per SM
# ``probe_trace``: the on-device profiler's ranges a warpgroup records (Mosaic GPU's
# ``profile_space``; later ones are dropped). Its buffer - 16 bytes a range, for each of a
# program's warpgroups - is in shared memory, counted by ``_stages``: 128 ranges leave the
# engine's D 128 launch its 2 stages at every head group.
TRACE_RANGES = 128
TRACE_LEVELS = ("items", "tiles", "parts")
CONSUMERS = (1, 2)  # compute warpgroups of a program (2: plus a producer warpgroup)
ORDERS = ("ascending", "heaviest")  # the order programs take the row tiles in
# registers per thread with warp specialization (2 x 128 x 232 + 128 x 40 <= 65536)
_CONSUMER_REGISTERS, _PRODUCER_REGISTERS = 232, 40


def supported(dtype, head_dim: int, spec: AttentionSpec) -> str | None:
    """Why this kernel cannot run a call, or None if it can."""
    if jnp.dtype(dtype) not in DTYPES:
        return f"dtype {jnp.dtype(dtype)} (wgmma takes bf16 / f16)"
    if head_dim not in (64, 128):
        return f"head_dim {head_dim}"
    if spec.softcap is not None:
        return "logit_softcap (tanh's bits on Mosaic GPU are not known to equal Triton's)"
    return None


def _layout_refusal(block_size: int, group: int) -> str | None:
    """Why pages of ``block_size`` tokens or a query-head group of ``group`` cannot be laid out
    in this kernel's tiles, or None."""
    if kv_tile(block_size) % block_size or block_size % 8:
        return f"block_size {block_size} must be a multiple of 8"
    if group > ROWS:
        return f"query group too large for {ROWS} rows"
    return None


def can_run(dtype, head_dim: int, spec: AttentionSpec, *, block_size: int, group: int, launch=()) -> bool:
    """Whether this kernel runs the call here under ``launch`` (``tiles_mgpu``'s launch
    arguments, e.g. ``attention_triton.MGPU_PREFILL_LAUNCH``): ``supported``, a page size and
    query group it lays out, pages that fit that launch's shared memory, and a Hopper GPU
    (wgmma) as the default device."""
    if supported(dtype, head_dim, spec) is not None or _layout_refusal(block_size, group) is not None:
        return False
    launch = dict(launch)
    try:
        _stages(
            kv_tile(block_size),
            head_dim,
            jnp.dtype(dtype).itemsize,
            2,
            launch.get("consumers", 1),
            launch.get("fold_in_smem", False),
            launch.get("prefetch_q", False),
            k_ahead=launch.get("k_ahead", False),
            out_in_fold=launch.get("out_in_fold", False),
        )
    except ValueError:
        return False
    return getattr(jax.devices()[0], "compute_capability", None) == "9.0"


def _box_tokens(group: int, d: int, itemsize: int) -> int:
    """``direct_io``: the whole tokens of a q / output buffer - enough for a tile's 64 rows,
    and a multiple of 1 KB, so that the second consumer's buffer starts where the 128-byte
    swizzle's 8-row pattern does (else TMA and the register loads disagree on its layout: wrong
    rows on the H100 at 70 and 66 rows, session 52)."""
    tokens = -(-ROWS // group)
    while tokens * group * d * itemsize % 1024:
        tokens += 1
    return tokens


def out_in_fold_layout(group: int, d: int, itemsize: int, consumers: int = 2) -> tuple[tuple[int, ...], int]:
    """``out_in_fold``: the output boxes in the split fold's SMEM - that buffer [consumers, 64,
    D] fp32 seen as one [tokens, G, D] buffer of the output's dtype - as (each consumer's first
    token, the view's tokens). Consumer c's box (``_box_tokens``) starts at the first token on
    a 1 KB boundary (the swizzle's pattern) at or past the start of c's own fold rows, and ends
    before they do: a consumer's output never shares a byte with another consumer's fold, only
    with its own, whose lifetime it follows."""
    token, part = group * d * itemsize, ROWS * d * 4
    box = _box_tokens(group, d, itemsize)
    bases = []
    for c in range(consumers):
        first = -(-c * part // token)
        while first * token % 1024:
            first += 1
        if (first + box) * token > (c + 1) * part:
            raise ValueError(
                f"attention (Mosaic GPU tiles): out_in_fold: a {box}-token output box of {group} heads "
                f"at head_dim {d} does not fit in a warpgroup's {part // 1024} KB of fold"
            )
        bases.append(first)
    return tuple(bases), bases[-1] + box


def _wait_box_stored():
    """(``out_in_fold``) Before an item's walk writes its fold: the output store of the item
    before has read its box, which lies in these fold rows."""
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _stages(
    tile: int,
    d: int,
    itemsize: int,
    stages: int,
    consumers: int = 1,
    fold_in_smem: bool = False,
    out_buffer: bool = False,
    qo_rows: int = ROWS,
    trace: bool = False,
    k_ahead: bool = False,
    out_in_fold: bool = False,
) -> int:
    """Ring slots: as asked, fewer where the program would not fit (two programs per SM with one
    warpgroup; one with warp specialization, which also holds each consumer's q), at least 2.
    ``fold_in_smem``: each warpgroup also holds its split fold's fp32 accumulator;
    ``out_buffer``: and its output's staging buffer (``prefetch_q``). ``qo_rows``: the rows of
    each q / output buffer (``direct_io``'s whole tokens: up to 112). ``trace``: and the
    profiler's buffer (``probe_trace``). ``k_ahead``: the K ring has one slot more than the V
    ring (``stages`` counts the V ring's). ``out_in_fold``: the output's staging buffer lies in
    the fold's."""
    per_stage = 2 * tile * d * itemsize
    fixed = tile * _SUM_N * itemsize + 4 * 1024  # ones; rows, segments, barriers
    if trace:
        fixed += (consumers + (consumers > 1)) * TRACE_RANGES * 16
    if k_ahead:
        fixed += tile * d * itemsize
    if fold_in_smem:
        fixed += consumers * ROWS * d * 4
    if out_buffer and not out_in_fold:
        fixed += consumers * qo_rows * d * itemsize
    budget = _SMEM_BYTES
    if consumers > 1:
        fixed += consumers * qo_rows * d * itemsize
        budget = _SMEM_BYTES_ALONE
    if fixed + 2 * per_stage > (2 * _SMEM_BYTES if consumers == 1 else budget):
        fold = " with the fold in shared memory" if fold_in_smem else ""
        raise ValueError(
            f"attention (Mosaic GPU tiles): {tile}-key tiles at head_dim {d}{fold} need more shared "
            "memory than an SM has (use a block size of at most 128, or fold_in_smem=False)"
        )
    return max(2, min(stages, (budget - fixed) // per_stage))


ROUNDINGS = ("compiler", "fma", "two")


def _inline_pointwise(op, *arrays):
    """op over the registers of fp32 arrays in the kernel's layouts (inline Mosaic GPU)."""
    a = arrays[0]
    layout = plgpu.Layout.WGMMA if a.ndim == 2 else plgpu.Layout.WGMMA.reduce(1)

    @plgpu.inline_mgpu(
        arg_types=(layout,) * len(arrays),
        return_type=plgpu.ShapeDtypeStruct(a.shape, jnp.float32, layout=layout),
    )
    def run(_, x, *others):
        return x._pointwise(op, *others)

    return run(*arrays)


def _mul_rn(a, b):
    """``a * b`` by ``mul.rn.f32`` (inline PTX, which ptxas never fuses with a following add)."""
    from jax.experimental.mosaic.gpu import fragmented_array

    return _inline_pointwise(fragmented_array.FragmentedArray._lift_fast_instr("mul.rn.f32"), a, b)


def _mul_rn_add(a, b, c):
    """``a * b + c`` with two roundings: the product by ``mul.rn``, then the add."""
    return _mul_rn(a, b) + c


def _ex2(x):
    """2**x by ``attention_math.EX2_PTX`` (inline PTX: the Triton kernels' instruction)."""
    from jax.experimental.mosaic.gpu import fragmented_array

    return _inline_pointwise(fragmented_array.FragmentedArray._lift_fast_instr(EX2_PTX), x)


def _fma(a, b, c):
    """``a * b + c`` with one rounding (``fma.rn.f32``), on fp32 arrays in the kernel's layouts."""
    from jax._src.lib.mlir.dialects import math as mlir_math

    return _inline_pointwise(mlir_math.fma, a, b, c)


@dataclasses.dataclass(frozen=True)
class _Walk:
    """The order of KV tiles a program visits: segments (its sequences, ascending), the splits
    each segment's rows use, the tiles of each split. Both cursors (prefetch and compute) use
    these same functions, so they visit the same tiles in the same order."""

    segs: object  # SMEM [4, max_segs] int32: seq, lo, hi, ctx of each of the tile's segments
    nseg: object  # how many
    spec: AttentionSpec
    tile: int
    max_segs: int

    def segment(self, s):
        s = jnp.clip(s, 0, self.max_segs - 1)
        return self.segs[0, s], self.segs[1, s], self.segs[2, s], self.segs[3, s]

    def splits(self, lo, hi):
        """[first, end) of the splits the rows of positions lo..hi use."""
        ss, window = self.spec.split_size, self.spec.window
        first = 0 if window is None else jnp.maximum(lo - window + 1, 0) // ss
        return jnp.int32(first), hi // ss + 1

    def split_tiles(self, split, lo, hi):
        """(start key, first tile, number of tiles) of a split, as the Triton kernel's."""
        ss, window, tile = self.spec.split_size, self.spec.window, self.tile
        start = split * ss
        num_tiles = (jnp.clip(hi + 1 - start, 0, ss) + tile - 1) // tile
        first = jnp.int32(0)
        if window is not None:
            first = jnp.clip((lo - window + 1 - start) // tile, 0, num_tiles)
        return start, first, num_tiles

    def begin(self):
        """Cursor (segment, split, tile index) of the first tile."""
        _, lo, hi, _ = self.segment(0)
        split, _ = self.splits(lo, hi)
        _, first, _ = self.split_tiles(split, lo, hi)
        return jnp.int32(0), split, first

    def advance(self, cur):
        """The cursor after ``cur`` (segment index past the end when the walk is over)."""
        seg, split, t = cur
        _, lo, hi, _ = self.segment(seg)
        _, _, num_tiles = self.split_tiles(split, lo, hi)
        _, end_split = self.splits(lo, hi)
        more_tiles = t + 1 < num_tiles
        more_splits = split + 1 < end_split
        _, first2, _ = self.split_tiles(split + 1, lo, hi)
        _, lo3, hi3, _ = self.segment(seg + 1)
        split3, _ = self.splits(lo3, hi3)
        _, first3, _ = self.split_tiles(split3, lo3, hi3)
        same_seg = more_tiles | more_splits
        return (
            jnp.where(same_seg, seg, seg + 1),
            jnp.where(more_tiles, split, jnp.where(more_splits, split + 1, split3)),
            jnp.where(more_tiles, t + 1, jnp.where(more_splits, first2, first3)),
        )


def _scopes(level: str | None):
    """(an item's scope, a tile's scope, a tile part's scope) for ``probe_trace`` at ``level``:
    ``jax.named_scope``, which Mosaic GPU's profiler records as a range of the warpgroup that
    runs it, where that level is traced ("items" < "tiles" < "parts"); else a no-op (and the
    kernel's text is the launch's own)."""

    def off(name):
        return contextlib.nullcontext()

    depth = 0 if level is None else 1 + TRACE_LEVELS.index(level)
    return tuple(jax.named_scope if depth > i else off for i in range(3))


def _kernel(
    segs_ref, nseg_ref, order_ref, rpos_ref, rseq_ref, bt_ref, q_ref, k_ref, v_ref, ones_ref, o_ref,
    *, spec: AttentionSpec, block_size: int, max_blocks: int, stages: int, max_segs: int, pv: str,
    a_in_smem: bool, overlap: bool, rounding: str, consumers: int, one_drain: bool, q_from_smem: bool,
    fold_in_smem: bool, work: tuple[int, int, int] | None, prefetch_q: bool,
    direct: tuple[int, int] | None, probe_unmasked: bool, inline_ex2: bool, probe_exact_exp: bool, probe_log2_scores: bool,
    trace: str | None = None, pingpong: bool = False, bare_full: bool = False,
    lean_mask: bool = False, wide_sum: bool = False, k_stages: int | None = None,
    probe_skip: tuple[str, ...] = (), out_bases: tuple[int, ...] | None = None,
    early_reads: bool = False,
):  # fmt: skip
    item_scope, tile_scope, part_scope = _scopes(trace)
    # ``k_ahead``: the K ring's slots (the V ring has ``stages``); tile c is in K slot
    # c % k_stages and V slot c % stages
    k_stages = stages if k_stages is None else k_stages
    if work is None:  # a program per (tile, head)
        i = lax.axis_index("tile") if order_ref is None else order_ref[lax.axis_index("tile")]
        h = lax.axis_index("head")
    else:  # persistent: each program runs a list of (tile, head) work items (``body_specialized``)
        i = h = None
    d = q_ref.shape[-1]
    tile = kv_tile(block_size)
    pages = tile // block_size
    dtype = q_ref.dtype
    wgmma_layout = plgpu.Layout.WGMMA
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    swizzle = min(128, d * dtype.itemsize)
    transforms = (plgpu.TilingTransform((8, swizzle // dtype.itemsize)), plgpu.SwizzleTransform(swizzle))
    # (1-row tiles: a token's G rows at any row - ``direct_io``'s q and output buffers)
    row_transforms = (
        plgpu.TilingTransform((1, 1, swizzle // dtype.itemsize)),
        plgpu.SwizzleTransform(swizzle),
    )
    p_swizzle = min(128, tile * dtype.itemsize)
    p_transforms = (
        plgpu.TilingTransform((8, p_swizzle // dtype.itemsize)),
        plgpu.SwizzleTransform(p_swizzle),
    )
    sum_transforms = (
        plgpu.TilingTransform((8, _SUM_N)),
        plgpu.SwizzleTransform(_SUM_N * dtype.itemsize),
    )

    fused_mul_add = {"compiler": None, "fma": _fma, "two": _mul_rn_add}[rounding]  # None: a * b + c
    fold_mul = _mul_rn if rounding == "two" else None  # the fold's a * b + c * d: both products rounded
    exp2 = _ex2 if inline_ex2 else jnp.exp2  # (the interpreter runs no PTX)
    # (``out_in_fold``) a consumer's output box: its tokens (``out_bases``: where each begins)
    out_box_tokens = None if out_bases is None else _box_tokens(direct[1], d, dtype.itemsize)
    if probe_exact_exp:
        exp2 = lambda x: jnp.exp(x * math.log(2.0))  # noqa: E731 - timing only, other bits
    # (the base-2 probe: log2 e in the logit scale - timing only, other bits)
    step_spec = dataclasses.replace(spec, scale=spec.scale * LOG2E) if probe_log2_scores else spec
    # ``bare_full``: full tiles build no selects, so the logit product is rounded on its own in
    # every tile (nothing may fuse it into the subtraction after it; a select kept it apart)
    scale_mul = None
    if bare_full:
        scale_mul = _mul_rn if inline_ex2 else rounded_product

    def mul_add(a, b, c):
        return a * b + c if fused_mul_add is None else fused_mul_add(a, b, c)

    def issue(walk, cur, c, k_smem, v_smem, k_bar, v_bar, ready=None, h=h, ring="kv"):
        """TMA the KV tile at ``cur`` of KV head ``h`` into slot c % stages (one copy per page);
        ``ready(ring)``, if given, runs between the block-table reads and the copies (the wait
        for a free slot: ring "kv" - or with ``k_ahead`` "k" before the K copies and "v" before
        the V copies, K slot c % k_stages). ``ring`` (``k_ahead``): "k" or "v" copies only
        that half of the tile."""
        seg, split, t = cur
        seq, _, _, _ = walk.segment(seg)
        tile_start = split * spec.split_size + t * tile
        slot = lax.rem(c, stages)
        kslot = lax.rem(c, k_stages)
        # every page's row first: a copy is preceded by a warpgroup barrier, so reading
        # the block table between copies would serialize its loads
        rows0 = [
            bt_ref[seq, jnp.minimum(tile_start // block_size + p, max_blocks - 1)] * block_size
            for p in range(pages)
        ]
        pages_at = [
            (pl.ds(row0, block_size), pl.ds(p * block_size, block_size)) for p, row0 in enumerate(rows0)
        ]
        if k_stages != stages:  # (``k_ahead``: each ring's slot waited for on its own)
            if ring != "v":
                if ready is not None:
                    ready("k")
                for src, dst in pages_at:
                    plgpu.copy_gmem_to_smem(k_ref.at[src, h], k_smem.at[kslot, dst], k_bar.at[kslot])
            if ring != "k":
                if ready is not None:
                    ready("v")
                for src, dst in pages_at:
                    plgpu.copy_gmem_to_smem(v_ref.at[src, h], v_smem.at[slot, dst], v_bar.at[slot])
            return
        if ready is not None:
            ready("kv")
        for src, dst in pages_at:
            plgpu.copy_gmem_to_smem(k_ref.at[src, h], k_smem.at[slot, dst], k_bar.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[src, h], v_smem.at[slot, dst], v_bar.at[slot])

    def consume(
        walk,
        q,
        rpos,
        rseq,
        k_smem,
        v_smem,
        ones_smem,
        k_bar,
        v_bar,
        a_smem,
        prefetch,
        pf,
        tile_done,
        zero_v_sync,
        fold_smem,
        c0=0,
        after_walk=None,
        turns=None,
    ):
        """The walk's compute side for one warpgroup's 64 rows: (the folded output [ROWS, D],
        the tile count after its walk). Its first tile is the ring's tile ``c0`` (slot c0 %
        stages: a persistent program's walks go through one ring, one after another);
        ``after_walk()``, if given, runs once the walk's last wgmma is done, before the fold's
        accumulator is read back and normalized.
        ``prefetch(pf, c)`` (the single-warpgroup kernel's own loads; ``pf`` its cursor, () if
        none) runs at the start of tile c; ``tile_done(c)`` once tile c's wgmmas are done with
        its slots; ``zero_v_sync(zero)`` runs the zeroing of a slot's unseen V rows.
        ``fold_smem``: an fp32 [ROWS, D] SMEM buffer that holds the split fold's accumulator
        between folds (None: it stays in registers, 64 a thread live through every tile).
        ``turns`` (``pingpong``): (wait for this warpgroup's turn, give the other its turn),
        around the issue of a tile's p @ ones and p @ v (with ``overlap`` also the next tile's
        q @ k.T; without, q @ k.T takes a turn of its own)."""
        nseg = walk.nseg

        def fold_split(fold, state, use):
            """``fold_step`` with the fold's accumulator in registers or in ``fold_smem`` (each
            thread reads back the elements it wrote: no barrier)."""
            if fold_smem is None:
                return fold_step(fold, state, use, fused_mul_add, fold_mul, exp2=exp2)
            fm, fl, started = fold
            facc = plgpu.load(fold_smem, layout=wgmma_layout)
            fm, fl, facc, started = fold_step(
                (fm, fl, facc, started), state, use, fused_mul_add, fold_mul, exp2=exp2
            )
            fold_smem[...] = facc
            return fm, fl, started

        def rows2(x, n):  # a row vector broadcast over n columns
            return lax.broadcast_in_dim(x, (ROWS, n), (0,))

        def take_turn():  # (``pingpong``) wait for this warpgroup's turn to issue wgmmas
            if turns is not None:
                with part_scope("turn"):
                    turns[0]()

        def give_turn():  # (``pingpong``) the other warpgroup's turn
            if turns is not None:
                turns[1]()

        def qk(slot):
            def dot(acc_ref):
                take_turn()  # (``pingpong`` without ``overlap``: q @ k.T in a turn of its own)
                plgpu.wgmma(acc_ref, q, k_smem.at[slot].transpose((1, 0)))
                give_turn()
                return acc_ref[...]

            return pl.run_scoped(dot, plgpu.ACC((ROWS, tile), jnp.float32))

        def step(c, has_next, s, state, ok, zero_v):
            """Tile c: (new state, the scores of tile c + 1 if ``overlap``). With ``overlap`` the
            wgmma of the next tile's q @ k.T runs while this tile's softmax does (its scores
            ``s`` were made by the step before); without, this step makes its own."""
            slot, kslot = lax.rem(c, stages), lax.rem(c, k_stages)
            if not overlap:
                with tile_scope("wait_k"):
                    plgpu.barrier_wait(k_bar.at[kslot])
                with part_scope("qk"):
                    scores = qk(kslot)
                new = tile_math(slot, scores, state, ok, zero_v)
                tile_done(c)
                return new, s
            nslot = lax.rem(c + 1, k_stages)

            def scope(next_ref):
                def issue_next():
                    # Only the wait is conditional: a wgmma under a branch may be serialized by
                    # ptxas. After the last tile it reads a slot that holds no tile of this walk
                    # (a persistent program's producer may be filling it for the next item);
                    # unused.
                    pl.when(has_next)(lambda: plgpu.barrier_wait(k_bar.at[nslot]))
                    plgpu.wgmma(next_ref, q, k_smem.at[nslot].transpose((1, 0)))

                if turns is None:  # issued before this tile's softmax
                    issue_next()
                    new = tile_math(slot, s, state, ok, zero_v)
                else:  # issued with this tile's p @ v, in this warpgroup's turn
                    new = tile_math(slot, s, state, ok, zero_v, issue_next)
                return new, next_ref[...]

            new, s = pl.run_scoped(scope, plgpu.ACC((ROWS, tile), jnp.float32))
            tile_done(c)
            return new, s

        def tile_math(slot, s, state, ok, zero_v, issue_next=None):
            with part_scope("wait_v"):
                plgpu.barrier_wait(v_bar.at[slot])
            if zero_v is not None:
                with part_scope("zero_v"):
                    zero_v(slot)

            def operand(p):
                if not a_in_smem:
                    return p
                p_smem = a_smem[1]
                p_smem[...] = p
                plgpu.commit_smem()
                return p_smem

            def rescale(acc, alpha):  # (the probe skipping it: timing only, wrong values)
                return acc if "rescale" in probe_skip else acc * alpha

            def rescale_add(acc, alpha, pvs):
                return acc + pvs if "rescale" in probe_skip else mul_add(acc, alpha, pvs)

            def update(acc, alpha, p):
                alpha = lax.broadcast_in_dim(alpha, acc.shape, (0,))
                p = operand(p)
                if pv == "into":

                    def into(acc_ref):
                        plgpu.wgmma(acc_ref, p, v_smem.at[slot])

                    return pl.run_state(into)(plgpu.ACC.init(rescale(acc, alpha)))

                def pv_dot(acc_ref):
                    plgpu.wgmma(acc_ref, p, v_smem.at[slot])
                    return acc_ref[...]

                return rescale_add(acc, alpha, pl.run_scoped(pv_dot, plgpu.ACC((ROWS, d), jnp.float32)))

            def row_sum(p):
                p = operand(p)

                def dot(acc_ref):
                    plgpu.wgmma(acc_ref, p, ones_smem)
                    return acc_ref[...]

                return pl.run_scoped(dot, plgpu.ACC((ROWS, _SUM_N), jnp.float32))

            def end_turn():  # (``pingpong`` with ``overlap``: the next tile's q @ k.T too)
                if issue_next is not None:
                    issue_next()
                give_turn()

            def sum_and_update(acc, alpha, p):
                """p @ ones and the new acc with one wait for both wgmmas (``one_drain``; with
                ``pingpong`` in this warpgroup's turn, with the next tile's q @ k.T)."""
                alpha = lax.broadcast_in_dim(alpha, acc.shape, (0,))
                p = operand(p)
                if pv == "into":

                    def both(refs):
                        acc_ref, sum_ref = refs
                        take_turn()
                        plgpu.wgmma(sum_ref, p, ones_smem)
                        plgpu.wgmma(acc_ref, p, v_smem.at[slot])
                        end_turn()

                    zero = plgpu.layout_cast(jnp.full((ROWS, _SUM_N), 0.0, jnp.float32), wgmma_layout)
                    scaled = rescale(acc, alpha)
                    with part_scope("dots"):
                        new, sums = pl.run_state(both)((plgpu.ACC.init(scaled), plgpu.ACC.init(zero)))
                    return sums, new

                def dots(sum_ref, pv_ref):
                    take_turn()
                    plgpu.wgmma(sum_ref, p, ones_smem)
                    plgpu.wgmma(pv_ref, p, v_smem.at[slot])
                    end_turn()
                    return sum_ref[...], pv_ref[...]

                with part_scope("dots"):
                    sums, pvs = pl.run_scoped(
                        dots, plgpu.ACC((ROWS, _SUM_N), jnp.float32), plgpu.ACC((ROWS, d), jnp.float32)
                    )
                return sums, rescale_add(acc, alpha, pvs)

            return softmax_step(
                state,
                s,
                ok,
                step_spec,
                p_dtype=dtype,
                update=update,
                row_sum=row_sum,
                mul_add=fused_mul_add,
                sum_and_update=sum_and_update if one_drain else None,
                exp2=(lambda x: x) if "exp" in probe_skip else exp2,  # (the probe: no MUFU)
                scale_mul=scale_mul,
                log2_scores=probe_log2_scores,
                select_p=not lean_mask,
                wide_sum=wide_sum,
            )

        def empty_state(wide=False):  # (``wide``: l as [ROWS, 16], ``wide_sum``'s walk state)
            def zero_l():
                return jnp.full((ROWS, _SUM_N) if wide else (ROWS,), 0.0, jnp.float32)

            # (the launches with ``wide_sum`` were measured with l's zeros built first: each
            # launch's lowered module - its module hash - stays the measured one)
            l0 = zero_l() if wide_sum else None
            m0 = plgpu.layout_cast(jnp.full((ROWS,), -jnp.inf, jnp.float32), row_layout)
            l0 = plgpu.layout_cast(zero_l() if l0 is None else l0, wgmma_layout if wide else row_layout)
            return m0, l0, plgpu.layout_cast(jnp.full((ROWS, d), 0.0, jnp.float32), wgmma_layout)

        def one_segment(sidx, carry):
            seq, lo, hi, ctx = walk.segment(sidx)
            mine = (rseq == seq) & (rpos >= 0)
            first_split, end_split = walk.splits(lo, hi)
            pos2 = rows2(rpos, tile)
            mine2 = rows2(mine, tile)
            if lean_mask:  # (each row's visible keys as a range)
                first_key, last_key = key_range(rpos, ctx, spec.window, mine)

            def one_split(split, carry):
                fold, pf, c, s = carry
                start, first, num_tiles = walk.split_tiles(split, lo, hi)
                more = (split + 1 < end_split) | (sidx + 1 < nseg)  # tiles after this split

                def tile_step(masked, t, x):
                    with tile_scope("tile_masked" if masked else "tile_full"):
                        return tile_step_(masked, t, x)

                def tile_step_(masked, t, x):
                    state, pf, c, s = x
                    pf = prefetch(pf, c + stages - 1)
                    tile_start = start + t * tile
                    if masked and lean_mask:  # each row's key range: one compare a key and side
                        col = plgpu.broadcasted_iota(jnp.int32, (ROWS, tile), 1, layout=wgmma_layout)
                        ok = col <= rows2(last_key - tile_start, tile)
                        if first_key is not None:
                            ok &= col >= rows2(first_key - tile_start, tile)
                    elif masked:
                        j = tile_start + plgpu.broadcasted_iota(
                            jnp.int32, (ROWS, tile), 1, layout=wgmma_layout
                        )
                        ok = key_mask(j, pos2, ctx, spec.window) & mine2
                    if masked:
                        # keys some row of this sequence sees; the rest of V is zeroed
                        seen_hi = jnp.minimum(hi, ctx - 1)
                        seen_lo = 0 if spec.window is None else lo - spec.window + 1
                        partial = (tile_start + tile - 1 > seen_hi) | (tile_start < seen_lo)

                        def zero(slot):
                            key = tile_start + plgpu.broadcasted_iota(
                                jnp.int32, (tile, d), 0, layout=wgmma_layout
                            )
                            seen = key_mask(key, hi, ctx, None)
                            if spec.window is not None:
                                seen &= key > lo - spec.window
                            v = plgpu.load(v_smem.at[slot], layout=wgmma_layout)
                            v_smem.at[slot][...] = jnp.where(seen, v, jnp.zeros_like(v))
                            plgpu.commit_smem()

                        def zero_v(slot):
                            pl.when(partial)(lambda: zero_v_sync(functools.partial(zero, slot)))

                    else:  # every key visible to every row of the sequence (full_tiles)
                        ok = None  # (``bare_full``: no select at all)
                        if not bare_full:
                            visible = start + (t + 1) * tile <= lo + 1
                            ok = plgpu.layout_cast(jnp.full((ROWS, tile), visible), wgmma_layout)
                        zero_v = None
                    state, s = step(c, (t + 1 < num_tiles) | more, s, state, ok, zero_v)
                    return state, pf, c + 1, s

                a, b = full_tiles(start, first, num_tiles, lo, hi, tile, spec.window)
                masked = not probe_unmasked  # (the probe: every tile as a full one, wrong values)

                def tiles(x):
                    x = lax.fori_loop(first, a, functools.partial(tile_step, masked), x)
                    x = lax.fori_loop(a, b, functools.partial(tile_step, False), x)
                    return lax.fori_loop(b, num_tiles, functools.partial(tile_step, masked), x)

                x = tiles((empty_state(wide_sum), pf, c, s))
                with tile_scope("fold"):
                    state = x[0]
                    if wide_sum:  # the row sums' columns are the same values: any is the max
                        state = (state[0], jnp.max(state[1], axis=1), state[2])
                    fold = fold_split(fold, state, split_used(split, rpos, spec) & mine)
                return fold, *x[1:]

            return lax.fori_loop(first_split, end_split, one_split, carry)

        started = rpos < -1  # all False, in the row layout
        if overlap:  # the first tile's scores, made before the walk (each step makes the next's)

            def first_scores(acc_ref):
                @pl.when(nseg > 0)
                def _():
                    slot0 = lax.rem(jnp.int32(c0), k_stages)
                    plgpu.barrier_wait(k_bar.at[slot0])
                    plgpu.wgmma(acc_ref, q, k_smem.at[slot0].transpose((1, 0)))

                return acc_ref[...]

            s0 = pl.run_scoped(first_scores, plgpu.ACC((ROWS, tile), jnp.float32))
        else:
            s0 = jnp.int32(0)  # unused
        fm, fl, facc = empty_state()
        if fold_smem is None:
            fold = (fm, fl, facc, started)
        else:
            fold_smem[...] = facc
            fold = (fm, fl, started)
        with item_scope("walk"):
            fold, _, c, _ = lax.fori_loop(0, nseg, one_segment, (fold, pf, jnp.int32(c0), s0))
        with item_scope("finish"):
            if after_walk is not None:
                after_walk()
            if fold_smem is not None:
                fm, fl, started = fold
                fold = (fm, fl, plgpu.load(fold_smem, layout=wgmma_layout), started)
            return fold_finish(fold).astype(dtype), c

    def q_operand(q_smem, q_copy):
        """q into registers (wgmma's A operand), or into ``q_copy`` in interpret mode."""
        if a_in_smem:  # wgmma's A operands from SMEM (interpret mode has no register A)
            q_copy[...] = plgpu.load(q_smem, layout=wgmma_layout)
            plgpu.commit_smem()
            return q_copy
        return plgpu.load(q_smem, layout=wgmma_layout)

    def body(k_smem, v_smem, ones_smem, rows_smem, segs_smem, a_smem, fold_smem, k_bar, v_bar, ones_bar):
        """One warpgroup: it prefetches its own tiles (``stages - 1`` ahead) and computes."""
        nseg = nseg_ref[i]
        walk = _Walk(segs_smem, nseg, spec, tile, max_segs)

        def prefetch(pf, c):
            """Issue the load of the prefetch cursor (if the walk is not over); advance it."""
            pl.when(pf[0] < nseg)(lambda: issue(walk, pf, c, k_smem, v_smem, k_bar, v_bar))
            return walk.advance(pf)

        # q goes through the last slot (free until the first prefetch of step 0) into registers
        q_smem = k_smem.at[stages - 1, pl.ds(0, ROWS)]
        plgpu.copy_gmem_to_smem(ones_ref, ones_smem, ones_bar)
        plgpu.copy_gmem_to_smem(q_ref.at[i, h], q_smem, ones_bar)
        plgpu.copy_gmem_to_smem(rpos_ref.at[i], rows_smem.at[0], ones_bar)
        plgpu.copy_gmem_to_smem(rseq_ref.at[i], rows_smem.at[1], ones_bar)
        plgpu.copy_gmem_to_smem(segs_ref.at[i], segs_smem, ones_bar)
        plgpu.barrier_wait(ones_bar)
        q = q_operand(q_smem, None if a_smem is None else a_smem[0])
        rpos = plgpu.load(rows_smem.at[0], layout=row_layout)
        rseq = plgpu.load(rows_smem.at[1], layout=row_layout)
        plgpu.commit_smem()  # the reads are done before any TMA refills the slot
        pf = walk.begin()
        for c in range(stages - 1):
            pf = prefetch(pf, jnp.int32(c))
        out, _ = consume(
            walk, q, rpos, rseq, k_smem, v_smem, ones_smem, k_bar, v_bar, a_smem,
            prefetch, pf, lambda c: None, lambda zero: zero(), fold_smem,
        )  # fmt: skip
        o_smem = k_smem.at[0, pl.ds(0, ROWS)]  # every load has been consumed: slot 0 is free
        o_smem[...] = out
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_ref.at[i, h])
        plgpu.wait_smem_to_gmem(0)

    def body_specialized(
        k_smem, v_smem, ones_smem, qo_smem, rows_smem, segs_smem, a_smem, fold_smem, out_smem,
        k_bar, v_bar, ones_bar, setup_bar, segs_free, q_bar, consumed_bar, zero_bar, turn_bar,
        consumed_k_bar,
    ):  # fmt: skip
        """``consumers`` warpgroups compute (one 64-row tile each: tiles ``consumers * i + wg``)
        on the walk of their tiles' union; one more loads the KV tiles (FlashAttention-3's
        warp specialization). A slot is refilled once every consumer has finished with it.
        ``turn_bar`` (``pingpong``): consumer w issues its dots once ``turn_bar[w]`` says it is
        its turn and then gives the other its turn; consumer 1 gives consumer 0 the first.
        ``consumed_k_bar`` (``k_ahead``): the K ring's own "slot consumed" barriers (else
        ``consumed_bar`` tells of both rings).

        Persistent (``work`` = (items, programs, KV heads)): program p runs one work item a
        round, p in even rounds and programs - 1 - p in odd ones (item w: KV head w % heads
        of the (ordered) tile pair w // heads), one after another through one slot ring whose
        tile count goes on, so the producer loads an item's first KV tiles while the
        consumers finish the item before it. The items' segments alternate between two
        buffers; ``segs_free[b]``: both consumers are done walking buffer b's last item."""
        wg = lax.axis_index("wg")
        nbuf = segs_smem.shape[0]
        if work is not None:
            total, programs, heads = work
            pid = lax.axis_index("tile")
            # this program's items: full rounds, plus one if the last (part) round's snake
            # reaches it
            full, rest = total // programs, total % programs
            in_last = jnp.where(full % 2 == 0, pid < rest, pid >= programs - rest)
            count = full + in_last.astype(jnp.int32)

        def items(run, c, early=False):
            """``run(k, i, h, b, c) -> c`` for each of this program's items k (b: its segments'
            buffer; c: the ring's tile count). ``early`` (``early_reads``): ``run(k, i, h, b, c,
            nseg, nxt)`` with item k's walk length and item k + 1's (tile pair, KV head) read
            from GMEM while the item before ran (and item k + 2's while this one runs): no read
            waited for between items."""
            if work is None:
                return run(0, i, h, 0, c)

            def one(k, c):
                ik, hk = item_of(k)
                return run(k, ik, hk, lax.rem(k, nbuf), c)

            if not early:
                return lax.fori_loop(0, count, one, c)

            def ahead(k, nik, nhk):
                """Item k + 1's (pair, head, walk length), item k + 2's (pair, head): the reads
                start now, their values are used by the next item (the last items read the
                program's last item again: nothing past it)."""
                return (nik, nhk, nseg_ref[nik], *item_of(jnp.minimum(k + 2, count - 1)))

            def one_early(k, carry):
                c, (ik, hk, nseg, nik, nhk) = carry
                nxt = ahead(k, nik, nhk)
                return run(k, ik, hk, lax.rem(k, nbuf), c, nseg, (nik, nhk)), nxt

            ik0, hk0 = item_of(0)
            first = (ik0, hk0, nseg_ref[ik0], *item_of(jnp.minimum(1, count - 1)))
            return lax.fori_loop(0, count, one_early, (c, first))[0]

        def item_of(k):
            """(tile pair, KV head) of this program's item k: round k's items in snake order
            (round k + 1 runs back), so that with the items heaviest first no program takes
            the heaviest item of every round."""
            w = k * programs + jnp.where(lax.rem(k, 2) == 0, pid, programs - 1 - pid)
            pair, hk = w // heads, lax.rem(w, heads)
            return (pair if order_ref is None else order_ref[pair]), hk

        @pl.when(wg == consumers)
        def _producer():
            plgpu.set_max_registers(_PRODUCER_REGISTERS, action="decrease")
            plgpu.copy_gmem_to_smem(ones_ref, ones_smem, ones_bar)

            def run(k, ik, hk, b, c):
                with item_scope("producer_setup"):
                    if work is not None:  # both consumers are done walking this buffer's last item

                        @pl.when(k >= nbuf)
                        def _():
                            plgpu.barrier_wait(segs_free.at[b])
                            # ... and so are this warpgroup's own reads of it: an empty item's
                            # walk.begin() has no TMA after it to order it before the copy below
                            # (a proxy fence; interpret mode's race detector found it missing)
                            plgpu.commit_smem()

                    plgpu.copy_gmem_to_smem(segs_ref.at[ik], segs_smem.at[b], setup_bar.at[b])
                    plgpu.barrier_wait(setup_bar.at[b])
                walk = _Walk(segs_smem.at[b], nseg_ref[ik], spec, tile, max_segs)

                def ready_for(c, slot):
                    """The wait for tile c's slot (``slot``: c % stages) in a ring (``issue``'s
                    ``ready``)."""

                    def ready(ring):
                        with tile_scope("producer_slot_wait"):
                            if ring == "k":
                                kslot = lax.rem(c, k_stages)
                                wait = lambda: plgpu.barrier_wait(consumed_k_bar.at[kslot])  # noqa: E731
                                pl.when(c >= k_stages)(wait)
                            else:
                                pl.when(c >= stages)(lambda: plgpu.barrier_wait(consumed_bar.at[slot]))

                    return ready

                def load_ring(cur, c, ring, slot=None):
                    slot = lax.rem(c, stages) if slot is None else slot
                    issue(walk, cur, c, k_smem, v_smem, k_bar, v_bar, ready_for(c, slot), h=hk, ring=ring)

                def load(x):
                    cur, c = x
                    slot = lax.rem(c, stages)
                    nxt = walk.advance(cur)  # the walk and the block-table reads before the wait
                    if k_stages == stages:
                        load_ring(cur, c, "kv", slot)
                    else:  # (``k_ahead``) the next tile's K before this tile's V: K a tile ahead
                        pl.when(nxt[0] < walk.nseg)(lambda: load_ring(nxt, c + 1, "k"))
                        load_ring(cur, c, "v", slot)
                    return nxt, c + 1

                with item_scope("producer_loads"):
                    first = walk.begin()
                    if k_stages != stages:  # (the item's first K)
                        pl.when(first[0] < walk.nseg)(lambda: load_ring(first, c, "k"))
                    return lax.while_loop(lambda x: x[0][0] < walk.nseg, load, (first, c))[1]

            n = items(run, jnp.int32(0))
            for j in range(stages):  # wait out the last tiles: every completed phase is seen
                c = n - stages + j
                pl.when(c >= 0)(lambda c=c: plgpu.barrier_wait(consumed_bar.at[lax.rem(c, stages)]))
            for j in range(k_stages if k_stages != stages else 0):  # (and the K ring's)
                c = n - k_stages + j
                pl.when(c >= 0)(lambda c=c: plgpu.barrier_wait(consumed_k_bar.at[lax.rem(c, k_stages)]))
            if work is not None:  # and the last items' segment buffers
                for j in range(nbuf):
                    k = count - nbuf + j
                    pl.when(k >= 0)(lambda k=k: plgpu.barrier_wait(segs_free.at[lax.rem(k, nbuf)]))

        def box_rows(box):
            """A [tokens, G, D] buffer's first 64 rows, as one [64, D] view."""
            return box.reshape(box.shape[0] * box.shape[1], d).at[pl.ds(0, ROWS)]

        def _consumer(fold_c, out_c):
            """A consumer warpgroup's items, with its fold rows (``fold_in_smem``; else None) and
            its output's staging buffer (``prefetch_q``; else None)."""
            plgpu.set_max_registers(_CONSUMER_REGISTERS, action="increase")
            q_smem = qo_smem.at[wg]
            q_box = q_smem  # (``direct``: [tokens, G, D], a TMA box; q_smem its first 64 rows)
            if direct is not None and not a_in_smem:
                q_smem = box_rows(q_box)
            scratch = None if a_smem is None else (a_smem[0].at[wg], a_smem[1].at[wg])

            def zero_v_sync(zero):
                """Consumer 0 zeroes the slot's unseen V rows; no consumer's p @ v reads the
                slot before that (every consumer takes the same branch: the walk is shared)."""
                pl.when(wg == 0)(zero)
                plgpu.barrier_arrive(zero_bar)
                plgpu.barrier_wait(zero_bar)

            def tile_done(c):
                """Tile c's K and V slots are free for the producer (this consumer's part; with
                ``k_ahead`` the K ring's own barrier too)."""
                plgpu.barrier_arrive(consumed_bar.at[lax.rem(c, stages)])
                if k_stages != stages:
                    plgpu.barrier_arrive(consumed_k_bar.at[lax.rem(c, k_stages)])

            def load_q(ik, hk):
                """TMA item (ik, hk)'s q and row positions / sequences into this warpgroup's
                buffers (``q_bar``)."""
                row_tile = consumers * ik + wg
                if direct is None:
                    plgpu.copy_gmem_to_smem(q_ref.at[row_tile, hk], q_smem, q_bar.at[wg])
                else:  # the tile's tq tokens x G rows from q [T, Hkv, G, D], one copy
                    tq = direct[0]  # (TMA reads zeros past T: padding rows)
                    plgpu.copy_gmem_to_smem(
                        q_ref.at[pl.ds(row_tile * tq, tq), hk], q_box.at[pl.ds(0, tq)], q_bar.at[wg]
                    )
                plgpu.copy_gmem_to_smem(rpos_ref.at[row_tile], rows_smem.at[wg, 0], q_bar.at[wg])
                plgpu.copy_gmem_to_smem(rseq_ref.at[row_tile], rows_smem.at[wg, 1], q_bar.at[wg])

            def after_walk(b):
                """The walk is over: its segments' buffer is free (for the producer's next item)."""
                if work is not None:
                    plgpu.barrier_arrive(segs_free.at[b])

            def begin(k, ik, hk, b, nxt=None):
                """Item k's q (wgmma's A operand) and row positions / sequences, once its q, rows
                and segments are in (and the next item's q loads started, ``prefetch_q``; ``nxt``:
                its (tile pair, KV head) if already read)."""
                if not prefetch_q:  # (else the item before loaded it, or the loop's start)
                    load_q(ik, hk)
                with part_scope("q_wait"):
                    plgpu.barrier_wait(q_bar.at[wg])
                # q as wgmma's A operand: from its SMEM buffer (``q_from_smem``: 32 registers a
                # thread fewer) or loaded into registers
                with part_scope("q_load"):
                    if direct is not None and a_in_smem:  # (interpret mode reshapes no refs: a value's)
                        scratch[0][...] = q_box[...].reshape(-1, d)[:ROWS]
                        plgpu.commit_smem()
                        q = scratch[0]
                    else:
                        q = (
                            q_smem
                            if q_from_smem
                            else q_operand(q_smem, None if scratch is None else scratch[0])
                        )
                    rpos = plgpu.load(rows_smem.at[wg, 0], layout=row_layout)
                    rseq = plgpu.load(rows_smem.at[wg, 1], layout=row_layout)
                if prefetch_q:  # q and the rows are in registers: the next item's load them now
                    with part_scope("next_q"):
                        plgpu.commit_smem()  # (every thread's reads done: a warpgroup barrier)
                        pl.when(k + 1 < count)(lambda: load_q(*(item_of(k + 1) if nxt is None else nxt)))
                with part_scope("segs_wait"):
                    plgpu.barrier_wait(setup_bar.at[b])  # the walk (segments)
                if work is None:  # and, before the first item, the ones matrix (after q's loads)
                    plgpu.barrier_wait(ones_bar)
                else:
                    pl.when(k == 0)(lambda: plgpu.barrier_wait(ones_bar))
                return q, rpos, rseq

            def store(out, row_tile, hk):
                """The item's output into o: staged and stored by TMA (``prefetch_q``: in its own
                buffer, while the next item starts) or through q's buffer."""
                if prefetch_q:
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # (the last store has read it)
                    out_box = out_c
                    if direct is not None and a_in_smem:  # (interpret mode: as q)
                        pad = out_box.shape[0] * out_box.shape[1] - ROWS
                        out_box[...] = jnp.pad(out, ((0, pad), (0, 0))).reshape(out_box.shape)
                    elif direct is not None:
                        box_rows(out_box)[...] = out
                    else:
                        out_box[...] = out
                    plgpu.commit_smem()
                    if direct is None:
                        plgpu.copy_smem_to_gmem(out_box, o_ref.at[row_tile, hk])
                        return
                    tq = direct[0]  # one copy into the output [T, Hkv, G, D] (TMA drops rows past T)
                    plgpu.copy_smem_to_gmem(out_box.at[pl.ds(0, tq)], o_ref.at[pl.ds(row_tile * tq, tq), hk])
                    return
                q_smem[...] = out  # every wgmma reading q is done (each result was waited for)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(q_smem, o_ref.at[row_tile, hk])
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # q_smem is free again

            def run(k, ik, hk, b, c, nseg=None, nxt=None):
                row_tile = consumers * ik + wg
                with item_scope("begin"):
                    q, rpos, rseq = begin(k, ik, hk, b, nxt)
                walk = _Walk(segs_smem.at[b], nseg_ref[ik] if nseg is None else nseg, spec, tile, max_segs)
                if out_bases is not None:
                    _wait_box_stored()
                out, c = consume(
                    walk, q, rpos, rseq, k_smem, v_smem, ones_smem, k_bar, v_bar, scratch,
                    lambda pf, c: pf, (), tile_done,
                    zero_v_sync, fold_c, c,
                    functools.partial(after_walk, b), turns,
                )  # fmt: skip
                with item_scope("store"):
                    store(out, row_tile, hk)
                return c

            turns = None
            if pingpong:  # FlashAttention-3's ping-pong: the consumers take turns issuing dots
                turns = (
                    lambda: plgpu.barrier_wait(turn_bar.at[wg]),
                    lambda: plgpu.barrier_arrive(turn_bar.at[1 - wg]),
                )
                pl.when(wg == 1)(turns[1])  # consumer 0 has the first turn ...
            if prefetch_q:
                pl.when(count > 0)(lambda: load_q(*item_of(0)))
            items(run, jnp.int32(0), early_reads)
            if pingpong:  # ... and is given one more than it takes: take it (none left over)
                pl.when(wg == 0)(turns[0])
            plgpu.wait_smem_to_gmem(0)

        if out_bases is None:
            pl.when(wg < consumers)(
                lambda: _consumer(
                    None if fold_smem is None else fold_smem.at[wg],
                    None if out_smem is None else out_smem.at[wg],
                )
            )
        elif not a_in_smem:  # (``out_in_fold``) one union: consumer c's box at token out_bases[c]
            fold_all, out_all = fold_smem
            pl.when(wg < consumers)(
                lambda: _consumer(fold_all.at[wg], out_all.at[pl.ds(out_bases[1] * wg, out_box_tokens)])
            )
        else:  # interpret mode: a union a consumer, each its own code (see ``_fold_buffers``)
            for c, union in enumerate(fold_smem):
                pl.when(wg == c)(functools.partial(_consumer, *union))

    def a_operands(*lead):
        """Interpret mode's SMEM copies of wgmma's A operands (q, p), ``lead`` x each; else None."""
        if not a_in_smem:
            return None
        return (
            plgpu.SMEM((*lead, ROWS, d), dtype, transforms=transforms),
            plgpu.SMEM((*lead, ROWS, tile), dtype, transforms=p_transforms),
        )

    if consumers == 1:
        pl.run_scoped(
            body,
            plgpu.SMEM((stages, tile, d), dtype, transforms=transforms),
            plgpu.SMEM((stages, tile, d), dtype, transforms=transforms),
            plgpu.SMEM((tile, _SUM_N), dtype, transforms=sum_transforms),
            plgpu.SMEM((2, ROWS), jnp.int32),
            plgpu.SMEM((4, max_segs), jnp.int32),
            a_operands(),
            plgpu.SMEM((ROWS, d), jnp.float32) if fold_in_smem else None,
            plgpu.Barrier(num_arrivals=pages, num_barriers=stages),
            plgpu.Barrier(num_arrivals=pages, num_barriers=stages),
            plgpu.Barrier(num_arrivals=5),
        )
        return

    def _fold_buffers():
        """(the fold's buffer, the output's staging buffer): [consumers, 64, D] fp32 (with
        ``fold_in_smem``) and ``qo_buffer`` (with ``prefetch_q``), or (``out_in_fold``) one
        ``RefUnion`` of the fold and a [tokens, G, D] view over it holding each consumer's box
        inside its own fold rows (``out_in_fold_layout``), and None. Interpret mode's race
        detector takes every access through one alias group of a union to overlap every access
        through another, whatever its bytes; so there each consumer has a union of its own (its
        fold rows and its box): the race check then sees each consumer's fold against its own
        output, and ``out_in_fold_layout`` keeps the consumers' bytes apart."""
        fold = plgpu.SMEM((consumers, ROWS, d), jnp.float32) if fold_in_smem else None
        if out_bases is None:
            return fold, qo_buffer if prefetch_q else None
        box = out_box_tokens
        if a_in_smem:
            one = plgpu.SMEM((ROWS, d), jnp.float32)
            return tuple(
                plgpu.RefUnion(one, plgpu.SMEM((box, direct[1], d), dtype, transforms=row_transforms))
                for _ in range(consumers)
            ), None
        view = plgpu.SMEM((out_bases[-1] + box, direct[1], d), dtype, transforms=row_transforms)
        return plgpu.RefUnion(fold, view), None

    # q (and with ``prefetch_q`` the output's staging buffer); with ``direct`` [tokens, G, D] in
    # 1-row tiles (8-row tiles would not take a token's G rows at any row): whole tokens that
    # cover a tile's 64 rows, a copy's box
    if direct is not None:
        qo_buffer = plgpu.SMEM(
            (consumers, _box_tokens(direct[1], d, dtype.itemsize), direct[1], d),
            dtype,
            transforms=row_transforms,
        )
    else:
        qo_buffer = plgpu.SMEM((consumers, ROWS, d), dtype, transforms=transforms)
    pl.run_scoped(
        body_specialized,
        plgpu.SMEM((k_stages, tile, d), dtype, transforms=transforms),
        plgpu.SMEM((stages, tile, d), dtype, transforms=transforms),
        plgpu.SMEM((tile, _SUM_N), dtype, transforms=sum_transforms),
        qo_buffer,
        plgpu.SMEM((consumers, 2, ROWS), jnp.int32),
        plgpu.SMEM((1 if work is None else 2, 4, max_segs), jnp.int32),
        a_operands(consumers),
        *_fold_buffers(),
        plgpu.Barrier(num_arrivals=pages, num_barriers=k_stages),
        plgpu.Barrier(num_arrivals=pages, num_barriers=stages),
        plgpu.Barrier(num_arrivals=1),  # the ones matrix
        plgpu.Barrier(num_arrivals=1, num_barriers=1 if work is None else 2),  # segments
        plgpu.Barrier(num_arrivals=consumers, num_barriers=1 if work is None else 2),  # segs_free
        plgpu.Barrier(num_arrivals=3, num_barriers=consumers),
        plgpu.Barrier(num_arrivals=consumers, num_barriers=stages),
        plgpu.Barrier(num_arrivals=consumers),
        plgpu.Barrier(num_arrivals=1, num_barriers=2) if pingpong else None,  # turns
        # (``k_ahead``) the K ring's slots consumed
        plgpu.Barrier(num_arrivals=consumers, num_barriers=k_stages) if k_stages != stages else None,
        collective_axes="wg",
    )


def segments(rseq, rpos):
    """Per tile, its sequences ascending [tiles, rows] (2**30 past the last) and their number
    [tiles]. Padding rows (position < 0) belong to no segment."""
    nt, rows = rseq.shape
    valid = rpos >= 0
    big = jnp.int32(2**30)
    key = jnp.where(valid, rseq, big)
    # a row heads its segment if no earlier valid row has its sequence
    earlier = jnp.tril(jnp.ones((rows, rows), bool), -1)
    dup = jnp.any(earlier[None] & (key[:, None, :] == key[:, :, None]) & valid[:, None, :], axis=2)
    head = valid & ~dup
    # each head's place among its tile's heads by sequence (heads' sequences differ): the sort's
    # result without a sort (an XLA sort kernel took 3-6 us of the tables on the H100)
    below = head[:, None, :] & (key[:, None, :] < key[:, :, None])
    rank = jnp.sum(below, axis=2)  # [tiles, rows]: heads with a smaller sequence
    at = head[:, None, :] & (rank[:, None, :] == jnp.arange(rows)[None, :, None])
    seqs = jnp.min(jnp.where(at, key[:, None, :], big), axis=2).astype(rseq.dtype)
    nseg = jnp.sum(head, axis=1).astype(jnp.int32)
    return seqs, nseg


def tiles_mgpu(
    qg,
    k_cache,
    v_cache,
    index,
    *,
    spec: AttentionSpec,
    stages: int = 3,
    pv: str = "into",
    overlap: bool = False,
    rounding: str = "two",
    consumers: int = 1,
    order: str = "ascending",
    one_drain: bool = False,
    q_from_smem: bool = False,
    packing: str = "pow2",
    fold_in_smem: bool = False,
    persistent: int | bool = False,
    prefetch_q: bool = False,
    direct_io: bool = False,
    token_walk: bool = False,
    pingpong: bool = False,
    bare_full: bool = False,
    lean_mask: bool = False,
    wide_sum: bool = False,
    k_ahead: bool = False,
    out_in_fold: bool = False,
    early_reads: bool = False,
    probe_skip: tuple[str, ...] = (),
    probe_exact_exp: bool = False,
    probe_unmasked: bool = False,
    probe_log2_scores: bool = False,
    probe_trace: tuple[str, str] | None = None,
    interpret=None,
):
    """q [T, Hkv, G, D] -> normalised output [T, Hkv, G, D], the ``tiles`` walk on Mosaic GPU.

    Launch choices (never the bits: every row's walk and arithmetic stay the same):
    ``consumers`` 2 makes a program of two compute warpgroups, each on its own 64-row tile,
    walking the union of their tiles' walks, and a producer warpgroup that issues the KV
    loads (FlashAttention-3's warp specialization; one program per SM, so each KV tile read
    into shared memory serves 128 rows instead of 64). A row's extra tiles and splits in the
    union are exact no-ops for it, as for the rows of one tile today. ``order`` "heaviest":
    programs take the (pairs of) row tiles with the most keys to walk first, so the long
    causal tiles do not start last. ``one_drain``: a tile's ``p @ ones`` and ``p @ v`` wgmmas
    are issued together and waited for once (not one wait each). ``q_from_smem`` (with
    ``consumers=2``): wgmma reads q from shared memory, not registers (fewer registers a thread
    under warp specialization's 232). ``packing``: how a tile's 64 rows hold tokens x query
    heads (``attention_math.row_tiles``): "dense" fills 63 rows with 9 tokens of a group of 7
    (or 21 of 3) where "pow2" pads the group to 8 (4): 8/9 (3/4) as many tiles to walk.
    ``fold_in_smem``: the split fold's fp32 accumulator waits in shared memory between folds
    (once a split: 512 keys by default) instead of holding 64 registers a thread through every
    tile; its 32 KB a warpgroup (D 128) come out of the ring: at D 128 one warpgroup fits 2
    stages, not 3, and a pair 3, not 4 (``stages`` is lowered to what fits, as always).
    ``persistent`` (with ``consumers=2``): that many programs (True: one per SM of an H100 /
    H200, 132 - a constant, as the matmul's, so that a program's text never depends on the
    process that lowers it), each running (tile pair, KV head) work items - in ``order`` -
    one after another through one ring of KV slots: the next item's first KV loads overlap
    the last item's end, and a program starts once, not once an item.
    ``prefetch_q`` (with ``persistent`` and ``fold_in_smem``): a consumer loads its next item's q
    (and rows) as soon as this item's are in registers - the load is in flight for the whole
    walk - and stages its output in a buffer of its own, stored by TMA while the next item
    starts (16 KB a warpgroup at D 128, out of the ring: 2 stages there, not 3; see
    ``out_in_fold`` for a place in the fold's SMEM). (``early_q``,
    which loaded the next q only after a walk and stored the output from registers, was
    measured in session 44 - 0.97x on 4096-token prompts, 1.03x elsewhere - and removed.)

    ``direct_io`` (with ``prefetch_q``): a consumer reads its tile's q straight from q [T, Hkv,
    G, D] and writes its output straight into the result, one TMA copy a tile each way (a
    [tokens, 1, G, D] box: a token's G query heads are G consecutive rows of a tile) where a
    tile's rows are whole query-head groups (``packing`` "dense", or a group that is a power of
    two). Without it q goes through an XLA transpose into tiles before the kernel and the
    output through another after it (at 8 x 1024 tokens, 28 / 4 heads, ~235 MB of memory
    traffic next to the kernel's). Only where the rows come from and go changes. The buffers are
    [tokens, G, D] in 1-row tiles with the 128-byte swizzle (whole tokens: 64 rows or a few
    more, a multiple of 1 KB), whose first 64 rows wgmma reads; TMA reads zeros past the last
    token (padding rows) and drops writes past it. (Session 51's form, a copy a token, cost a
    TMA issue and a barrier arrival a token: slower than the transposes at 16 and 21 tokens a
    tile; this form is faster than both everywhere, RESULTS.md session 52.)

    ``token_walk``: the walk tables (XLA work before the kernel) from each token's first row
    instead of every row (``walk_tables(token_rows=...)``: the same segments, compared pairwise
    over up to 42 tokens a program instead of 128 rows; a narrower segments table). In the
    engine's launch since session 53: on an H100 the tables took 13-19 us a call instead of
    18-31 (RESULTS.md), the same bits on every check. (``early_segs``, session 54: the next
    item's segments copied while this item's tiles were issued - 1.00-1.01x slower on the
    H100, removed: the copy was not on the critical path.)

    ``pingpong`` (with ``consumers=2`` and ``one_drain``): FlashAttention-3's ping-pong
    schedule. A consumer issues its wgmmas only in its turn (a barrier a consumer, consumer 1
    giving consumer 0 the first), then gives the other consumer its turn and waits for them:
    with ``overlap`` a tile's p @ ones and p @ v and the next tile's q @ k.T in one turn after
    the tile's softmax; without it a tile's q @ k.T in one turn and its p @ ones and p @ v in the
    next. So one consumer's softmax runs while the other's dots do; without turns both wait on
    the same K slot and run dots and softmax at the same time (session 54's trace: a tile ~
    their sum). Only when the dots are issued changes. (Session 51's ``pingpong``, one rendezvous barrier passed twice a
    tile, p @ v waited for before the next q @ k.T was issued: 1.02-1.07x slower on the H100,
    and it deadlocked on empty items; removed.)
    This form, measured (session 56, H100): 1.02-1.07x slower too - a tile's softmax (~1,250
    cycles a consumer) is ~2.4x one consumer's wgmmas, so the turns have nothing to hide it
    behind; kept for when the softmax is shorter.

    ``bare_full``: the full KV tiles (every key visible to every row of the sequence) build no
    select at all - not the scores' ``-inf`` nor the probabilities' ``0`` (64 selects a thread
    and tile) - and the logit scaling is ``mul.rn`` in every tile, so no compiler can fuse it
    into the subtraction that the selects used to keep it apart from: the same values.

    ``lean_mask``: the masked KV tiles (the causal diagonal's, a window's edge) build the key mask
    from each row's range of visible keys (``key_range``: one compare a key and side, against
    ~5 integer operations a key for ``key_mask``) and leave out the probabilities' select (their
    scores are -inf: exp gives exactly +0, the select's value): the same values.

    ``wide_sum`` (with ``one_drain``): a walk carries each of the 16 columns of ``p @ ones`` as
    its own running sum (``softmax_step``'s ``wide_sum``) and takes their max once, before the
    split's fold - not a max across a row's 4 threads (2 shuffles a row) after every tile's
    dots, where it held up the next tile's q @ k.T: the same values.

    ``k_ahead`` (with ``consumers=2``): the K ring has one slot more than the V ring, each with
    its own "consumed" barriers, and the producer loads a tile's K a tile earlier than its V
    (the next tile's K, then this tile's V) - what ``overlap`` needs: its next tile's q @ k.T
    waits for K one tile ahead, which in a 2-slot ring (D 128 with the fold and q / output
    buffers in SMEM) is the slot the tile before has only just released, so every tile waited
    out a whole load (session 57: why overlapped scores were 1.3x slower). Where it does not
    fit, the V ring has fewer slots.

    ``out_in_fold`` (with ``direct_io``): a consumer stages its output in its own fold rows
    (``out_in_fold_layout``: a ``RefUnion``), not in a buffer of its own - the output is
    written once the fold is read back, and an item's walk starts (its first fold write) once
    the item before's output store has read the box - saving 2 x 21 KB at 28 / 4 heads, where
    ``k_ahead`` does not fit otherwise (236 KB against 226). Only where the output waits
    changes. Where the rows do not go straight to the output (no ``direct``), it has no effect.

    ``early_reads`` (with ``persistent``): a consumer reads each item's launch-order entry and
    walk length from GMEM an item ahead (carried in the items loop), not when the item starts -
    three scalar loads a consumer and item, each waited for at once before (up to ~600 cycles
    each against an item of ~25,000 at 8 x 1024 tokens; session 54's trace: ~1,100 cycles
    between an item's ranges). Only when a value is read changes.

    (``defer_pv``, FlashAttention-3's schedule - a tile's p @ v waited for only at the next
    tile's rescale, the accumulator in registers across a split's tiles - was measured in
    sessions 58-59 and removed: ptxas serialized every wgmma while a group stayed in flight at
    each wait (C7514); with every group waited for at the rescale it was 1.06-1.10x slower than
    the engine's launch on the H100, and with ``out_in_fold`` one bit check (a 300-key window)
    failed. RESULTS.md session 59.)

    ``probe_exact_exp`` is a measurement probe, not a launch choice: 2**y as the exact ``exp`` of
    y * ln 2 (libdevice's ``expf``, the exponential of NUMERICS_VERSION 5, with two multiplies
    more), other bits - about what the one-instruction ``EX2_PTX`` saved. ``probe_unmasked``,
    another: every KV tile takes the full tiles' path (no key mask built, no V rows zeroed:
    wrong values) - what the masked tiles on the causal diagonal cost. ``probe_log2_scores``,
    a third: log2 e folded into the logit scale and each exponential of a tile step ``EX2_PTX``
    of the difference (one multiply an element less; the fold's exponentials as they are):
    what a numerics change to base-2 logits would save, other bits. ``probe_trace`` (directory,
    level), a fourth, keeps the bits: Mosaic GPU's on-device profiler writes each call's trace
    (a JSON file in the directory; each range a warpgroup's ``globaltimer`` start and clock
    cycles) of each item's ``begin`` / ``walk`` / ``finish`` / ``store`` and the producer's
    ``producer_setup`` / ``producer_loads`` (level "items"), or with those each KV tile
    (``tile_full``, ``tile_masked``), split fold (``fold``) and the producer's wait for a free
    slot (level "tiles"), or with those a tile's parts - ``wait_k``, ``qk``, ``wait_v``,
    ``zero_v``, ``dots`` and (``pingpong``) ``turn`` - and an item's ``begin``'s (``q_wait``,
    ``q_load``, ``next_q``, ``segs_wait``) (level "parts"); ``TRACE_RANGES`` ranges a warpgroup (``benchmarks/attention_trace.py``
    reads them). ``probe_skip``, a fifth (wrong values): parts of a tile's softmax left out -
    "exp" (each exponential of a tile step as its argument: no MUFU work), "rescale" (the
    accumulator not multiplied by the rescale factor: 64 multiplies a thread and tile fewer) -
    what each costs. Nothing in the engine passes any of them."""
    why = supported(qg.dtype, qg.shape[-1], spec)
    if why is not None:
        raise ValueError(f"attention (Mosaic GPU tiles): unsupported {why}")
    if rounding not in ROUNDINGS:
        raise ValueError(
            f"attention (Mosaic GPU tiles): rounding must be one of {ROUNDINGS}, got {rounding!r}"
        )
    if rounding != "compiler" and interpret is not None:
        raise ValueError(
            f"attention (Mosaic GPU tiles): rounding={rounding!r} has no interpret mode (inline Mosaic GPU)"
        )
    if pv not in PV_VARIANTS:
        raise ValueError(f"attention (Mosaic GPU tiles): pv must be one of {PV_VARIANTS}, got {pv!r}")
    if pv == "into" and interpret is not None:
        raise ValueError('attention (Mosaic GPU tiles): pv="into" has no interpret mode (use pv="add")')
    if consumers not in CONSUMERS:
        raise ValueError(
            f"attention (Mosaic GPU tiles): consumers must be one of {CONSUMERS}, got {consumers!r}"
        )
    if order not in ORDERS:
        raise ValueError(f"attention (Mosaic GPU tiles): order must be one of {ORDERS}, got {order!r}")
    if persistent is not False and (
        consumers == 1 or not (persistent is True or is_int(persistent) and persistent > 0)
    ):
        raise ValueError(
            "attention (Mosaic GPU tiles): persistent takes True or a positive number of programs, "
            f"with consumers=2; got persistent={persistent!r}, consumers={consumers}"
        )
    if prefetch_q and (persistent is False or not fold_in_smem or q_from_smem):
        raise ValueError(
            "attention (Mosaic GPU tiles): prefetch_q needs persistent programs and fold_in_smem, "
            "and goes without q_from_smem"
        )
    if direct_io and not prefetch_q:
        raise ValueError("attention (Mosaic GPU tiles): direct_io needs prefetch_q (its output buffer)")
    if pingpong and (consumers == 1 or not one_drain):
        raise ValueError("attention (Mosaic GPU tiles): pingpong needs consumers=2 and one_drain")
    if wide_sum and not one_drain:
        raise ValueError("attention (Mosaic GPU tiles): wide_sum needs one_drain")
    if k_ahead and consumers == 1:
        raise ValueError("attention (Mosaic GPU tiles): k_ahead needs consumers=2 (a producer's rings)")
    if out_in_fold and not direct_io:
        raise ValueError("attention (Mosaic GPU tiles): out_in_fold needs direct_io (its output boxes)")
    if early_reads and persistent is False:
        raise ValueError("attention (Mosaic GPU tiles): early_reads needs persistent programs (items)")
    if not set(probe_skip) <= {"exp", "rescale"}:
        raise ValueError(
            f"attention (Mosaic GPU tiles): probe_skip takes 'exp' and 'rescale', got {probe_skip!r}"
        )
    trace_level = None
    if probe_trace is not None:
        if not (isinstance(probe_trace, tuple) and len(probe_trace) == 2 and probe_trace[1] in TRACE_LEVELS):
            raise ValueError(
                "attention (Mosaic GPU tiles): probe_trace takes (directory, level) with a level "
                f"in {TRACE_LEVELS}, got {probe_trace!r}"
            )
        if interpret is not None:
            raise ValueError("attention (Mosaic GPU tiles): probe_trace needs a GPU (no interpret mode)")
        trace_level = probe_trace[1]
    if q_from_smem and consumers == 1:
        raise ValueError(
            "attention (Mosaic GPU tiles): q_from_smem needs consumers=2 (one warpgroup's q shares a KV slot)"
        )
    block_tables, context_lens, token_seq, token_pos = index
    hkv, d = qg.shape[1], qg.shape[3]
    num_blocks, block_size = k_cache.shape[:2]
    tile = kv_tile(block_size)
    why = _layout_refusal(block_size, qg.shape[2])
    if why is not None:
        raise ValueError(f"attention (Mosaic GPU tiles): {why}")
    q, rpos, rseq, unpack = row_tiles(qg, token_seq, token_pos, ROWS, packing)
    tokens_a_tile, rows_a_token = tile_tokens(qg.shape[2], ROWS, packing)
    direct = None
    if direct_io and rows_a_token == qg.shape[2]:  # (else the tiles' padded heads: XLA's copies)
        direct = (tokens_a_tile, rows_a_token)
    nt = rpos.shape[0]
    programs = -(-nt // consumers)
    if direct is None and programs * consumers != nt:  # a last program's second tile: padding rows
        q = jnp.pad(q, ((0, programs * consumers - nt), (0, 0), (0, 0), (0, 0)))
    rpos, rseq, segs, nseg, program_order = walk_tables(
        rpos,
        rseq,
        context_lens,
        block_tables.shape[0],
        consumers=consumers,
        order=order,
        window=spec.window,
        token_rows=(tokens_a_tile, rows_a_token) if token_walk else None,
    )
    max_segs = segs.shape[2]
    ones = jnp.ones((tile, _SUM_N), qg.dtype)
    rows_view = (num_blocks * block_size, hkv, d)
    qo_rows = ROWS if direct is None else _box_tokens(direct[1], d, qg.dtype.itemsize) * direct[1]
    out_bases = None
    if out_in_fold and direct is not None:  # (else the tiles' rows: a buffer of their own)
        out_bases = out_in_fold_layout(direct[1], d, qg.dtype.itemsize, consumers)[0]
    stages = _stages(
        tile, d, qg.dtype.itemsize, stages, consumers, bool(fold_in_smem), bool(prefetch_q), qo_rows,
        trace=trace_level is not None, k_ahead=bool(k_ahead), out_in_fold=out_bases is not None,
    )  # fmt: skip
    kwargs = {} if interpret is None else {"interpret": interpret}
    if trace_level is not None:
        kwargs["compiler_params"] = plgpu.CompilerParams(
            profile_space=TRACE_RANGES, profile_dir=probe_trace[0], profile_bounds_check=True
        )
    if consumers > 1:
        kwargs.update(num_threads=consumers + 1, thread_name="wg")
    work = None
    grid, grid_names = (programs, hkv), ("tile", "head")
    if persistent is not False:
        total = programs * hkv
        count = H200_SMS if persistent is True else int(persistent)
        work = (total, min(count, total), hkv)
        grid, grid_names = (work[1],), ("tile",)
    kernel = functools.partial(
        _kernel,
        spec=spec,
        block_size=block_size,
        max_blocks=block_tables.shape[1],
        stages=stages,
        max_segs=max_segs,
        pv=pv,
        a_in_smem=interpret is not None,
        overlap=overlap,
        rounding=rounding,
        consumers=consumers,
        one_drain=bool(one_drain),
        q_from_smem=bool(q_from_smem),
        fold_in_smem=bool(fold_in_smem),
        work=work,
        prefetch_q=bool(prefetch_q),
        direct=direct,
        probe_unmasked=bool(probe_unmasked),
        inline_ex2=interpret is None,
        probe_exact_exp=bool(probe_exact_exp),
        probe_log2_scores=bool(probe_log2_scores),
        trace=trace_level,
        pingpong=bool(pingpong),
        bare_full=bool(bare_full),
        lean_mask=bool(lean_mask),
        wide_sum=bool(wide_sum),
        k_stages=stages + bool(k_ahead),
        probe_skip=tuple(probe_skip),
        out_bases=out_bases,
        early_reads=bool(early_reads),
    )
    args = [segs, nseg, program_order, rpos, rseq, block_tables, q if direct is None else qg]
    if program_order is None:  # the program index is the tile's
        args.pop(2)
        kernel = functools.partial(_without_order, kernel)
    out_shape = (programs * consumers, hkv, ROWS, d) if direct is None else qg.shape
    out = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct(out_shape, qg.dtype),
        grid=grid,
        grid_names=grid_names,
        kernel_name="bijax_attention_tiles_mgpu",
        **kwargs,
    )(*args, k_cache.reshape(rows_view), v_cache.reshape(rows_view), ones)
    if direct is not None:
        return out
    return unpack(out if programs * consumers == nt else out[:nt])


def walk_tables(
    rpos, rseq, context_lens, num_seqs: int, *, consumers: int, order: str, window, token_rows=None
):
    """The programs' walks from the row tiles' positions and sequences [tiles, 64]: (rpos, rseq
    padded to whole programs of ``consumers`` tiles, segments [programs, 4, max segments] -
    each segment's sequence, lowest and highest row position and context length - their
    number [programs], and the launch order (None unless ``order`` is "heaviest")).

    ``token_rows`` (tokens a tile, rows a token: ``attention_math.tile_tokens``): the segments
    come from each token's first row alone - a token's other rows are its other query heads
    (the same sequence and position) or padding (position -1), so the tables are the same -
    comparing up to 2 x 21 tokens a program pairwise instead of 128 rows."""
    nt = rpos.shape[0]
    programs = -(-nt // consumers)
    if programs * consumers != nt:  # a last program's second tile: padding rows
        extra = programs * consumers - nt
        rpos = jnp.pad(rpos, ((0, extra), (0, 0)), constant_values=-1)
        rseq = jnp.pad(rseq, ((0, extra), (0, 0)))
    # a program's walk: the segments of all its rows (one tile, or the union of its tiles)
    tpos, tseq = rpos, rseq
    if token_rows is not None:  # (each token's first row: head 0, never a padded head)
        tq, per = token_rows
        tpos, tseq = rpos[:, : tq * per : per], rseq[:, : tq * per : per]
    prog_pos, prog_seq = tpos.reshape(programs, -1), tseq.reshape(programs, -1)
    # (padding rows to a multiple of 8: the kernel's TMA copies of the tables want rows of 16
    # bytes and buffers at 128-byte boundaries)
    extra = -prog_pos.shape[1] % 8
    prog_pos = jnp.pad(prog_pos, ((0, 0), (0, extra)), constant_values=-1)
    prog_seq = jnp.pad(prog_seq, ((0, 0), (0, extra)))
    seqs, nseg = segments(prog_seq, prog_pos)
    mine = (prog_seq[:, None, :] == seqs[:, :, None]) & (prog_pos >= 0)[:, None, :]
    lo = jnp.min(jnp.where(mine, prog_pos[:, None, :], 2**30), axis=2)
    hi = jnp.max(jnp.where(mine, prog_pos[:, None, :], -1), axis=2)
    safe = jnp.clip(seqs, 0, num_seqs - 1)
    ctx = context_lens[safe]
    segs = jnp.stack([safe, lo, hi, ctx], axis=1).astype(jnp.int32)
    program_order = heaviest_first(lo, hi, nseg, window) if order == "heaviest" else None
    return rpos, rseq, segs, nseg, program_order


def _without_order(kernel, segs_ref, nseg_ref, *refs):
    return kernel(segs_ref, nseg_ref, None, *refs)


def heaviest_first(lo, hi, nseg, window):
    """Programs by the keys their walk covers, most first (ties: ascending): a launch order.
    ``lo``, ``hi`` [programs, max_segs]: each segment's lowest and highest row position."""
    first_key = 0 if window is None else jnp.maximum(lo - window + 1, 0)
    used = jnp.arange(lo.shape[1])[None, :] < nseg[:, None]
    work = jnp.sum(jnp.where(used, hi + 1 - first_key, 0), axis=1)
    return jnp.argsort(-work, stable=True).astype(jnp.int32)
