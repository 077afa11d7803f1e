"""Staged step inputs or not, in one process, runs interleaved: settles session 39's open
question (``cmdbuf_modes.py`` had staged inputs 0.5-0.9 ms a step slower; ``bijax bench``'s
single stream in the same call gave 4.81 ms ITL with them).

Two engines share one model (the weights are read once): one made with ``BIJAX_STAGED_INPUTS=1``
(``ModelRunner._staged``: a step's inputs copied into the buffers the last step used, which it
donates, so XLA's CUDA graph keeps its recording), one with ``=0`` (new buffers every step). Both
warm up (warm-up, a generate, the background whole-forward compiles, another generate), then
timed ``generate`` runs alternate A B B A A B ... from an empty prefix cache. Per run: wall time,
inter-token gaps (``bijax bench``'s rule), and the host seconds spent in ``_staged`` (a copy
into donated buffers may make the host wait for the step in flight: that would show here). The
two engines' token ids and float32 logprob bits must be equal (staging moves values only).

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/staged_ab.py [--model llama3-8b]
        [--seqs 1] [--input-len 64] [--output-len 256] [--runs 6] [--num-kv-blocks 1024]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time

import numpy as np


def _step_tokens(a) -> int:
    return max(64, min(2048, a.input_len * a.seqs))  # (bijax bench's 64-sequence engine: 2048)


def _engine(model, staged: bool, a):
    import bijax

    os.environ["BIJAX_STAGED_INPUTS"] = "1" if staged else "0"  # read when the engine is made
    try:
        return bijax.LLM(
            model,
            max_num_seqs=max(1, a.seqs),
            max_num_batched_tokens=_step_tokens(a),
            num_kv_blocks=a.num_kv_blocks,
            max_model_len=a.input_len + a.output_len + 16,
        )
    finally:
        del os.environ["BIJAX_STAGED_INPUTS"]


def _timed_staging(llm):
    """Wraps the engine's ``_staged`` to add up its host seconds; returns the counter."""
    runner = llm.engine.runner
    real, spent = runner._staged, [0.0]

    def staged(tree):
        t0 = time.perf_counter()
        try:
            return real(tree)
        finally:
            spent[0] += time.perf_counter() - t0

    runner._staged = staged
    return spent


def _run(llm, prompts, params, spent):
    """One generate from an empty prefix cache: (seconds, gaps, host seconds in _staged, digest)."""
    llm.reset_prefix_cache()
    last, gaps = {}, []
    spent[0] = 0.0
    t0 = time.perf_counter()

    def on_output(i, out):
        now = time.perf_counter() - t0
        n = len(out.outputs[0].token_ids)
        if n and i in last and n > last[i][0]:
            k = n - last[i][0]
            gaps.extend([(now - last[i][1]) / k] * k)
        if n:
            last[i] = (n, now)

    outs = llm.generate(prompts, params, use_tqdm=False, on_output=on_output)
    seconds = time.perf_counter() - t0
    h = hashlib.sha256()
    for o in outs:
        h.update(np.asarray(o.outputs[0].token_ids, np.int32).tobytes())
        h.update(np.asarray(o.outputs[0].logprobs, np.float32).view(np.uint32).tobytes())
    return seconds, np.array(gaps), spent[0], h.hexdigest()[:16]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--seqs", type=int, default=1)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--runs", type=int, default=6, help="timed runs per side (alternated)")
    ap.add_argument("--num-kv-blocks", type=int, default=1024, help="each engine's pool")
    a = ap.parse_args()

    import jax

    import bijax
    from models import load_model

    t0 = time.perf_counter()
    model = load_model(a.model, progress=True)
    print(
        f"{a.model} on {jax.devices()[0].device_kind}: built in {time.perf_counter() - t0:.1f} s", flush=True
    )
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    prompts = [
        {"prompt_token_ids": [int(x) for x in rng.integers(0, vocab, a.input_len)]} for _ in range(a.seqs)
    ]
    params = [
        bijax.SamplingParams(temperature=0.8, seed=i, max_tokens=a.output_len, ignore_eos=True)
        for i in range(a.seqs)
    ]
    sides = {}
    for name, staged in (("staged", True), ("unstaged", False)):
        llm = _engine(model, staged, a)
        assert llm.engine.runner._stage == staged, "BIJAX_STAGED_INPUTS did not reach the engine"
        t0 = time.perf_counter()
        llm.warmup(progress=False, max_step_tokens=_step_tokens(a))
        llm.generate(prompts, params, use_tqdm=False)
        llm.wait_for_upgrades()
        llm.generate(prompts, params, use_tqdm=False)
        print(f"{name}: warmed up in {time.perf_counter() - t0:.1f} s", flush=True)
        sides[name] = (llm, _timed_staging(llm))
    order = []
    for r in range(a.runs):  # A B B A A B ...: each side as often first as second
        order += ["staged", "unstaged"] if r % 2 == 0 else ["unstaged", "staged"]
    results = {name: [] for name in sides}
    compiled = {name: llm.engine.stats().num_compiled_steps for name, (llm, _) in sides.items()}
    for name in order:
        llm, spent = sides[name]
        res = _run(llm, prompts, params, spent)
        results[name].append(res)
        steps = max(1, len(res[1]) // max(1, a.seqs))
        print(
            f"{name:>8}: {res[0]:.3f} s, ITL p50 {np.median(res[1]) * 1e3:.2f} ms, mean "
            f"{res[1].mean() * 1e3:.2f} ms, host in _staged {res[2] / steps * 1e3:.3f} ms a step, digest {res[3]}",
            flush=True,
        )
    compiles = {
        name: llm.engine.stats().num_compiled_steps - compiled[name] for name, (llm, _) in sides.items()
    }
    digests = {res[3] for rs in results.values() for res in rs}
    print(f"\n{a.model}, {a.seqs} x ({a.input_len} + {a.output_len}), {a.runs} runs a side, alternated")
    print(
        "| inputs | run s (median, min-max) | ITL p50 ms | ITL mean ms | ITL p99 ms | _staged ms a step | compiles |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, rs in results.items():
        secs = np.array([r[0] for r in rs])
        gaps = np.concatenate([r[1] for r in rs])
        host = np.median([r[2] / max(1, len(r[1]) // max(1, a.seqs)) for r in rs])
        print(
            f"| {name} | {np.median(secs):.3f} ({secs.min():.3f}-{secs.max():.3f}) | {np.median(gaps) * 1e3:.2f} | "
            f"{gaps.mean() * 1e3:.2f} | {np.percentile(gaps, 99) * 1e3:.2f} | {host * 1e3:.3f} | {compiles[name]} |"
        )
    same = len(digests) == 1
    print(f"same tokens and logprob bits on both sides and every run: {same}")
    print(f"compiles inside timed runs: {sum(compiles.values())}")
    return 0 if same and not sum(compiles.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
