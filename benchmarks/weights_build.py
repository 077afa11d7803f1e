"""Where a preset's random-weight build goes (the "model" share of a cold start): the
backend's start, then ``models.loading.load_model`` of the preset twice in one process - the
first build traces and compiles its weight programs (one per shape, scale and dtype), the
second reuses them, so it is the draws and their dispatch alone - with the compile and trace
seconds JAX reports (``jax.monitoring``) and the number of compiles.

Run on the H200 from the repo root:
    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/weights_build.py [--model llama3-8b]
``--smoke``: the ``tiny`` preset (CPU).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import time

import jax
import jax.numpy as jnp
from jax._src import dispatch

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


def build(name: str, seed: int) -> dict:
    _seen.clear()
    _count.clear()
    t0 = time.perf_counter()
    model = load_model(name, seed=seed)
    jax.block_until_ready(jax.tree_util.tree_leaves(model))
    row = {"seconds": time.perf_counter() - t0, **{k: _seen[k] for k in EVENTS.values()}}
    row["compiles"] = _count["compile"]
    row["bytes"] = sum(x.nbytes for x in jax.tree_util.tree_leaves(model) if hasattr(x, "nbytes"))
    del model
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--smoke", action="store_true", help="tiny preset (CPU)")
    a = p.parse_args()
    name = "tiny" if a.smoke else a.model
    jax.monitoring.register_event_duration_secs_listener(_listen)
    t0 = time.perf_counter()
    devices = jax.devices()
    jnp.zeros(1).block_until_ready()
    start = time.perf_counter() - t0
    print(f"# {datetime.date.today()} {devices[0].device_kind} jax {jax.__version__} model {name}")
    print(f"backend start (jax.devices() and a first op): {start:.2f} s")
    rows = [("first build", build(name, 0)), ("second build, same process", build(name, 1))]
    print("\n| build | s | compile s (programs) | trace s | lower s | GB |\n|---|---|---|---|---|---|")
    for label, r in rows:
        print(
            f"| {label} | {r['seconds']:.2f} | {r['compile']:.2f} ({r['compiles']}) | {r['trace']:.2f} |"
            f" {r['lower']:.2f} | {r['bytes'] / 1e9:.1f} |"
        )


if __name__ == "__main__":
    main()
