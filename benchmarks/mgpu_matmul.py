"""Mosaic GPU (wgmma) matmul vs the Pallas Triton path: bit identity and kernel time, on the H200.

(Over 400 lines: it is one device run - every phase shares the compiled kernels and the time
budget of a single call - so its phases stay in one script.)

Run from the repo root:
    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/mgpu_matmul.py [--budget 250] [--phases A,T,B]

Phases (each guarded by the time budget, most informative first; every case catches its own
exceptions and the run goes on):
  A  sanity: Mosaic vs Triton bits on a few shapes, with the accumulation variants
     (fused wgmma chain / 64-chunk from zero then add), launch-shape variants, M < 8 with
     and without padding, float16. Picks the variant that matches for the later phases.
  T  timing: CUPTI medians of kernel time, weights rotated over copies exceeding the L2,
     XLA vs Triton vs Mosaic side by side (and the bf16 outputs compared bit for bit).
  B  the bit matrix: M in MS x (K, N) in WEIGHTS x k_shards 1, 8; the fp32 leaf sums (the
     kernels' own output, before any bf16 rounding) Mosaic(x[:M]) vs Triton(x[:4096])[:M]
     plus a direct Triton(x[:M]) at a few M (the Triton rows are batch invariant).
Compact tables last.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib
import math
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

mm = importlib.import_module("pallas_kernels.matmul")
mg = importlib.import_module("pallas_kernels.matmul_mgpu")

WEIGHTS = [(576, 1536), (1536, 576), (576, 49152), (4096, 6144), (4096, 14336), (14336, 4096), (4096, 128256)]
MS = (1, 7, 16, 64, 100, 128, 255, 512, 2048, 4096)
DIRECT_MS = (1, 100)  # Triton(x[:M]) computed directly too, as a check of the Triton rows' invariance
T = mg.MgpuTiles
A_KN = (4096, 6144)
A_EXTRA = ((14336, 4096, 8, 64), (14336, 4096, 1, 16), (1536, 576, 8, 100))  # (K, N, k_shards, M)
START = time.time()
DEADLINE = START + 250.0
BITS_ROWS: list[tuple] = []
TIME_ROWS: list[tuple] = []
SWEEP_ROWS: list[tuple] = []
STATE = {"fused": True, "pad_small_m": False}


def left() -> float:
    return DEADLINE - time.time()


def log(*a):
    print(f"[{time.time() - START:6.1f}s]", *a, flush=True)


def rand(key, shape, dtype, scale=1.0):
    return (jax.random.normal(jax.random.key(key), shape, jnp.float32) * scale).astype(dtype)


def bits(a) -> np.ndarray:
    a = np.asarray(jax.device_get(a))
    return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def ulp_diff(a: np.ndarray, b: np.ndarray) -> tuple[int, int]:
    """(elements that differ, max distance in ULPs) between two bit arrays of one float type."""
    if a.shape != b.shape:
        return -1, -1
    wide = np.int64
    nbits = a.dtype.itemsize * 8
    sign = wide(1) << (nbits - 1)

    def ordered(x):
        x = x.astype(wide)
        return np.where(x & sign, -(x & (sign - 1)), x)

    d = np.abs(ordered(a) - ordered(b))
    return int((d != 0).sum()), int(d.max()) if d.size else 0


# --------------------------------------------------------------------------- the two paths


@functools.partial(jax.jit, static_argnames=("k_shards", "out_dtype"))
def triton_path(x, w, *, k_shards, out_dtype):
    # backend="triton": the Triton kernel only (the Mosaic path is taken only under "auto").
    return mm.matmul(x, w, k_shards=k_shards, out_dtype=out_dtype, backend="triton")


@functools.partial(jax.jit, static_argnames=("k_shards", "out_dtype", "tiles", "pad_small_m"))
def mosaic_path(x, w, *, k_shards, out_dtype, tiles=None, pad_small_m=False):
    plan = mm.plan_matmul(w.shape[0], w.shape[1], w.dtype, k_shards=k_shards, platform="gpu")
    return mg.mgpu_partial(
        x, w, plan=plan, num_shards=k_shards, out_dtype=out_dtype, tiles=tiles, pad_small_m=pad_small_m
    )


def mosaic(x, w, ks, out_dtype, tiles=None, fused=None, pad_small_m=None):
    fused = STATE["fused"] if fused is None else fused
    pad_small_m = STATE["pad_small_m"] if pad_small_m is None else pad_small_m
    if tiles is None:
        plan = mm.plan_matmul(w.shape[0], w.shape[1], w.dtype, k_shards=ks, platform="gpu")
        tiles = mg.mgpu_tiles(plan.n, ks * plan.split_k, x.shape[0])
    if tiles.fused != fused:
        tiles = T(**{**tiles.__dict__, "fused": fused})
    return mosaic_path(x, w, k_shards=ks, out_dtype=out_dtype, tiles=tiles, pad_small_m=pad_small_m)


@jax.jit
def _same_bits(a, b):
    u = {2: jnp.uint16, 4: jnp.uint32}[a.dtype.itemsize]
    return jnp.array_equal(jax.lax.bitcast_convert_type(a, u), jax.lax.bitcast_convert_type(b, u))


def compare(tag, got, ref) -> bool | None:
    try:
        if got.shape == ref.shape and got.dtype == ref.dtype and bool(_same_bits(got, ref)):
            log(f"SAME {tag}: 0/{got.size} elements differ")
            BITS_ROWS.append((tag, True, 0, got.size, 0))
            return True
        g, r = bits(got), bits(ref)
        nd, mu = ulp_diff(g, r)
        ok = nd == 0
        rel = float(np.max(np.abs(np.asarray(got, np.float64) - np.asarray(ref, np.float64)))) / max(
            1e-30, float(np.max(np.abs(np.asarray(ref, np.float64))))
        )
        log(
            f"{'SAME' if ok else 'DIFF'} {tag}: {nd}/{g.size} elements differ, max {mu} ulp, max rel {rel:.2e}"
        )
        BITS_ROWS.append((tag, ok, nd, g.size, mu))
        return ok
    except Exception as e:  # noqa: BLE001
        log(f"ERROR {tag}: {type(e).__name__}: {str(e)[:300]}")
        BITS_ROWS.append((tag, None, -1, -1, -1))
        return None


def attempt(tag, fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001
        msg = str(e).strip().splitlines()
        log(f"ERROR {tag}: {type(e).__name__}: {' | '.join(msg[:3])[:600]}")
        if "--verbose" in sys.argv:
            traceback.print_exc()
        BITS_ROWS.append((tag, None, -1, -1, -1))
        return None


# --------------------------------------------------------------------------- phase A


def phase_a():
    log("=== phase A: sanity and accumulation variants ===")
    f32 = jnp.float32
    k, n = A_KN
    x = rand(1, (512, k), jnp.bfloat16)
    w = rand(2, (k, n), jnp.bfloat16, 1 / math.sqrt(k))
    results = {}
    for m in (255, 1):
        ref = triton_path(x[:m], w, k_shards=1, out_dtype=f32)
        for fused in (True, False):
            tag = f"A {k}x{n} M={m} ks=1 f32-partials fused={fused}"
            results[(m, fused)] = compare(tag, attempt(tag, mosaic, x[:m], w, 1, f32, fused=fused), ref)
    fused_ok = bool(results.get((255, True))) and bool(results.get((1, True)))
    split_ok = bool(results.get((255, False))) and bool(results.get((1, False)))
    STATE["fused"] = fused_ok or not split_ok
    log(
        f"INFO accumulation: fused matches={fused_ok}, 64-chunk-then-add matches={split_ok}; using fused={STATE['fused']}"
    )
    # bf16 output end to end (in-kernel fp32 -> bf16 rounding)
    for m in (255, 1):
        tag = f"A {k}x{n} M={m} ks=1 bf16-out"
        ref = triton_path(x[:m], w, k_shards=1, out_dtype=jnp.bfloat16)
        compare(tag, attempt(tag, mosaic, x[:m], w, 1, jnp.bfloat16), ref)
    # M < 8: unpadded (TMA bounds) vs padded to 8
    small = {}
    for m in (7, 3):
        ref = triton_path(x[:m], w, k_shards=1, out_dtype=f32)
        for pad in (False, True):
            tag = f"A {k}x{n} M={m} ks=1 f32 pad_small_m={pad}"
            small[(m, pad)] = compare(tag, attempt(tag, mosaic, x[:m], w, 1, f32, pad_small_m=pad), ref)
    if not (small[(7, False)] and small[(3, False)]) and small[(7, True)] and small[(3, True)]:
        STATE["pad_small_m"] = True
    log(f"INFO M < 8: pad_small_m={STATE['pad_small_m']}")
    # launch shapes at M=255 (all must give the same bits)
    ref = triton_path(x[:255], w, k_shards=1, out_dtype=f32)
    for t in (
        T(128, 64, 2, "n", 4),
        T(64, 128, 2, "m", 4),
        T(64, 64, 2, "n", 6),
        T(64, 64, 1, "n", 8),
        T(128, 128, 2, "n", 4, persistent=False),
        T(128, 256, 1, "n", 3, grid_minor="m", grid_width=4),
    ):
        tag = f"A {k}x{n} M=255 ks=1 f32 {t.tile_m}x{t.tile_n}x{t.wgs}{t.wg_dim} st{t.stages} pers={t.persistent}"
        compare(tag, attempt(tag, mosaic, x[:255], w, 1, f32, tiles=t), ref)
    # split-K leaves + k_shards tree (down proj) and N not a multiple of the tile (576)
    for kk, nn, ks, m in A_EXTRA:
        xx = rand(3, (m, kk), jnp.bfloat16)
        ww = rand(4, (kk, nn), jnp.bfloat16, 1 / math.sqrt(kk))
        for od in (f32, jnp.bfloat16):
            tag = f"A {kk}x{nn} M={m} ks={ks} {jnp.dtype(od).name}"
            compare(
                tag,
                attempt(tag, mosaic, xx, ww, ks, od),
                triton_path(xx, ww, k_shards=ks, out_dtype=od),
            )
    # float16
    xh, wh = x.astype(jnp.float16), w.astype(jnp.float16)
    for m in (255, 1):
        tag = f"A {k}x{n} M={m} ks=1 float16 f32-partials"
        compare(
            tag,
            attempt(tag, mosaic, xh[:m], wh, 1, f32),
            triton_path(xh[:m], wh, k_shards=1, out_dtype=f32),
        )


# --------------------------------------------------------------------------- phase T


def kernel_us(fn, *args, iterations: int = 20):
    """(outputs of fn, median CUPTI kernel time of one call in us)."""
    from jax.experimental.mosaic.gpu import profiler

    out, times = profiler.measure(fn, iterations=iterations)(*args)
    return out, statistics.median(times) * 1e3


def copies_for(nbytes: int) -> int:
    return min(48, max(3, math.ceil(3 * 60e6 / nbytes)))


TIMED = [  # (K, N, M, k_shards), most decision-relevant first
    (4096, 6144, 4096, 1),
    (4096, 14336, 4096, 1),
    (14336, 4096, 4096, 1),
    (4096, 6144, 512, 1),
    (14336, 4096, 512, 1),
    (4096, 128256, 512, 1),
    (4096, 6144, 1, 1),
    (14336, 4096, 1, 1),
    (4096, 128256, 64, 1),
    (4096, 14336, 64, 1),
    (4096, 6144, 64, 1),
    (14336, 4096, 64, 1),
    (4096, 14336, 1, 1),
    (4096, 6144, 2048, 1),
    (4096, 128256, 1, 1),
    (14336, 4096, 1, 8),
    (14336, 4096, 4096, 8),
    (576, 1536, 512, 1),
    (1536, 576, 512, 1),
    (576, 49152, 512, 1),
    (576, 1536, 1, 1),
    (1536, 576, 1, 1),
    (576, 49152, 1, 1),
    (576, 49152, 64, 1),
    (1536, 576, 1, 8),
    (576, 1536, 4096, 1),
    (1536, 576, 4096, 1),
    (576, 49152, 4096, 1),
    (4096, 128256, 4096, 1),
]


def phase_t(cells):
    log("=== phase T: timing (CUPTI median kernel us, weights rotated) ===")
    bf = jnp.bfloat16
    for k, n, m, ks in cells:
        if left() < 25:
            log(f"SKIP timing {k}x{n} M={m} ks={ks}: budget")
            continue
        tag = f"{k}x{n} M={m} ks={ks}"
        try:
            copies = copies_for(k * n * 2)
            x = rand(30, (m, k), bf)
            ws = [rand(31 + i, (k, n), bf, 1 / math.sqrt(k)) for i in range(copies)]
            plan = mm.plan_matmul(k, n, bf, k_shards=ks, platform="gpu")
            tiles = mg.mgpu_tiles(n, ks * plan.split_k, m)
            if tiles.fused != STATE["fused"]:
                tiles = T(**{**tiles.__dict__, "fused": STATE["fused"]})
            ops = {
                "xla": lambda x, w: x @ w,
                "triton": lambda x, w, ks=ks: triton_path(x, w, k_shards=ks, out_dtype=bf),
                "mosaic": lambda x, w, ks=ks, tiles=tiles: mosaic_path(
                    x, w, k_shards=ks, out_dtype=bf, tiles=tiles, pad_small_m=STATE["pad_small_m"]
                ),
            }
            res = {}
            outs = {}
            for name, op in ops.items():
                try:
                    fn = jax.jit(lambda x, *ws, op=op: [op(x, w) for w in ws])
                    out, us = kernel_us(fn, x, *ws)
                    res[name] = us / copies
                    outs[name] = out[0]
                except Exception as e:  # noqa: BLE001
                    log(f"ERROR timing {tag} {name}: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
                    res[name] = float("nan")
            same = None
            if "mosaic" in outs and "triton" in outs:
                same = bool(np.array_equal(bits(outs["mosaic"]), bits(outs["triton"])))
            t = res
            log(
                f"TIME {tag}: xla {t['xla']:.1f}  triton {t['triton']:.1f}  mosaic {t['mosaic']:.1f} us"
                f"  mosaic/triton {t['mosaic'] / t['triton']:.2f}  mosaic/xla {t['mosaic'] / t['xla']:.2f}"
                f"  triton/xla {t['triton'] / t['xla']:.2f}  bits mosaic==triton: {same}"
                f"  mgpu {tiles.cta_m}x{tiles.cta_n} wgs={tiles.wgs} triton {mm.gpu_tiles(plan, m)}"
            )
            TIME_ROWS.append(
                (
                    k,
                    n,
                    m,
                    ks,
                    t["xla"],
                    t["triton"],
                    t["mosaic"],
                    same,
                    f"{tiles.cta_m}x{tiles.cta_n}/{tiles.wgs}",
                )
            )
            del ws, outs
        except Exception as e:  # noqa: BLE001
            log(f"ERROR timing {tag}: {type(e).__name__}: {str(e).splitlines()[0][:300]}")


def phase_sweep(cells):
    """Mosaic launch shapes side by side with XLA and Triton; each one's bf16 output vs Triton's."""
    log("=== phase S: Mosaic launch-shape sweep ===")
    bf = jnp.bfloat16
    for k, n, m, ks, variants in cells:
        if left() < 20:
            log(f"SKIP sweep {k}x{n} M={m} ks={ks}: budget")
            continue
        try:
            copies = copies_for(k * n * 2)
            x = rand(30, (m, k), bf)
            ws = [rand(31 + i, (k, n), bf, 1 / math.sqrt(k)) for i in range(copies)]
            ref = {}
            for name, op in (
                ("xla", lambda x, w: x @ w),
                ("triton", lambda x, w, ks=ks: triton_path(x, w, k_shards=ks, out_dtype=bf)),
            ):
                fn = jax.jit(lambda x, *ws, op=op: [op(x, w) for w in ws])
                out, us = kernel_us(fn, x, *ws)
                ref[name] = (out[0], us / copies)
            log(f"SWEEP {k}x{n} M={m} ks={ks}: xla {ref['xla'][1]:.1f} us, triton {ref['triton'][1]:.1f} us")
        except Exception as e:  # noqa: BLE001
            log(f"ERROR sweep {k}x{n} M={m} ks={ks} refs: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            continue
        for t in variants:
            if left() < 15:
                break
            t = T(**{**t.__dict__, "fused": STATE["fused"]})
            desc = f"{t.cta_m}x{t.cta_n}/{t.wgs}{t.wg_dim} st{t.stages} sk{t.step_k} pers={int(t.persistent)}"
            try:
                fn = jax.jit(
                    lambda x, *ws, t=t, ks=ks: [
                        mosaic_path(
                            x, w, k_shards=ks, out_dtype=bf, tiles=t, pad_small_m=STATE["pad_small_m"]
                        )
                        for w in ws
                    ]
                )
                out, us = kernel_us(fn, x, *ws)
                us /= copies
                same = bool(_same_bits(out[0], ref["triton"][0]))
                BITS_ROWS.append(
                    (f"S {k}x{n} M={m} ks={ks} {desc} bf16", same, 0 if same else -1, out[0].size, -1)
                )
                log(
                    f"SWEEP {k}x{n} M={m} ks={ks} {desc}: {us:.1f} us  mosaic/triton {us / ref['triton'][1]:.2f}"
                    f"  mosaic/xla {us / ref['xla'][1]:.2f}  bits==triton {same}"
                )
                SWEEP_ROWS.append((k, n, m, ks, desc, ref["xla"][1], ref["triton"][1], us, same))
            except Exception as e:  # noqa: BLE001
                log(f"ERROR sweep {k}x{n} M={m} {desc}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        del ws, ref


# --------------------------------------------------------------------------- phase B


def phase_b(k_shards_list=(1, 8), weights=None):
    log("=== phase B: bit matrix (fp32 leaf sums, Mosaic(x[:M]) vs Triton(x[:4096])[:M]) ===")
    f32 = jnp.float32
    for ks in k_shards_list:
        for k, n in weights or WEIGHTS:
            if left() < 15:
                log(f"SKIP bits {k}x{n} ks={ks}: budget")
                continue
            try:
                x = rand(10, (max(MS), k), jnp.bfloat16)
                w = rand(11, (k, n), jnp.bfloat16, 1 / math.sqrt(k))
                full = triton_path(x, w, k_shards=ks, out_dtype=f32)
            except Exception as e:  # noqa: BLE001
                log(f"ERROR bits {k}x{n} ks={ks} setup: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
                continue
            for m in MS:
                if left() < 10:
                    log(f"SKIP bits {k}x{n} ks={ks} M={m}: budget")
                    break
                tag = f"B {k}x{n} ks={ks} M={m}"
                got = attempt(tag, mosaic, x[:m], w, ks, f32)
                if got is not None:
                    compare(tag, got, full[:m])
                if m in DIRECT_MS:
                    compare(
                        f"B-triton-invariance {k}x{n} ks={ks} M={m}",
                        triton_path(x[:m], w, k_shards=ks, out_dtype=f32),
                        full[:m],
                    )
            del x, w, full


# --------------------------------------------------------------------------- main


def main():
    global DEADLINE
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=float, default=250.0, help="seconds for the whole run")
    ap.add_argument("--phases", default="A,T,B")
    ap.add_argument("--fused", choices=("auto", "1", "0"), default="auto")
    ap.add_argument("--timed", default="", help="indices into TIMED (comma list) or empty for all")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args()
    DEADLINE = START + args.budget
    if args.fused != "auto":
        STATE["fused"] = args.fused == "1"
    dev = jax.devices()[0]
    log(f"# {datetime.date.today()} {dev.device_kind} jax {jax.__version__} phases={args.phases}")
    phases = args.phases.split(",")
    cells = TIMED if not args.timed else [TIMED[int(i)] for i in args.timed.split(",")]
    for ph in phases:
        if left() < 10:
            break
        t_ph = time.time()
        try:
            if ph == "A":
                phase_a()
            elif ph == "T":
                phase_t(cells)
            elif ph == "B":
                phase_b()
            elif ph == "B8":
                phase_b((8,))
            elif ph == "B8rest":
                phase_b((8,), B8_REST)
            elif ph == "B1":
                phase_b((1,))
            elif ph == "S":
                phase_sweep(SWEEP)
        except Exception as e:  # noqa: BLE001
            log(f"ERROR phase {ph}: {type(e).__name__}: {e}")
            traceback.print_exc()
        log(f"phase {ph} took {time.time() - t_ph:.0f}s")
    # ---- compact tables
    print("\n## bits (Mosaic vs Triton)")
    same = sum(1 for r in BITS_ROWS if r[1] is True)
    diff = [r for r in BITS_ROWS if r[1] is False]
    err = [r for r in BITS_ROWS if r[1] is None]
    print(f"same {same}, differ {len(diff)}, errors {len(err)}")
    for r in diff:
        print(f"DIFF {r[0]}: {r[2]}/{r[3]} differ, max {r[4]} ulp")
    for r in err:
        print(f"ERROR {r[0]}")
    print(
        "\n| K x N | M | k_shards | XLA us | Triton us | Mosaic us | Mosaic/Triton | Mosaic/XLA | Triton/XLA | bf16 bits equal | mgpu CTA/wgs |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for k, n, m, ks, a, b, c, s, cfg in TIME_ROWS:
        print(
            f"| {k}x{n} | {m} | {ks} | {a:.1f} | {b:.1f} | {c:.1f} | {c / b:.2f} | {c / a:.2f} | {b / a:.2f} | {s} | {cfg} |"
        )
    if SWEEP_ROWS:
        print(
            "\n| K x N | M | k_shards | Mosaic launch | XLA us | Triton us | Mosaic us | Mosaic/Triton | bits |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for k, n, m, ks, desc, a, b, c, same in SWEEP_ROWS:
            print(f"| {k}x{n} | {m} | {ks} | {desc} | {a:.1f} | {b:.1f} | {c:.1f} | {c / b:.2f} | {same} |")
    print(f"\nfused={STATE['fused']} pad_small_m={STATE['pad_small_m']} wall {time.time() - START:.0f}s")


_DECODE = [
    T(64, 64, 1, "n", 8),
    T(64, 64, 1, "n", 4, step_k=256),
    T(64, 32, 1, "n", 4, step_k=256),
    T(64, 32, 1, "n", 6, step_k=128),
    T(64, 32, 1, "n", 2, step_k=256, persistent=False),
    T(64, 64, 1, "n", 2, step_k=256, persistent=False),
]
_WIDE_DECODE = [
    T(64, 128, 2, "n", 5),
    T(64, 128, 2, "n", 4, step_k=128),
    T(64, 64, 2, "n", 4, step_k=256),
    T(64, 64, 1, "n", 4, step_k=256),
]
_MID = [
    T(128, 64, 2, "n", 4),
    T(128, 128, 2, "n", 4),
    T(64, 128, 2, "m", 4),
    T(64, 64, 2, "m", 4, step_k=128),
    T(64, 64, 1, "n", 4, step_k=128),
]
SWEEP = [  # (K, N, M, k_shards, Mosaic launch shapes)
    (4096, 6144, 1, 1, _DECODE),
    (14336, 4096, 1, 1, _DECODE),
    (4096, 14336, 1, 1, _DECODE),
    (14336, 4096, 1, 8, _DECODE[1:] + _WIDE_DECODE[:1]),
    (4096, 128256, 1, 1, _WIDE_DECODE),
    (576, 49152, 1, 1, _WIDE_DECODE),
    (4096, 6144, 512, 1, _MID),
    (14336, 4096, 512, 1, _MID),
    (4096, 128256, 64, 1, _WIDE_DECODE),
    (576, 49152, 64, 1, _WIDE_DECODE),
    (576, 1536, 512, 1, _MID),
]
B8_REST = [(576, 49152), (4096, 6144), (4096, 14336), (14336, 4096), (4096, 128256)]

if __name__ == "__main__":
    main()
