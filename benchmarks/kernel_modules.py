"""The attention kernels' modules as they go to the GPU compiler - the Mosaic GPU ``tiles``
kernel and the Triton ``tiles`` and ``tokens`` kernels (+ combine) - lowered for CUDA on any
machine with debug info left out, with their SHA-256: a refactor whose hashes match the last
measured tree's compiles the same kernels, so the H200 measurements still hold for it.

    PYTHONPATH=. python3 benchmarks/kernel_modules.py [--launch "consumers=2,stages=5"] [--out DIR]

(``--launch``: Mosaic launch arguments; the Triton kernels take none.)
"""

from __future__ import annotations

import argparse
import hashlib
import os

import jax
import jax.numpy as jnp
from jax._src.pallas.triton import pallas_call_registration
from jax.experimental.mosaic.gpu import core

from pallas_kernels import attention_triton
from pallas_kernels.attention_math import AttentionSpec
from pallas_kernels.attention_mgpu import tiles_mgpu
from pallas_kernels.runtime import cuda_export

# name -> (head_dim, query heads, KV heads, block size, tiles_mgpu arguments, AttentionSpec arguments)
CONFIGS = {
    "d128": (128, 8, 2, 16, {"pv": "into", "rounding": "two"}, {}),
    "d128-overlap": (128, 8, 2, 16, {"pv": "into", "rounding": "two", "overlap": True}, {}),
    "d64-window-fma": (64, 28, 4, 64, {"pv": "add", "rounding": "fma"}, {"sliding_window": 100}),
}


def _args(d, hq, hkv, bs):
    s, i32 = jax.ShapeDtypeStruct, jnp.int32
    return (
        s((200, hkv, hq // hkv, d), jnp.bfloat16),
        s((64, bs, hkv, d), jnp.bfloat16),
        s((64, bs, hkv, d), jnp.bfloat16),
        (s((2, 32), i32), s((2,), i32), s((200,), i32), s((200,), i32)),
    )


def parse_launch(text: str) -> dict:
    """ "consumers=2,order=heaviest,one_drain=True" -> tiles_mgpu's launch keywords (ints,
    booleans, else strings)."""
    launch = {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"launch choice {item!r}: write it as name=value")
        launch[key] = int(value) if value.isdigit() else {"True": True, "False": False}.get(value, value)
    return launch


def modules(launch: dict) -> dict[str, str]:
    """Name -> a kernel module's text: the Mosaic kernel per config, then the Triton kernels
    (tiles; tokens and its combine) without and with a window."""
    captured = []
    serde = core._run_serde_pass
    to_triton = pallas_call_registration.lowering.lower_jaxpr_to_triton_module

    def capture(module, *args, **kw):
        if kw.get("serialize"):
            captured.append(module.operation.get_asm(enable_debug_info=False))
        return serde(module, *args, **kw)

    def capture_triton(*args, **kw):
        result = to_triton(*args, **kw)
        captured.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    core._run_serde_pass = capture
    pallas_call_registration.lowering.lower_jaxpr_to_triton_module = capture_triton
    try:
        out = {}
        for name, (d, hq, hkv, bs, kw, spec_kw) in CONFIGS.items():
            spec = AttentionSpec.create(d, **spec_kw)
            captured.clear()
            cuda_export(
                lambda q, k, v, idx, kw=kw, spec=spec: tiles_mgpu(q, k, v, idx, spec=spec, **kw, **launch),
                *_args(d, hq, hkv, bs),
            )
            if len(captured) != 1:
                raise RuntimeError(f"{name}: expected one Mosaic GPU kernel, lowered {len(captured)}")
            out[name] = captured[0]
        for kernel in ("tiles", "tokens"):
            for window in (None, 100):
                spec = AttentionSpec.create(128, sliding_window=window)
                captured.clear()
                cuda_export(
                    lambda q, k, v, idx, kernel=kernel, spec=spec: attention_triton.attend(
                        q, k, v, idx, spec=spec, interpret=False, kernel=kernel
                    ),
                    *_args(128, 8, 2, 16),
                )
                for i, text in enumerate(captured):
                    out[f"triton-{kernel}{'-window' if window else ''}-{i}"] = text
        return out
    finally:
        core._run_serde_pass = serde
        pallas_call_registration.lowering.lower_jaxpr_to_triton_module = to_triton


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--launch", default="", help="tiles_mgpu launch arguments, e.g. consumers=2,stages=5,order=heaviest"
    )
    ap.add_argument("--out", help="also write each module's text here")
    a = ap.parse_args()
    for name, text in modules(parse_launch(a.launch)).items():
        print(f"{name}: {hashlib.sha256(text.encode()).hexdigest()} ({len(text)} chars)")
        if a.out:
            os.makedirs(a.out, exist_ok=True)
            with open(os.path.join(a.out, f"{name}.mlir"), "w") as f:
                f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
