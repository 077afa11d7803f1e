"""A SwiGLU MLP's hidden activation: ``swiglu`` (the formula's one home) and
``gate_up_swiglu(x, w_gate, w_up)`` = ``swiglu(x @ w_gate, x @ w_up)`` rounded to x's dtype,
with the bits of the two matmuls and then the formula - on the GPU at decode rows in one
launch (``FUSED``): each program computes a column tile of both projections (``matmul``'s K
chain for each, ``matmul_triton.pair_epilogue``) and applies SiLU(g) * u to them in its
epilogue, so a layer runs one kernel where it ran three (gate, up, an XLA fusion) and writes
and reads no g and u.

The kernel's epilogue is ``swiglu`` itself: Pallas Triton's sigmoid (``1 / (1 + exp(-g))``)
gives the XLA fusion's bits on every bfloat16 g with four sets of u, in float32 and rounded
to bfloat16 (H100, ``benchmarks/swiglu_bits.py``, session 50); the op against the unfused one:
``benchmarks/kernels.py --gate-up`` (H100: bits PASS for three models' weights at M 1-300,
0.87-0.88x the unfused ops' kernel time; the engine's digests MATCH with it).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels import runtime
from pallas_kernels.matmul import (
    _check_cols,
    _check_operands,
    _dot_bwd,
    _matmul_impl,
    _planned,
    _runs_mgpu,
    formulations,
)
from pallas_kernels.matmul_triton import GpuTiles, default_tiles, gpu_tiles, pair_epilogue
from pallas_kernels.plan import MatmulPlan, round_like

F32 = jnp.float32

# True (the default): on the GPU, gate and up of one-leaf plans (every dense model's) at any M where their
# launches are Triton ones (the model calls the op below GATE_UP_SHARED_MIN_ROWS rows) run as
# one launch with SwiGLU in its epilogue. False: the two matmuls' results, then ``swiglu`` in an
# XLA fusion - the same bits (the switch of benchmarks/ab.py swiglu). Read when a program is
# traced and not part of jit's cache key (clear the caches after setting it; the engine's step
# cache keys on it).
FUSED = True
# The fused launch's shape (None: ``pair_tiles``); a launch choice, never the bits.
PAIR_TILES: GpuTiles | None = None
# Decode rows of 2-byte weights with at least this many 128-column tiles take 128 columns, 8 warps
# and 3 stages: llama3-8b's gate and up at M = 1 / 16 in 77.6 / 77.1 us, against 82.3 / 82.2
# for the gate's own launch shape with half its stages (16 x 64, 4 warps, 4 stages), 88.4 /
# 88.5 for gate and up a launch each plus the XLA fusion, and XLA's 80.3 / 89.4 (H100, CUPTI,
# weights rotated past L2, every launch checked bit for bit; RESULTS.md session 50).
PAIR_WIDE_TILES = 64
# The model takes the fused launch up to this many rows (``models.llama``), and here it replaces
# the Mosaic GPU kernel where that would run (32 < M <= 64 on K >= 4096 weights: ``matmul``'s
# rule for one weight). Above it, gate and up go ``matmul_shared``'s way and SwiGLU is an XLA
# fusion. llama3-8b's gate and up at 32 / 64 rows: 77.8 / 79.2 us fused (M x 64 tiles, 4 warps,
# 3 stages) against 82.1 / 83.0 for the shared launch + the XLA fusion the model ran there,
# and XLA's 94.3 / 97.7 (H100, CUPTI, rotated weights, bits checked; RESULTS.md session 51).
# 16 (decode rows only, session 50's rule): the switch of ``benchmarks/ab.py swiglu-mid``. A
# launch choice: the same bits either way.
FUSED_MAX_ROWS = 64


def swiglu(g: jax.Array, u: jax.Array) -> jax.Array:
    """SiLU(g) * u = g * sigmoid(g) * u on float32 g, u (the projections' results, each rounded
    to the model's dtype first), float32 out: the one formula of a SwiGLU MLP's activation."""
    return g * jax.nn.sigmoid(g) * u


def _epilogue(acc_g, acc_u, out_dtype):
    """The fused launch's epilogue: each float32 sum rounded to the output dtype (the matmuls'
    results g and u), then ``swiglu`` - the same formula in the kernel: Pallas Triton's sigmoid
    gives XLA's fusion's bits on every bfloat16 g (H100, ``benchmarks/swiglu_bits.py``, session
    50; an IEEE ``div.rn`` in its place did not)."""
    return swiglu(round_like(acc_g, out_dtype), round_like(acc_u, out_dtype))


def pair_tiles(plan: MatmulPlan, m: int, interpret: bool = False) -> GpuTiles:
    """The fused launch's shape at M rows (``PAIR_TILES`` if set): for wide 2-byte weights
    (``PAIR_WIDE_TILES``) at decode rows 16 x 128 tiles, 8 warps, 3 stages, at 17-64 rows
    M-row tiles (32 or 64) x 64 columns, 4 warps, 3 stages; else the gate weight's own launch
    (``gpu_tiles``) with half its pipeline stages (each stage holds both weights' tiles); in
    interpret mode matmul's fixed interpret tile."""
    if interpret:
        return default_tiles(plan, m, interpret=True)
    if PAIR_TILES is not None:
        return PAIR_TILES
    t = gpu_tiles(plan, m)
    wide = plan.n % 128 == 0 and plan.n // 128 >= PAIR_WIDE_TILES and jnp.dtype(plan.dtype).itemsize == 2
    if t.tile_m == 16 and wide:
        return GpuTiles(16, 128, 8, 3)
    if t.tile_m in (32, 64) and wide:  # 17-64 rows (``FUSED_MAX_ROWS``)
        return GpuTiles(t.tile_m, 64, 4, 3)
    return dataclasses.replace(t, num_stages=max(2, t.num_stages // 2))


def _unfused(g, u, dtype):
    return swiglu(g.astype(F32), u.astype(F32)).astype(dtype)


def _impl(x, wg, wu, cols, backend, interpret):
    mm_cpu, mm_gpu = formulations(x.dtype, 1, cols, backend, interpret)

    def cpu(x, wg, wu):
        return _unfused(mm_cpu(x, wg), mm_cpu(x, wu), x.dtype)

    def gpu(x, wg, wu):
        plan = _planned(wg, 1, cols, "gpu")
        m = x.shape[0]
        mgpu = backend == "auto" and not interpret and _runs_mgpu(plan, m) and m > FUSED_MAX_ROWS
        if FUSED and plan.num_leaves == 1 and not mgpu:
            tiles = pair_tiles(plan, x.shape[0], interpret)
            kw = dict(plan=plan, out_dtype=x.dtype, tiles=tiles, interpret=interpret)
            return pair_epilogue(x, wg, wu, epilogue=_epilogue, **kw)
        return _unfused(mm_gpu(x, wg)[0], mm_gpu(x, wu)[0], x.dtype)

    return runtime.dispatch(backend, cpu, gpu, x, wg, wu)


# Differentiable: the forward under differentiation runs the matmuls and the formula unfused
# (the same bits) and keeps g and u; the backward is the formula's VJP, then each matmul's
# float32 dots - what autodiff of ``swiglu(matmul(x, w_gate), matmul(x, w_up))`` gives.
@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _vjp(x, wg, wu, cols, backend, interpret):
    return _impl(x, wg, wu, cols, backend, interpret)


def _vjp_fwd(x, wg, wu, cols, backend, interpret):
    g, u = (_matmul_impl(x, w, x.dtype, 1, cols, backend, interpret, None) for w in (wg, wu))
    return _unfused(g, u, x.dtype), (x, wg, wu, g, u)


def _vjp_bwd(cols, backend, interpret, res, dh):
    x, wg, wu, g, u = res
    _, vjp = jax.vjp(lambda g, u: _unfused(g, u, x.dtype), g, u)
    dg, du = vjp(dh)
    dxg, dwg = _dot_bwd(x, wg, dg)
    dxu, dwu = _dot_bwd(x, wu, du)
    return dxg + dxu, dwg, dwu


_vjp.defvjp(_vjp_fwd, _vjp_bwd)


@runtime.kernel_op("gate_up_swiglu", static_argnames=("cols", "backend", "interpret"))
def _gate_up_swiglu(x, wg, wu, *, cols, backend, interpret):
    return _vjp(x, wg, wu, cols, backend, interpret)


def gate_up_swiglu(
    x: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    *,
    col_blocks: int = 1,
    full_n: int | None = None,
    backend: str = "auto",
    interpret: bool = False,
) -> jax.Array:
    """``swiglu(matmul(x, w_gate), matmul(x, w_up))`` rounded to x's dtype (``matmul`` with
    ``col_blocks`` and ``full_n``) - a SwiGLU MLP's hidden activation - with the same bits; on
    the GPU (``FUSED``) at decode rows in one kernel launch.

    Args:
      x: [M, K]; w_gate, w_up: [K, N] each (or a column-parallel rank's columns of them, with
        ``full_n``); all of one float dtype.
      col_blocks, full_n, backend, interpret: as ``matmul``'s.
    Differentiable (``jax.custom_vjp``: the formula's VJP, then ``matmul``'s backward).
    """
    for name, w in (("w_gate", w_gate), ("w_up", w_up)):
        try:
            _check_operands(x, w, None)
        except (TypeError, ValueError) as e:
            raise type(e)(f"gate_up_swiglu: {name}: {str(e).removeprefix('matmul: ')}") from None
    if tuple(w_gate.shape) != tuple(w_up.shape):
        raise ValueError(f"gate_up_swiglu: w_gate is {tuple(w_gate.shape)} but w_up is {tuple(w_up.shape)}")
    n = w_gate.shape[1]
    full_n = n if full_n is None else full_n
    _check_cols("gate_up_swiglu", "w_gate", n, col_blocks, full_n)
    runtime.check_backend(backend, interpret)
    return _gate_up_swiglu(x, w_gate, w_up, cols=(col_blocks, full_n), backend=backend, interpret=interpret)


__all__ = ["gate_up_swiglu", "swiglu"]
