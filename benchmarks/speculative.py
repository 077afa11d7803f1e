"""Speculative decoding on the H200: tok/s with and without it, acceptance, and the bits.

Run from the repo root:
    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/speculative.py [--model llama3-8b]
``--smoke``: the ``tiny`` preset on CPU (a check of the script).

Workloads, each at 1 and 16 streams, n-gram drafts (k = 4) vs plain decoding on the same
engine limits, both with the engine's default (async) scheduling:
- "cycle": outputs that repeat their prompts. The model's weights with every layer's output
  projections (attention o, MLP down) zeroed (``looping_weights``): the same kernels on the
  same shapes, so a step costs what it does with the real weights, but the logits depend on the
  last token only, so greedy decoding walks a cycle of token -> next token. The prompt is that
  cycle, repeated (``cycle_prompt``); the output continues it. A random-weight model copies
  nothing by itself, and no real checkpoint of this size is on the machine.
- "repeat": a random 32-token phrase repeated 8 times, greedy, the random weights;
- "random": random prompts, temperature 1.0 sampling (drafts rarely accepted: the cost of trying).
Every timed run (3 per engine, alternating, or ``--repeats``; the median; each run's seconds printed) follows an identical warm-up run (prefix cache emptied before each), and the
script fails if anything compiled inside a timed run. Token ids and float32 logprob bits of the
two engines must be identical. Next to the ratio of the medians: the range of the pairs' ratios,
the ratio of the best runs, and what speculation cost on the host (``EngineStats``): steps the
async queue was drained for (and of them those that carried no drafts after all) and the
speculator's host time per step - where no drafts are accepted, these are what it costs.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.kernels import bits
from bijax import LLM, SamplingParams
from models.llama import param_state

K = 4
REPEATS = 3  # timed runs per engine and workload, alternating plain / ngram (median)


def looping_weights(model) -> dict:
    """``model``'s parameters (a pure dict for ``LLM.update_weights``) with every layer's output
    projections - attention ``wo`` and MLP ``w_down`` - zeroed: the layers add nothing to the
    residual, so the logits depend on the last token only (the map token -> argmax of
    lm_head(norm(embed(token)))), and greedy decoding ends in a cycle of that map. Same shapes,
    same kernels, same cost per step as the real weights."""
    state = nnx.to_pure_dict(param_state(model))
    for layer in state["layers"].values():
        layer["attn"]["wo"] = jnp.zeros_like(layer["attn"]["wo"])
        layer["mlp"]["w_down"] = jnp.zeros_like(layer["mlp"]["w_down"])
    return state


def cycle_prompt(llm, start: int, length: int, search: int = 2048) -> list[int]:
    """The cycle that greedy decoding from ``[start]`` falls into on ``llm``'s (looping)
    weights, repeated to at least ``length`` tokens and at least once whole: a prompt that its
    greedy output continues exactly, every continued token already in it."""
    sp = SamplingParams(temperature=0, max_tokens=search, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": [start]}], sp, use_tqdm=False)[0].outputs[0].token_ids
    last = len(out) - 1
    prev = max((i for i in range(last) if out[i] == out[last]), default=None)
    if prev is None:
        raise RuntimeError(f"greedy decoding from token {start} found no cycle in {search} tokens")
    cycle = out[prev + 1 : last + 1]
    return cycle * max(1, -(-length // len(cycle)))


def workload(kind: str, streams: int, vocab: int, out_len: int, cycles=None):
    rng = np.random.default_rng(7)
    prompts, params = [], []
    for i in range(streams):
        if kind == "cycle":
            prompts.append(cycles[i % len(cycles)])
            params.append(SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True))
        elif kind == "repeat":
            prompts.append([int(t) for t in rng.integers(0, vocab, 32)] * 8)
            params.append(SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True))
        else:
            prompts.append([int(t) for t in rng.integers(0, vocab, 256)])
            params.append(SamplingParams(temperature=1.0, seed=i, max_tokens=out_len, ignore_eos=True))
    return [{"prompt_token_ids": p} for p in prompts], params


def timed(llm, prompts, params):
    """(outputs, seconds, compiles, engine steps, speculation counters) of a run after an
    identical warm-up run; the counters: drained steps, drained steps that carried no drafts
    (async scheduling), host seconds in the speculator."""
    llm.reset_prefix_cache()
    llm.generate(prompts, params, use_tqdm=False)  # warm-up: the same run
    llm.wait_for_upgrades()  # tiered (the GPU default): whole forwards ready before timing
    llm.reset_prefix_cache()
    before = llm.engine.stats()
    steps = [0]
    step = llm.engine.step

    def counting_step(*args, **kw):
        steps[0] += 1
        return step(*args, **kw)

    llm.engine.step = counting_step  # counts steps (this script only)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    secs = time.perf_counter() - t0
    del llm.engine.step
    after = llm.engine.stats()
    spec = (
        after.num_drained_steps - before.num_drained_steps,
        after.num_drained_steps_without_drafts - before.num_drained_steps_without_drafts,
        after.speculation_host_seconds - before.speculation_host_seconds,
    )
    return outs, secs, after.num_compiled_steps - before.num_compiled_steps, steps[0], spec


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--workloads", default="cycle,repeat,random", help="comma-separated subset")
    ap.add_argument("--repeats", type=int, default=REPEATS, help="timed runs per engine and workload")
    args = ap.parse_args()
    model = "tiny" if args.smoke else args.model
    out_len = 24 if args.smoke else args.output_len
    print(f"# {datetime.date.today()} {jax.devices()[0].device_kind} jax {jax.__version__} model {model}")
    kw = dict(max_model_len=1024 if args.smoke else 4096, max_num_seqs=16, max_num_batched_tokens=512)
    spec = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    plain = LLM(model, **kw)
    fast = LLM(plain.model, tokenizer=plain.tokenizer, speculative_config=spec, **kw)
    # Every step program ahead of time: the adaptive rule's choices follow measured step times,
    # so a timed run may draft in a shape its warm-up run did not.
    print(
        f"warm-up: plain {plain.warmup(progress=False):.1f} s, ngram {fast.warmup(progress=False):.1f} s",
        flush=True,
    )
    vocab = plain.model.config.vocab_size
    real = nnx.to_pure_dict(param_state(plain.model))  # arrays, not the model's variables
    loop = looping_weights(plain.model)
    rows, failures = [], []
    for kind in args.workloads.split(","):
        cycles = None
        for llm in (plain, fast):  # (they share one model object: each engine takes the arrays)
            llm.update_weights(loop if kind == "cycle" else real)
        if kind == "cycle":
            t0 = time.perf_counter()
            cycles = [
                cycle_prompt(plain, start, 128, 64 if args.smoke else 2048)
                for start in (11, 97, 1234 % vocab)
            ]
            lens = [len(set(c)) for c in cycles]
            print(
                f"cycle prompts: cycle lengths {lens}, prompt lengths {[len(c) for c in cycles]} "
                f"({time.perf_counter() - t0:.1f} s)",
                flush=True,
            )
        for streams in (1, 16):
            prompts, params = workload(kind, streams, vocab, out_len, cycles)
            runs = [
                (timed(plain, prompts, params), timed(fast, prompts, params)) for _ in range(args.repeats)
            ]
            print(
                f"{kind} x{streams}: runs plain "
                + ", ".join(f"{r[0][1]:.3f}" for r in runs)
                + " s; ngram "
                + ", ".join(f"{r[1][1]:.3f}" for r in runs)
                + " s",
                flush=True,
            )
            (a, _, ca, sa, _), (b, _, cb, sb, _) = runs[0]  # outputs and steps: the same every run
            ta = statistics.median(r[0][1] for r in runs)  # alternating runs, the median of each
            tb = statistics.median(r[1][1] for r in runs)
            pairs = sorted(r[0][1] / r[1][1] for r in runs)  # each pair's plain / ngram seconds
            best = min(r[0][1] for r in runs) / min(r[1][1] for r in runs)
            ca, cb = sum(r[0][2] for r in runs), sum(r[1][2] for r in runs)
            drains = sum(r[1][4][0] for r in runs) / len(runs)
            empty = sum(r[1][4][1] for r in runs) / len(runs)
            host = sum(r[1][4][2] / r[1][3] for r in runs) / len(runs)  # speculator seconds per step
            same = all(
                x.token_ids == y.token_ids and np.array_equal(bits(x.logprobs), bits(y.logprobs))
                for x, y in zip(a, b, strict=True)
            )
            drafted = sum(o.metrics.num_draft_tokens for o in b)
            accepted = sum(o.metrics.num_accepted_tokens for o in b)
            verify = sum(o.metrics.num_verify_steps for o in b)
            toks = streams * out_len
            rows.append(
                dict(kind=kind, streams=streams, plain=toks / ta / streams, ngram=toks / tb / streams,
                     speedup=ta / tb, pairs=f"{pairs[0]:.2f}-{pairs[-1]:.2f}", best=best,
                     acceptance=accepted / drafted if drafted else 0.0,
                     per_verify=accepted / verify if verify else 0.0, same=same, compiles=ca + cb,
                     steps=f"{sa} / {sb} ({verify} verify rows)", ms=f"{1e3 * ta / sa:.2f} / {1e3 * tb / sb:.2f}",
                     drains=f"{drains:.1f} ({empty:.1f} without drafts)", host_us=1e6 * host)
            )  # fmt: skip
            print(rows[-1], flush=True)
            if not same:
                failures.append(f"{kind} x{streams}: bits differ")
            if ca or cb:
                failures.append(f"{kind} x{streams}: {ca + cb} compiles inside timed runs")
    print(
        "\n| workload | streams | plain tok/s per stream | ngram k=4 tok/s per stream | speed-up (medians) "
        "| pairs' range | best / best | acceptance | accepted per verify row | bits identical "
        "| compiles in timed runs | steps plain / ngram | ms per step plain / ngram "
        "| drained steps per run | speculator host us per step |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['kind']} | {r['streams']} | {r['plain']:.1f} | {r['ngram']:.1f} | {r['speedup']:.2f}x "
            f"| {r['pairs']} | {r['best']:.2f}x | {r['acceptance']:.2f} | {r['per_verify']:.2f} | {r['same']} "
            f"| {r['compiles']} | {r['steps']} | {r['ms']} | {r['drains']} | {r['host_us']:.0f} |"
        )
    print(f"\nfailures: {failures}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
