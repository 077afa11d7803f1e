"""Where an engine step's time goes: per-kernel CUPTI times of the compiled step program
(forward + sampling, KV cache donated, as the engine runs it), grouped by kernel name, next to
the step's wall time and the gap between the two (launches, host work, transfers).

Run on the H200 from the repo root:
    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/profile_step.py [--model llama3-8b]
Cases: decode 1 x 1024 context, decode 64 x 1024, prefill one 2048-token chunk; the invariant
path and the XLA path. ``--smoke``: the ``tiny`` preset on CPU, wall times only (no CUPTI there).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bijax.model_runner import step_program
from bijax.sampler import SamplingRows
from models.configs import preset
from models.llama import Llama
from models.paged import PagedBatch, init_kv_cache

BS = 16


def make_step(num_seqs: int, ctx: int, new_tokens: int, max_len: int, vocab: int):
    """A step of ``num_seqs`` sequences with ``ctx`` cached tokens, ``new_tokens`` new ones each,
    laid out as the engine's runner would (one logits row per sequence)."""
    per = -(-max_len // BS)
    t = num_seqs * new_tokens
    b = PagedBatch.padding(num_seqs, t, per)
    rng = np.random.default_rng(0)
    for r in range(num_seqs):
        pos = np.arange(ctx, ctx + new_tokens)
        table = 1 + r * per + np.arange(per)
        sl = slice(r * new_tokens, (r + 1) * new_tokens)
        b.tokens[sl] = rng.integers(0, vocab, new_tokens)
        b.token_seq[sl] = r
        b.token_pos[sl] = pos
        b.slot_mapping[sl] = table[pos // BS] * BS + pos % BS
        b.block_tables[r] = table
        b.context_lens[r] = ctx + new_tokens
        b.logit_rows[r] = (r + 1) * new_tokens - 1
    s = SamplingRows.greedy(num_seqs)
    s.temperature[:] = 0.8  # sampled rows: the whole sampling path runs
    s.position[:] = ctx + new_tokens
    return b, s, num_seqs * per + 1


def _group(name: str) -> str:
    """Kernel names without instance numbers (loop_fusion_12 -> loop_fusion)."""
    return re.sub(r"(_\d+)+$", "", re.sub(r"\.\d+$", "", name))


def profile(model, case, *, invariant: bool, iters: int, cupti: bool):
    name, num_seqs, ctx, new = case
    c = model.config
    batch, sampling, nblocks = make_step(num_seqs, ctx, new, ctx + new, c.vocab_size)
    graphdef, params = nnx.split(model)
    cache = init_kv_cache(c, nblocks, BS, model.dtype)
    batch = jax.tree_util.tree_map(jnp.asarray, batch)
    sampling = jax.tree_util.tree_map(jnp.asarray, sampling)
    kw = dict(graphdef=graphdef, invariant=invariant, num_logprobs=0)
    t0 = time.perf_counter()
    compiled = step_program.lower(params, cache, batch, sampling, **kw).compile()
    compile_s = time.perf_counter() - t0

    def run(cache, n):
        for _ in range(n):
            out, cache = compiled(params, cache, batch, sampling)
        jax.block_until_ready((out, cache))
        return cache

    cache = run(cache, 3)  # warm-up (module load, autotuning)
    t0 = time.perf_counter()
    cache = run(cache, iters)
    wall_ms = (time.perf_counter() - t0) / iters * 1e3
    kernels = None
    if cupti:
        from jax.experimental.mosaic.gpu import profiler

        ext = profiler.mosaic_gpu_lib._mosaic_gpu_ext
        ext._cupti_init()
        try:
            cache = run(cache, iters)
        finally:
            timings = ext._cupti_get_timings(True)
        kernels = collections.defaultdict(lambda: [0, 0.0])
        for k, ms in timings:
            kernels[_group(k)][0] += 1
            kernels[_group(k)][1] += ms
        kernels = {k: (n / iters, ms / iters) for k, (n, ms) in kernels.items()}
    return dict(
        case=name,
        path="invariant" if invariant else "XLA",
        wall_ms=wall_ms,
        compile_s=compile_s,
        kernels=kernels,
    )


def report(r, top: int):
    head = (
        f"## {r['case']} - {r['path']}: wall {r['wall_ms']:.2f} ms per step (compile {r['compile_s']:.1f} s)"
    )
    print(head)
    if r["kernels"] is None:
        return
    total = sum(ms for _, ms in r["kernels"].values())
    n = sum(c for c, _ in r["kernels"].values())
    print(
        f"kernel time {total:.2f} ms in {n:.0f} launches; gap (wall - kernels) {r['wall_ms'] - total:.2f} ms\n"
    )
    print("| kernel | count | ms per step | share of kernel time |")
    print("|---|---|---|---|")
    for k, (c, ms) in sorted(r["kernels"].items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"| {k} | {c:.0f} | {ms:.3f} | {ms / total:.1%} |")
    print()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--top", type=int, default=15, help="kernel groups shown per case")
    p.add_argument("--smoke", action="store_true", help="tiny preset, CPU, wall times only")
    p.add_argument("--cases", default="decode1,decode64,prefill", help="subset of decode1,decode64,prefill")
    p.add_argument("--paths", default="invariant,xla", help="subset of invariant,xla")
    args = p.parse_args()
    name = "tiny" if args.smoke else args.model
    cupti = jax.default_backend() == "gpu"
    print(f"# {datetime.date.today()} {jax.devices()[0].device_kind} jax {jax.__version__} model {name}")
    print(f"# XLA_FLAGS={os.environ.get('XLA_FLAGS', '')}")
    model = Llama(preset(name), dtype=jnp.bfloat16, seed=0)
    cases = {
        "decode1": ("decode 1 x 1024", 1, 1024, 1),
        "decode64": ("decode 64 x 1024", 64, 1024, 1),
        "prefill": ("prefill 1 x 2048", 1, 0, 2048),
    }
    if args.smoke:
        cases = {
            "decode1": ("decode 1 x 64", 1, 64, 1),
            "decode64": ("decode 4 x 64", 4, 64, 1),
            "prefill": ("prefill 1 x 64", 1, 0, 64),
        }
    cases = [cases[c] for c in args.cases.split(",")]
    paths = [{"invariant": True, "xla": False}[p] for p in args.paths.split(",")]
    rows = []
    for case in cases:
        for invariant in paths:
            r = profile(model, case, invariant=invariant, iters=args.iters, cupti=cupti)
            report(r, args.top)
            rows.append(r)
    print("| case | path | wall ms | kernel ms | gap ms | launches |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        k = r["kernels"]
        kt = sum(ms for _, ms in k.values()) if k else float("nan")
        n = sum(c for c, _ in k.values()) if k else float("nan")
        print(
            f"| {r['case']} | {r['path']} | {r['wall_ms']:.2f} | {kt:.2f} | {r['wall_ms'] - kt:.2f} | {n:.0f} |"
        )


if __name__ == "__main__":
    main()
