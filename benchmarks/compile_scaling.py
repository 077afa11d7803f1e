"""How one forward program's lowering and compile time grow with the model's layer count - the
start-up issue's open question: after the helpers lower in parallel, a cold 64 x 2048 warm-up is
XLA compiling ~21 forward programs at ~8 s each. Is that per layer (per Pallas call site: XLA
compiles each Triton custom call it meets) or per program?

For each L in ``--layers``: the preset's shapes with L layers (random weights, built here), the
engine's forward program for each ``--buckets`` (sequences x tokens), traced and lowered
(exported, as a warm-up does) and compiled in this process on an empty compile cache of its
own; the Pallas calls in the lowered text counted. A time that grows ~linearly in L at a
per-call rate says that compiling the kernels is the cost (and a scan over layers, or a kernel
cache, is the lever); a flat one says it is the program.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/compile_scaling.py [--model llama3-8b] [--layers 1,4,16,32]
``--smoke``: the ``tiny`` preset on CPU (a check of the script).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import re
import sys
import tempfile
import time

# an empty cache of its own, whatever the environment says: every compile here must be real
os.environ["BIJAX_CACHE_DIR"] = tempfile.mkdtemp(prefix="bijax-compile-scaling-")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import bijax  # noqa: E402
from models.configs import preset  # noqa: E402
from models.llama import Llama  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--layers", default="1,4,16,32", help="comma-separated layer counts")
    ap.add_argument("--buckets", default="64x64,16x2048", help="comma-separated SEQSxTOKENS forward buckets")
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    name = "tiny" if a.smoke else a.model
    layers = [int(x) for x in a.layers.split(",")]
    buckets = [tuple(int(v) for v in b.split("x")) for b in a.buckets.split(",")]
    if a.smoke:
        layers, buckets = [1, 2], [(1, 16)]
    print(f"# {datetime.date.today()} {jax.devices()[0].device_kind} jax {jax.__version__} model {name}")
    print(f"# cache {os.environ['BIJAX_CACHE_DIR']} (empty at the start; every program here is new)")
    rows = []
    for n in layers:
        cfg = dataclasses.replace(preset(name), num_layers=n)
        model = Llama(cfg, dtype=jnp.bfloat16, seed=0)
        s_max = max(s for s, _ in buckets)
        t_max = max(t for _, t in buckets)
        llm = bijax.LLM(
            model, max_num_seqs=s_max, max_num_batched_tokens=t_max, max_model_len=max(t_max, 1024)
        )
        runner = llm.engine.runner
        for s, t in buckets:
            key = ("forward", s, t, s)
            t0 = time.perf_counter()
            lowered = runner._lowered(key)  # traced, lowered, exported (a warm-up's path)
            t1 = time.perf_counter()
            text = getattr(lowered, "lowered", lowered).as_text()  # (a step_cache.FlatStep wraps it)
            triton = len(re.findall(r"__gpu\$xla\.gpu\.triton", text))
            mosaic = len(re.findall(r"mosaic_gpu", text))
            t2 = time.perf_counter()
            lowered.compile()
            t3 = time.perf_counter()
            rows.append((n, f"{s} x {t}", t1 - t0, t3 - t2, triton, mosaic))
            print(
                f"{n} layers, {s} x {t}: lower {t1 - t0:.2f} s, compile {t3 - t2:.2f} s, "
                f"Triton calls {triton}, Mosaic GPU mentions {mosaic}",
                flush=True,
            )
        del llm, runner, model
    print(
        "\n| layers | bucket | trace + lower + export s | compile s | Triton custom calls | Mosaic GPU mentions |"
    )
    print("|---|---|---|---|---|---|")
    for n, b, lo, co, tr, mo in rows:
        print(f"| {n} | {b} | {lo:.2f} | {co:.2f} | {tr} | {mo} |")
    for b in dict.fromkeys(r[1] for r in rows):
        mine = [r for r in rows if r[1] == b]
        if len(mine) > 1:
            (n0, _, _, c0, *_), (n1, _, _, c1, *_) = mine[0], mine[-1]
            print(f"{b}: compile {(c1 - c0) / (n1 - n0):.3f} s per added layer, {c0:.2f} s at {n0}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
