"""Async vs synchronous scheduling on the same model, in one process: ``LLM.generate`` wall time
per output token after a warm-up run (prefix caching off, so the timed run schedules exactly the
warm-up's steps; the two engines share their compiled programs), and the two runs' token ids
and float32 logprob bits compared.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/async_scheduling.py [--model llama3-8b] [--seqs 1,64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import bijax
from bijax import SamplingParams
from bijax.model_runner import num_compiled_steps
from models.configs import preset
from models.llama import Llama


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--seqs", default="1,64", help="comma-separated numbers of concurrent sequences")
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=1, help="timed runs per cell (the median is reported)")
    ap.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="the engine's max_model_len (default: input + output; the engine's own default "
        "is 8192 on the GPU, and the decode attention's grid has a split per 512 of it)",
    )
    ap.add_argument("--modes", default="sync,async", help="comma-separated: sync, async")
    a = ap.parse_args()
    if a.repeats < 1:
        ap.error("--repeats must be at least 1")
    modes = [m.strip() for m in a.modes.split(",")]
    if not modes or any(m not in ("sync", "async") for m in modes):
        ap.error(f"--modes takes sync and/or async, got {a.modes!r}")
    print(f"# {datetime.date.today()} {jax.devices()[0].device_kind} jax {jax.__version__} model {a.model}")
    model = Llama(preset(a.model), dtype=jnp.bfloat16, seed=0)
    rng = np.random.default_rng(0)
    rows, failures = [], []
    for n in map(int, a.seqs.split(",")):
        prompts = [[int(x) for x in rng.integers(3, model.config.vocab_size, a.input_len)] for _ in range(n)]
        sp = SamplingParams(temperature=0.8, seed=1, max_tokens=a.output_len, ignore_eos=True)
        got = {}
        for async_scheduling in [m == "async" for m in modes]:
            llm = bijax.LLM(
                model,
                max_model_len=a.max_model_len or a.input_len + a.output_len,
                max_num_seqs=max(n, 1),
                max_num_batched_tokens=max(512, n),
                enable_prefix_caching=False,
                async_scheduling=async_scheduling,
            )
            t0 = time.perf_counter()
            llm.generate(prompts, sp, use_tqdm=False)  # warm-up: compiles what the timed run uses
            copies = llm.engine.runner.copy_seconds  # BIJAX_LAYER_COPIES (a measurement switch)
            waited = llm.wait_for_upgrades()  # BIJAX_STEP_PROGRAMS=tiered: the whole forwards
            print(
                f"{n} seqs, async={async_scheduling}: warm-up run {time.perf_counter() - t0:.1f} s"
                + (f", {copies:.1f} s of it loading copies of the layer programs" if copies else "")
                + (f", {waited:.1f} s of it waiting for the background compiles" if waited else ""),
                flush=True,
            )
            compiled = num_compiled_steps()
            walls = []
            for _ in range(a.repeats):
                t0 = time.perf_counter()
                outs = llm.generate(prompts, sp, use_tqdm=False)
                walls.append(time.perf_counter() - t0)
            wall = float(np.median(walls))
            if a.repeats > 1:
                print(f"{n} seqs, async={async_scheduling}: runs {', '.join(f'{w:.3f}' for w in walls)} s")
            if num_compiled_steps() != compiled:
                failures.append(f"{n} seqs async={async_scheduling}: compiled inside the timed run")
            got[async_scheduling] = outs
            ms = wall / a.output_len * 1e3
            rows.append((n, async_scheduling, wall, ms, n * a.output_len / wall))
            print(f"{n} seqs, async={async_scheduling}: {wall:.3f} s, {ms:.2f} ms per step", flush=True)
        if len(got) < 2:
            continue
        same = all(
            x.token_ids == y.token_ids
            and np.array_equal(x.logprobs.view(np.uint32), y.logprobs.view(np.uint32))
            for p, q in zip(got[False], got[True], strict=True)
            for x, y in zip(p.outputs, q.outputs, strict=True)
        )
        print(f"{n} seqs: async == sync bits: {same}", flush=True)
        if not same:
            failures.append(f"{n} seqs: async and sync runs differ")
    print(f"\nmax_model_len {a.max_model_len or a.input_len + a.output_len}")
    print(f"| seqs x ({a.input_len} + {a.output_len}) | scheduling | wall s | ms per step | out tok/s |")
    print("|---|---|---|---|---|")
    for n, asy, wall, ms, tps in rows:
        print(f"| {n} | {'async' if asy else 'sync'} | {wall:.3f} | {ms:.2f} | {tps:.1f} |")
    print("FAILURES:\n  " + "\n  ".join(failures) if failures else "ALL CHECKS PASS")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
