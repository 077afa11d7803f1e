"""Where a preset's random-weight build goes (the "model" share of a cold start), in two
fresh processes, each on an empty compilation cache: ``models.loading.load_model`` (the draw
programs compiled side by side first, ``compile_draws``) and the model's constructor alone (the
same programs compiled one after another as the build meets them). In each: the backend's
start, then the build twice - the first traces and compiles its weight programs (one per
shape, scale and dtype), the second reuses them, so it is the draws and their dispatch alone -
with the compile and trace seconds JAX reports (``jax.monitoring``; side by side they add up to
more than the wall time) and the number of compiles; and whether both give the same weights.

Run on the H200 from the repo root:
    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/weights_build.py [--model llama3-8b]
``--smoke``: the ``tiny`` preset (CPU).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import dispatch

from models.configs import preset
from models.llama import Llama
from models.loading import load_model

EVENTS = {
    dispatch.BACKEND_COMPILE_EVENT: "compile",
    dispatch.JAXPR_TRACE_EVENT: "trace",
    dispatch.JAXPR_TO_MLIR_MODULE_EVENT: "lower",
}
_seen: collections.Counter = collections.Counter()
_count: collections.Counter = collections.Counter()


def _listen(event: str, seconds: float, **_) -> None:
    name = EVENTS.get(event)
    if name is not None:
        _seen[name] += seconds
        _count[name] += 1


def build(name: str, seed: int, side_by_side: bool) -> dict:
    _seen.clear()
    _count.clear()
    t0 = time.perf_counter()
    if side_by_side:
        model = load_model(name, seed=seed)
    else:
        model = Llama(preset(name), dtype=jnp.bfloat16, seed=seed)
    leaves = [x for x in jax.tree_util.tree_leaves(model) if isinstance(x, jax.Array)]
    jax.block_until_ready(leaves)
    row = {"seconds": time.perf_counter() - t0, **{k: _seen[k] for k in EVENTS.values()}}
    row["compiles"] = _count["compile"]
    row["bytes"] = sum(x.nbytes for x in leaves)
    # a digest of a few weights (every 8th leaf's first row): the two sides must agree
    h = hashlib.sha256()
    for x in leaves[::8]:
        h.update(np.asarray(x[:1] if x.ndim else x).tobytes())
    row["digest"] = h.hexdigest()[:16]
    del model, leaves
    return row


def child(name: str, side_by_side: bool) -> None:
    jax.monitoring.register_event_duration_secs_listener(_listen)
    t0 = time.perf_counter()
    jax.devices()
    jnp.zeros(1).block_until_ready()
    start = time.perf_counter() - t0
    rows = [build(name, 0, side_by_side), build(name, 0, side_by_side)]
    print("RESULT " + json.dumps({"start": start, "rows": rows}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--smoke", action="store_true", help="tiny preset (CPU)")
    p.add_argument("--child", choices=("side-by-side", "one-by-one"), help=argparse.SUPPRESS)
    a = p.parse_args()
    name = "tiny" if a.smoke else a.model
    if a.child:
        child(name, a.child == "side-by-side")
        return
    print(f"# {datetime.date.today()} {jax.devices()[0].device_kind} jax {jax.__version__} model {name}")
    table, digests = [], set()
    for side, label in (
        ("side-by-side", "load_model (draw programs compiled side by side)"),
        ("one-by-one", "constructor alone (compiled one by one)"),
    ):
        env = dict(os.environ, BIJAX_CACHE_DIR=tempfile.mkdtemp(prefix="bijax-weights-"))
        cmd = [sys.executable, __file__, "--model", name, "--child", side]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
        r = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
        print(label, json.dumps(r), flush=True)
        for i, row in enumerate(r["rows"]):
            digests.add(row["digest"])
            table.append((label, "first build" if i == 0 else "second build", r["start"], row))
    print(f"same weights on both sides: {len(digests) == 1}")
    print("\n| side | build | backend start s | build s | compile s (programs) | trace s | lower s | GB |")
    print("|---|---|---|---|---|---|---|---|")
    for label, which, start, r in table:
        print(
            f"| {label} | {which} | {start:.2f} | {r['seconds']:.2f} | {r['compile']:.2f} ({r['compiles']}) |"
            f" {r['trace']:.2f} | {r['lower']:.2f} | {r['bytes'] / 1e9:.1f} |"
        )
    if len(digests) != 1:
        sys.exit(1)


if __name__ == "__main__":
    main()
