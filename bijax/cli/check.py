"""``bijax check``: the invariance suite against a model (exit 1 on any mismatch), or the fixed
digest suite recorded on one machine and checked on another (``--record`` / ``--against``)."""

from __future__ import annotations

import argparse
import json
import os
import time

from bijax.cli.common import engine_args, info, make_llm


def add_parser(sub) -> None:
    c = sub.add_parser("check", help="the invariance suite against a model; exit 1 on any mismatch")
    c.add_argument("--requests", type=int, default=4, help="requests in the suite (default 4)")
    c.add_argument("--max-tokens", type=int, default=12, help="tokens generated per request (default 12)")
    c.add_argument("--no-control", action="store_true", help="skip the invariant=False negative control")
    c.add_argument(
        "--full-control",
        action="store_true",
        help="run every dimension on the control (default: stop at the first that differs)",
    )
    c.add_argument(
        "--strict", action="store_true", help="exit 3 when the negative control finds no difference"
    )
    c.add_argument("--json", action="store_true", help="print the report as JSON")
    c.add_argument(
        "--record",
        metavar="FILE",
        help="instead of the suite: write the digest of a fixed request suite and this machine's "
        "fingerprint to FILE (JSON)",
    )
    c.add_argument(
        "--against",
        metavar="FILE",
        help="instead of the suite: recompute a --record FILE's digest here; MATCH (exit 0) or the "
        "requests that differ (exit 1); a record of another model/settings/NUMERICS_VERSION exits 2",
    )
    engine_args(c)
    c.set_defaults(func=run)


def _check_digest(args, llm, record) -> int:
    """``check --record FILE`` / ``--against FILE``: the fixed digest suite (bijax.digest)."""
    from bijax import digest

    if args.record:
        record = digest.make_record(llm, args.model)
        digest.write_record(record, args.record)
        if args.json:
            print(
                json.dumps(
                    {"record": args.record, "digest": record["digest"], "fingerprint": record["fingerprint"]}
                )
            )
        else:
            print(f"bijax check: recorded digest {record['digest']} of {len(record['completions'])} completions "
                  f"to {args.record}\n  on {digest.describe(record['fingerprint'])}")  # fmt: skip
        return 0
    digest.check_compatible(record, llm, args.against)
    outputs = digest.run_suite(llm)
    diffs = digest.compare(record, outputs)
    here = digest.fingerprint()
    if args.json:
        print(json.dumps({"against": args.against, "match": not diffs, "differences": diffs,
                          "recorded_on": record["fingerprint"], "this_run": here}))  # fmt: skip
    else:
        total = len(record["completions"])
        head = "MATCH" if not diffs else f"MISMATCH: {len(diffs)} of {total} completions differ"
        print(f"bijax check --against {args.against}: {head}")
        for d in diffs:
            tok = (
                "token ids equal" if d["first_token"] is None else f"first differing token {d['first_token']}"
            )
            dl = "n/a" if d["max_abs_dlogprob"] is None else f"{d['max_abs_dlogprob']:.3g}"
            print(f"  request {d['request']} sample {d['sample']}: {tok}, max |dlogprob| {dl}")
        if not diffs:
            print(
                f"  digest {record['digest']}: token ids and float32 logprob bits identical ({total} completions)"
            )
        print(f"  recorded on: {digest.describe(record['fingerprint'])}")
        print(f"  this run:    {digest.describe(here)}")
    return 1 if diffs else 0


def run(args: argparse.Namespace) -> int:
    from bijax.check import run_check

    if args.record and args.against:
        raise ValueError("give --record FILE or --against FILE, not both")
    record = None
    if args.record:  # a file that cannot be written fails before the suite runs
        folder = os.path.dirname(os.path.abspath(args.record))
        if not os.path.isdir(folder):
            raise FileNotFoundError(f"--record: no such directory: {folder}")
        if os.path.isdir(args.record):
            raise ValueError(f"--record: {args.record} is a directory (give a file name in it)")
        if not os.access(folder, os.W_OK) or (
            os.path.exists(args.record) and not os.access(args.record, os.W_OK)
        ):
            raise ValueError(f"--record: {args.record} cannot be written here")
    if args.against:  # a bad file fails before the model loads
        from bijax import digest

        if not os.path.isfile(args.against):
            raise FileNotFoundError(f"--against: no such file: {args.against}")
        record = digest.load_record(args.against)
    t0 = time.perf_counter()
    s = args.max_num_seqs or 4
    t = args.max_num_batched_tokens or 64
    llm = make_llm(args, max_num_seqs=s, max_num_batched_tokens=t)
    if args.record or args.against:
        info(f"model {args.model} loaded in {time.perf_counter() - t0:.1f}s; running the digest suite")
        return _check_digest(args, llm, record)
    info(f"model {args.model} loaded in {time.perf_counter() - t0:.1f}s; running the invariance suite")
    llm.close()  # the suite builds its own engines: this one's KV pool is freed for them
    report = run_check(
        llm.model,
        llm.tokenizer,
        num_requests=args.requests,
        max_tokens=args.max_tokens,
        max_num_seqs=s,
        max_num_batched_tokens=t,
        max_model_len=llm.config.max_model_len,
        block_size=args.block_size,
        num_kv_blocks=llm.config.num_kv_blocks,
        seed=args.model_seed,
        control=not args.no_control,
        full_control=args.full_control,
        speculative=llm.engine.speculative,
        tensor_parallel_size=llm.config.tensor_parallel_size,
        async_scheduling=llm.config.async_scheduling,
        enable_prefix_caching=llm.config.enable_prefix_caching,
    )
    tp = llm.config.tensor_parallel_size
    del llm
    if args.json:
        rows = [{"dimension": r.dimension, "result": r.status, "detail": r.detail} for r in report.rows]
        print(json.dumps({"model": args.model, "ok": report.ok, "rows": rows, "seconds": report.seconds,
                          "tensor_parallel_size": tp}))  # fmt: skip
    else:
        print(f"bijax check: {args.model}  ({args.requests} requests x {args.max_tokens} tokens, "
              f"{s} seqs / {t} tokens per step, TP {tp}, {report.seconds:.0f}s)\n")  # fmt: skip
        print(report.table())
        print("\n" + report.summary())
    if not report.ok:
        return 1
    if report.control_inconclusive and args.strict:
        return 3
    return 0
