"""Mosaic GPU (Hopper wgmma) path of the batch-invariant matmul.

Drop-in for ``matmul_triton``'s kernel / ``matmul_triton.triton_partial``: the same leaf layout in
(``x[M, L*leaf_k]``, ``w[L*leaf_k, N]``, made by ``plan.to_leaves``), the same result out
(``L == 1``: ``[M, N]`` in ``out_dtype``; ``L > 1``: fp32 partials per leaf combined by
``plan.combine_leaves``). Every leaf is the fp32 sum over its K in ascending order, like the
Triton kernel's ``acc + dot(xk, wk)`` over ``TILE_K = 64`` chunks:

* ``fused=True`` (default): one wgmma accumulator per output tile; every k16 wgmma step of
  every chunk accumulates into it in ascending K. Measured on the H200: bit-identical to the
  Triton kernel (fp32 leaf sums and bf16/f16 outputs) for M 1..4096, seven weight shapes,
  k_shards 1 and 8, every launch shape tried - so Triton (XLA's Triton pipeline) folds
  ``acc + dot(a, b, 0)`` into ``dot(a, b, acc)``, and its mma chain equals this one.
* ``fused=False``: each 64-wide chunk is a wgmma chain from zero, then added to the running
  fp32 sum. Measured: NOT Triton's bits (almost every element differs, up to ~5e-6 relative).
  Kept only as the diagnostic that tells the two orders apart.

Only 2-byte dtypes (bfloat16, float16) have a wgmma path; float32 stays on Triton
(HIGHEST-precision f32 products have no wgmma form). Which of the two paths is faster per
(plan, M) is ``prefer_mgpu``.

Kernel structure (after ``jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu``): a
persistent grid of CTAs walks the (leaf, row tile, column tile) work items; in each, a
warp-specialized TMA pipeline (one memory warpgroup) feeds one or two compute
warpgroups that run wgmma on swizzled SMEM tiles; the epilogue goes registers -> SMEM ->
TMA store. TMA zero-fills loads past M / N and drops stores there, so ragged M and N need
no padding copies (except M > 8 not a multiple of 8: TMA's (8, .) tiling).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.plan import H200_SMS, TILE_K, leaf_result, to_leaves

MGPU_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# H100/H200 dynamic shared memory per block (227 KiB), less room for barriers.
_SMEM_BYTES = 227 * 1024 - 2048


@dataclasses.dataclass(frozen=True)
class MgpuTiles:
    """Launch shape of the Mosaic GPU kernel (rows' bits do not depend on it).

    tile_m, tile_n: the output tile of ONE compute warpgroup (tile_m in {64, 128, ...},
      tile_n 32 or a multiple of 64 up to 256).
    wgs: compute warpgroups per CTA (1 or 2); with 2 they split the CTA tile along
      ``wg_dim`` ("n": CTA tile tile_m x 2*tile_n, "m": 2*tile_m x tile_n).
    stages: TMA pipeline depth (capped by SMEM and by the leaf's chunk count).
    persistent: grid of min(work, SMs) CTAs looping over work items; else one CTA each.
    grid_minor, grid_width: planar-snake order of (row tile, column tile) inside a leaf.
    fused: accumulation chain (see the module docstring).
    step_k: K per pipeline step (a multiple of 64; lowered to what divides the leaf). With
      ``fused`` the wgmma chain is the same run of k16 steps in ascending K for any step_k.
    tile_n 32 uses 64-byte swizzled SMEM tiles (wgmma wants both operands' swizzles equal).
    """

    tile_m: int = 128
    tile_n: int = 128
    wgs: int = 2
    wg_dim: str = "n"
    stages: int = 4
    persistent: bool = True
    grid_minor: str = "n"
    grid_width: int = 8
    fused: bool = True
    step_k: int = 64

    @property
    def cta_m(self) -> int:
        return self.tile_m * (2 if self.wgs == 2 and self.wg_dim == "m" else 1)

    @property
    def cta_n(self) -> int:
        return self.tile_n * (2 if self.wgs == 2 and self.wg_dim == "n" else 1)


def supported(dtype) -> bool:
    """Whether this path exists for the dtype (bf16/f16 wgmma with fp32 accumulation)."""
    return jnp.dtype(dtype) in MGPU_DTYPES


# Launch shapes tried in order: (tiles, least work items). A candidate is skipped when it
# would give fewer items, or pad N by more than 1/8 (N = 576 with 256-wide tiles). Tuned on
# the H200 (benchmarks/h200_mgpu_2026-11-30.log, "SWEEP"/"TIME" lines); every one of these
# gave the Triton kernel's bits.
_WIDE_M = (  # M > 64
    (MgpuTiles(128, 128, 2, "n", 4), 64),  # CTA 128 x 256
    (MgpuTiles(128, 64, 2, "n", 4), H200_SMS),  # CTA 128 x 128
    (MgpuTiles(64, 64, 2, "m", 4, step_k=128), 64),  # CTA 128 x 64
    (MgpuTiles(64, 64, 1, "n", 8), 0),  # CTA 64 x 64
)
_NARROW_M = (  # M <= 64: one 64-row tile, weight streaming
    (MgpuTiles(64, 128, 2, "n", 4, step_k=128), 128),  # CTA 64 x 256
    (MgpuTiles(64, 64, 2, "n", 6), H200_SMS),  # CTA 64 x 128
    (MgpuTiles(64, 64, 1, "n", 8), 0),  # CTA 64 x 64
)
# Decode rows (M <= 16) stream the weight best in 256-deep K steps (fewer barrier round trips).
_DECODE_64 = MgpuTiles(64, 64, 1, "n", 4, step_k=256)
# 128 < M <= 256 (two 128-row tiles) where CTAs of 128 x 256 would not fill the SMs: 128 x 128
# (H200, h200_mid_m_tiles_2026-12-04.log, M = 256: o 20.5 vs 27.4 us, down 50.5 vs 73.5, qkv
# 25.3 vs 30.7 for the launch the table gave; at M = 384 the table's launch was the best).
_MID_256 = MgpuTiles(128, 64, 2, "n", 4)


def mgpu_tiles(n: int, num_leaves: int, m: int, *, num_sms: int = H200_SMS) -> MgpuTiles:
    """Default launch shape from (N, leaves, M): only the launch, never the bits, follows M."""
    if 128 < m <= 256:
        wide = _WIDE_M[0][0]
        if num_leaves * -(-m // wide.cta_m) * -(-n // wide.cta_n) < num_sms:
            return _MID_256
    cands = _WIDE_M if m > 64 else _NARROW_M
    for t, least in cands:
        cols = -(-n // t.cta_n)
        if cols * t.cta_n * 8 > n * 9 and least:
            continue
        if num_leaves * -(-m // t.cta_m) * cols >= least * num_sms // H200_SMS:
            break
    if m <= 16 and t.cta_n == 64:
        return _DECODE_64
    return t


def prefer_mgpu(plan, m: int) -> bool:
    """Whether the Mosaic path is the faster one for this (plan, M) on an H200 (measured).

    Faster (CUPTI kernel time, benchmarks/h200_mgpu_2026-11-30.log): every timed cell with
    M >= 512 (0.55-0.92x Triton's time; weights 576x1536 ... 4096x128256, M 512/2048/4096,
    k_shards 1, and 14336x4096 with k_shards 8), and M = 64 on K >= 4096 weights that stream
    through 64 x 64 tiles (N * leaves < 16896: 0.50-0.91x; Triton's 64-row tiles are slow
    there, and it uses them for every M in 33..64 while the Mosaic kernel's work does not
    change with M <= 64). Decode rows (M <= 16) and wide-N weights at M <= 64 tie or lose
    (0.98-1.5x): Triton. 17 <= M <= 32 was not timed: Triton until measured.
    64 < M < 512 (benchmarks/h200_shared_launch_mid_m_2026-12-04.log and
    h200_mid_m_tiles_2026-12-04.log: Llama-3-8B's four layer weights at M 96, 128, 256, 384):
    Mosaic took 0.51-0.91x Triton's time in 14 of 16 cells (M = 256 with ``_MID_256``'s
    launch), 1.02-1.03x on gate_up at M 96 and 128.
    """
    if plan.platform != "gpu" or jnp.dtype(plan.dtype) not in MGPU_DTYPES:
        return False
    if m > 64:
        return True
    return 32 < m <= 64 and plan.k >= 4096 and plan.n * plan.num_leaves < 16896


def _step_k(t: MgpuTiles, leaf_k: int) -> int:
    step = t.step_k
    while leaf_k % step:
        step -= TILE_K
    return step


def _stages(t: MgpuTiles, step_k: int, k_iters: int, itemsize: int, out_smem_bytes: int) -> int:
    stage = (t.cta_m * step_k + step_k * t.cta_n) * itemsize
    fit = (_SMEM_BYTES - out_smem_bytes) // stage
    if fit < 1:
        raise ValueError(f"mgpu matmul: tiles {t} do not fit in shared memory")
    return max(1, min(t.stages, k_iters, fit))


def _kernel(
    x_gmem, w_gmem, o_gmem, *, t: MgpuTiles, leaf_k: int, m_iters: int, n_iters: int, num_leaves: int
):
    """x_gmem [M, L*leaf_k], w_gmem [L*leaf_k, N] -> o_gmem [M, N] (L == 1) or [L, M, N].

    M and N need not be multiples of the tile: TMA loads zero-fill out-of-bounds rows and
    columns and TMA stores drop them."""
    dtype = x_gmem.dtype
    out_dtype = o_gmem.dtype
    itemsize = jnp.dtype(dtype).itemsize
    # One swizzle for both operands: x's K rows of the step and w's (per-warpgroup) columns.
    swizzle = plgpu.find_swizzle(min(TILE_K, t.tile_n) * itemsize * 8)
    swizzle_elems = swizzle // itemsize
    transforms = (plgpu.TilingTransform((8, swizzle_elems)), plgpu.SwizzleTransform(swizzle))
    tile_m, tile_n, cta_m, cta_n = t.tile_m, t.tile_n, t.cta_m, t.cta_n
    step_k = _step_k(t, leaf_k)
    k_iters = leaf_k // step_k

    out_itemsize = jnp.dtype(out_dtype).itemsize
    epi_m, epi_n = min(64, tile_m), min(64, tile_n)
    slots = min(2, (tile_m * tile_n) // (epi_m * epi_n))
    out_swizzle = plgpu.find_swizzle(epi_n * out_itemsize * 8)
    out_transforms = (
        plgpu.TilingTransform((8, out_swizzle // out_itemsize)),
        plgpu.SwizzleTransform(out_swizzle),
    )
    out_smem_bytes = t.wgs * slots * epi_m * epi_n * out_itemsize
    stages = _stages(t, step_k, k_iters, itemsize, out_smem_bytes)

    def get_pipeline(body, compute_context):
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(k_iters,),
            memory_registers=40,
            in_specs=[
                plgpu.BlockSpec(
                    (cta_m, step_k), lambda k: (0, k), transforms=transforms, memory_space=plgpu.SMEM
                ),
                plgpu.BlockSpec(
                    (step_k, cta_n), lambda k: (k, 0), transforms=transforms, memory_space=plgpu.SMEM
                ),
            ],
            wg_axis="wg",
            num_compute_wgs=t.wgs,
            max_concurrent_steps=stages,
            compute_context=compute_context,
        )

    ignore = lambda *_, **__: None  # noqa: E731

    @functools.partial(
        pl.run_scoped,
        pipeline_allocs=get_pipeline(ignore, ignore).get_allocations(x_gmem, w_gmem),
        out_smem=plgpu.SMEM((t.wgs, slots, epi_m, epi_n), out_dtype, transforms=out_transforms),
        collective_axes="wg",
    )
    def _scope(pipeline_allocs, out_smem):
        wg_idx = lax.axis_index("wg")
        items_per_leaf = m_iters * n_iters

        @plgpu.nd_loop((num_leaves * items_per_leaf,), collective_axes="sm")
        def _item(info: plgpu.NDLoopInfo):
            (lin,) = info.index
            leaf = lax.div(lin, jnp.int32(items_per_leaf))
            rest = lax.rem(lin, jnp.int32(items_per_leaf))
            mi, ni = plgpu.planar_snake(
                rest, (m_iters, n_iters), 0 if t.grid_minor == "m" else 1, t.grid_width
            )
            k_slice = pl.ds(leaf * leaf_k, leaf_k)
            cta_m_slice = pl.ds(mi * cta_m, cta_m)
            cta_n_slice = pl.ds(ni * cta_n, cta_n)
            if t.wgs == 2 and t.wg_dim == "m":
                wg_m, wg_n = pl.ds(wg_idx * tile_m, tile_m), slice(None)
            elif t.wgs == 2:
                wg_m, wg_n = slice(None), pl.ds(wg_idx * tile_n, tile_n)
            else:
                wg_m, wg_n = slice(None), slice(None)

            o_leaf = o_gmem.at[leaf] if num_leaves > 1 else o_gmem

            def epilogue(acc):
                acc = acc.astype(out_dtype)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                for em in range(tile_m // epi_m):
                    for en in range(tile_n // epi_n):
                        ms = slice(em * epi_m, (em + 1) * epi_m)
                        ns = slice(en * epi_n, (en + 1) * epi_n)
                        slot = (em * (tile_n // epi_n) + en) % slots
                        plgpu.wait_smem_to_gmem(slots - 1, wait_read_only=True)
                        out_smem[wg_idx, slot] = acc[ms, ns]
                        plgpu.commit_smem()
                        plgpu.copy_smem_to_gmem(
                            out_smem.at[wg_idx, slot],
                            o_leaf.at[cta_m_slice, cta_n_slice].at[wg_m, wg_n].at[ms, ns],
                        )

            if t.fused:

                def compute_context(eval_pipeline):
                    @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tile_m, tile_n), jnp.float32))
                    def _acc(acc_ref):
                        eval_pipeline(acc_ref)
                        epilogue(acc_ref[...])

                def body(_, x_smem, w_smem, acc_ref):
                    plgpu.wgmma(acc_ref, x_smem.at[wg_m], w_smem.at[:, wg_n])
                    plgpu.wgmma_wait(0)
                    return acc_ref

            else:

                def compute_context(eval_pipeline):
                    epilogue(eval_pipeline(jnp.zeros((tile_m, tile_n), jnp.float32)))

                def body(_, x_smem, w_smem, total):
                    @functools.partial(pl.run_scoped, part_ref=plgpu.ACC((tile_m, tile_n), jnp.float32))
                    def part(part_ref):  # a fresh (zeroed) accumulator for this chunk
                        plgpu.wgmma(part_ref, x_smem.at[wg_m], w_smem.at[:, wg_n])
                        plgpu.wgmma_wait(0)
                        return part_ref[...]

                    return total + part

            get_pipeline(body, compute_context)(
                x_gmem.at[cta_m_slice, k_slice],
                w_gmem.at[k_slice, cta_n_slice],
                allocations=pipeline_allocs,
            )

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def matmul_mgpu_leaves(
    x,
    w,
    *,
    leaf_k: int,
    num_leaves: int,
    out_dtype,
    tiles: MgpuTiles,
    num_sms: int = H200_SMS,
    pad_small_m: bool = False,
    interpret=None,
):
    """Leaf layout in -> ``[L, M, N]`` fp32 partials (L > 1) or ``[M, N]`` out_dtype (L == 1).

    x[M, L*leaf_k], w[L*leaf_k, N]; any M >= 1. TMA zero-fills loads past M / N and drops
    stores there, so no padding copies, except: M > 8 not a multiple of 8 is padded to one
    (TMA's (8, .) tiling; ``pad_small_m`` also pads M < 8), N not a multiple of 8 too.
    """
    if not supported(x.dtype) or x.dtype != w.dtype:
        raise TypeError(f"mgpu matmul: needs bf16/f16 operands of one dtype, got {x.dtype}, {w.dtype}")
    if leaf_k % TILE_K or x.shape[1] != num_leaves * leaf_k or w.shape[0] != x.shape[1]:
        raise ValueError(
            f"mgpu matmul: not a leaf layout: x {x.shape}, w {w.shape}, {num_leaves=}, {leaf_k=}"
        )
    t = tiles
    if (
        t.wgs not in (1, 2)
        or t.wg_dim not in ("m", "n")
        or t.tile_m % 64
        or (t.tile_n % 64 and t.tile_n != 32)
        or t.tile_n > 256
        or t.step_k % TILE_K
        or t.step_k < TILE_K
    ):
        raise ValueError(f"mgpu matmul: bad tiles {t}")
    m, n = x.shape[0], w.shape[1]
    m_real, n_real = m, n
    # TMA with the (8, .) SMEM tiling wants the row count to be a multiple of 8 or below 8.
    if m % 8 and (m > 8 or pad_small_m):
        x = jnp.pad(x, ((0, -m % 8), (0, 0)))
        m = x.shape[0]
    if n % 8:  # TMA needs 16-byte row strides: pad such weights' columns (a copy per call)
        np_ = -(-n // t.cta_n) * t.cta_n
        w = jnp.pad(w, ((0, 0), (0, np_ - n)))
        n = np_
    m_iters, n_iters = -(-m // t.cta_m), -(-n // t.cta_n)
    work = num_leaves * m_iters * n_iters
    grid = min(work, num_sms) if t.persistent else work
    if num_leaves == 1:
        out_type = jax.ShapeDtypeStruct((m, n), out_dtype)
    else:
        out_type = jax.ShapeDtypeStruct((num_leaves, m, n), jnp.float32)
    kwargs = {} if interpret is None else {"interpret": interpret}
    out = plgpu.kernel(
        functools.partial(
            _kernel, t=t, leaf_k=leaf_k, m_iters=m_iters, n_iters=n_iters, num_leaves=num_leaves
        ),
        out_type=out_type,
        grid=(grid,),
        grid_names=("sm",),
        num_threads=t.wgs + 1,
        thread_name="wg",
        kernel_name="bijax_matmul_mgpu",
        **kwargs,
    )(x, w)
    if (m_real, n_real) != (m, n):
        out = out[..., :m_real, :n_real]
    return out


def mgpu_partial(
    x,
    w,
    *,
    plan,
    num_shards: int,
    out_dtype,
    tiles: MgpuTiles | None = None,
    pad_small_m: bool = False,
    interpret=None,
    combine: bool = True,
):
    """Mosaic GPU twin of ``matmul_triton.triton_partial`` (same arguments, same bits)."""

    xl = to_leaves(x, plan, num_shards, axis=1)
    wl = to_leaves(w, plan, num_shards, axis=0)
    num_leaves = num_shards * plan.split_k
    if tiles is None:
        tiles = mgpu_tiles(plan.n, num_leaves, x.shape[0])
    out = matmul_mgpu_leaves(
        xl,
        wl,
        leaf_k=plan.leaf_k,
        num_leaves=num_leaves,
        out_dtype=out_dtype,
        tiles=tiles,
        pad_small_m=pad_small_m,
        interpret=interpret,
    )
    return leaf_result(out, num_leaves, plan.split_k, out_dtype) if combine else out


__all__ = [
    "MGPU_DTYPES",
    "MgpuTiles",
    "matmul_mgpu_leaves",
    "mgpu_partial",
    "mgpu_tiles",
    "prefer_mgpu",
    "supported",
]
