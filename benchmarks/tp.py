"""GPU evidence for tensor parallelism: the same requests at several (invariant, TP size, k_shards)
settings in one process; token ids + float32 logprob bits compared, and decode throughput.

Run on a machine with >= 2 GPUs from the repo root:
    PYTHONPATH=. python benchmarks/tp.py --model llama3-8b --runs inv:1:8,inv:2:8,inv:1:1,xla:1:1,xla:2:8
CPU check of the script (8 fake devices):  PYTHONPATH=. python benchmarks/tp.py --smoke

Each run: ``--requests`` prompts of ``--prompt-len`` random tokens (seeded), every request
``--max-tokens`` new tokens (greedy and seeded sampling mixed, ignore_eos), so every step after
the first is a decode step of all requests. One warm-up generate() compiles the two buckets
(prefill, decode); the second is timed. Exit code 1 if an invariant run's bits differ from the
first invariant run with the same k_shards; XLA runs are compared with the first XLA run (the
negative control: they are expected to differ across TP sizes).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import hashlib
import sys
import time

import jax
import numpy as np


def _digest(outs) -> tuple[str, list]:
    h = hashlib.sha256()
    lps = []
    for o in outs:
        for c in o.outputs:
            h.update(np.asarray(c.token_ids, np.int64).tobytes())
            lp = np.asarray(c.logprobs, np.float32)
            h.update(lp.view(np.uint32).tobytes())
            lps.append(lp)
    return h.hexdigest()[:16], lps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--runs", default="inv:1:8,inv:2:8,inv:1:1", help="comma list of path:tp:k_shards")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--smoke", action="store_true", help="tiny preset on 8 CPU devices")
    args = ap.parse_args()
    if args.smoke:
        jax.config.update("jax_num_cpu_devices", 8)
        args.model, args.runs, args.requests, args.max_tokens = (
            "tiny",
            "inv:1:8,inv:2:8,inv:8:8,xla:1:1,xla:4:8",
            4,
            8,
        )

    import bijax
    from bijax import SamplingParams as SP
    from models.configs import preset

    cfg = preset(args.model)
    dev = jax.devices()[0]
    print(
        f"# benchmarks/tp.py {datetime.date.today()} {jax.device_count()} x {dev.device_kind}, jax {jax.__version__}; "
        f"{args.model} bf16 random weights, {args.requests} requests x {args.prompt_len} prompt + "
        f"{args.max_tokens} new tokens",
        flush=True,
    )
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(3, cfg.vocab_size, args.prompt_len))) for _ in range(args.requests)]
    params = [
        SP(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        if i % 2 == 0
        else SP(temperature=0.8, top_p=0.95, seed=i, max_tokens=args.max_tokens, ignore_eos=True)
        for i in range(args.requests)
    ]
    tokens = args.requests * args.prompt_len
    budget = 16
    while budget < tokens:
        budget *= 2
    max_len = args.prompt_len + args.max_tokens
    blocks = args.requests * -(-max_len // 16) + 1
    print("| path | TP | k_shards | bits (sha256/16) | same bits as | first generate s | decode tok/s |")
    print("|---|---|---|---|---|---|---|")
    first: dict[tuple, tuple] = {}
    failed = False
    rows = []
    for run in args.runs.split(","):
        path, tp, ks = run.split(":")
        tp, ks, inv = int(tp), int(ks), path == "inv"
        t0 = time.perf_counter()
        llm = bijax.LLM(
            args.model,
            k_shards=ks,
            tensor_parallel_size=tp,
            invariant=inv,
            max_model_len=max_len,
            max_num_seqs=args.requests,
            max_num_batched_tokens=budget,
            num_kv_blocks=blocks,
        )
        llm.generate(prompts, params, use_tqdm=False)  # compiles the prefill and decode buckets
        llm.wait_for_upgrades()  # tiered (the GPU default): whole forwards ready before timing
        t1 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        t2 = time.perf_counter()
        digest, lps = _digest(outs)
        key = (inv, ks) if inv else (inv,)  # the XLA path at every size is compared with its first run
        same = "-"
        if key in first:
            ref_run, ref_digest, ref_lps = first[key]
            same = ref_run if digest == ref_digest else "DIFFERS"
            if digest != ref_digest:
                gap = max(float(np.abs(a - b).max()) for a, b in zip(lps, ref_lps, strict=True))
                same += f" from {ref_run} (max |dlogprob| {gap:.2e})"
                failed |= inv
        else:
            first[key] = (run, digest, lps)
        tok_s = args.requests * args.max_tokens / (t2 - t1)
        print(f"| {path} | {tp} | {ks} | {digest} | {same} | {t1 - t0:.1f} | {tok_s:.0f} |", flush=True)
        rows.append((run, tok_s))
        llm.close()  # its KV pool now, before the next run sizes its own
        del llm, outs
        gc.collect()
    base = dict(rows)
    for run, tok_s in rows:
        for ref in ("inv:1:1", "xla:1:1"):
            if ref in base and run != ref:
                print(f"# {run} decode throughput / {ref}: {tok_s / base[ref]:.2f}x")
    print("RESULT:", "FAIL (invariant bits differ)" if failed else "PASS", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
