"""Export (trace + lower for CUDA, on any machine) time of the engine's llama3-8b forward with
the Triton dialect's module named where MLIR looks (``runtime.TRITON_DIALECT_MODULE``, the
default since session 42) or not (``--side unnamed``: MLIR's three failed imports per "tt"
value, as before). Each side runs in a fresh process; the sides alternate; the exported text's
SHA-256 must be the same on both (the parent checks).

    PYTHONPATH=. python3 benchmarks/lowering_ab.py [--layers 32] [--tokens 16,512] [--rounds 2]

Per side and shape: the first export (tracing + lowering) and a second one with a new outer
function (the inner jitted functions' traces cached: mostly lowering).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import time


def child(a) -> None:
    if a.side == "unnamed":  # before anything lowers: MLIR has cached nothing yet
        import pallas_kernels.runtime as runtime

        del sys.modules[runtime.TRITON_DIALECT_MODULE]
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from models.configs import preset
    from models.llama import Llama
    from models.paged import PagedBatch, init_kv_cache
    from pallas_kernels.runtime import cuda_export

    cfg = dataclasses.replace(preset("llama3-8b"), num_layers=a.layers)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Llama(cfg, dtype=jnp.bfloat16, seed=0)))
    seqs, blocks = 16, 64
    cache = jax.eval_shape(lambda: init_kv_cache(cfg, 256, 16, jnp.bfloat16))

    def step(state, cache, tok, seq, pos, slot, tables, lens):
        m = nnx.merge(graphdef, state)
        return m.forward_paged(PagedBatch(tok, seq, pos, slot, tables, lens), cache, invariant=True)

    spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)  # noqa: E731
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    t = a.tokens
    args = (
        jax.tree.map(spec, state),
        jax.tree.map(spec, cache),
        *(i32(t),) * 4,
        i32(seqs, blocks),
        i32(seqs),
    )
    t0 = time.perf_counter()
    text = cuda_export(lambda *x: step(*x), *args)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    cuda_export(lambda *x: step(*x), *args)
    again = time.perf_counter() - t0
    sha = hashlib.sha256(text.encode()).hexdigest()
    print("RESULT " + json.dumps(dict(first=first, again=again, sha=sha)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--tokens", default="16,512", help="tokens a step (16: decode, > 16: prefill)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--side", choices=("named", "unnamed"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.side:
        a.tokens = int(a.tokens)
        child(a)
        return 0
    rows, shas = [], {}
    for tokens in (int(x) for x in a.tokens.split(",")):
        for r in range(a.rounds):
            for side in ("unnamed", "named") if r % 2 == 0 else ("named", "unnamed"):
                cmd = [sys.executable, os.path.abspath(__file__), "--side", side]
                cmd += ["--layers", str(a.layers), "--tokens", str(tokens)]
                p = subprocess.run(
                    cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1")
                )
                line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
                if p.returncode or line is None:
                    print(f"{side} {tokens}: failed: {p.stderr[-1500:]}")
                    return 1
                res = json.loads(line.split(" ", 1)[1])
                shas.setdefault(tokens, set()).add(res["sha"])
                rows.append((tokens, side, res["first"], res["again"]))
                print(
                    f"{tokens} tokens, {side}: first {res['first']:.2f} s, again {res['again']:.2f} s",
                    flush=True,
                )
    print(f"\nllama3-8b, {a.layers} layers, export for CUDA (H200), s")
    print("| tokens a step | Triton dialect module | first export | again (new outer function) |")
    print("|---|---|---|---|")
    for tokens, side, first, again in rows:
        print(f"| {tokens} | {side} | {first:.2f} | {again:.2f} |")
    same = all(len(s) == 1 for s in shas.values())
    print("exported text the same on both sides:", same)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
