"""``bijax`` command line: ``generate``, ``check``, ``bench``.

Text and JSON go to stdout; progress bars and status lines to stderr. Bad input exits with
status 2 and a one-line error; ``check`` exits 1 when any dimension's bits differ (or, with
``--against FILE``, when the recorded digest suite's bits differ).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

_DTYPES = ("bfloat16", "float16", "float32")


def _info(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _on_cpu() -> bool:
    import jax

    return jax.default_backend() == "cpu"


# --------------------------------------------------------------------------- arguments


def _engine_args(p: argparse.ArgumentParser) -> None:
    from models.loading import DEFAULT_MODEL

    g = p.add_argument_group("model and engine (names as bijax.LLM / vLLM)")
    g.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"preset (tiny, llama3-8b), embedded model, .gguf file, HF or orbax directory (default {DEFAULT_MODEL})",
    )
    g.add_argument("--dtype", choices=_DTYPES, help="weights/activations dtype (default: the checkpoint's)")
    g.add_argument(
        "--max-model-len", type=int, help="longest prompt + output (default: 1024 on CPU, 8192 on GPU)"
    )
    g.add_argument("--max-num-seqs", type=int, help="sequences per step")
    g.add_argument("--max-num-batched-tokens", type=int, help="tokens per step (the prefill chunk size)")
    g.add_argument("--block-size", type=int, default=16, help="KV block size (default 16)")
    g.add_argument("--num-kv-blocks", type=int, help="KV pool size in blocks")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--k-shards", type=int, default=1, help="virtual K shards of o/down (1, 2, 4, 8)")
    g.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="devices to split the model over (a divisor of --k-shards; use --k-shards 8)",
    )
    g.add_argument(
        "--model-seed", type=int, default=0, help="engine seed (draws request seeds; preset weights)"
    )
    g.add_argument("--no-prefix-caching", action="store_true")


def _sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (names as SamplingParams)")
    g.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default 1.0)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, help="the request's seed (default: drawn and reported)")
    g.add_argument("--n", type=int, default=1, help="samples per prompt")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--stop-token-ids", type=lambda s: [int(x) for x in s.replace(",", " ").split()])
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--logprobs", type=int, help="also the top-N logprobs of each step (JSON output)")


def _dtype(name):
    if name is None:
        return None
    import jax.numpy as jnp

    return jnp.dtype(name)


def _make_llm(
    args, *, max_num_seqs: int, max_num_batched_tokens: int, invariant: bool | None = None, model=None
):
    from bijax import LLM

    if invariant is None:
        invariant = not getattr(args, "no_invariant", False)
    kwargs = dict(
        invariant=invariant,
        max_model_len=args.max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        gpu_memory_utilization=args.gpu_memory_utilization,
        tensor_parallel_size=args.tensor_parallel_size,
        k_shards=args.k_shards,
        seed=args.model_seed,
        enable_prefix_caching=not args.no_prefix_caching,
    )
    if model is not None:
        return LLM(model.model, tokenizer=model.tokenizer, **kwargs)
    return LLM(args.model, dtype=_dtype(args.dtype), **kwargs)


def _sizes(args, num_seqs: int) -> tuple[int, int]:
    """Engine limits: the user's, else sized to the work (few buckets to compile on a CPU)."""
    s = args.max_num_seqs or min(16, _pow2_at_least(num_seqs))
    t = args.max_num_batched_tokens or max(s, 64 if _on_cpu() else 512)
    return s, t


def _warmup(llm, args, logprobs: bool) -> None:
    if args.no_warmup:
        return
    from bijax import compile_cache

    took = llm.warmup(logprobs=logprobs)
    where = compile_cache.directory()
    _info(f"warm-up: {llm.engine.num_compiled_buckets} step buckets ready in {took:.1f}s")
    if where:
        _info(f"         (compiled steps are cached in {where}: the next start loads them)")


# --------------------------------------------------------------------------- generate


def _prompts(args) -> list[str]:
    prompts = list(args.prompt)
    if not prompts:
        if sys.stdin.isatty():
            raise ValueError("give a prompt argument, or pipe the prompt on stdin")
        text = sys.stdin.read()
        if not text.strip():
            raise ValueError("the prompt read from stdin is empty")
        prompts = [text.rstrip("\n")]
    for i, p in enumerate(prompts):
        if not p.strip():
            raise ValueError(f"prompt {i} is empty")
    return prompts


def _json_output(out, index: int) -> dict:
    return {
        "request_id": str(index),
        "prompt": out.prompt,
        "prompt_token_ids": out.prompt_token_ids,
        "seed": out.seed,
        "outputs": [
            {
                "index": o.index,
                "text": o.text,
                "token_ids": o.token_ids,
                # float32 -> Python float is exact; float32(x) gives the bits back.
                "logprobs": [float(x) for x in o.logprobs],
                "finish_reason": o.finish_reason,
                **({"top_logprobs": o.top_logprobs} if o.top_logprobs is not None else {}),
            }
            for o in out.outputs
        ],
    }


class _Streamer:
    """Prints the requests' text in order: the earliest unfinished one streams live, later
    ones are held and printed (then streamed) when their turn comes."""

    def __init__(self, prompts, holdback: int, headers: bool):
        self.prompts, self.holdback, self.headers = prompts, holdback, headers
        self.latest: dict[int, object] = {}
        self.cur, self.shown = 0, 0

    def _text(self, out) -> str:
        if len(out.outputs) > 1:  # n > 1: printed whole when finished
            return ""
        return out.outputs[0].text

    def update(self, i: int, out) -> None:
        self.latest[i] = out
        while self.cur in self.latest:
            out = self.latest[self.cur]
            if self.shown == 0 and self.headers:
                sys.stdout.write(f"\n--- [{self.cur}] {self._short(self.prompts[self.cur])}\n")
            text = self._text(out)
            if out.finished:
                if len(out.outputs) > 1:
                    for o in out.outputs:
                        sys.stdout.write(f"[sample {o.index}, seed {out.seed}] {o.text}\n")
                else:
                    sys.stdout.write(text[self.shown :] + "\n")
                sys.stdout.flush()
                self.cur, self.shown = self.cur + 1, 0
                continue
            end = len(text) - self.holdback
            while end > self.shown and text[end - 1] == "\ufffd":  # an incomplete UTF-8 sequence
                end -= 1
            if end > self.shown:
                sys.stdout.write(text[self.shown : end])
                sys.stdout.flush()
                self.shown = end
            break

    @staticmethod
    def _short(p: str) -> str:
        p = " ".join(p.split())
        return p if len(p) <= 70 else p[:67] + "..."


def cmd_generate(args) -> int:
    from bijax import SamplingParams

    if args.system and not args.chat:
        raise ValueError("--system needs --chat")
    prompts = _prompts(args)
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        n=args.n,
        max_tokens=args.max_tokens,
        stop=args.stop,
        stop_token_ids=args.stop_token_ids,
        ignore_eos=args.ignore_eos,
        logprobs=args.logprobs,
    )
    t0 = time.perf_counter()
    s, t = _sizes(args, len(prompts) * args.n)
    llm = _make_llm(args, max_num_seqs=s, max_num_batched_tokens=t)
    _info(f"model {args.model} loaded in {time.perf_counter() - t0:.1f}s")
    tok = llm.tokenizer
    if tok is None:
        raise ValueError(f"model {args.model!r} has no tokenizer: text prompts need one")
    if args.chat:
        system = [{"role": "system", "content": args.system}] if args.system else []
        ids = [tok.encode_chat(system + [{"role": "user", "content": p}]) for p in prompts]
        inputs = [{"prompt_token_ids": x} for x in ids]
    else:
        inputs = prompts
    for i, p in enumerate(inputs):  # all checked before anything compiles or runs
        try:
            llm.engine.validate(p, params)
        except ValueError as e:
            raise ValueError(f"prompt {i}: {e}") from None
    _warmup(llm, args, logprobs=bool(args.logprobs))
    holdback = max((len(x) for x in params.stop), default=1) - 1
    stream = None if args.json else _Streamer(prompts, holdback, headers=len(prompts) > 1)

    def on_output(i, out):
        if stream is not None:
            stream.update(i, out)
        if out.finished and args.json:
            print(json.dumps(_json_output(out, i)), flush=True)

    t1 = time.perf_counter()
    results = llm.generate(inputs, params, use_tqdm=False, on_output=on_output)
    n_tokens = sum(len(o.token_ids) for out in results for o in out.outputs)
    dt = time.perf_counter() - t1
    seeds = ", ".join(str(results[i].seed) for i in range(len(prompts)))
    _info(f"{n_tokens} tokens in {dt:.2f}s ({n_tokens / dt:.1f} tok/s); seeds: {seeds}")
    return 0


# --------------------------------------------------------------------------- check


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


def cmd_check(args) -> int:
    from bijax.check import run_check

    if args.record and args.against:
        raise ValueError("give --record FILE or --against FILE, not both")
    record = None
    if args.against:  # a bad file fails before the model loads
        from bijax import digest

        if not os.path.isfile(args.against):
            raise FileNotFoundError(f"--against: no such file: {args.against}")
        record = digest.load_record(args.against)
    t0 = time.perf_counter()
    s = args.max_num_seqs or 4
    t = args.max_num_batched_tokens or 64
    llm = _make_llm(args, max_num_seqs=s, max_num_batched_tokens=t)
    if args.record or args.against:
        _info(f"model {args.model} loaded in {time.perf_counter() - t0:.1f}s; running the digest suite")
        return _check_digest(args, llm, record)
    _info(f"model {args.model} loaded in {time.perf_counter() - t0:.1f}s; running the invariance suite")
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
    )
    del llm
    if args.json:
        rows = [{"dimension": r.dimension, "result": r.status, "detail": r.detail} for r in report.rows]
        print(json.dumps({"model": args.model, "ok": report.ok, "rows": rows, "seconds": report.seconds}))
    else:
        print(f"bijax check: {args.model}  ({args.requests} requests x {args.max_tokens} tokens, "
              f"{s} seqs / {t} tokens per step, {report.seconds:.0f}s)\n")  # fmt: skip
        print(report.table())
        print("\n" + report.summary())
    if not report.ok:
        return 1
    if report.control_inconclusive and args.strict:
        return 3
    return 0


# --------------------------------------------------------------------------- bench


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


def cmd_bench(args) -> int:
    from bijax import SamplingParams

    rng = np.random.default_rng(args.model_seed)
    s, t = _sizes(args, args.num_prompts)
    t0 = time.perf_counter()
    inv = _make_llm(args, max_num_seqs=s, max_num_batched_tokens=t, invariant=True)
    _info(f"model {args.model} loaded in {time.perf_counter() - t0:.1f}s")
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
            llm = _make_llm(args, max_num_seqs=s, max_num_batched_tokens=t, invariant=False, model=inv)
        _info(f"{name}: warm-up run (compiles every bucket the workload uses)")
        _bench_run(llm, reqs)
        times = []
        for r in range(args.repeats):
            total, lat, ttft = _bench_run(llm, reqs)
            times.append(total)
            _info(f"{name}: run {r + 1}/{args.repeats}: {total:.3f}s")
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


# --------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bijax", description="Batch-invariant LLM inference for JAX.")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text (streams to the terminal)")
    g.add_argument("prompt", nargs="*", help="prompts (default: one prompt read from stdin)")
    g.add_argument(
        "--chat", action="store_true", help="wrap each prompt as a user message in the chat template"
    )
    g.add_argument("--system", help="system message (with --chat)")
    g.add_argument("--json", action="store_true", help="one JSON line per request: token ids, logprobs, text")
    g.add_argument("--no-invariant", action="store_true", help="plain XLA ops (batch-variant baseline)")
    g.add_argument(
        "--no-warmup", action="store_true", help="compile buckets on first use instead of up front"
    )
    _sampling_args(g)
    _engine_args(g)
    g.set_defaults(func=cmd_generate)

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
    _engine_args(c)
    c.set_defaults(func=cmd_check)

    b = sub.add_parser("bench", help="throughput and latency, invariant vs --no-invariant, same requests")
    b.add_argument("--num-prompts", type=int, default=32)
    b.add_argument("--input-len", type=int, default=128)
    b.add_argument("--output-len", type=int, default=64)
    b.add_argument("--temperature", type=float, default=1.0)
    b.add_argument("--repeats", type=int, default=1, help="timed runs per path (best is reported)")
    b.add_argument("--json", action="store_true")
    _engine_args(b)
    b.set_defaults(func=cmd_bench)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    for name in ("requests", "num_prompts", "input_len", "output_len", "repeats", "max_tokens"):
        v = getattr(args, name, None)
        if v is not None and v < 1:
            print(f"bijax: error: --{name.replace('_', '-')} must be >= 1, got {v}", file=sys.stderr)
            return 2
    try:
        return args.func(args)
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"bijax: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.exit(main())
