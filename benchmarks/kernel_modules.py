"""The Mosaic GPU attention kernel's modules as they go to the GPU compiler (lowered for CUDA
on any machine, debug info left out), with their SHA-256: a refactor whose hashes match the
last measured tree's compiled the same kernels, so the H200 measurements still hold for it.

    PYTHONPATH=. python3 benchmarks/mgpu_modules.py [--launch "consumers=2,stages=5"] [--out DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import os

import jax
import jax.numpy as jnp
from jax.experimental.mosaic.gpu import core

from pallas_kernels.attention_math import AttentionSpec
from pallas_kernels.attention_mgpu import tiles_mgpu
from pallas_kernels.runtime import cuda_export

# name -> (head_dim, query heads, KV heads, block size, tiles_mgpu arguments, AttentionSpec arguments)
CONFIGS = {
    "d128": (128, 8, 2, 16, {"pv": "into", "rounding": "two"}, {}),
    "d128-overlap": (128, 8, 2, 16, {"pv": "into", "rounding": "two", "overlap": True}, {}),
    "d64-window-fma": (64, 28, 4, 64, {"pv": "add", "rounding": "fma"}, {"sliding_window": 100}),
}


def modules(launch: dict) -> dict[str, str]:
    """Config name -> the kernel module's text (one Mosaic GPU kernel per config)."""
    captured = []
    serde = core._run_serde_pass

    def capture(module, *args, **kw):
        if kw.get("serialize"):
            captured.append(module.operation.get_asm(enable_debug_info=False))
        return serde(module, *args, **kw)

    core._run_serde_pass = capture
    try:
        out = {}
        s = jax.ShapeDtypeStruct
        for name, (d, hq, hkv, bs, kw, spec_kw) in CONFIGS.items():
            spec = AttentionSpec.create(d, **spec_kw)
            i32 = jnp.int32
            args = (
                s((200, hkv, hq // hkv, d), jnp.bfloat16),
                s((64, bs, hkv, d), jnp.bfloat16),
                s((64, bs, hkv, d), jnp.bfloat16),
                (s((2, 32), i32), s((2,), i32), s((200,), i32), s((200,), i32)),
            )
            captured.clear()
            cuda_export(
                lambda q, k, v, idx, kw=kw, spec=spec: tiles_mgpu(q, k, v, idx, spec=spec, **kw, **launch),
                *args,
            )
            if len(captured) != 1:
                raise RuntimeError(f"{name}: expected one Mosaic GPU kernel, lowered {len(captured)}")
            out[name] = captured[0]
        return out
    finally:
        core._run_serde_pass = serde


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--launch", default="", help="tiles_mgpu launch arguments, e.g. consumers=2,stages=5,order=heaviest"
    )
    ap.add_argument("--out", help="also write each module's text here")
    a = ap.parse_args()
    launch = {}
    for item in filter(None, a.launch.split(",")):
        key, _, value = item.partition("=")
        launch[key] = int(value) if value.isdigit() else value
    for name, text in modules(launch).items():
        print(f"{name}: {hashlib.sha256(text.encode()).hexdigest()} ({len(text)} chars)")
        if a.out:
            os.makedirs(a.out, exist_ok=True)
            with open(os.path.join(a.out, f"{name}.mlir"), "w") as f:
                f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
