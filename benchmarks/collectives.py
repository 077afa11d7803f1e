"""``tree_psum``'s two data movements ("gather", "scatter") against the library's ``lax.psum``, per
number of ranks and message size (one rank's float32 partial): the time of one reduction and
the bits. Issue 24 asks for P = 4 and 8 on the H200s; the table says where "auto" should switch
from "gather" to "scatter" (``pallas_kernels.collectives.GATHER_MAX_BYTES``; P = 2 always
gathers).

Time: a jitted ``shard_map`` runs ``--chain`` dependent reductions in a loop (each takes the
last one's result), so one dispatch covers many; the wall time of a call, median of
``--repeats`` calls after a warm-up call, divided by the chain. Bits: "gather" and "scatter"
must equal the one-device tree (``matmul.tree_sum`` over the ranks in order) on every rank - a
mismatch fails the run; ``psum``'s bits are reported (it is the negative control: free to
differ).

    PYTHONPATH=. python3 benchmarks/collectives.py [--ranks 2,4,8] [--sizes 16K,64K,...]
    PYTHONPATH=. python3 benchmarks/collectives.py --smoke     # 8 fake CPU devices, small sizes
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

SIZES = "16K,64K,256K,1M,4M,16M,64M"  # decode rows of a 4096-8192 hidden size up to a 2048-token prefill


def _bytes(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(text.rstrip("KMG")) * scale


def _label(n: int) -> str:
    for unit, size in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="2,4,8", help="comma list of rank counts (powers of two)")
    ap.add_argument("--sizes", default=SIZES, help="comma list of per-rank message sizes (bytes, K, M)")
    ap.add_argument("--chain", type=int, default=20, help="dependent reductions per timed call")
    ap.add_argument("--repeats", type=int, default=15, help="timed calls per cell (median)")
    ap.add_argument("--smoke", action="store_true", help="8 fake CPU devices, small sizes, few repeats")
    a = ap.parse_args(argv)
    if a.smoke:
        flag = "--xla_force_host_platform_device_count=8"
        if flag not in os.environ.get("XLA_FLAGS", ""):
            os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        a.sizes, a.chain, a.repeats = "4K,64K", 2, 2

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    import pallas_kernels as pk
    from pallas_kernels.collectives import GATHER_MAX_BYTES

    if a.chain < 1 or a.repeats < 1:
        ap.error("--chain and --repeats must be at least 1")
    ranks = [int(r) for r in a.ranks.split(",")]
    sizes = [_bytes(s) for s in a.sizes.split(",")]
    if any(p < 2 or p & (p - 1) for p in ranks):
        ap.error(f"--ranks must be powers of two >= 2, got {a.ranks}")
    devices = jax.devices()
    ranks = [p for p in ranks if p <= len(devices)] or ap.error(
        f"--ranks {a.ranks}: this machine has {len(devices)} device(s)"
    )
    print(f"# {datetime.date.today()} {devices[0].device_kind} x {len(devices)}, jax {jax.__version__}")
    print(
        f"# chain {a.chain} reductions a call, median of {a.repeats} calls; GATHER_MAX_BYTES now {GATHER_MAX_BYTES}"
    )

    def reduction(mesh, method):
        def one(x):
            if method == "psum":
                return jax.lax.psum(x, "tp")
            return pk.tree_psum(x, "tp", method=method)

        def chain(x):
            return jax.lax.fori_loop(0, a.chain, lambda _, y: one(y), x[0])[None]

        def single(x):
            return one(x[0])[None]

        spec = dict(mesh=mesh, in_specs=P("tp"), out_specs=P("tp"), check_vma=False)
        return jax.jit(jax.shard_map(chain, **spec)), jax.jit(jax.shard_map(single, **spec))

    rows, failures = [], []
    for p in ranks:
        mesh = Mesh(np.array(devices[:p]), ("tp",))
        sharding = jax.sharding.NamedSharding(mesh, P("tp"))
        for size in sizes:
            n = size // 4
            rng = np.random.default_rng(p * 1000 + n)
            # mixed magnitudes: the order of the additions shows in the bits
            parts = (rng.standard_normal((p, n)) * 10.0 ** rng.integers(-3, 4, (p, n))).astype(np.float32)
            x = jax.device_put(parts, sharding)
            want = np.asarray(pk.tree_sum([jnp.asarray(v) for v in parts])).view(np.uint32)
            cell = {}
            for method in ("gather", "scatter", "psum"):
                chained, single = reduction(mesh, method)
                got = np.asarray(single(x)).view(np.uint32)  # [P, n]: every rank's result
                same = bool((got == want[None]).all())
                if method != "psum" and not same:
                    failures.append(f"P {p} {_label(size)} {method}: bits differ from the one-device tree")
                jax.block_until_ready(chained(x))  # compile + warm-up
                times = []
                for _ in range(a.repeats):
                    t0 = time.perf_counter()
                    jax.block_until_ready(chained(x))
                    times.append(time.perf_counter() - t0)
                cell[method] = (statistics.median(times) / a.chain * 1e6, same)
            rows.append((p, size, cell))
            g, s, ps = (cell[m][0] for m in ("gather", "scatter", "psum"))
            print(
                f"P {p} {_label(size):>5}: gather {g:9.1f} us, scatter {s:9.1f} us, psum {ps:9.1f} us"
                f" (psum bits {'==' if cell['psum'][1] else '!='} tree)",
                flush=True,
            )
    print(
        "\n| ranks | per-rank partial | gather us | scatter us | psum us | auto picks | best tree / psum | psum bits |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for p, size, cell in rows:
        g, s, ps = (cell[m][0] for m in ("gather", "scatter", "psum"))
        auto = "gather" if p == 2 or size <= GATHER_MAX_BYTES else "scatter"
        print(
            f"| {p} | {_label(size)} | {g:.1f} | {s:.1f} | {ps:.1f} | {auto} | {min(g, s) / ps:.2f} |"
            f" {'same' if cell['psum'][1] else 'differ'} |"
        )
    print("\nWhere gather is at least as fast as scatter (the measured switch for 'auto'):")
    for p in ranks:
        faster = [size for q, size, cell in rows if q == p and cell["gather"][0] <= cell["scatter"][0]]
        print(f"  P {p}: gather <= scatter at {[_label(s) for s in faster] or 'no size'}")
    print(f"\nchecks failed: {len(failures)} {failures}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
