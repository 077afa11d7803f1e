"""Where an engine step's time goes: per-kernel CUPTI times of the compiled step programs
(the forward - one program, or the chain of programs where ``BIJAX_STEP_PROGRAMS`` says so -
KV cache donated, then sampling: the engine's runner runs them), grouped by kernel
name, next to the step's wall time, the host's time to enqueue it, and the gap between wall
and kernel time (launches, host work, transfers). ``--trace DIR`` takes a jax.profiler trace
instead of CUPTI's kernel times and also prints where the device sat idle: the kernels each
idle stretch came before and after, and what the host did during the longest one.

Run on the H200 from the repo root:
    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/profile_step.py [--model llama3-8b]
Cases: decode 1 x 1024 context, decode 64 x 1024, prefill one 2048-token chunk; the invariant
path and the XLA path. ``--smoke``: the ``tiny`` preset on CPU, wall times only (no CUPTI there).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

from bijax.config import EngineConfig
from bijax.model_runner import ModelRunner
from bijax.sampler import SamplingRows
from models.configs import preset
from models.llama import Llama
from models.paged import PagedBatch

BS = 16


def make_step(num_seqs: int, ctx: int, new_tokens: int, max_len: int, vocab: int):
    """A step of ``num_seqs`` sequences with ``ctx`` cached tokens, ``new_tokens`` new ones each,
    laid out as the engine's runner would: padded to its (sequences, tokens) bucket - at least
    16 of each, powers of two (``EngineConfig``'s buckets, with max_num_seqs and
    max_num_batched_tokens of at least 16) - one logits row per sequence row. (Before
    2026-12-02 the step was not padded: a single-stream decode ran its matmuls on 1 row, each
    behind a pad to the kernel's 16-row tile, which the engine's 16-token bucket never needs.)"""
    per = -(-max_len // BS)
    t = num_seqs * new_tokens
    cfg = EngineConfig(
        max_model_len=max_len, max_num_seqs=max(16, num_seqs), max_num_batched_tokens=max(16, t)
    )
    b = PagedBatch.padding(*cfg.step_bucket(num_seqs, t), per)
    rng = np.random.default_rng(0)
    for r in range(num_seqs):
        pos = np.arange(ctx, ctx + new_tokens)
        table = 1 + r * per + np.arange(per)
        sl = slice(r * new_tokens, (r + 1) * new_tokens)
        b.tokens[sl] = rng.integers(0, vocab, new_tokens)
        b.token_seq[sl] = r
        b.token_pos[sl] = pos
        b.slot_mapping[sl] = table[pos // BS] * BS + pos % BS
        b.block_tables[r] = table
        b.context_lens[r] = ctx + new_tokens
        b.logit_rows[r] = (r + 1) * new_tokens - 1
    s = SamplingRows.greedy(len(b.logit_rows))
    s.temperature[:] = 0.8  # sampled rows: the whole sampling path runs
    s.position[:num_seqs] = ctx + new_tokens
    return b, s, num_seqs * per + 1


def _group(name: str) -> str:
    """Kernel names without instance numbers (loop_fusion_12 -> loop_fusion)."""
    return re.sub(r"(_\d+)+$", "", re.sub(r"\.\d+$", "", name))


def trace_gaps(d: str, iters: int) -> dict:
    """From the perfetto trace under ``d``: the device's idle time per step, grouped by the
    kernel that ran next (what the device waited to start) and by the one before it, and the
    host events that took most time (thunk launches and the like)."""
    import glob
    import gzip
    import json

    path = sorted(glob.glob(os.path.join(d, "**", "*perfetto_trace.json.gz"), recursive=True))[-1]
    with gzip.open(path) as f:
        ev = json.load(f)
    ev = ev["traceEvents"] if isinstance(ev, dict) else ev
    pname = {
        e["pid"]: e["args"].get("name", "")
        for e in ev
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    gpu_pids = {p for p, n in pname.items() if "GPU" in n or "gpu" in n}
    dev = sorted(
        (float(e["ts"]), float(e.get("dur", 0)), e["name"])
        for e in ev
        if e.get("ph") == "X" and e.get("pid") in gpu_pids
    )
    kern = collections.defaultdict(lambda: [0, 0.0])
    for _, dur, n in dev:
        kern[_group(n)][0] += 1
        kern[_group(n)][1] += dur
    tname = {
        (e["pid"], e.get("tid")): e["args"].get("name", "")
        for e in ev
        if e.get("ph") == "M" and e.get("name") == "thread_name"
    }
    host = collections.defaultdict(lambda: [0, 0.0])
    threads = collections.defaultdict(lambda: [0, 0.0])  # by (thread, event): who waits on whom
    for e in ev:
        if e.get("ph") == "X" and e.get("pid") not in gpu_pids:
            host[_group(e["name"])][0] += 1
            host[_group(e["name"])][1] += float(e.get("dur", 0))
            where = (tname.get((e["pid"], e.get("tid")), str(e.get("tid"))), _group(e["name"]))
            threads[where][0] += 1
            threads[where][1] += float(e.get("dur", 0))
    before = collections.defaultdict(lambda: [0, 0.0])
    after = collections.defaultdict(lambda: [0, 0.0])
    busy_end = None
    prev = None
    idle = 0.0
    for ts, dur, n in dev:
        if busy_end is not None and ts > busy_end:
            g = ts - busy_end
            idle += g
            before[_group(n)][0] += 1
            before[_group(n)][1] += g
            after[_group(prev)][0] += 1
            after[_group(prev)][1] += g
        busy_end = ts + dur if busy_end is None else max(busy_end, ts + dur)
        prev = n
    span = (busy_end - dev[0][0]) if dev else 0.0
    # The longest idle stretch: what the device ran around it, what the host did during it.
    worst, end = (0.0, 0.0, 0), None
    for i, (ts, dur, _) in enumerate(dev):
        if end is not None and ts - end > worst[0]:
            worst = (ts - end, end, i)
        end = ts + dur if end is None else max(end, ts + dur)
    g, g0, gi = worst
    around = [(ts - g0, dur, n) for ts, dur, n in dev[max(0, gi - 4) : gi + 4]]
    during = sorted(
        (
            (float(e["ts"]) - g0, float(e.get("dur", 0)), e["name"])
            for e in ev
            if e.get("ph") == "X"
            and e.get("pid") not in gpu_pids
            and float(e["ts"]) < g0 + g
            and float(e["ts"]) + float(e.get("dur", 0)) > g0
        ),
        key=lambda x: -x[1],
    )[:25]
    per = lambda m: {k: (c / iters, us / iters / 1e3) for k, (c, us) in m.items()}  # noqa: E731
    return dict(
        events=len(dev) / iters,
        span_ms=span / iters / 1e3,
        idle_ms=idle / iters / 1e3,
        before=per(before),
        after=per(after),
        host=per(host),
        threads=per(threads),
        kernels=per(kern),
        worst_us=g,
        around=around,
        during=during,
    )


def profile(
    model,
    case,
    *,
    invariant: bool,
    iters: int,
    cupti: bool,
    trace_dir: str | None = None,
    top_p: float = 1.0,
    placed: bool = False,
):
    name, num_seqs, ctx, new = case
    c = model.config
    batch, sampling, nblocks = make_step(num_seqs, ctx, new, ctx + new, c.vocab_size)
    sampling.top_p[:] = top_p
    if placed:  # the forward's inputs on the device once: the same buffers every step
        batch = jax.device_put(batch)
    # The engine's runner runs the step as the engine does: its forward's programs (the chain
    # of embedding, layer and LM-head programs, or one program with BIJAX_STEP_PROGRAMS=whole),
    # the KV cache donated, then the sampling program the rows need.
    s, t = len(batch.context_lens), batch.num_tokens
    cfg = EngineConfig(
        max_model_len=ctx + new,
        max_num_seqs=s,
        max_num_batched_tokens=t,
        block_size=BS,
        num_kv_blocks=nblocks,
        invariant=invariant,
    )
    runner = ModelRunner(model, cfg)
    t0 = time.perf_counter()
    runner.warmup([(s, t)], processes=0)
    runner.wait_upgrades()  # tiered (the GPU default): whole forwards ready before timing
    compile_s = time.perf_counter() - t0

    def run(n):
        for _ in range(n):
            out = runner._run(batch, sampling, 0)
        jax.block_until_ready((out, runner.cache))

    run(3)  # warm-up (module load, autotuning)
    t0 = time.perf_counter()
    run(iters)
    wall_ms = (time.perf_counter() - t0) / iters * 1e3
    # Host time to enqueue one step (the call returns before the device finishes): when it is
    # close to the wall time, the host's launches, not the kernels, set the pace.
    jax.block_until_ready(runner.cache)
    t0 = time.perf_counter()
    for _ in range(iters):
        out = runner._run(batch, sampling, 0)
    dispatch_ms = (time.perf_counter() - t0) / iters * 1e3
    jax.block_until_ready((out, runner.cache))
    kernels = None
    if cupti:
        from jax.experimental.mosaic.gpu import profiler

        ext = profiler.mosaic_gpu_lib._mosaic_gpu_ext
        ext._cupti_init()
        try:
            run(iters)
        finally:
            timings = ext._cupti_get_timings(True)
        kernels = collections.defaultdict(lambda: [0, 0.0])
        for k, ms in timings:
            kernels[_group(k)][0] += 1
            kernels[_group(k)][1] += ms
        kernels = {k: (n / iters, ms / iters) for k, (n, ms) in kernels.items()}
    # After CUPTI's kernel times: the profiler's own CUPTI session would drop their records.
    gaps = None
    if trace_dir is not None:
        d = os.path.join(trace_dir, re.sub(r"\W+", "_", f"{name}_{invariant}"))
        jax.profiler.start_trace(d, create_perfetto_trace=True)
        try:
            run(iters)
        finally:
            jax.profiler.stop_trace()
        try:
            gaps = trace_gaps(d, iters)
        except Exception as e:  # noqa: BLE001 - a profile that cannot be read: say so, go on
            print(f"(trace of {name} not read: {type(e).__name__}: {e})")
    if kernels is None and gaps is not None:
        kernels = gaps["kernels"]  # the trace's device events, when CUPTI was not asked
    return dict(
        case=name
        + f" (bucket {len(batch.context_lens)} x {batch.num_tokens})"
        + (f", top-p {top_p}" if top_p < 1 else "")
        + (", inputs placed once" if placed else ""),
        path="invariant" if invariant else "XLA",
        wall_ms=wall_ms,
        dispatch_ms=dispatch_ms,
        compile_s=compile_s,
        kernels=kernels,
        gaps=gaps,
    )


def kernel_table(r, top: int):
    total = sum(ms for _, ms in r["kernels"].values())
    n = sum(c for c, _ in r["kernels"].values())
    print(
        f"kernel time {total:.2f} ms in {n:.0f} launches; gap (wall - kernels) {r['wall_ms'] - total:.2f} ms;"
        f" host enqueue {r['dispatch_ms']:.2f} ms per step\n"
    )
    print("| kernel | count | ms per step | share of kernel time |")
    print("|---|---|---|---|")
    for k, (c, ms) in sorted(r["kernels"].items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"| {k} | {c:.0f} | {ms:.3f} | {ms / total:.1%} |")
    print()


def report(r, top: int):
    head = (
        f"## {r['case']} - {r['path']}: wall {r['wall_ms']:.2f} ms per step (compile {r['compile_s']:.1f} s)"
    )
    print(head)
    if r["kernels"] is not None:
        kernel_table(r, top)
    g = r["gaps"]
    if g is None:
        return
    print(
        f"trace: {g['events']:.0f} device events per step over {g['span_ms']:.2f} ms,"
        f" device idle {g['idle_ms']:.2f} ms per step\n"
    )
    for title, m in (
        ("idle before (the event that waited)", g["before"]),
        ("idle after", g["after"]),
        ("host events, total", g["host"]),
    ):
        print(f"| {title} | count | ms per step |")
        print("|---|---|---|")
        for k, (c, ms) in sorted(m.items(), key=lambda kv: -kv[1][1])[:top]:
            print(f"| {k[:90]} | {c:.0f} | {ms:.3f} |")
        print()
    print(
        f"longest device idle: {g['worst_us']:.0f} us; device events around it (start us from its start, dur us):"
    )
    for t, d, n in g["around"]:
        print(f"  {t:10.1f} {d:8.1f}  {n[:100]}")
    print("host events overlapping it (start us, dur us), longest first:")
    for t, d, n in g["during"]:
        print(f"  {t:10.1f} {d:8.1f}  {n[:100]}")
    print()


def engine_profile(name: str, num_seqs: int, trace_dir: str, tokens: int, top: int, invariant: bool) -> None:
    """``LLM.generate`` of ``num_seqs`` x (64 in + ``tokens`` out) under a profiler trace, after
    an identical warm-up run: wall ms per step, device busy and idle per step, and the host's
    time by Python function (what the engine does between the device's steps)."""
    import bijax

    llm = bijax.LLM(
        name, max_num_seqs=num_seqs, max_num_batched_tokens=max(512, 64 * num_seqs), invariant=invariant
    )
    prompts = [{"prompt_token_ids": [10 + (i + j) % 50 for j in range(64)]} for i in range(num_seqs)]
    sp = bijax.SamplingParams(temperature=0.8, seed=1, max_tokens=tokens, ignore_eos=True)
    llm.warmup(progress=False, max_step_tokens=64 * num_seqs)
    llm.generate(prompts, sp, use_tqdm=False)  # compiles whatever warm-up did not
    llm.wait_for_upgrades()  # tiered (the GPU default): whole forwards ready before timing
    llm.reset_prefix_cache()
    t0 = time.perf_counter()
    llm.generate(prompts, sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    llm.reset_prefix_cache()
    d = os.path.join(trace_dir, f"engine_{num_seqs}_{invariant}")
    jax.profiler.start_trace(d, create_perfetto_trace=True)
    try:
        llm.generate(prompts, sp, use_tqdm=False)
    finally:
        jax.profiler.stop_trace()
    g = trace_gaps(d, tokens)
    print(
        f"## engine {name} ({'invariant' if invariant else 'XLA'}), {num_seqs} seqs x (64 + {tokens}):"
        f" {wall / tokens * 1e3:.2f} ms per step untraced;"
        f" traced: device busy {g['span_ms'] - g['idle_ms']:.2f} ms, idle {g['idle_ms']:.2f} ms per step\n"
    )
    print("| host event (per step) | count | ms per step |")
    print("|---|---|---|")
    for k, (c, ms) in sorted(g["host"].items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"| {k[:100]} | {c:.1f} | {ms:.3f} |")
    print()
    print("| host thread | event (per step) | count | ms per step |")
    print("|---|---|---|---|")
    for (th, k), (c, ms) in sorted(g["threads"].items(), key=lambda kv: -kv[1][1])[: 2 * top]:
        print(f"| {th[:40]} | {k[:90]} | {c:.1f} | {ms:.3f} |")
    print()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--top", type=int, default=15, help="kernel groups shown per case")
    p.add_argument("--smoke", action="store_true", help="tiny preset, CPU, wall times only")
    p.add_argument(
        "--cases",
        default="decode1,decode64,prefill",
        help="subset of decode1,decode64,prefill,prefill4096,prefill64",
    )
    p.add_argument("--paths", default="invariant,xla", help="subset of invariant,xla")
    p.add_argument("--trace", default=None, help="directory: also take a jax.profiler trace, print idle gaps")
    p.add_argument("--top-p", type=float, default=1.0, help="every row's top_p (< 1: the filter masks run)")
    p.add_argument(
        "--engine",
        default=None,
        help="comma-separated sequence counts: trace whole LLM.generate runs instead, for each of --paths",
    )
    p.add_argument("--tokens", type=int, default=64, help="--engine: output tokens per sequence")
    p.add_argument(
        "--placed-inputs",
        action="store_true",
        help="also run each case with the forward's inputs placed on the device once (what new "
        "input buffers every step cost - the default since 2026-12-05; BIJAX_STAGED_INPUTS=1 "
        "copies them into the same buffers every step)",
    )
    args = p.parse_args()
    name = "tiny" if args.smoke else args.model
    if args.engine:
        for n in args.engine.split(","):
            for path in args.paths.split(","):
                invariant = {"invariant": True, "xla": False}[path]
                engine_profile(
                    name, int(n), args.trace or "/tmp/bijax-trace", args.tokens, args.top, invariant
                )
        return
    # CUPTI's own kernel times, unless a profiler trace is taken: after one, CUPTI drops its
    # records (the trace's device events give the kernel table then).
    cupti = jax.default_backend() == "gpu" and args.trace is None
    print(f"# {datetime.date.today()} {jax.devices()[0].device_kind} jax {jax.__version__} model {name}")
    print(f"# XLA_FLAGS={os.environ.get('XLA_FLAGS', '')}")
    model = Llama(preset(name), dtype=jnp.bfloat16, seed=0)
    cases = {
        "decode1": ("decode 1 x 1024", 1, 1024, 1),
        "decode64": ("decode 64 x 1024", 64, 1024, 1),
        "prefill": ("prefill 1 x 2048", 1, 0, 2048),
        "prefill4096": ("prefill 1 x 4096", 1, 0, 4096),  # the attention issue's whole-prompt forward
        "prefill64": ("prefill 64 x 32", 64, 0, 32),  # the 64 x 2048 bucket ab.py's prompts fill
    }
    if args.smoke:
        cases = {
            "decode1": ("decode 1 x 64", 1, 64, 1),
            "decode64": ("decode 4 x 64", 4, 64, 1),
            "prefill": ("prefill 1 x 64", 1, 0, 64),
            "prefill4096": ("prefill 1 x 128", 1, 0, 128),
            "prefill64": ("prefill 4 x 16", 4, 0, 16),
        }
    cases = [cases[c] for c in args.cases.split(",")]
    paths = [{"invariant": True, "xla": False}[p] for p in args.paths.split(",")]
    rows = []
    for case in cases:
        for invariant in paths:
            for placed in (False, True) if args.placed_inputs else (False,):
                r = profile(
                    model,
                    case,
                    invariant=invariant,
                    iters=args.iters,
                    cupti=cupti,
                    trace_dir=args.trace,
                    top_p=args.top_p,
                    placed=placed,
                )
                report(r, args.top)
                rows.append(r)
    print("| case | path | wall ms | host enqueue ms | kernel ms | gap ms | launches |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        k = r["kernels"]
        kt = sum(ms for _, ms in k.values()) if k else float("nan")
        n = sum(c for c, _ in k.values()) if k else float("nan")
        print(
            f"| {r['case']} | {r['path']} | {r['wall_ms']:.2f} | {r['dispatch_ms']:.2f} | {kt:.2f} |"
            f" {r['wall_ms'] - kt:.2f} | {n:.0f} |"
        )


if __name__ == "__main__":
    main()
