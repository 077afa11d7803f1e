"""Where the Mosaic GPU prefill kernel's time goes inside the kernel: Mosaic GPU's on-device
profiler (``tiles_mgpu(probe_trace=...)``) on the engine's launch (``attention_triton.
MGPU_PREFILL_LAUNCH``), per case, in clock cycles of each warpgroup.

    PYTHONPATH=. python3 benchmarks/attention_trace.py [--cases 8x1024-28/4,1x4096-32/8] [--keep DIR]
        [--levels items,tiles,parts] [--launch pingpong=True]

For each case and level ("items": each work item's ``begin`` (its q, rows and segments in),
``walk`` (its KV tiles), ``finish`` (the fold read back and normalized), ``store``; "tiles":
also each KV tile and split fold; "parts": also each tile's ``qk`` (q @ k.T issued and waited
for), ``wait_v``, ``zero_v`` and ``dots`` (p @ ones and p @ v issued and waited for), the rest
of a tile being its softmax): the kernel time (CUPTI) with and without the probe, whether
the traced kernel's output has the untraced one's bits (it must: the probe only reads clocks),
and per warpgroup kind the ranges' counts, mean cycles and shares of the warpgroup's traced
span. A program's ranges stop at ``attention_mgpu.TRACE_RANGES`` a warpgroup (the rest are
dropped), so "tiles" covers a program's first items only. Exit code 1 if a traced output's bits
differ.

Reading it (benchmarks/attention_plan.md, RESULTS.md session 54): a consumer's span is
``begin + walk + finish + store`` and the time between them, an item at a time; what an item
costs besides its tiles, the 8 x 1024 case pays ~3.8x as often a KV tile as a 4096-token prompt.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import tempfile
from collections import defaultdict

CASES = {
    "8x1024-28/4": (8, 1024, 28, 4, 128),
    "1x4096-28/4": (1, 4096, 28, 4, 128),
    "1x4096-32/8": (1, 4096, 32, 8, 128),
    "1x4096-9/3-d64": (1, 4096, 9, 3, 64),
}
ITEM_RANGES = ("begin", "walk", "finish", "store")


def intervals(events: list[dict]) -> dict[int, list[tuple[str, float, float, int]]]:
    """A trace's "B" / "E" events -> per trace id (a warpgroup of a program), its ranges in
    order of their start: (name, start, end, depth), times as the trace gives them. A tile
    part's range (level "parts") is named after its tile's or item's begin: "tile_full/qk",
    "begin/q_wait"."""
    out: dict[int, list] = defaultdict(list)
    stacks: dict[int, list] = defaultdict(list)
    for e in events:
        tid = e["tid"]
        if e["ph"] == "B":
            stacks[tid].append((e["name"], e["ts"], len(stacks[tid])))
        elif e["ph"] == "E":
            if not stacks[tid] or stacks[tid][-1][0] != e["name"]:
                raise ValueError(f"trace {tid}: end of {e['name']!r} without its start")
            name, start, depth = stacks[tid].pop()
            parent = stacks[tid][-1][0] if stacks[tid] else ""
            if parent.startswith("tile_") or parent == "begin":
                name = f"{parent}/{name}"
            out[tid].append((name, start, e["ts"], depth))
    for ranges in out.values():
        ranges.sort(key=lambda r: (r[1], r[3]))
    return dict(out)


def summarize(trace: dict, warpgroups: int, producer: int | None) -> dict:
    """Per warpgroup kind ("consumer", "producer"): {"traces", "span" (cycles summed over the
    traces), "ranges": {name: (count, total cycles)}, "gaps" (span not in any outermost
    range)}. Times in the trace are kilo-units (its "ts" is microseconds of a ns timer plus
    clock cycles since the warpgroup's first range): cycles are 1000 x their differences."""
    kinds: dict[str, dict] = {}
    for tid, ranges in intervals(trace["traceEvents"]).items():
        wg = (tid - 1) % warpgroups
        kind = "producer" if wg == producer else "consumer"
        k = kinds.setdefault(
            kind, {"traces": 0, "span": 0.0, "ranges": defaultdict(lambda: [0, 0.0]), "gaps": 0.0}
        )
        k["traces"] += 1
        span = (max(r[2] for r in ranges) - min(r[1] for r in ranges)) * 1e3
        k["span"] += span
        outer = 0.0
        for name, start, end, depth in ranges:
            cyc = (end - start) * 1e3
            k["ranges"][name][0] += 1
            k["ranges"][name][1] += cyc
            if depth == 0:
                outer += cyc
        k["gaps"] += span - outer
    for k in kinds.values():
        k["ranges"] = {n: tuple(v) for n, v in k["ranges"].items()}
    return kinds


def report(name: str, level: str, kinds: dict) -> list[str]:
    """Lines: each kind's ranges (count, mean cycles, share of the span), and its gaps."""
    lines = []
    for kind, k in sorted(kinds.items()):
        span = k["span"] or 1.0
        lines.append(
            f"{name} [{level}] {kind}: {k['traces']} warpgroups, {k['span'] / k['traces']:.0f} cycles traced each"
        )
        for rname, (count, total) in sorted(k["ranges"].items(), key=lambda kv: -kv[1][1]):
            lines.append(
                f"    {rname:20s} x{count:7d}  mean {total / count:9.0f} cycles  {100 * total / span:5.1f}%"
            )
        lines.append(f"    {'(between ranges)':20s}           {'':15s}        {100 * k['gaps'] / span:5.1f}%")
    return lines


def _newest_trace(directory: str) -> dict:
    files = sorted(glob.glob(os.path.join(directory, "*trace.json")), key=os.path.getmtime)
    if not files:
        raise RuntimeError(f"no trace written into {directory}")
    with open(files[-1]) as f:
        return json.load(f)


def engine_launch(extra: dict) -> dict:
    """The engine's prefill launch (``attention_triton.MGPU_PREFILL_LAUNCH``) with ``extra``'s
    choices over it."""
    from pallas_kernels import attention_triton

    return {**dict(attention_triton.MGPU_PREFILL_LAUNCH), **extra}


PARTS = ("wait_k", "qk", "wait_v", "dots")  # a full tile's parts the table shows (level "parts")


def run_case(
    name: str, keep: str | None, levels: tuple[str, ...], extra: dict
) -> tuple[list[str], list[tuple], bool]:
    import jax
    import numpy as np

    from benchmarks.attention import kernel_us, prefill_case
    from pallas_kernels import attention_mgpu

    n, length, hq, hkv, d = CASES[name]
    c, q, idx, spec, qg, flops, _, cud = prefill_case(n, length, hq, hkv, d)
    launch = engine_launch(extra)
    consumers = launch.get("consumers", 1)

    def kernel(q, k, v, trace=None):
        return attention_mgpu.tiles_mgpu(
            qg(q), k, v, idx, spec=spec, pv="into", rounding="two", probe_trace=trace, **launch
        )

    plain = np.asarray(jax.jit(kernel)(q, c.kc, c.vc))
    plain_us = kernel_us(kernel, q, c.kc, c.vc)
    lines, rows, same_bits = [], [], True
    for level in levels:
        directory = tempfile.mkdtemp(prefix="bijax-trace-", dir=keep)
        traced = jax.jit(lambda q, k, v, t=(directory, level): kernel(q, k, v, t))
        got = np.asarray(traced(q, c.kc, c.vc))
        jax.effects_barrier()
        same = bool(np.array_equal(got.view(np.uint16), plain.view(np.uint16)))
        same_bits &= same
        kinds = summarize(
            _newest_trace(directory), consumers + (consumers > 1), consumers if consumers > 1 else None
        )
        us = kernel_us(lambda q, k, v, t=(directory, level): kernel(q, k, v, t), q, c.kc, c.vc)
        lines += report(name, level, kinds)
        cons = kinds["consumer"]
        per_item = {r: cons["ranges"].get(r, (1, 0.0)) for r in ITEM_RANGES}
        items = per_item["walk"][0] or 1
        tiles = cons["ranges"].get("tile_full", (0, 0.0))

        def part(p, cons=cons):  # mean cycles of a full tile's part, where the level traces it
            count, total = cons["ranges"].get(f"tile_full/{p}", (0, 0.0))
            return total / count if count else float("nan")

        rows.append(
            (
                name,
                level,
                plain_us,
                us,
                cud,
                "same" if same else "DIFFER",
                *(per_item[r][1] / items for r in ITEM_RANGES),
                cons["gaps"] / items,
                tiles[1] / tiles[0] if tiles[0] else float("nan"),
                *(part(p) for p in PARTS),
            )
        )
    return lines, rows, same_bits


def main() -> int:
    from benchmarks.kernel_modules import parse_launch
    from pallas_kernels.attention_mgpu import TRACE_LEVELS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    ap.add_argument("--keep", help="write the traces (Perfetto JSON) under this directory")
    ap.add_argument(
        "--levels", default="items,tiles,parts", help="comma-separated, of " + ", ".join(TRACE_LEVELS)
    )
    ap.add_argument(
        "--launch",
        default="",
        help="launch choices over the engine's, as kernel_modules.py --launch takes them (k=v,...)",
    )
    a = ap.parse_args()
    levels = tuple(x for x in a.levels.split(",") if x)
    if not levels or any(x not in TRACE_LEVELS for x in levels):
        ap.error(f"--levels takes {', '.join(TRACE_LEVELS)}; got {a.levels!r}")
    extra = parse_launch(a.launch)
    names = [x for x in a.cases.split(",") if x]
    unknown = [x for x in names if x not in CASES]
    if unknown:
        ap.error(f"unknown cases {unknown}; known: {', '.join(CASES)}")
    all_rows, ok = [], True
    for name in names:
        lines, rows, same = run_case(name, a.keep, levels, extra)
        print("\n".join(lines), flush=True)
        all_rows += rows
        ok &= same
    print(
        "\n| case | level | kernel us | traced us | cuDNN us | traced bits | begin | walk | finish | store "
        "| between | full tile | " + " | ".join(PARTS) + " |"
    )
    print("|---" * (12 + len(PARTS)) + "|")
    for r in all_rows:
        print(
            f"| {r[0]} | {r[1]} | {r[2]:.1f} | {r[3]:.1f} | {r[4]:.1f} | {r[5]} | "
            + " | ".join(f"{x:.0f}" for x in r[6:])
            + " |"
        )
    print(
        "(per item, consumer warpgroups, clock cycles; 'full tile': a KV tile's step without the mask; "
        "its parts (level 'parts'): the wait for K, q @ k.T issued and waited for, the wait for V, "
        "p @ ones and p @ v issued and waited for - the rest of the tile is the softmax)"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
