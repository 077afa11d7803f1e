"""A 32k-token prompt through the engine (attention issue, long context): it prefills and
decodes, compile time does not grow with the context, and the bits hold at that length.

Run on the H200 from the repo root, on an empty compilation cache so that compile times mean
something:
    BIJAX_CACHE_DIR=$(mktemp -d) PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/long_context.py
``--smoke``: the ``tiny`` preset on CPU at a 2048-token context (a check of the script).

1. Warm-up (``LLM.warmup``) of the same engine at ``max_model_len`` 4096 and at ``--context``:
   programs compiled and seconds. The attention walks KV tiles in a loop (no split unrolled per
   context), so no more programs and about the same time (the second engine reuses the first's
   sampling programs, which do not depend on the context).
2. One prompt of ``context - new`` random tokens, ``new`` tokens greedy: time to first token
   (the prefill, in 2048-token chunks) and decode ms per token at that context, after an
   identical warm-up run (0 compiles inside the timed run, checked), invariant and XLA paths.
3. Bits: the same request on an engine with 4096-token chunks, and next to three other
   requests, gives the same token ids and float32 logprob bits (invariant path).
A short table comes last. Exit code 1 if a check failed.
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
from benchmarks.kernels import bits
from bijax import SamplingParams
from bijax.model_runner import num_compiled_steps
from models.configs import preset
from models.llama import Llama

FAILURES: list[str] = []


def same(a, b) -> bool:
    return a.token_ids == b.token_ids and np.array_equal(bits(a.logprobs), bits(b.logprobs))


def engine(model, context: int, chunk: int, *, invariant: bool = True, seqs: int = 4):
    return bijax.LLM(
        model,
        invariant=invariant,
        max_model_len=context,
        max_num_seqs=seqs,
        max_num_batched_tokens=chunk,
        num_kv_blocks=seqs * (context // 16) + 64,
        enable_prefix_caching=False,
    )


def timed(llm, prompts, sp):
    """(outputs, seconds to the first token, seconds for the whole run) after a warm-up run."""
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for p in (first, sp):
        llm.generate(prompts, p, use_tqdm=False)  # warm-up: the same steps
    llm.wait_for_upgrades()  # tiered (the GPU default): whole forwards ready before timing
    compiled = num_compiled_steps()
    t0 = time.perf_counter()
    llm.generate(prompts, first, use_tqdm=False)
    ttft = time.perf_counter() - t0
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    total = time.perf_counter() - t0
    if num_compiled_steps() != compiled:
        FAILURES.append("compiled inside a timed run")
    return outs, ttft, total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    name, context, chunk = ("tiny", 2048, 256) if a.smoke else (a.model, a.context, 2048)
    dtype = jnp.float32 if a.smoke else jnp.bfloat16
    print(
        f"# {datetime.date.today()} {jax.devices()[0].device_kind} jax {jax.__version__} model {name}",
        flush=True,
    )
    model = Llama(preset(name), dtype=dtype, seed=0)
    rows = []

    # 1. compile time against the context
    warm = {}
    for ctx in (min(4096, context // 2) if a.smoke else 4096, context):
        llm = engine(model, ctx, chunk)
        made = num_compiled_steps()
        t0 = time.perf_counter()
        llm.warmup(progress=False)
        warm[ctx] = (num_compiled_steps() - made, time.perf_counter() - t0)
        print(
            f"warm-up at max_model_len {ctx}: {warm[ctx][0]} programs compiled, {warm[ctx][1]:.1f} s",
            flush=True,
        )
        rows.append(f"| warm-up, max_model_len {ctx} | {warm[ctx][0]} programs, {warm[ctx][1]:.1f} s | | |")
    small, big = warm.values()
    if big[0] > small[0]:  # (fewer: the sampling programs do not depend on the context; shared)
        FAILURES.append(f"more programs at the long context: {big[0]} > {small[0]}")

    # 2. one long prompt: prefill and decode, both paths
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    prompt = [int(t) for t in rng.integers(3, vocab, context - a.new)]
    sp = SamplingParams(temperature=0, max_tokens=a.new, ignore_eos=True)
    res = {}
    for inv in (True, False):  # the invariant engine is the one warmed up at the long context
        eng = llm if inv else engine(model, context, chunk, invariant=False)
        try:
            outs, ttft, total = timed(eng, [prompt], sp)
        except Exception as err:  # noqa: BLE001 - a baseline that fails is reported, not fatal
            print(f"  {'invariant' if inv else 'XLA'} path failed: {type(err).__name__}: {str(err)[:300]}")
            if inv:
                FAILURES.append("the invariant path failed")
            continue
        decode_ms = (total - ttft) / (a.new - 1) * 1e3
        res[inv] = (outs[0].outputs[0], ttft, decode_ms)
        label = "invariant" if inv else "XLA path"
        print(
            f"{label}: {len(prompt)}-token prompt, first token {ttft:.2f} s, decode {decode_ms:.2f} ms/token",
            flush=True,
        )
        rows.append(
            f"| {label}: prompt {len(prompt)} + {a.new} | first token {ttft:.2f} s | decode {decode_ms:.2f} ms/token | |"
        )
        eng.close()  # (each engine holds its KV pool: one at a time)
        del outs, eng
    del llm

    # 3. bits at the long context: another chunk size, and among other requests
    ref = res[True][0] if True in res else None
    if ref is not None:
        other = engine(model, context, 2 * chunk)
        alone = other.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
        ok = same(alone, ref)
        print(
            f"{'PASS' if ok else 'FAIL'} {2 * chunk}-token chunks == {chunk}-token chunks (ids and logprob bits)"
        )
        rows.append(f"| bits: {2 * chunk}- vs {chunk}-token chunks | {'same' if ok else 'DIFFER'} | | |")
        if not ok:
            FAILURES.append("chunk size changed the bits")
        del other
        mates = [[int(t) for t in rng.integers(3, vocab, n)] for n in (100, 1000, min(3000, context // 4))]
        batch = engine(model, context, chunk).generate([*mates[:1], prompt, *mates[1:]], sp, use_tqdm=False)
        ok = same(batch[1].outputs[0], ref)
        print(f"{'PASS' if ok else 'FAIL'} among 3 other requests == alone (ids and logprob bits)")
        rows.append(f"| bits: among 3 other requests vs alone | {'same' if ok else 'DIFFER'} | | |")
        if not ok:
            FAILURES.append("other requests changed the bits")

    print(f"\n| {name}, context {context} | | | |\n|---|---|---|---|")
    print("\n".join(rows))
    print(f"\n{len(FAILURES)} failed: {FAILURES}" if FAILURES else "\nall checks passed")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
