"""The non-invariant baseline on the H200: its attention (``attention_xla``: cuDNN for first
chunks, a bounded paged loop for cached keys) next to the invariant kernel, the old dense
reference and cuDNN over contiguous keys; then ``bijax bench`` on llama3-8b (both paths).

Run on the H200 from the repo root:
  PYTHONPATH=. python benchmarks/baseline.py --part kernels
  PYTHONPATH=. python benchmarks/baseline.py --part bench [--single]
Kernel times are CUPTI (all kernels of the jitted call); the baseline's loop also syncs the host
once per iteration, so its wall time per call is printed next to it.
"""

from __future__ import annotations

import argparse
import datetime
import subprocess
import sys
import time

import jax
import numpy as np

from benchmarks.attention import Case, kernel_us
from pallas_kernels.attention import attention, attention_reference
from pallas_kernels.attention_xla import attention_xla


def wall_us(fn, *args, n=20):
    fn = jax.jit(fn)
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    for _ in range(n):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / n * 1e6


def case_row(name, n, ctx, qn, hq, hkv):
    c = Case(n, ctx, hq, hkv, 128)
    seq = np.repeat(np.arange(n), qn)
    pos = np.tile(np.arange(ctx - qn, ctx), n)
    q, s, p = c.tokens(seq, pos)
    # this step's own k/v: read back from the cache (they were written before attention)
    btn = np.asarray(c.bt)
    kv_rows = (btn[seq, pos // 16], pos % 16)
    k, v = c.kc[kv_rows], c.vc[kv_rows]
    inv = lambda q, s, p: attention(q, c.kc, c.vc, c.bt, c.cl, s, p)  # noqa: E731
    base = lambda q, k, v, s, p: attention_xla(q, k, v, c.kc, c.vc, c.bt, c.cl, s, p)  # noqa: E731
    ref = lambda q, s, p: attention_reference(q, c.kc, c.vc, c.bt, c.cl, s, p)  # noqa: E731
    a = np.asarray(jax.jit(inv)(q, s, p), np.float32)
    b = np.asarray(jax.jit(base)(q, k, v, s, p), np.float32)
    err = float(np.abs(a - b).max())
    t_inv = kernel_us(inv, q, s, p)
    t_base = kernel_us(base, q, k, v, s, p)
    w_base = wall_us(base, q, k, v, s, p)
    try:
        t_ref = f"{kernel_us(ref, q, s, p):.1f}"
    except Exception as e:  # noqa: BLE001 - the old baseline may not fit: say so
        t_ref = f"failed ({type(e).__name__})"
    # cuDNN over contiguous keys (what a dense engine would do)
    kd = c.kc[btn[:, : ctx // 16]].reshape(n, ctx, hkv, 128)
    vd = c.vc[btn[:, : ctx // 16]].reshape(n, ctx, hkv, 128)
    qd = q.reshape(n, qn, hq, 128)
    if qn == ctx:
        dense = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")  # noqa: E731
    else:
        dense = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn")  # noqa: E731
    try:
        t_cudnn = f"{kernel_us(dense, qd, kd, vd):.1f}"
    except Exception as e:  # noqa: BLE001
        t_cudnn = f"failed ({type(e).__name__}: {str(e)[:80]})"
    return name, t_inv, t_base, w_base, t_ref, t_cudnn, err


def kernels(only=()):
    rows = []
    # (name, seqs, ctx, query tokens per seq (the step's last tokens), hq, hkv)
    cases = [
        ("prefill 4096 causal", 1, 4096, 4096, 32, 8),
        ("prefill 8 x 1024 causal", 8, 1024, 1024, 32, 8),
        ("later chunk 512 of 4096", 1, 4096, 512, 32, 8),
        ("decode 1 x 1024", 1, 1024, 1, 32, 8),
        ("decode 64 x 1024", 64, 1024, 1, 32, 8),
        ("decode 64 x 4096", 64, 4096, 1, 32, 8),
    ]
    if only:
        cases = [c for c in cases if c[0] in only]
    for case in cases:
        rows.append(case_row(*case))
        print(rows[-1], flush=True)
    print(
        "\n| case | invariant us | attention_xla us (wall) | old reference us | cuDNN dense us | max abs diff |"
    )
    print("|---|---|---|---|---|---|")
    for name, ti, tb, wb, tr, tc, err in rows:
        print(f"| {name} | {ti:.1f} | {tb:.1f} ({wb:.0f}) | {tr} | {tc} | {err:.2e} |")


def bench(single: bool):
    common = ["--model", "llama3-8b", "--json"]
    if single:
        args = ["--num-prompts", "1", "--input-len", "64", "--output-len", "256", "--max-num-seqs", "1"]
    else:
        args = [
            "--num-prompts", "64", "--input-len", "256", "--output-len", "128",
            "--max-num-seqs", "64", "--max-num-batched-tokens", "2048",
        ]  # fmt: skip
    cmd = [sys.executable, "-m", "bijax.cli", "bench", *common, *args]
    print("$", " ".join(cmd[1:]), flush=True)
    t0 = time.perf_counter()
    r = subprocess.run(cmd, text=True)
    print(f"(exit {r.returncode}, {time.perf_counter() - t0:.0f} s)", flush=True)
    return r.returncode


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", choices=["kernels", "bench"], required=True)
    ap.add_argument("--single", action="store_true")
    ap.add_argument("--cases", default="", help="kernels: comma-separated case names (default all)")
    a = ap.parse_args()
    print(
        f"# benchmarks/baseline.py --part {a.part} {datetime.date.today()} {jax.devices()[0].device_kind}, jax {jax.__version__}"
    )
    if a.part == "kernels":
        kernels(tuple(c for c in a.cases.split(",") if c))
        return 0
    return bench(a.single)


if __name__ == "__main__":
    sys.exit(main())
