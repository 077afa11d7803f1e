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
    """One run of all requests, submitted at once, from the same engine state every time (prefix
    cache emptied first). Returns (seconds, per-request latency, time to first token,
    inter-token gaps, step programs compiled during the run, speculative (drafted, accepted,
    verify steps) or None, steps whose forward ran as the chain of programs, steps run in a
    larger bucket than their own while it compiled)."""
    llm.reset_prefix_cache()
    compiled = llm.engine.stats().num_compiled_steps
    chain = llm.engine.stats().num_chain_steps
    larger = llm.engine.stats().num_larger_bucket_steps
    first, done, last, gaps, spec = {}, {}, {}, [], []
    t0 = time.perf_counter()

    def on_output(i, out):
        now = time.perf_counter() - t0
        n = len(out.outputs[0].token_ids) if out.outputs else 0
        if n and i not in first:
            first[i] = now
        elif n > last.get(i, (0, 0))[0]:
            # tokens that arrived together share the step's time: gap / their number each
            k = n - last[i][0]
            gaps.extend([(now - last[i][1]) / k] * k)
        if n:
            last[i] = (n, now)
        if out.finished:
            done[i] = now
            if out.metrics is not None:
                m = out.metrics
                spec.append((m.num_draft_tokens, m.num_accepted_tokens, m.num_verify_steps))

    llm.generate(
        [{"prompt_token_ids": ids} for ids, _ in reqs],
        [p for _, p in reqs],
        use_tqdm=False,
        on_output=on_output,
    )
    total = time.perf_counter() - t0
    lat = np.array([done[i] for i in range(len(reqs))])
    ttft = np.array([first[i] for i in range(len(reqs))])
    compiles = llm.engine.stats().num_compiled_steps - compiled
    spec = tuple(int(x) for x in np.sum(spec, axis=0)) if spec else None
    chain = llm.engine.stats().num_chain_steps - chain
    larger = llm.engine.stats().num_larger_bucket_steps - larger
    return total, lat, ttft, np.array(gaps or [np.nan]), compiles, spec, chain, larger


WARMUP_RUNS = 3  # at most: tiered programs settle after the second (test_bench)


def _warm_up(llm, reqs, name: str) -> int:
    """Runs the workload untimed until a run leaves the engine as the next one finds it: it
    compiles every bucket the workload uses, and - tiered step programs (the GPUs' default) -
    once the whole forwards compiled in the background are kept, runs again on them, so that
    their first execution (CUDA graphs recorded, kernels loaded) is not inside a timed run.
    Returns the number of warm-up runs. With speculative decoding every bucket is compiled
    first (``LLM.warmup``): adaptive drafting decides from measured times, so a timed run may
    draft in steps the warm-up runs did not."""
    if llm.engine.speculator is not None:
        info(f"{name}: compiling every step bucket (speculative decoding: the drafted steps vary)")
        llm.warmup(progress=False)
    for n in range(1, WARMUP_RUNS + 1):
        info(f"{name}: warm-up run {n} (compiles every bucket the workload uses)")
        before = llm.engine.stats().num_upgraded_programs
        _bench_run(llm, reqs)
        waited = llm.wait_for_upgrades()  # tiered step programs: timed runs need the final ones
        if waited:
            info(f"{name}: waited {waited:.1f}s for the whole-forward programs compiling in the background")
        if llm.engine.stats().num_upgraded_programs == before:
            return n  # the run used the programs the timed runs use, each already run once
    return WARMUP_RUNS


def _floors(llm) -> dict:
    """What one decode step must move and compute at least: every weight read once, 2 FLOP per
    weight per token (attention and the KV cache come on top). Mixture-of-experts weights count
    ``num_experts_per_tok / num_experts`` of their size: a token reads and multiplies only its
    own experts (the floor of a batch of 1; larger batches touch more experts)."""
    import jax

    from models import param_state

    c = llm.model.config
    share = c.num_experts_per_tok / c.num_experts if c.num_experts else 1.0
    size = nbytes = 0.0
    for path, a in jax.tree_util.tree_leaves_with_path(param_state(llm.model)):
        if not hasattr(a, "nbytes"):
            continue
        f = share if any(str(getattr(k, "key", "")).startswith("experts_") for k in path) else 1.0
        size, nbytes = size + f * int(a.size), nbytes + f * int(a.nbytes)
    return {"weight_bytes": int(nbytes), "flop_per_token": int(2 * size)}


def run(args: argparse.Namespace) -> int:
    from bijax import SamplingParams
    from bijax.llm import default_max_model_len
    from bijax.prompts import check_fits
    from models.configs import PRESETS
    from models.loading import is_preset

    rng = np.random.default_rng(args.model_seed)
    # bad sampling values fail before the model loads (an 8B preset takes a while to build)
    SamplingParams(temperature=args.temperature, max_tokens=args.output_len, ignore_eos=True)
    # so do requests that cannot fit the limit given (or a preset's default limit)
    limit = args.max_model_len
    if limit is None and is_preset(args.model):
        limit = default_max_model_len(PRESETS[args.model])
    if limit is not None:
        check_fits(args.input_len, args.output_len, limit)
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
        warmups = _warm_up(llm, reqs, name)
        runs = []
        for r in range(args.repeats):
            runs.append(_bench_run(llm, reqs))
            info(f"{name}: run {r + 1}/{args.repeats}: {runs[-1][0]:.3f}s, {runs[-1][4]} compiles")
        total, lat, ttft, gaps, _, spec, _, _ = min(runs, key=lambda x: x[0])
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
                itl_p50_s=float(np.nanpercentile(gaps, 50)) if not np.isnan(gaps).all() else None,
                itl_p99_s=float(np.nanpercentile(gaps, 99)) if not np.isnan(gaps).all() else None,
                compiles_in_timed_runs=int(sum(x[4] for x in runs)),
                warmup_runs=warmups,
                # steps of the timed runs on the chain of programs (tiered start-up's first form,
                # or BIJAX_STEP_PROGRAMS asking for it): 0 with the GPU's defaults once warmed
                # up; on the CPU the chain is the default form, so every step counts
                chain_steps_in_timed_runs=int(sum(x[6] for x in runs)),
                # tiered: steps run in a larger bucket while their own compiled (0 once warmed up)
                larger_bucket_steps_in_timed_runs=int(sum(x[7] for x in runs)),
            )
        )
        if spec is not None:
            drafted, accepted, steps = spec
            rows[-1].update(
                draft_tokens=drafted,
                accepted_tokens=accepted,
                acceptance_rate=accepted / drafted if drafted else 0.0,
                accepted_per_verify_step=accepted / steps if steps else 0.0,
            )
        # its KV pool freed before the next engine sizes its own from the memory left (the
        # model's weights stay: both engines run them)
        llm.close()
        del llm
    ratio = rows[0]["seconds"] / rows[1]["seconds"]
    floors = _floors(inv)
    compiled = {r["path"]: r["compiles_in_timed_runs"] for r in rows if r["compiles_in_timed_runs"]}
    if args.json:
        print(json.dumps({"model": args.model, "rows": rows, "invariant_over_xla_time": ratio, **floors}))
    else:
        print(
            f"bijax bench: {args.model}, {args.num_prompts} requests x ({args.input_len} prompt + "
            f"{args.output_len} output) tokens, {s} seqs / {t} tokens per step, best of {args.repeats}; "
            "every run starts with an empty prefix cache\n"
        )
        hdr = (f"{'path':<22} {'time s':>8} {'req/s':>8} {'out tok/s':>10} {'tok/s':>9} {'lat p50':>8} "
               f"{'lat p99':>8} {'TTFT':>8} {'ITL p50':>8} {'ITL p99':>8} {'compiles':>8}")  # fmt: skip
        print(hdr)
        print("-" * len(hdr))
        ms = lambda x: "n/a" if x is None else f"{x * 1e3:.1f}ms"
        for r in rows:
            print(
                f"{r['path']:<22} {r['seconds']:>8.3f} {r['requests_per_s']:>8.2f} {r['output_tok_per_s']:>10.1f} "
                f"{r['total_tok_per_s']:>9.1f} {r['latency_p50_s']:>8.3f} {r['latency_p99_s']:>8.3f} "
                f"{r['ttft_mean_s']:>8.3f} {ms(r['itl_p50_s']):>8} {ms(r['itl_p99_s']):>8} "
                f"{r['compiles_in_timed_runs']:>8}"
            )
        for r in rows:
            if "draft_tokens" in r:
                print(
                    f"{r['path']}: speculative decoding accepted {r['accepted_tokens']}/{r['draft_tokens']} "
                    f"drafts ({r['acceptance_rate']:.2f}), {r['accepted_per_verify_step']:.2f} per verify step"
                )
        print(f"\ninvariant / XLA time: {ratio:.3f}x  (same requests, same engine limits, one process)")
        print(
            f"floor per decode step: {floors['weight_bytes'] / 1e9:.3f} GB of weights read, "
            f"{floors['flop_per_token'] / 1e9:.3f} GFLOP per token (plus attention and the KV cache)"
        )
    if compiled:
        info(f"bijax bench: error: step programs compiled inside timed runs ({compiled}): the timings "
             "include compile time; warm-up did not cover the workload")  # fmt: skip
        return 1
    return 0
