"""The matmul's GPU kernel (Pallas, Triton lowering) and its launch shapes.

One program per (leaf, row tile, column tile) sums its leaf in ``tile_k`` chunks in ascending
order into an fp32 accumulator; the leaves are combined by ``plan.combine_leaves``. The launch
shape (``GpuTiles``) may follow M: a row's bits do not depend on it (benchmarks/kernels.py
checks a dozen shapes bit for bit on the H200).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.plan import GPU_MIN_TILE_N, H200_SMS, MatmulPlan, leaf_result, to_leaves

# Decode-row launches (16-row tiles, 2-byte weights) take 64-column tiles from this many programs
# on (Llama-3-8B's 4096-column weights give 64); narrower weights keep 32-column tiles.
DECODE_WIDE_PROGRAMS = 64
# Row tile groups that share column tiles in consecutive programs (L2 reuse at large M).
_GPU_GROUP_M = 8
# GPU row tiles chosen from M (rows are bit-identical across these; proven on
# the H200 by benchmarks/kernels.py, which compares every choice bit for bit).
GPU_TILE_M = (16, 32, 64, 128)
# Weights that share their input (a layer's q, k and v) run in one launch when their launch
# shapes agree (``shared_partial``): each program is the program a launch of its own weight
# would run, so the same bits, with one kernel's ramp and tail instead of several. Read when a
# program is traced (set it before the first trace: jit caches do not key on it; the engine's
# step cache does); interpret mode always takes the one launch.
SHARED_LAUNCH = True
# Up to this many rows the shared launch is taken even where each weight alone would run on the
# Mosaic GPU kernel (32 < M <= 64 on K >= 4096): at M = 64 it took 0.93x the three Mosaic
# launches' time for llama3-8b's q, k, v, 0.89x for gate, up, 0.49x for qwen2.5-7b's q, k, v
# (H200, CUPTI, same run, bits equal: RESULTS.md 2026-12-06 session 47). 0: the old rule.
SHARED_OVER_MGPU_ROWS = 64
# gate and up share x but run as one launch only from this many rows: at M <= 16 one launch of
# both took 68 us against 62 us for a launch each (H200, llama3-8b; sessions 33 and 47), at
# M = 32 58 us against 62, at M = 64 59 against 66 (Mosaic each). Read by models.llama.
GATE_UP_SHARED_MIN_ROWS = 17
# The shared launch's shape where set, for launch sweeps (benchmarks/kernels.py --mid-rows):
# (GpuTiles for the row tile, warps and stages; each weight's column tile, or None for its own
# launch's). A launch choice, never the bits; read when a program is traced (clear jit's caches
# after setting it).
SHARED_TILES: tuple[GpuTiles, tuple[int, ...] | None] | None = None


@dataclasses.dataclass(frozen=True)
class GpuTiles:
    """Launch shape of the GPU kernel. It may depend on M: a row's bits do not depend on
    it (benchmarks/kernels.py checks a dozen shapes bit for bit on the GPU)."""

    tile_m: int
    tile_n: int
    num_warps: int
    num_stages: int


def gpu_tile_m(m: int) -> int:
    """Row tile for the GPU kernel: the smallest of GPU_TILE_M that covers m, else the largest."""
    for t in GPU_TILE_M:
        if m <= t:
            return t
    return GPU_TILE_M[-1]


def gpu_tiles(plan: MatmulPlan, m: int) -> GpuTiles:
    """Widest column tile that still gives the GPU enough programs at this M.

    Measured on the H200 (benchmarks/RESULTS.md): 128-row tiles are heavy enough
    that ~96 programs fill it; decode-sized tiles want 2 warps and a deeper pipeline.
    """
    tile_m = gpu_tile_m(m)
    programs = -(-m // tile_m) * plan.num_leaves
    enough = 96 if tile_m >= 128 else H200_SMS
    for tile_n in (256, 128, 64, GPU_MIN_TILE_N):
        if tile_n == 256 and tile_m < 128:
            continue
        if programs * -(-plan.n // tile_n) >= enough:
            break
    wide = tile_m == 16 and tile_n <= 64 and plan.n % 64 == 0 and jnp.dtype(plan.dtype).itemsize == 2
    if wide and programs * (plan.n // 64) >= DECODE_WIDE_PROGRAMS:
        # Decode rows: 64 columns, 4 warps, an 8-deep pipeline (H200, Llama-3-8B's bf16 qkv, o
        # and down at M = 1 and 16: 1.31-1.44x XLA's time with 32 columns, 2 warps and 4 stages
        # -> 0.99-1.16x; RESULTS.md, session 24, `kernels.py --decode-sweep`, same bits). Only
        # where 64 columns need no padding, and for 2-byte weights (what was measured).
        return GpuTiles(16, 64, 4, 8)
    if tile_m <= 32 and tile_n <= 64:
        return GpuTiles(tile_m, tile_n, 2, 4)
    return GpuTiles(tile_m, tile_n, 8 if tile_m * tile_n >= 128 * 128 else 4, 3)


def k_loop(load_x, load_w, num_chunks: int, shape):
    """The K reduction every GPU matmul kernel runs: an fp32 accumulator over ``num_chunks``
    chunks in ascending order, ``acc + dot(load_x(c), load_w(c))``. The one home of that chain
    (``matmul``, ``grouped_matmul`` and ``gate_up_swiglu`` run it, so their rows have the same
    bits). ``load_w`` a tuple of loaders (weights sharing x): an accumulator each, each that
    chain over the same x chunk, returned as a tuple."""

    def dot(x, w):
        # HIGHEST: float32 inputs use full-precision IEEE products, never TF32.
        return jnp.dot(x, w, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)

    if isinstance(load_w, tuple):

        def body_many(c, accs):
            x = load_x(c)
            return tuple(acc + dot(x, load(c)) for acc, load in zip(accs, load_w, strict=True))

        zeros = tuple(jnp.zeros(shape, jnp.float32) for _ in load_w)
        return lax.fori_loop(0, num_chunks, body_many, zeros)

    def body(c, acc):
        return acc + dot(load_x(c), load_w(c))

    return lax.fori_loop(0, num_chunks, body, jnp.zeros(shape, jnp.float32))


def _matmul_kernel(x_ref, w_ref, o_ref, *, tile_k: int, leaf_k: int):
    """One (leaf, row tile, column tile): fp32 sum over the leaf in tile_k chunks, in ascending order."""
    acc = k_loop(
        lambda c: x_ref[:, pl.ds(c * tile_k, tile_k)],
        lambda c: w_ref[pl.ds(c * tile_k, tile_k), :],
        leaf_k // tile_k,
        o_ref.shape[-2:],
    )
    o_ref[...] = acc.astype(o_ref.dtype)


def swizzle(pid, row_tiles: int, col_tiles: int):
    """Program id -> (leaf, row tile, column tile); groups of _GPU_GROUP_M row tiles walk the
    column tiles together so consecutive programs share weight tiles in L2."""
    tiles = row_tiles * col_tiles
    leaf, t = pid // tiles, pid % tiles
    width = _GPU_GROUP_M * col_tiles
    first = (t // width) * _GPU_GROUP_M
    size = jnp.minimum(row_tiles - first, _GPU_GROUP_M)
    return leaf, first + (t % width) % size, (t % width) // size


def leaf_output(ids, num_leaves: int, shape, block, out_dtype):
    """The output's BlockSpec and shape for a (leaf, row tile, column tile) grid: one [M, N]
    result in out_dtype for one leaf, else an fp32 [L, M, N] of partial sums (one per leaf,
    combined afterwards). ``ids`` maps a program id to (leaf, row tile, column tile)."""

    def o_map(pid):
        leaf, i, j = ids(pid)
        return (i, j) if num_leaves == 1 else (leaf, i, j)

    if num_leaves == 1:
        return pl.BlockSpec(block, o_map), jax.ShapeDtypeStruct(shape, out_dtype)
    return pl.BlockSpec((pl.squeezed, *block), o_map), jax.ShapeDtypeStruct((num_leaves, *shape), jnp.float32)


def _matmul_pallas(
    x,
    w,
    *,
    plan: MatmulPlan,
    num_leaves: int,
    out_dtype,
    tiles: GpuTiles,
    interpret: bool,
    combine: bool = True,
):
    """x[M, L*leaf_k], w[L*leaf_k, N] (leaf layout) -> combined result in out_dtype; with
    ``combine`` False the kernel's own output (``leaf_result``'s input), rows and columns
    padded to whole tiles."""
    m, n = x.shape[0], w.shape[1]
    tm, tn = tiles.tile_m, tiles.tile_n
    mp, np_ = -(-m // tm) * tm, -(-n // tn) * tn
    if mp != m:
        x = jnp.pad(x, ((0, mp - m), (0, 0)))
    if np_ != n:
        w = jnp.pad(w, ((0, 0), (0, np_ - n)))
    lk = plan.leaf_k
    rt, ct = mp // tm, np_ // tn
    ids = functools.partial(swizzle, row_tiles=rt, col_tiles=ct)

    def x_map(pid):
        leaf, i, _ = ids(pid)
        return i, leaf

    def w_map(pid):
        leaf, _, j = ids(pid)
        return leaf, j

    out_spec, out_shape = leaf_output(ids, num_leaves, (mp, np_), (tm, tn), out_dtype)
    out = pl.pallas_call(
        functools.partial(_matmul_kernel, tile_k=plan.tile_k, leaf_k=lk),
        grid=(num_leaves * rt * ct,),
        in_specs=[pl.BlockSpec((tm, lk), x_map), pl.BlockSpec((lk, tn), w_map)],
        out_specs=out_spec,
        out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret,
        name="bijax_matmul",
    )(x, w)
    if not combine:
        return out
    out = out[..., :m, :n]
    return leaf_result(out, num_leaves, plan.split_k, out_dtype)


def triton_partial(x, w, *, plan, num_shards, out_dtype, tiles, interpret, combine: bool = True):
    xl = to_leaves(x, plan, num_shards, axis=1)
    wl = to_leaves(w, plan, num_shards, axis=0)
    if tiles is None:
        tiles = default_tiles(plan, x.shape[0], interpret)
    return _matmul_pallas(
        xl,
        wl,
        plan=plan,
        num_leaves=num_shards * plan.split_k,
        out_dtype=out_dtype,
        tiles=tiles,
        interpret=interpret,
        combine=combine,
    )


def default_tiles(plan: MatmulPlan, m: int, interpret: bool) -> GpuTiles:
    """The Triton launch ``triton_partial`` takes by default at M rows: ``gpu_tiles``, or in
    interpret mode one fixed tile (it computes each block with the CPU's dot, whose bits depend
    on the block shape)."""
    return GpuTiles(16, plan.tile_n, 4, 3) if interpret else gpu_tiles(plan, m)


def _pair_kernel(x_ref, a_ref, b_ref, o_ref, *, tile_k: int, leaf_k: int, epilogue):
    """One (row tile, column tile) of two one-leaf weights sharing x (a SwiGLU MLP's gate and
    up): each weight's fp32 sum is ``_matmul_kernel``'s chain (``k_loop``, one accumulator a
    weight over the same x chunks); the program stores ``epilogue(sum_a, sum_b, dtype)``."""
    acc_a, acc_b = k_loop(
        lambda c: x_ref[:, pl.ds(c * tile_k, tile_k)],
        (lambda c: a_ref[pl.ds(c * tile_k, tile_k), :], lambda c: b_ref[pl.ds(c * tile_k, tile_k), :]),
        leaf_k // tile_k,
        o_ref.shape,
    )
    o_ref[...] = epilogue(acc_a, acc_b, o_ref.dtype).astype(o_ref.dtype)


def pair_epilogue(x, a, b, *, plan: MatmulPlan, out_dtype, tiles: GpuTiles, interpret: bool, epilogue):
    """``epilogue(x @ a, x @ b)`` for two [K, N] weights of one one-leaf plan, in one launch: a
    program per (row tile, column tile) computes both weights' tiles (each with ``matmul``'s
    chain, so each sum has ``matmul``'s bits before the epilogue) and stores the epilogue's
    [tile_m, tile_n] -> [M, N] in out_dtype."""
    if plan.num_leaves != 1:
        raise ValueError(f"pair_epilogue: the weights' plan must have one leaf, it has {plan.num_leaves}")
    if not callable(epilogue):
        raise TypeError(f"pair_epilogue: epilogue must be a function (sum_a, sum_b, dtype), got {epilogue!r}")
    m, n = x.shape[0], a.shape[1]
    tm, tn = tiles.tile_m, tiles.tile_n
    mp, np_ = -(-m // tm) * tm, -(-n // tn) * tn
    xl = to_leaves(x, plan, 1, axis=1)
    al, bl = (to_leaves(w, plan, 1, axis=0) for w in (a, b))
    if mp != m:
        xl = jnp.pad(xl, ((0, mp - m), (0, 0)))
    if np_ != n:
        al, bl = (jnp.pad(w, ((0, 0), (0, np_ - n))) for w in (al, bl))
    lk = plan.leaf_k
    ids = functools.partial(swizzle, row_tiles=mp // tm, col_tiles=np_ // tn)
    w_spec = pl.BlockSpec((lk, tn), lambda pid: (0, ids(pid)[2]))
    out = pl.pallas_call(
        functools.partial(_pair_kernel, tile_k=plan.tile_k, leaf_k=lk, epilogue=epilogue),
        grid=((mp // tm) * (np_ // tn),),
        in_specs=[pl.BlockSpec((tm, lk), lambda pid: (ids(pid)[1], 0)), w_spec, w_spec],
        out_specs=pl.BlockSpec((tm, tn), lambda pid: ids(pid)[1:]),
        out_shape=jax.ShapeDtypeStruct((mp, np_), out_dtype),
        compiler_params=pltriton.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret,
        name="bijax_matmul_pair",
    )(xl, al, bl)
    return out[:m, :n]


# --------------------------------------------------------------------------- weights sharing x


def shared_tiles(plans, m: int) -> GpuTiles | None:
    """The launch settings one launch of ``plans``' weights at M rows shares (row tile, warps,
    pipeline depth; ``tile_n`` is the first weight's, each weight keeps its own), or None where
    the weights' own launch shapes (``gpu_tiles``) differ in them."""
    tiles = [gpu_tiles(p, m) for p in plans]
    first = tiles[0]
    if any(
        (t.tile_m, t.num_warps, t.num_stages) != (first.tile_m, first.num_warps, first.num_stages)
        for t in tiles
    ):
        return None
    return first


def _shared_kernel(*refs, specs, num_x: int, tile_k: int, tile_m: int):
    """The programs of several weights' launches in one grid: weight i owns programs
    [start_i, start_i + leaves_i * row_tiles * col_tiles_i) and runs ``_matmul_kernel``'s K loop
    on them, reading x (its leaf layout ``x_index``) and its weight whole, at the offsets its
    own launch's BlockSpecs would give."""
    x_refs, rest = refs[:num_x], refs[num_x:]
    w_refs, o_refs = rest[: len(specs)], rest[len(specs) :]
    pid = pl.program_id(0)
    for (x_index, leaf_k, leaves, rt, ct, tn, start), w_ref, o_ref in zip(specs, w_refs, o_refs, strict=True):

        def run(
            x_ref=x_refs[x_index],
            w_ref=w_ref,
            o_ref=o_ref,
            leaf_k=leaf_k,
            leaves=leaves,
            rt=rt,
            ct=ct,
            tn=tn,
            start=start,
        ):
            leaf, i, j = swizzle(pid - start, rt, ct)
            k0, r0, n0 = leaf * leaf_k, i * tile_m, j * tn
            acc = k_loop(
                lambda c: x_ref[pl.ds(r0, tile_m), pl.ds(k0 + c * tile_k, tile_k)],
                lambda c: w_ref[pl.ds(k0 + c * tile_k, tile_k), pl.ds(n0, tn)],
                leaf_k // tile_k,
                (tile_m, tn),
            )
            if leaves == 1:
                o_ref[pl.ds(r0, tile_m), pl.ds(n0, tn)] = acc.astype(o_ref.dtype)
            else:
                o_ref[leaf, pl.ds(r0, tile_m), pl.ds(n0, tn)] = acc

        pl.when((pid >= start) & (pid < start + leaves * rt * ct))(run)


def shared_partial(
    x,
    ws,
    *,
    plans,
    num_shards,
    out_dtype,
    tiles: GpuTiles,
    interpret,
    combine: bool = True,
    tile_ns: tuple[int, ...] | None = None,
):
    """``[triton_partial(x, w, plan=p, ...) for w, p in zip(ws, plans)]`` in one launch with
    ``tiles``' row tile, warps and stages: each weight keeps the column tile its own launch
    would take (``gpu_tiles``, or in interpret mode its plan's; ``tile_ns``: one given per
    weight), so its programs are its own launch's programs and its bits that launch's.
    ``combine`` False: the kernel's own outputs (as ``triton_partial``'s)."""
    m = x.shape[0]
    tm = tiles.tile_m
    mp = -(-m // tm) * tm
    rt = mp // tm
    layouts, xls, specs, wls, out_shapes = {}, [], [], [], []
    start = 0
    if tile_ns is not None and len(tile_ns) != len(ws):
        raise ValueError(f"shared_partial: {len(tile_ns)} column tiles for {len(ws)} weights")
    for i, (w, plan) in enumerate(zip(ws, plans, strict=True)):
        key = (plan.k_shards, plan.split_k, plan.leaf_k, plan.shard_k)
        if key not in layouts:
            xl = to_leaves(x, plan, num_shards, axis=1)
            layouts[key] = len(xls)
            xls.append(jnp.pad(xl, ((0, mp - m), (0, 0))) if mp != m else xl)
        if tile_ns is not None:
            tn = tile_ns[i]
        else:
            tn = plan.tile_n if interpret else gpu_tiles(plan, m).tile_n
        n = w.shape[1]
        np_ = -(-n // tn) * tn
        wl = to_leaves(w, plan, num_shards, axis=0)
        wls.append(jnp.pad(wl, ((0, 0), (0, np_ - n))) if np_ != n else wl)
        leaves = num_shards * plan.split_k
        ct = np_ // tn
        specs.append((layouts[key], plan.leaf_k, leaves, rt, ct, tn, start))
        start += leaves * rt * ct
        shape = (mp, np_) if leaves == 1 else (leaves, mp, np_)
        out_shapes.append(jax.ShapeDtypeStruct(shape, out_dtype if leaves == 1 else jnp.float32))

    def whole(a):
        zeros = (0,) * len(a.shape)
        return pl.BlockSpec(a.shape, lambda pid: zeros)

    outs = pl.pallas_call(
        functools.partial(
            _shared_kernel, specs=tuple(specs), num_x=len(xls), tile_k=plans[0].tile_k, tile_m=tm
        ),
        grid=(start,),
        in_specs=[whole(a) for a in xls + wls],
        out_specs=[whole(s) for s in out_shapes],
        out_shape=out_shapes,
        compiler_params=pltriton.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret,
        name="bijax_matmul_shared",
    )(*xls, *wls)
    if not combine:
        return list(outs)
    results = []
    for out, w, plan, (_, _, leaves, *_rest) in zip(outs, ws, plans, specs, strict=True):
        results.append(leaf_result(out[..., :m, : w.shape[1]], leaves, plan.split_k, out_dtype))
    return results
