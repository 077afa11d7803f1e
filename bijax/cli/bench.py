"""``bijax bench``: throughput and latency of the invariant engine and the plain-XLA engine on
the same requests, in one process."""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from bijax.cli.common import engine_args, info, make_llm, sizes


def add_parser(sub) -> None:
    b = sub.add_parser("bench", help="throughput and latency, invariant vs --no-invariant, same requests")
    b.add_argument("--num-prompts", type=int, default=32)
    b.add_argument("--input-len", type=int, default=128)
    b.add_argument("--output-len", type=int, default=64)
    b.add_argument("--temperature", type=float, default=1.0)
    b.add_argument("--repeats", type=int, default=1, help="timed runs per path (best is reported)")
    b.add_argument("--json", action="store_true")
    engine_args(b)
    b.set_defaults(func=run)


def _bench_run(llm, reqs):
    """All requests submitted at once; returns (seconds, per-request latency, time to first token)."""
    first, done = {}, {}
    t0 = time.perf_counter()

    def on_output(i, out):
        now = time.perf_counter() - t0
        if out.token_ids and i not in first:
            first[i] = now
        if out.finished:
            done[i] = now

    llm.generate(
        [{"prompt_token_ids": ids} for ids, _ in reqs],
        [p for _, p in reqs],
        use_tqdm=False,
        on_output=on_output,
    )
    total = time.perf_counter() - t0
    lat = np.array([done[i] for i in range(len(reqs))])
    ttft = np.array([first[i] for i in range(len(reqs))])
    return total, lat, ttft


def run(args: argparse.Namespace) -> int:
    from bijax import SamplingParams

    rng = np.random.default_rng(args.model_seed)
    s, t = sizes(args, args.num_prompts)
    t0 = time.perf_counter()
    inv = make_llm(args, max_num_seqs=s, max_num_batched_tokens=t, invariant=True)
    info(f"model {args.model} loaded in {time.perf_counter() - t0:.1f}s")
    vocab = inv.model.config.vocab_size
    reqs = [
        (
            [int(x) for x in rng.integers(0, vocab, args.input_len)],
            SamplingParams(temperature=args.temperature, seed=i, max_tokens=args.output_len, ignore_eos=True),
        )
        for i in range(args.num_prompts)
    ]
    for ids, p in reqs:
        inv.engine.validate({"prompt_token_ids": ids}, p)
    rows = []
    out_tokens = args.num_prompts * args.output_len
    in_tokens = args.num_prompts * args.input_len
    for name, llm in (("invariant", inv), ("XLA (--no-invariant)", None)):
        if llm is None:
            llm = make_llm(args, max_num_seqs=s, max_num_batched_tokens=t, invariant=False, model=inv)
        info(f"{name}: warm-up run (compiles every bucket the workload uses)")
        _bench_run(llm, reqs)
        times = []
        for r in range(args.repeats):
            total, lat, ttft = _bench_run(llm, reqs)
            times.append(total)
            info(f"{name}: run {r + 1}/{args.repeats}: {total:.3f}s")
        best = int(np.argmin(times))
        total = times[best]
        rows.append(
            dict(
                path=name,
                seconds=total,
                requests_per_s=args.num_prompts / total,
                output_tok_per_s=out_tokens / total,
                total_tok_per_s=(in_tokens + out_tokens) / total,
                latency_mean_s=float(lat.mean()),
                latency_p50_s=float(np.percentile(lat, 50)),
                latency_p99_s=float(np.percentile(lat, 99)),
                ttft_mean_s=float(ttft.mean()),
            )
        )
        del llm
    ratio = rows[0]["seconds"] / rows[1]["seconds"]
    if args.json:
        print(json.dumps({"model": args.model, "rows": rows, "invariant_over_xla_time": ratio}))
        return 0
    print(
        f"bijax bench: {args.model}, {args.num_prompts} requests x ({args.input_len} prompt + "
        f"{args.output_len} output) tokens, {s} seqs / {t} tokens per step, best of {args.repeats}\n"
    )
    hdr = f"{'path':<22} {'time s':>8} {'req/s':>8} {'out tok/s':>10} {'tok/s':>9} {'lat mean':>9} {'lat p50':>8} {'lat p99':>8} {'TTFT':>8}"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(
            f"{r['path']:<22} {r['seconds']:>8.3f} {r['requests_per_s']:>8.2f} {r['output_tok_per_s']:>10.1f} "
            f"{r['total_tok_per_s']:>9.1f} {r['latency_mean_s']:>9.3f} {r['latency_p50_s']:>8.3f} "
            f"{r['latency_p99_s']:>8.3f} {r['ttft_mean_s']:>8.3f}"
        )
    print(f"\ninvariant / XLA time: {ratio:.3f}x  (same requests, same engine limits, one process)")
    return 0
