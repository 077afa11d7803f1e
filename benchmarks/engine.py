"""GPU evidence for the engine: the CI invariance checks on the device, and generate throughput.

Run on the H200 from the repo root:  PYTHONPATH=. python benchmarks/engine.py [--smoke]
A SmolLM2-135M-shaped model with random bf16 weights (the GGUF does not travel to the device):
needle in a batch, batch 1 vs N, prefill vs decode, chunked prefill (tests/bijax/test_engine.py's
checks), the negative control with invariant=False, then the wall time of one generate() of the
same requests with the invariant kernels and with the XLA path. Exit code 1 on any failure.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import bijax
import tests.bijax.test_engine as te
from benchmarks.model import SMOLLM2_SHAPE
from models.configs import preset
from models.llama import Llama


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="tiny preset (CPU check of the script)")
    ap.add_argument("--skip-checks", action="store_true", help="only the negative control and the timing")
    args = ap.parse_args()
    cfg = preset("tiny") if args.smoke else SMOLLM2_SHAPE
    model = Llama(cfg, dtype=jnp.bfloat16, seed=0)
    te._model = functools.cache(lambda name: (model, None))
    te._needle = lambda name: list(map(int, np.random.default_rng(5).integers(3, cfg.vocab_size, 23)))
    print(f"# {datetime.date.today()} {jax.devices()[0].device_kind} jax {jax.__version__}", flush=True)
    failures = []
    for name, fn in ({} if args.skip_checks else te.CHECKS).items():
        t = time.time()
        ok = fn("gpu", True)
        print(f"{'PASS' if ok else 'FAIL'} {name} ({time.time() - t:.0f}s)", flush=True)
        failures += [] if ok else [name]
    neg = {name: fn("gpu", False) for name, fn in te.CHECKS.items()}
    ok = not all(neg.values())
    print(f"{'PASS' if ok else 'FAIL'} negative control: XLA path fails some check {neg}", flush=True)
    failures += [] if ok else ["negative control"]

    rng = np.random.default_rng(0)
    n_req, plen, new = (8, 32, 8) if args.smoke else (64, 128, 64)
    prompts = [list(map(int, rng.integers(3, cfg.vocab_size, plen))) for _ in range(n_req)]
    sp = bijax.SamplingParams(temperature=0.8, top_p=0.95, max_tokens=new, seed=1, ignore_eos=True)
    times = {}
    for inv in (True, False):
        llm = bijax.LLM(
            model,
            invariant=inv,
            max_model_len=1024,
            max_num_seqs=64,
            max_num_batched_tokens=2048,
            num_kv_blocks=64 * 16 + 8,
        )
        llm.generate(prompts, sp, use_tqdm=False)  # compile
        llm.wait_for_upgrades()  # tiered (the GPU default): whole forwards ready before timing
        t = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        times[inv] = time.perf_counter() - t
        toks = sum(len(o.token_ids) for o in outs)
        print(
            f"  generate {'bijax' if inv else 'XLA'}: {n_req} requests x {plen} prompt + {new} new: "
            f"{times[inv]:.2f}s, {toks / times[inv]:.0f} tok/s",
            flush=True,
        )
    print(
        f"\n| requests | prompt | new | bijax s | XLA s | bijax/XLA |\n|---|---|---|---|---|---|\n"
        f"| {n_req} | {plen} | {new} | {times[True]:.2f} | {times[False]:.2f} | {times[True] / times[False]:.2f} |"
    )
    print(f"\n{len(failures)} failed: {failures}" if failures else "\nall checks passed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
