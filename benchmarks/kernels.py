"""GPU evidence for the kernels: correctness, bitwise batch invariance, kernel time vs XLA.

Run on the H200 from the repo root:  PYTHONPATH=. python benchmarks/kernels.py [--quick]
Prints PASS/FAIL lines for every check, then the timing tables (CUPTI medians of
kernel time, weights rotated over >= 3 copies so the L2 cache does not hold them),
compact tables last. Exit code 1 if any check failed.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib
import math
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk

mm_mod = importlib.import_module("pallas_kernels.matmul")
FAILURES: list[str] = []

LLAMA3_8B = {  # name: (K, N)
    "qkv": (4096, 6144),
    "o": (4096, 4096),
    "gate_up": (4096, 28672),
    "down": (14336, 4096),
    "lm_head": (4096, 128256),
}
TIMED = [  # the GPU.md baseline cells
    ("qkv", 1),
    ("qkv", 256),
    ("qkv", 4096),
    ("o", 1),
    ("gate_up", 64),
    ("gate_up", 4096),
    ("down", 1),
    ("down", 256),
    ("down", 4096),
    ("lm_head", 64),
]
INVARIANCE_M = (1, 7, 16, 64, 255, 256, 1024, 4096)
T = mm_mod.GpuTiles
TILE_VARIANTS = [
    T(16, 128, 4, 3),
    T(32, 128, 4, 3),
    T(64, 128, 4, 3),
    T(128, 128, 8, 3),
    T(128, 256, 8, 3),
    T(128, 256, 8, 4),
    T(64, 256, 8, 3),
    T(64, 64, 4, 3),
    T(16, 32, 4, 3),
    T(16, 64, 2, 4),
    T(128, 64, 4, 3),
    T(128, 32, 4, 3),
    T(16, 32, 2, 4),
]
SWEEP_CELLS = [  # (weight, M, launch shapes to time besides the default)
    ("o", 1, [T(16, 64, 2, 4), T(16, 32, 4, 4)]),
    ("qkv", 1, [T(16, 64, 2, 4)]),
    ("qkv", 64, [T(64, 64, 4, 3), T(64, 32, 2, 4)]),
    ("down", 64, [T(64, 64, 4, 3), T(64, 32, 2, 4)]),
]


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'PASS' if ok else 'FAIL'} {name} {detail}", flush=True)
    if not ok:
        FAILURES.append(name)


def bits(a) -> np.ndarray:
    a = np.asarray(jax.device_get(a))
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


def rand(key, shape, dtype, scale=1.0):
    return (jax.random.normal(jax.random.key(key), shape, jnp.float32) * scale).astype(dtype)


def kernel_us(fn, *args, iterations: int = 20) -> float:
    from jax.experimental.mosaic.gpu import profiler

    _, times = profiler.measure(fn, iterations=iterations)(*args)
    return statistics.median(times) * 1e3


def named_kernel_us(fn, *args, iterations: int = 20) -> tuple[float, list[str]]:
    """Median summed kernel time of fn, leaving out the copies XLA adds when an aliased cache is
    not donated (both sides copy the same caches); returns the names of the kernels summed."""
    from jax.experimental.mosaic.gpu import profiler

    _, per_iter = profiler.measure(fn, aggregate=False, iterations=iterations)(*args)
    keep = [name for name, _ in per_iter[0] if "copy" not in name.lower()]
    totals = [sum(t for name, t in it if "copy" not in name.lower()) for it in per_iter]
    return statistics.median(totals) * 1e3, keep


def rotated_us(op, x, ws) -> float:
    """Median kernel time of op(x, w) per weight copy, cycling over the copies inside one call."""
    fn = jax.jit(lambda x, *ws: [op(x, w) for w in ws])
    return kernel_us(fn, x, *ws) / len(ws)


def copies_for(nbytes: int) -> int:
    return max(3, math.ceil(3 * 60e6 / nbytes))


# --------------------------------------------------------------------------- checks


def check_correctness():
    for dtype, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 1e-2), (jnp.float16, 1e-2)):
        for m, k, n in ((1, 576, 1536), (255, 1536, 576), (64, 4096, 4096), (7, 14336, 4096)):
            x, w = rand(1, (m, k), dtype), rand(2, (k, n), dtype, 1 / math.sqrt(k))
            ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
            for ks in (1, 8):
                out = np.asarray(pk.matmul(x, w, k_shards=ks), np.float64)
                err = np.abs(out - ref).max() / np.abs(ref).max()
                check(
                    f"matmul accuracy {jnp.dtype(dtype).name} {m}x{k}x{n} k_shards={ks}",
                    err <= tol,
                    f"{err:.2e}",
                )
        x = rand(3, (300, 4096), dtype)
        g = rand(4, (4096,), dtype)
        ref64 = np.asarray(x, np.float64)
        ref64 = ref64 / np.sqrt((ref64**2).mean(-1, keepdims=True) + 1e-5) * np.asarray(g, np.float64)
        err = np.abs(np.asarray(pk.rms_norm(x, g, eps=1e-5), np.float64) - ref64).max() / np.abs(ref64).max()
        check(f"rms_norm accuracy {jnp.dtype(dtype).name}", err <= tol, f"{err:.2e}")
        lg = rand(5, (33, 128256), dtype, 4.0)
        l64 = np.asarray(lg, np.float64)
        mx = l64.max(-1, keepdims=True)
        ref = l64 - mx - np.log(np.exp(l64 - mx).sum(-1, keepdims=True))
        err = np.abs(np.asarray(pk.log_softmax(lg), np.float64) - ref).max() / np.abs(ref).max()
        check(f"log_softmax accuracy {jnp.dtype(dtype).name}", err <= max(tol, 1e-5), f"{err:.2e}")


def check_matmul_invariance(quick: bool):
    dtype = jnp.bfloat16
    for name, (k, n) in LLAMA3_8B.items():
        x = rand(10, (max(INVARIANCE_M), k), dtype)
        w = rand(11, (k, n), dtype, 1 / math.sqrt(k))
        for ks in (1, 8):
            full = bits(pk.matmul(x, w, k_shards=ks))
            ok = all(np.array_equal(bits(pk.matmul(x[:m], w, k_shards=ks)), full[:m]) for m in INVARIANCE_M)
            check(f"matmul invariance {name} k_shards={ks} M={INVARIANCE_M}", ok)
            # every launch shape the kernel may pick (and some it does not) gives the same rows
            ref = full[:256]
            same = {
                t: np.array_equal(bits(pk.matmul(x[:256], w, k_shards=ks, tiles=t)), ref)
                for t in TILE_VARIANTS
            }
            bad = [t for t, ok in same.items() if not ok]
            check(
                f"matmul launch shapes {name} k_shards={ks} ({len(same)} variants)", not bad, f"differ: {bad}"
            )
            # slot position: rows moved inside the batch keep their bits
            rolled = bits(pk.matmul(jnp.roll(x[:255], 5, axis=0), w, k_shards=ks))
            check(
                f"matmul row position {name} k_shards={ks}",
                np.array_equal(np.roll(rolled, -5, axis=0), full[:255]),
            )
        # k_shards=8 through per-rank partials (TP 2, 4, 8) reproduces the full result
        plan = pk.plan_matmul(k, n, dtype, k_shards=8, platform="gpu")
        full8 = bits(pk.matmul(x[:64], w, k_shards=8))
        for p in (2, 4, 8):
            kr = k // p
            parts = [
                pk.matmul_partial(
                    x[:64, r * kr : (r + 1) * kr], w[r * kr : (r + 1) * kr], plan=plan, backend="triton"
                )
                for r in range(p)
            ]
            check(
                f"matmul tp-partials {name} P={p}",
                np.array_equal(bits(pk.tree_sum(parts).astype(dtype)), full8),
            )
        # negative control: XLA's dot changes row 0 somewhere
        ref_full = bits(pk.matmul_reference(x, w))
        differs = [
            m for m in INVARIANCE_M if not np.array_equal(bits(pk.matmul_reference(x[:m], w))[0], ref_full[0])
        ]
        print(f"INFO negative control {name}: XLA x@w row 0 differs from M=4096 at M={differs}")
        if quick:
            break


def check_row_invariance():
    for h in (576, 4096):
        x = rand(20, (8192, h), jnp.bfloat16)
        r = rand(21, (8192, h), jnp.bfloat16)
        g = rand(22, (h,), jnp.bfloat16)
        full = bits(pk.rms_norm(x, g, eps=1e-5))
        fr, fs = pk.rms_norm(x, g, eps=1e-5, residual=r)
        fr, fs = bits(fr), bits(fs)
        ok = True
        for t in (1, 7, 64, 255, 1024):
            ok &= np.array_equal(bits(pk.rms_norm(x[:t], g, eps=1e-5)), full[:t])
            a, s = pk.rms_norm(x[:t], g, eps=1e-5, residual=r[:t])
            ok &= np.array_equal(bits(a), fr[:t]) and np.array_equal(bits(s), fs[:t])
        check(f"rms_norm invariance H={h}", ok)
        check(
            f"rms_norm fused residual == unfused H={h}",
            np.array_equal(fr, bits(pk.rms_norm(fs.view(jnp.bfloat16), g, eps=1e-5))),
        )
        check(f"rms_norm residual sum == XLA bf16 add H={h}", np.array_equal(fs, bits(x + r)))
    for v in (49152, 128256):
        lg = rand(23, (1024, v), jnp.float32, 4.0)
        full, flse = bits(pk.log_softmax(lg)), bits(pk.logsumexp(lg))
        ok = all(
            np.array_equal(bits(pk.log_softmax(lg[:t])), full[:t])
            and np.array_equal(bits(pk.logsumexp(lg[:t])), flse[:t])
            for t in (1, 7, 65, 255)
        )
        check(f"log_softmax/logsumexp invariance V={v}", ok)
        ref0 = bits(pk.log_softmax_reference(lg))[0]
        differs = [
            t for t in (1, 7, 65, 255) if not np.array_equal(bits(pk.log_softmax_reference(lg[:t]))[0], ref0)
        ]
        print(f"INFO negative control log_softmax V={v}: XLA row 0 differs from T=1024 at T={differs}")


# --------------------------------------------------------------------------- timing


def time_matmul(quick: bool):
    rows = []
    for name, m in TIMED[: 3 if quick else None]:
        k, n = LLAMA3_8B[name]
        x = rand(30, (m, k), jnp.bfloat16)
        ws = [rand(31 + i, (k, n), jnp.bfloat16, 1 / math.sqrt(k)) for i in range(copies_for(k * n * 2))]
        t_xla = rotated_us(lambda x, w: x @ w, x, ws)
        t_1 = rotated_us(lambda x, w: pk.matmul(x, w), x, ws)
        t_8 = (
            rotated_us(lambda x, w: pk.matmul(x, w, k_shards=8), x, ws)
            if name in ("o", "down")
            else float("nan")
        )
        rows.append((f"{name} {k}x{n}", m, t_xla, t_1, t_1 / t_xla, t_8))
        print(
            f"TIME matmul {name} M={m}: xla {t_xla:.1f} us, bijax {t_1:.1f} us ({t_1 / t_xla:.2f}x), k_shards=8 {t_8:.1f} us",
            flush=True,
        )
        del ws
    return rows


def sweep():
    """Kernel time of other launch shapes on some cells (bits are the same for all; see the checks)."""
    for name, m, cfgs in SWEEP_CELLS:
        k, n = LLAMA3_8B[name]
        x = rand(30, (m, k), jnp.bfloat16)
        ws = [rand(31 + i, (k, n), jnp.bfloat16, 1 / math.sqrt(k)) for i in range(copies_for(k * n * 2))]
        t_xla = rotated_us(lambda x, w: x @ w, x, ws)
        default = mm_mod.gpu_tiles(mm_mod.plan_matmul(k, n, jnp.bfloat16), m)
        for cfg in [default] + cfgs:
            t = rotated_us(lambda x, w, cfg=cfg: pk.matmul(x, w, tiles=cfg), x, ws)
            tag = "default " if cfg == default else ""
            print(f"SWEEP {name} M={m} {tag}{cfg}: {t:.1f} us ({t / t_xla:.2f}x XLA {t_xla:.1f})", flush=True)
        del ws


# Decode rows: Triton launches around the default (16-row tiles), deeper pipelines included.
DECODE_VARIANTS = [T(16, tn, w, st) for tn in (32, 64) for w in (2, 4) for st in (4, 6, 8)]


def decode_sweep():
    """Decode rows (M = 1 and 16) of every Llama-3-8B weight: each launch in DECODE_VARIANTS
    against the default launch and XLA - its rows' bits equal to the default's (a check), its
    kernel time - and the best launch per cell (decode issue: matmul rows within 1.10x of XLA)."""
    best = []
    for name, (k, n) in LLAMA3_8B.items():
        ws = [rand(51 + i, (k, n), jnp.bfloat16, 1 / math.sqrt(k)) for i in range(copies_for(k * n * 2))]
        for m in (1, 16):
            x = rand(50, (m, k), jnp.bfloat16)
            t_xla = rotated_us(lambda x, w: x @ w, x, ws)
            default = mm_mod.gpu_tiles(mm_mod.plan_matmul(k, n, jnp.bfloat16), m)
            want = bits(pk.matmul(x, ws[0]))
            t_default = rotated_us(lambda x, w: pk.matmul(x, w), x, ws)
            timed = [(t_default, default)]
            for cfg in DECODE_VARIANTS:
                if cfg == default:
                    continue
                try:
                    same = np.array_equal(bits(pk.matmul(x, ws[0], tiles=cfg)), want)
                    t = rotated_us(lambda x, w, cfg=cfg: pk.matmul(x, w, tiles=cfg), x, ws)
                except Exception as e:  # noqa: BLE001 - a launch that does not compile is a finding
                    print(f"INFO decode sweep {name} M={m} {cfg}: {type(e).__name__}: {str(e)[:160]}")
                    continue
                check(f"decode sweep {name} M={m} {cfg} == default launch", same)
                print(f"DSWEEP {name} M={m} {cfg}: {t:.1f} us ({t / t_xla:.2f}x XLA {t_xla:.1f})", flush=True)
                timed.append((t, cfg))
            t_best, cfg_best = min(timed, key=lambda r: r[0])
            best.append((name, m, t_xla, t_default, default, t_best, cfg_best))
        del ws
    print("\n| weight | M | XLA us | default us | / XLA | default launch | best us | / XLA | best launch |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, m, t_xla, t_def, default, t_best, cfg in best:
        print(
            f"| {name} | {m} | {t_xla:.1f} | {t_def:.1f} | {t_def / t_xla:.2f} | {default} | {t_best:.1f} "
            f"| {t_best / t_xla:.2f} | {cfg} |"
        )


# Weights that share their input, per layer: (name, [(K, N), ...]).
SHARED_GROUPS = [
    ("llama3-8b q,k,v", [(4096, 4096), (4096, 1024), (4096, 1024)]),
    ("llama3-8b gate,up", [(4096, 14336), (4096, 14336)]),
    ("qwen2.5-7b q,k,v", [(3584, 3584), (3584, 512), (3584, 512)]),
    ("smollm2 q,k,v", [(576, 576), (576, 192), (576, 192)]),
]


def group_us(op, x, sets) -> float:
    """Median kernel time of ``op(x, ws)`` per weight set, cycling over ``sets`` in one call."""
    size = len(sets[0])
    fn = jax.jit(lambda x, *flat: [op(x, flat[i : i + size]) for i in range(0, len(flat), size)])
    return kernel_us(fn, x, *[w for ws in sets for w in ws]) / len(sets)


def shared_launch():
    """Weights that share x (a layer's q, k, v; gate, up) in one launch (``pk.matmul_shared``)
    against a launch each (``pk.matmul`` per weight) and XLA's dots, at decode rows: every
    output's bits equal to its own ``pk.matmul``'s (a check), CUPTI kernel time of the group
    (every kernel of the call: the leaves' combines too), weights rotated past L2."""
    rows = []
    for name, shapes in SHARED_GROUPS:
        nbytes = sum(k * n * 2 for k, n in shapes)
        sets = [
            [rand(61 + 7 * i + j, (k, n), jnp.bfloat16, 1 / math.sqrt(k)) for j, (k, n) in enumerate(shapes)]
            for i in range(copies_for(nbytes))
        ]
        # M = 64 (a 64-sequence decode step): "auto" runs a Mosaic GPU launch per weight there,
        # so "shared" is the Triton shared launch (backend="triton") - would it be faster?
        for m in (1, 16, 32, 64):
            x = rand(60, (m, shapes[0][0]), jnp.bfloat16)
            backend = "triton" if m == 64 else "auto"
            want = [bits(pk.matmul(x, w)) for w in sets[0]]
            got = [bits(y) for y in pk.matmul_shared(x, sets[0], backend=backend)]
            check(
                f"shared launch ({backend}) {name} M={m} == a launch each",
                all(np.array_equal(a, b) for a, b in zip(got, want, strict=True)),
            )

            t_xla = group_us(lambda x, ws: [x @ w for w in ws], x, sets)
            t_each = group_us(lambda x, ws: [pk.matmul(x, w) for w in ws], x, sets)
            t_shared = group_us(lambda x, ws, b=backend: pk.matmul_shared(x, ws, backend=b), x, sets)
            rows.append((name, m, nbytes, t_xla, t_each, t_shared))
            print(
                f"SHARED {name} M={m}: xla {t_xla:.1f} us, a launch each {t_each:.1f} us, shared {t_shared:.1f} us",
                flush=True,
            )
        del sets
    print(
        "\n| weights | M | MB | XLA us | a launch each us | shared us | shared / each | shared / XLA | shared TB/s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, m, nbytes, t_xla, t_each, t_sh in rows:
        print(
            f"| {name} | {m} | {nbytes / 1e6:.0f} | {t_xla:.1f} | {t_each:.1f} | {t_sh:.1f} | {t_sh / t_each:.2f} "
            f"| {t_sh / t_xla:.2f} | {nbytes / t_sh / 1e6:.2f} |"
        )


MID_MS = (96, 128, 256, 384)


def triton(x, w, *, plan):
    return mm_mod.triton_partial(
        x, w, plan=plan, num_shards=1, out_dtype=jnp.bfloat16, tiles=None, interpret=False
    )


def mid_m():
    """64 < M < 512 (untimed for the Mosaic GPU kernel so far; Triton runs there): the Triton
    kernel (the default), the Mosaic GPU kernel forced, and XLA, per Llama-3-8B weight; the
    Mosaic outputs' bits equal to Triton's (a check)."""
    mg = importlib.import_module("pallas_kernels.matmul_mgpu")
    rows = []
    for name, (k, n) in LLAMA3_8B.items():
        if name == "lm_head":
            continue
        plan = mm_mod.plan_matmul(k, n, jnp.bfloat16)
        ws = [rand(71 + i, (k, n), jnp.bfloat16, 1 / math.sqrt(k)) for i in range(copies_for(k * n * 2))]

        mosaic = functools.partial(mg.mgpu_partial, plan=plan, num_shards=1, out_dtype=jnp.bfloat16)

        for m in MID_MS:
            x = rand(70, (m, k), jnp.bfloat16)
            tri = functools.partial(triton, plan=plan)
            same = np.array_equal(bits(jax.jit(mosaic)(x, ws[0])), bits(jax.jit(tri)(x, ws[0])))
            check(f"mid-M {name} M={m} Mosaic == Triton", same)
            t_xla = rotated_us(lambda x, w: x @ w, x, ws)
            t_tri = rotated_us(tri, x, ws)
            t_mg = rotated_us(mosaic, x, ws)
            t_def = rotated_us(lambda x, w: pk.matmul(x, w), x, ws)
            rows.append((name, k, n, m, t_xla, t_tri, t_mg, t_def))
            print(
                f"MID {name} M={m}: xla {t_xla:.1f}, triton {t_tri:.1f}, mosaic {t_mg:.1f}, default {t_def:.1f} us",
                flush=True,
            )
        del ws
    print("\n| weight | M | XLA us | Triton us (/ XLA) | Mosaic us (/ XLA) | default us |")
    print("|---|---|---|---|---|---|")
    for name, k, n, m, t_xla, t_tri, t_mg, t_def in rows:
        print(
            f"| {name} {k}x{n} | {m} | {t_xla:.1f} | {t_tri:.1f} ({t_tri / t_xla:.2f}) | {t_mg:.1f} ({t_mg / t_xla:.2f}) "
            f"| {t_def:.1f} |"
        )


def mid_tiles():
    """Mosaic GPU launch shapes for the mid-M cells where its default launch was slow (o and down
    at M = 256 and 384: 64 or 96 CTAs of 128 x 256): each launch's bits equal to Triton's (a
    check) and its kernel time next to XLA's."""
    mg = importlib.import_module("pallas_kernels.matmul_mgpu")
    M = mg.MgpuTiles
    cands = [
        M(128, 128, 2, "n", 4),
        M(128, 64, 2, "n", 4),
        M(64, 64, 2, "m", 4, step_k=128),
        M(64, 128, 2, "m", 4),
        M(64, 64, 1, "n", 8),
    ]
    for name in ("o", "down", "qkv"):
        k, n = LLAMA3_8B[name]
        plan = mm_mod.plan_matmul(k, n, jnp.bfloat16)
        ws = [rand(81 + i, (k, n), jnp.bfloat16, 1 / math.sqrt(k)) for i in range(copies_for(k * n * 2))]
        for m in (256, 384):
            x = rand(80, (m, k), jnp.bfloat16)
            want = bits(jax.jit(functools.partial(triton, plan=plan))(x, ws[0]))
            t_xla = rotated_us(lambda x, w: x @ w, x, ws)
            default = mg.mgpu_tiles(n, plan.num_leaves, m)
            for t in [default] + [c for c in cands if c != default]:
                op = functools.partial(
                    mg.mgpu_partial, plan=plan, num_shards=1, out_dtype=jnp.bfloat16, tiles=t
                )
                try:
                    same = np.array_equal(bits(jax.jit(op)(x, ws[0])), want)
                    us = rotated_us(op, x, ws)
                except Exception as e:  # noqa: BLE001 - a launch that does not compile is a finding
                    print(f"INFO mid tiles {name} M={m} {t}: {type(e).__name__}: {str(e)[:160]}")
                    continue
                check(f"mid tiles {name} M={m} {t} == Triton", same)
                tag = "default " if t == default else ""
                print(
                    f"MIDT {name} M={m} {tag}{t}: {us:.1f} us ({us / t_xla:.2f}x XLA {t_xla:.1f})", flush=True
                )
        del ws


# ``mid_rows``: the rows of a 32- and 64-sequence decode step. The shared q, k, v launch's
# (tile_m, q's tile_n, k's and v's tile_n, warps, stages) besides its default ...
MID_ROWS_SHARED = [
    *(
        ("m", tq, tkv, w, st)
        for tq, tkv in ((32, 32), (64, 64), (64, 128), (128, 128))
        for w, st in ((2, 4), (4, 3), (4, 5), (8, 4))
    ),
    ("half", 64, 64, 4, 3),
    ("half", 64, 128, 4, 4),
    ("half", 128, 128, 4, 4),
]
# At 16 rows (a single stream's decode bucket; default 16 x 64, 4 warps, 8 stages for each weight):
# k's and v's 4 leaves against q's 2 make their programs half as long as q's at one tile width.
DECODE_ROWS_SHARED = [
    ("m", 64, 128, 4, 8),
    ("m", 64, 128, 4, 6),
    ("m", 64, 128, 8, 8),
    ("m", 32, 64, 4, 8),
    ("m", 32, 64, 2, 8),
    ("m", 128, 128, 8, 6),
]
# ... and o's and down's Mosaic GPU launches (M = 64 runs them by default) and Triton launches.
MID_ROWS_MOSAIC = [
    dict(tile_m=64, tile_n=64, wgs=1, stages=8),
    dict(tile_m=64, tile_n=64, wgs=1, stages=8, step_k=128),
    dict(tile_m=64, tile_n=64, wgs=1, stages=4, step_k=256),
    dict(tile_m=64, tile_n=128, wgs=1, stages=6),
    dict(tile_m=64, tile_n=128, wgs=1, stages=4, step_k=128),
    dict(tile_m=64, tile_n=64, wgs=2, stages=6),
    dict(tile_m=64, tile_n=32, wgs=1, stages=8, step_k=128),
]
MID_ROWS_TRITON = [
    *(("m", tn, w, st) for tn, w, st in ((32, 2, 4), (64, 4, 3), (64, 4, 5), (128, 4, 4), (128, 8, 3))),
    ("half", 64, 4, 4),
    ("half", 128, 4, 4),
]


def _mid_rows_launch(label: str, run, t_def: float, t_xla: float, best):
    """One launch of ``mid_rows``: ``run()`` -> (bits equal to the default launch's, us); its
    check and line; the faster of it and ``best`` ((us, label))."""
    try:
        same, t = run()
    except Exception as e:  # noqa: BLE001 - a launch that does not compile is a finding
        print(f"INFO mid rows {label}: {type(e).__name__}: {str(e)[:160]}", flush=True)
        return best
    check(f"mid rows {label} == default launch", same)
    print(f"MIDROWS {label}: {t:.1f} us (default {t_def:.1f}, XLA {t_xla:.1f})", flush=True)
    return min(best, (t, label.split(" ", 2)[2]))


def mid_rows():
    """Launch shapes at the rows of a 32- and 64-sequence decode step (llama3-8b): the shared
    q, k, v launch (``matmul_triton.SHARED_TILES``; at 16 rows too) and o's and down's launches (Mosaic GPU,
    Triton), each checked bit for bit against the default launch, CUPTI kernel time next to XLA
    and the weights' HBM read time at the card's measured copy bandwidth; weights rotated past L2."""
    mt = importlib.import_module("pallas_kernels.matmul_triton")
    mg = importlib.import_module("pallas_kernels.matmul_mgpu")
    # the card's HBM copy bandwidth (read + write of 1 GiB), for the weights' floor
    a = jnp.ones((1 << 29,), jnp.bfloat16)
    t_copy = kernel_us(jax.jit(lambda a: a + 1), a)
    bw = 2 * a.size * 2 / t_copy / 1e6  # TB/s
    del a
    print(f"MIDROWS HBM copy bandwidth {bw:.2f} TB/s", flush=True)
    rows = []
    shapes = [(4096, 4096), (4096, 1024), (4096, 1024)]
    nbytes = sum(k * n * 2 for k, n in shapes)
    sets = [
        [rand(161 + 7 * i + j, (k, n), jnp.bfloat16, 1 / math.sqrt(k)) for j, (k, n) in enumerate(shapes)]
        for i in range(copies_for(nbytes))
    ]
    try:
        for m in (16, 32, 64):
            x = rand(160, (m, 4096), jnp.bfloat16)
            mt.SHARED_TILES = None
            jax.clear_caches()
            want = [bits(y) for y in jax.jit(pk.matmul_shared)(x, sets[0])]
            t_xla = group_us(lambda x, ws: [x @ w for w in ws], x, sets)
            t_def = group_us(lambda x, ws: pk.matmul_shared(x, ws), x, sets)
            best = (t_def, "default")
            for tm, tq, tkv, w, st in MID_ROWS_SHARED if m > 16 else DECODE_ROWS_SHARED:
                tile_m = m if tm == "m" else m // 2
                mt.SHARED_TILES = (T(tile_m, tq, w, st), (tq, tkv, tkv))
                label = f"tile_m {tile_m} tile_n q {tq} kv {tkv} warps {w} stages {st}"
                jax.clear_caches()

                def run(x=x, want=want, sets=sets):
                    got = jax.jit(pk.matmul_shared)(x, sets[0])
                    same = all(np.array_equal(bits(y), b) for y, b in zip(got, want, strict=True))
                    return same, group_us(lambda x, ws: pk.matmul_shared(x, ws), x, sets)

                best = _mid_rows_launch(f"qkv M={m} {label}", run, t_def, t_xla, best)
            rows.append(("qkv (shared)", m, nbytes / bw / 1e6, t_xla, t_def, *best))
    finally:
        mt.SHARED_TILES = None
        jax.clear_caches()
    del sets
    for name in ("o", "down"):
        k, n = LLAMA3_8B[name]
        plan = mm_mod.plan_matmul(k, n, jnp.bfloat16)
        ws = [rand(181 + i, (k, n), jnp.bfloat16, 1 / math.sqrt(k)) for i in range(copies_for(k * n * 2))]
        for m in (32, 64):
            x = rand(180, (m, k), jnp.bfloat16)
            want = bits(jax.jit(pk.matmul)(x, ws[0]))
            t_xla = rotated_us(lambda x, w: x @ w, x, ws)
            t_def = rotated_us(lambda x, w: pk.matmul(x, w), x, ws)
            best = (t_def, "default")
            variants = [
                (
                    f"mosaic {kw}",
                    functools.partial(
                        mg.mgpu_partial,
                        plan=plan,
                        num_shards=1,
                        out_dtype=jnp.bfloat16,
                        tiles=mg.MgpuTiles(**kw),
                    ),
                )
                for kw in MID_ROWS_MOSAIC
            ]
            for tm, tn, w, st in MID_ROWS_TRITON:
                tiles = T(m if tm == "m" else m // 2, tn, w, st)
                variants.append((f"triton {tiles}", lambda x, w, tiles=tiles: pk.matmul(x, w, tiles=tiles)))
            for label, op in variants:

                def run(op=op, x=x, want=want, ws=ws):
                    return np.array_equal(bits(jax.jit(op)(x, ws[0])), want), rotated_us(op, x, ws)

                best = _mid_rows_launch(f"{name} M={m} {label}", run, t_def, t_xla, best)
            rows.append((name, m, k * n * 2 / bw / 1e6, t_xla, t_def, *best))
        del ws
    print(f"\nweights' HBM read time at the copy bandwidth ({bw:.2f} TB/s) as the floor")
    print("| weight | M | floor us | XLA us | default us (/ floor) | best us (/ floor) | best launch |")
    print("|---|---|---|---|---|---|---|")
    for name, m, floor, t_xla, t_def, t_best, label in rows:
        print(
            f"| {name} | {m} | {floor:.1f} | {t_xla:.1f} | {t_def:.1f} ({t_def / floor:.2f}) "
            f"| {t_best:.1f} ({t_best / floor:.2f}) | {label} |"
        )


SWEEP_GROUPS = [  # (K, weights' N, col_blocks, tensor-parallel ranks the weights are a shard of)
    (4096, (4096, 1024, 1024), 1, 1),  # llama3-8b q, k, v
    (4096, (2048, 512, 512), 8, 2),  # a TP 2 rank's shard of them, k_shards 8
    (4160, (4352, 2048, 64), 1, 1),  # K padded per leaf; 1 and 4 leaves
    (1000, (100, 64, 200), 1, 1),  # ragged everything
]


def bits_sweep():
    """Bits only, no timing: ``matmul_shared``'s outputs equal ``matmul``'s per weight (backends
    "triton" and "auto", bf16 and f32, M from 1 to 300, bf16 and f32 outputs), and the Mosaic GPU
    rows equal Triton's for 65 <= M <= 511 (backend "auto" against "triton"; k_shards 1 and 8)."""
    for k, ns, cb, tp in SWEEP_GROUPS:
        for dtype in (jnp.bfloat16, jnp.float32):
            bad = []
            for m in (1, 16, 17, 40, 64, 100, 129, 300):
                x = rand(90 + m, (m, k), dtype)
                ws = [rand(91 + i, (k, n), dtype, 1 / math.sqrt(k)) for i, n in enumerate(ns)]
                full = [n * tp for n in ns]
                for backend in ("triton", "auto"):
                    for out in (None, jnp.float32):
                        kw = dict(out_dtype=out, col_blocks=cb, backend=backend)
                        got = pk.matmul_shared(x, ws, full_ns=full, **kw)
                        for i, (g, w, f) in enumerate(zip(got, ws, full, strict=True)):
                            if not np.array_equal(bits(g), bits(pk.matmul(x, w, full_n=f, **kw))):
                                bad.append((m, backend, out, i))
            name = f"K {k} N {ns} col_blocks {cb} of {tp} {jnp.dtype(dtype).name}"
            check(f"bits sweep shared == a launch each, {name}", not bad, str(bad[:8]))
    for k, n in ((4096, 6144), (4096, 28672), (14336, 4096), (4096, 1024), (576, 1536)):
        w = rand(95, (k, n), jnp.bfloat16, 1 / math.sqrt(k))
        for k_shards in (1, 8):
            bad = []
            for m in (65, 100, 128, 129, 200, 256, 257, 300, 384, 511):
                x = rand(96 + m, (m, k), jnp.bfloat16)
                for out in (None, jnp.float32):
                    kw = dict(out_dtype=out, k_shards=k_shards)
                    if not np.array_equal(
                        bits(pk.matmul(x, w, **kw)), bits(pk.matmul(x, w, backend="triton", **kw))
                    ):
                        bad.append((m, out))
            check(f"bits sweep Mosaic (auto) == Triton, {k}x{n} k_shards {k_shards}", not bad, str(bad[:8]))


ROW_WEIGHTS = {  # name: (K, N) of a row-parallel weight
    "llama3-8b o": (4096, 4096),
    "llama3-8b down": (14336, 4096),
    "qwen2.5-7b down": (18944, 3584),
    "smollm2 down": (1536, 576),
}
HEADS = {"llama3-8b": (32, 8, 128), "qwen2.5-7b": (28, 4, 128), "smollm2": (9, 3, 64)}


def _rope_kv_inputs(t, hq, hkv, d, seed=0):
    num_blocks, block_size = 512, 16
    q, k, v = (rand(seed + i, (t, h, d), jnp.bfloat16) for i, h in enumerate((hq, hkv, hkv)))
    ang = rand(seed + 3, (t, 1, d // 2), jnp.float32, 30.0)
    cs = jnp.concatenate([jnp.cos(ang), jnp.sin(ang)], axis=1)
    perm = np.random.default_rng(seed).permutation(np.arange(block_size, num_blocks * block_size))[:t]
    slots = jnp.asarray(np.where(np.arange(t) % 5 == 4, -1, perm), jnp.int32)  # every 5th: padding
    caches = [rand(seed + 4 + i, (num_blocks, block_size, hkv, d), jnp.bfloat16) for i in range(2)]
    return q, k, v, cs, caches, slots


def qkv_fusion(rows=None):
    """``pk.qkv_rope_write_kv`` against ``pk.matmul_shared`` then ``pk.rope_write_kv``: bits at
    every T where the projections run one Triton launch (decode rows) or a launch each (Mosaic
    GPU above 64 rows), and CUPTI kernel time at decode rows. Appends table rows to ``rows``."""
    rows = [] if rows is None else rows

    def unfused(x, wq, wk, wv, cs, kc, vc, slots):
        d = kc.shape[-1]
        q, k, v = (y.reshape(x.shape[0], -1, d) for y in pk.matmul_shared(x, (wq, wk, wv)))
        return pk.rope_write_kv(q, k, v, cs, kc, vc, slots)

    def fused(x, wq, wk, wv, cs, kc, vc, slots):
        return pk.qkv_rope_write_kv(x, (wq, wk, wv), cs, kc, vc, slots)

    hidden = {"llama3-8b": 4096, "qwen2.5-7b": 3584, "smollm2": 576}
    for model, (hq, hkv, d) in HEADS.items():
        h = hidden[model]
        ws = [rand(90 + i, (h, n * d), jnp.bfloat16, 1 / math.sqrt(h)) for i, n in enumerate((hq, hkv, hkv))]
        bad = []
        for t in (1, 16, 33, 64, 65, 300, 2048):
            q, k, v, cs, (kc, vc), slots = _rope_kv_inputs(t, hq, hkv, d, seed=t)
            x = rand(95 + t, (t, h), jnp.bfloat16)
            want = jax.jit(unfused)(x, *ws, cs, jnp.array(kc), jnp.array(vc), slots)
            got = jax.jit(fused)(x, *ws, cs, jnp.array(kc), jnp.array(vc), slots)
            same = [np.array_equal(bits(got[0]), bits(want[0]))] + [
                np.array_equal(bits(a)[1:], bits(b)[1:]) for a, b in zip(got[1:], want[1:], strict=True)
            ]
            if not all(same):
                bad.append((t, same))
        check(
            f"qkv_rope_write_kv == matmul_shared + rope_write_kv, {model} heads {hq}/{hkv} x {d}",
            not bad,
            str(bad),
        )
        if model == "llama3-8b":
            for t in (1, 16, 64):
                q, k, v, cs, (kc, vc), slots = _rope_kv_inputs(t, hq, hkv, d, seed=t)
                x = rand(95 + t, (t, h), jnp.bfloat16)
                args = (x, *ws, cs, kc, vc, slots)
                t_un, names_un = named_kernel_us(jax.jit(unfused), *args)
                t_fu, names_fu = named_kernel_us(jax.jit(fused), *args)
                print(f"INFO T = {t} kernels timed, unfused: {names_un}; fused: {names_fu}")
                rows.append((f"q, k, v + rope_write_kv {model}", t, float("nan"), t_un, t_fu))
        del ws
    return rows


def print_fusion_rows(rows):
    print("\n| op | rows | XLA us | unfused us | fused us | fused / unfused |")
    print("|---|---|---|---|---|---|")
    for op, m, t_xla, t_un, t_fu in rows:
        print(f"| {op} | {m} | {t_xla:.1f} | {t_un:.1f} | {t_fu:.1f} | {t_fu / t_un:.2f} |")


def fusions():
    """``pk.matmul_norm`` against ``pk.matmul`` then ``pk.rms_norm``, and ``pk.rope_write_kv``
    against ``pk.rope`` and ``pk.write_kv``: bits (every row count where the matmul runs Triton or
    Mosaic GPU, k_shards 1 and 8, bf16 and f32; every token count) and CUPTI kernel time at
    decode rows (weights rotated past L2). A negative control: the RoPE kernel with plain
    multiplies, which the compiler may fuse into the adds."""
    rope_mod = importlib.import_module("pallas_kernels.rope")

    eps = 1e-5
    for name, (k, n) in ROW_WEIGHTS.items():
        for dtype in (jnp.bfloat16, jnp.float32):
            w = rand(70, (k, n), dtype, 1 / math.sqrt(k))
            g = rand(71, (n,), dtype)
            for k_shards in (1, 8):
                if dtype == jnp.float32 and k_shards == 1:
                    continue  # compile-bound: float32 (Triton at every M) with 8 shards only
                bad = []
                # Triton decode rows (1, 17), Mosaic GPU (65, 200: 128 x 128 CTAs, 2048), and
                # float32's Triton launches at 65 and 300 rows
                for m in (1, 17, 65, 200, 2048) if dtype == jnp.bfloat16 else (1, 65, 300):
                    x, r = rand(72 + m, (m, k), dtype), rand(73 + m, (m, n), dtype)
                    got = pk.matmul_norm(x, w, g, r, eps=eps, k_shards=k_shards)
                    y = pk.matmul(x, w, k_shards=k_shards)
                    want = pk.rms_norm(y, g, eps=eps, residual=r)
                    if not all(np.array_equal(bits(a), bits(b)) for a, b in zip(got, want, strict=True)):
                        bad.append(m)
                check(
                    f"matmul_norm == matmul + rms_norm, {name} {jnp.dtype(dtype).name} k_shards {k_shards}",
                    not bad,
                    str(bad),
                )
    rows = []
    for name in ("llama3-8b o", "llama3-8b down"):
        k, n = ROW_WEIGHTS[name]
        ws = [rand(80 + i, (k, n), jnp.bfloat16, 1 / math.sqrt(k)) for i in range(copies_for(k * n * 2))]
        g = rand(79, (n,), jnp.bfloat16)
        for m in (1, 16, 64):
            x, r = rand(81, (m, k), jnp.bfloat16), rand(82, (m, n), jnp.bfloat16)
            t_un = rotated_us(
                lambda x, w, g=g, r=r: pk.rms_norm(pk.matmul(x, w), g, eps=eps, residual=r), x, ws
            )
            t_fu = rotated_us(lambda x, w, g=g, r=r: pk.matmul_norm(x, w, g, r, eps=eps), x, ws)
            t_xla = rotated_us(
                lambda x, w, g=g, r=r: pk.rms_norm_reference(x @ w, g, eps=eps, residual=r), x, ws
            )
            rows.append((f"{name} + norm", m, t_xla, t_un, t_fu))
        del ws
    for model, (hq, hkv, d) in HEADS.items():
        bad, plain_differs = [], []
        for t in (1, 16, 64, 300, 2048):
            q, k, v, cs, (kc, vc), slots = _rope_kv_inputs(t, hq, hkv, d, seed=t)
            want_q = pk.rope(q, cs)
            want_k, want_v = pk.write_kv(jnp.array(kc), jnp.array(vc), pk.rope(k, cs), v, slots)
            got_q, got_k, got_v = pk.rope_write_kv(q, k, v, cs, jnp.array(kc), jnp.array(vc), slots)
            same = [
                np.array_equal(
                    bits(a)[1:] if a.ndim == 4 else bits(a), bits(b)[1:] if b.ndim == 4 else bits(b)
                )
                for a, b in ((got_q, want_q), (got_k, want_k), (got_v, want_v))
            ]
            if not all(same):
                bad.append((t, same))
            plain = jax.jit(
                functools.partial(
                    rope_mod._rope_kv_pallas,
                    interpret=False,
                    products=lambda pairs: tuple(a * b for a, b in pairs),
                )
            )(q, k, v, cs, jnp.array(kc), jnp.array(vc), slots)
            if not np.array_equal(bits(plain[0]), bits(want_q)):
                plain_differs.append(t)
        check(f"rope_write_kv == rope + write_kv, {model} heads {hq}/{hkv} x {d}", not bad, str(bad))
        print(
            f"INFO negative control: plain multiplies in the kernel differ from rope at T = {plain_differs}"
        )
        if model == "llama3-8b":
            for t in (16, 64):
                q, k, v, cs, (kc, vc), slots = _rope_kv_inputs(t, hq, hkv, d, seed=t)

                def unfused(q, k, v, cs, kc, vc, slots):
                    kc, vc = pk.write_kv(kc, vc, pk.rope(k, cs), v, slots)
                    return pk.rope(q, cs), kc, vc

                t_un, names_un = named_kernel_us(jax.jit(unfused), q, k, v, cs, kc, vc, slots)
                t_fu, names_fu = named_kernel_us(jax.jit(pk.rope_write_kv), q, k, v, cs, kc, vc, slots)
                print(f"INFO T = {t} kernels timed, unfused: {names_un}; fused: {names_fu}")
                rows.append((f"rope + write_kv {model}", t, float("nan"), t_un, t_fu))
    print_fusion_rows(qkv_fusion(rows))


UP_WEIGHTS = {  # name: (K, N) of a dense MLP's gate and up weights
    "llama3-8b": (4096, 14336),
    "qwen2.5-7b": (3584, 18944),
    "smollm2": (576, 1536),
}


def gate_up_fusion():
    """``pk.gate_up_swiglu`` with ``mlp.FUSED`` (gate and up in one launch, SwiGLU in its
    epilogue) against gate and up then XLA's formula: bits at every M where the op fuses (its
    Triton rows: 1-64 here - the model calls it below 17 only) and at 300 (Mosaic, unfused)
    for three models' gate/up weights, bf16, gate values over the sigmoid's whole range. A
    negative control (the epilogue's products grouped the other way). Then CUPTI kernel time at decode
    rows for llama3-8b (weights rotated past L2): XLA, the engine's route without the switch (a
    launch each, or from 17 rows one shared launch, + the XLA formula), and the fused launch
    under each of PAIR_LAUNCHES (M 1, 16) / PAIR_MID_LAUNCHES (M 32, 64: ``mlp.FUSED_MAX_ROWS``
    raised to 64 here, so 64 rows run the fused launch rather than Mosaic's; the model fuses
    above 16 rows only where ``FUSED_MAX_ROWS`` says), each checked bit for bit. The engine's bits with it: ``gpu_digests.py`` (the
    switch is on by default; ``ab.py swiglu xla --script gpu_digests.py`` without it)."""
    mlp = importlib.import_module("pallas_kernels.mlp")
    saved = mlp.FUSED, mlp.PAIR_TILES, mlp.FUSED_MAX_ROWS
    mlp.FUSED_MAX_ROWS = 64  # the fused launch timed at 32 and 64 rows too (over Mosaic at 64)

    def unfused(x, wg, wu):
        g, u = pk.matmul(x, wg), pk.matmul(x, wu)
        return pk.swiglu(g.astype(jnp.float32), u.astype(jnp.float32)).astype(x.dtype)

    def unfused_shared(x, wg, wu):
        g, u = pk.matmul_shared(x, (wg, wu))
        return pk.swiglu(g.astype(jnp.float32), u.astype(jnp.float32)).astype(x.dtype)

    def fused(tiles=None):
        mlp.FUSED, mlp.PAIR_TILES = True, tiles
        jax.clear_caches()
        return jax.jit(pk.gate_up_swiglu)

    rows = []
    try:
        for name, (k, n) in UP_WEIGHTS.items():
            wg, wu = (
                rand(90, (k, n), jnp.bfloat16, 1 / math.sqrt(k)),
                rand(89, (k, n), jnp.bfloat16, 1 / math.sqrt(k)),
            )
            bad = []
            for m in (1, 5, 16, 17, 64, 300):
                x = rand(91 + m, (m, k), jnp.bfloat16)
                if not np.array_equal(bits(fused()(x, wg, wu)), bits(jax.jit(unfused)(x, wg, wu))):
                    bad.append(m)
            check(f"gate_up_swiglu (fused) == gate, up + swiglu, {name}, bf16", not bad, str(bad))
        k, n = UP_WEIGHTS["llama3-8b"]
        wg, wu = (
            rand(93, (k, n), jnp.bfloat16, 1 / math.sqrt(k)),
            rand(88, (k, n), jnp.bfloat16, 1 / math.sqrt(k)),
        )
        x = rand(94, (16, k), jnp.bfloat16, 4.0)
        want = bits(jax.jit(unfused)(x, wg, wu))
        formula = mlp.swiglu
        mlp.swiglu = lambda g, u: g * (jax.nn.sigmoid(g) * u)  # read when the epilogue is traced
        try:
            approx = bits(fused()(x, wg, wu))
        finally:
            mlp.swiglu = formula
        differ = int((approx != want).sum())
        check(
            "negative control: the epilogue with the products grouped the other way differs",
            differ > 0,
            f"{differ} of {approx.size} elements",
        )
        copies = copies_for(2 * k * n * 2)
        wgs = [rand(96 + i, (k, n), jnp.bfloat16, 1 / math.sqrt(k)) for i in range(copies)]
        wus = [rand(196 + i, (k, n), jnp.bfloat16, 1 / math.sqrt(k)) for i in range(copies)]
        for m in (1, 16, 32, 64):
            x = rand(97, (m, k), jnp.bfloat16)

            def per_copy(op, x=x):
                fn = jax.jit(
                    lambda x, *ws: [op(x, a, b) for a, b in zip(ws[:copies], ws[copies:], strict=True)]
                )
                return kernel_us(fn, x, *wgs, *wus) / copies

            mlp.FUSED = False
            jax.clear_caches()
            t_xla = per_copy(
                lambda x, a, b: pk.swiglu((x @ a).astype(jnp.float32), (x @ b).astype(jnp.float32)).astype(
                    x.dtype
                )
            )
            # the engine's route without the switch: a launch each at decode rows, one shared
            # launch of both from GATE_UP_SHARED_MIN_ROWS rows (where the model does not call the
            # fused op: timed to decide whether it should)
            shared = m >= pk.matmul_triton.GATE_UP_SHARED_MIN_ROWS
            t_un = per_copy(unfused_shared if shared else unfused)
            want = bits(jax.jit(unfused)(x, wgs[0], wus[0]))
            best = None
            launches = PAIR_LAUNCHES if m <= 16 else [T(m, tn, w, st) for tn, w, st in PAIR_MID_LAUNCHES]
            for tiles in (None, *launches):
                mlp.PAIR_TILES = None  # (the default launch's label: pair_tiles' own rule)
                label = (
                    f"{tiles}"
                    if tiles
                    else f"default {mlp.pair_tiles(mm_mod.plan_matmul(k, n, jnp.bfloat16), m)}"
                )
                try:
                    same = np.array_equal(bits(fused(tiles)(x, wgs[0], wus[0])), want)
                    t = per_copy(pk.gate_up_swiglu)
                except Exception as e:  # noqa: BLE001 - a launch that does not compile is a finding
                    print(f"INFO gate_up M={m} {label}: {type(e).__name__}: {str(e)[:160]}", flush=True)
                    continue
                check(f"gate_up_swiglu M={m} {label} == gate, up + swiglu (bits)", same)
                print(f"GATEUP M={m} {label}: {t:.1f} us (unfused {t_un:.1f}, XLA {t_xla:.1f})", flush=True)
                if best is None or t < best[0]:
                    best = (t, label)
            rows.append(
                (
                    f"llama3-8b gate, up + SwiGLU (best: {best[1] if best else '-'})",
                    m,
                    t_xla,
                    t_un,
                    best[0] if best else float("nan"),
                )
            )
    finally:
        mlp.FUSED, mlp.PAIR_TILES, mlp.FUSED_MAX_ROWS = saved
        jax.clear_caches()
    return rows


# The fused gate/up launches timed by ``gate_up_fusion`` at 32 and 64 rows (tile_m = M):
# (tile_n, warps, stages).
PAIR_MID_LAUNCHES = [(64, 4, 3), (128, 4, 3), (128, 8, 3), (64, 8, 4)]
# The fused gate/up launches timed by ``gate_up_fusion`` (decode rows: 16-row tiles).
PAIR_LAUNCHES = [
    T(16, 32, 4, 4),
    *(T(16, 64, 4, st) for st in (3, 6)),
    *(T(16, 64, 8, st) for st in (3, 4)),
    *(T(16, 128, 4, st) for st in (2, 3)),
    T(16, 128, 8, 3),
]


def time_rows():
    rows = []
    for t in (1, 64, 1024, 8192):
        x = rand(40, (t, 4096), jnp.bfloat16)
        g = rand(41, (4096,), jnp.bfloat16)
        a = kernel_us(jax.jit(lambda x, g: pk.rms_norm_reference(x, g, eps=1e-5)), x, g)
        b = kernel_us(jax.jit(lambda x, g: pk.rms_norm(x, g, eps=1e-5)), x, g)
        rows.append(("rms_norm bf16 H=4096", t, a, b, b / a))
    for t in (1, 64, 1024, 8192):
        lg = rand(42, (t, 128256), jnp.float32)
        a = kernel_us(jax.jit(pk.log_softmax_reference), lg)
        b = kernel_us(jax.jit(pk.log_softmax), lg)
        rows.append(("log_softmax f32 V=128256", t, a, b, b / a))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="one weight, three timed cells")
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="also time alternative launch shapes")
    ap.add_argument("--rows-only", action="store_true", help="only rms_norm / softmax checks and times")
    ap.add_argument("--decode-sweep", action="store_true", help="only the decode-row launch sweep")
    ap.add_argument(
        "--shared", action="store_true", help="only weights sharing x: one launch vs a launch each"
    )
    ap.add_argument("--mid-m", action="store_true", help="only 64 < M < 512: Triton vs Mosaic GPU vs XLA")
    ap.add_argument("--mid-tiles", action="store_true", help="only Mosaic GPU launches at M 256 and 384")
    ap.add_argument(
        "--mid-rows", action="store_true", help="only launch shapes at 32 and 64 rows: bits, time"
    )
    ap.add_argument(
        "--bits-sweep", action="store_true", help="only bits: shared launch, Mosaic vs Triton rows"
    )
    ap.add_argument(
        "--fusions",
        action="store_true",
        help="only matmul_norm, rope_write_kv and qkv_rope_write_kv: bits and time",
    )
    ap.add_argument("--qkv", action="store_true", help="only qkv_rope_write_kv: bits and time")
    ap.add_argument(
        "--gate-up", action="store_true", help="only gate_up_swiglu fused vs unfused: bits and launches' time"
    )
    args = ap.parse_args()
    dev = jax.devices()[0]
    print(f"# {datetime.date.today()} {dev.device_kind} jax {jax.__version__}")
    if (
        args.shared
        or args.mid_m
        or args.mid_tiles
        or args.mid_rows
        or args.bits_sweep
        or args.fusions
        or args.qkv
        or args.gate_up
    ):
        if args.fusions:
            fusions()
        elif args.qkv:
            print_fusion_rows(qkv_fusion())
        if args.gate_up:
            print_fusion_rows(gate_up_fusion())
        if args.bits_sweep:
            bits_sweep()
        if args.mid_tiles:
            mid_tiles()
        if args.mid_rows:
            mid_rows()
        if args.shared:
            shared_launch()
        if args.mid_m:
            mid_m()
        print(f"\nchecks failed: {len(FAILURES)} {FAILURES}")
        sys.exit(1 if FAILURES else 0)
    if args.decode_sweep:
        decode_sweep()
        print(f"\nchecks failed: {len(FAILURES)} {FAILURES}")
        sys.exit(1 if FAILURES else 0)
    if args.rows_only:
        check_row_invariance()
        rrows = time_rows()
        for r in rrows:
            print(f"| {r[0]} | {r[1]} | {r[2]:.1f} | {r[3]:.1f} | {r[4]:.2f} |")
        print(f"\nchecks failed: {len(FAILURES)} {FAILURES}")
        sys.exit(1 if FAILURES else 0)
    if not args.skip_checks:
        check_correctness()
        check_matmul_invariance(args.quick)
        check_row_invariance()
    if args.sweep:
        sweep()
    mrows = time_matmul(args.quick)
    rrows = time_rows()
    print("\n| weight (K x N) | M | XLA us | bijax us | ratio | bijax k_shards=8 us |")
    print("|---|---|---|---|---|---|")
    for r in mrows:
        print(f"| {r[0]} | {r[1]} | {r[2]:.1f} | {r[3]:.1f} | {r[4]:.2f} | {r[5]:.1f} |")
    gm = math.exp(sum(math.log(r[4]) for r in mrows) / len(mrows))
    print(f"\ngeometric-mean matmul ratio bijax/XLA (k_shards=1): {gm:.3f}")
    print("\n| op | rows | XLA us | bijax us | ratio |")
    print("|---|---|---|---|---|")
    for r in rrows:
        print(f"| {r[0]} | {r[1]} | {r[2]:.1f} | {r[3]:.1f} | {r[4]:.2f} |")
    print(f"\nchecks failed: {len(FAILURES)} {FAILURES}")
    sys.exit(1 if FAILURES else 0)


if __name__ == "__main__":
    main()
