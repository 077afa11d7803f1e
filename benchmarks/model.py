"""GPU evidence for the model: token-level bit invariance and step time, invariant vs XLA.

Run on the H200 from the repo root:  PYTHONPATH=. python benchmarks/model.py [--skip-8b]
Random weights (bf16): a SmolLM2-135M-shaped model and the llama3-8b preset. Prints PASS/FAIL
per check (a token's logits along several routes compared as bits), compile times, then
per-step wall time of the paged forward (after warm-up; KV cache donated) for the invariant
kernels and the XLA path on the same inputs. Exit code 1 if any check failed.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.configs import preset
from models.llama import Llama
from models.paged import PagedBatch, init_kv_cache
from tests.models.harness import Paged, chunked, interleaved

FAILURES: list[str] = []
SMOLLM2_SHAPE = preset("smollm2-shape")
_FWD = nnx.jit(Llama.forward, static_argnames="invariant")


def check(name, ok, detail=""):
    print(f"{'PASS' if ok else 'FAIL'} {name} {detail}", flush=True)
    if not ok:
        FAILURES.append(name)


def bits(a):
    return np.asarray(a).view(np.uint32)


def routes(model, length, chunks, invariant, others=(5, 60, 23)):
    rng = np.random.default_rng(7)
    v = model.config.vocab_size
    a = rng.integers(0, v, length)
    oth = [rng.integers(0, v, n) for n in others]
    out = {"full": np.asarray(_FWD(model, jnp.asarray(a[None], jnp.int32), invariant=invariant))[0]}
    batch = np.stack([np.resize(o, length) for o in oth[:2]] + [a] + [np.resize(oth[2], length)])
    out["full batch of 4"] = np.asarray(_FWD(model, jnp.asarray(batch, jnp.int32), invariant=invariant))[2]
    max_blocks = -(-max(length, *others) // 16)
    paged = Paged(model, num_blocks=4 * max_blocks + 8, max_blocks=max_blocks, seed=1)
    for c in chunks:
        out[f"paged chunks of {c}"] = paged.run(
            [a], chunked(0, length, c), bucket=max(64, c), invariant=invariant
        )[0]
    seqs = oth[:2] + [a] + oth[2:]
    steps = interleaved([len(s) for s in seqs], [7, 4, 5, 9])
    out["paged mixed batch"] = paged.run(seqs, steps, bucket=64, invariant=invariant, slots=[3, 0, 5, 1])[2]
    return out


def check_routes(name, model, length, chunks):
    t = time.time()
    r = routes(model, length, chunks, invariant=True)
    ref = bits(r.pop("full"))
    for k, v in r.items():
        check(f"{name}: {k} == full forward alone", np.array_equal(bits(v), ref), f"({length} tokens)")
    print(f"  [{name} invariant routes: {time.time() - t:.0f}s incl. compiles]", flush=True)
    t = time.time()
    r = routes(model, length, chunks, invariant=False)
    ref = bits(r.pop("full"))
    diff = {k: int((bits(v) != ref).sum()) for k, v in r.items()}
    check(f"{name}: negative control (XLA path differs on some route)", any(diff.values()), str(diff))
    print(f"  [{name} XLA routes: {time.time() - t:.0f}s]", flush=True)


def check_k_shards(cfg):
    ids = jnp.asarray(np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 77)), jnp.int32)
    one = _FWD(Llama(cfg, dtype=jnp.bfloat16, k_shards=8, seed=0), ids)
    for parts in (2, 8):
        split = _FWD(Llama(cfg, dtype=jnp.bfloat16, k_shards=8, seed=0, tp_parts=parts), ids)
        check(
            f"k_shards=8 as {parts} separate partials == one device", np.array_equal(bits(split), bits(one))
        )


def time_steps(name, model, num_seqs, ctx, new_tokens, iters=10):
    """Wall time of one paged step: num_seqs sequences with ctx cached tokens, new_tokens each."""
    cfg = model.config
    bs = 16
    per = -(-(ctx + new_tokens) // bs)
    cache = init_kv_cache(cfg, num_seqs * per + 1, bs, model.dtype)
    key = jax.random.key(1)
    cache = [
        tuple(jax.random.normal(jax.random.fold_in(key, i), c.shape, model.dtype) for c in kv)
        for i, kv in enumerate(cache)
    ]
    tables = jnp.asarray(1 + np.arange(num_seqs * per).reshape(num_seqs, per), jnp.int32)
    t = num_seqs * new_tokens
    seq = np.repeat(np.arange(num_seqs), new_tokens)
    pos = np.tile(np.arange(ctx, ctx + new_tokens), num_seqs)
    slot = (np.asarray(tables)[seq, pos // bs] * bs + pos % bs).astype(np.int32)
    toks = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, t), jnp.int32)
    lens = jnp.full((num_seqs,), ctx + new_tokens, jnp.int32)
    # One logits row per sequence (its last token), as an engine step does.
    rows = jnp.asarray(np.arange(num_seqs) * new_tokens + new_tokens - 1, jnp.int32)
    graphdef, state = nnx.split(model)
    res = {}
    for inv in (True, False):

        @functools.partial(jax.jit, donate_argnums=(1,))
        def step(state, cache, toks, seq, pos, slot, tables, lens, rows, inv=inv):
            m = nnx.merge(graphdef, state)
            batch = PagedBatch(toks, seq, pos, slot, tables, lens, rows)
            return m.forward_paged(batch, cache, invariant=inv)

        args = [jnp.asarray(a, jnp.int32) for a in (seq, pos, slot)]
        t0 = time.time()
        logits, cache = step(state, cache, toks, *args, tables, lens, rows)
        logits.block_until_ready()
        compile_s = time.time() - t0
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            logits, cache = step(state, cache, toks, *args, tables, lens, rows)
            logits.block_until_ready()
            times.append(time.perf_counter() - t0)
        res[inv] = statistics.median(times) * 1e3
        print(
            f"  {name} S={num_seqs} ctx={ctx} new={new_tokens} {'bijax' if inv else 'XLA'}: "
            f"{res[inv]:.2f} ms/step (first call incl. compile {compile_s:.0f}s)",
            flush=True,
        )
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-8b", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny preset, small sizes (CPU check of the script)")
    args = ap.parse_args()
    print(f"# {datetime.date.today()} {jax.devices()[0].device_kind} jax {jax.__version__}", flush=True)
    rows = []
    if args.smoke:
        small_cfg, name, length, chunks, shapes = preset("tiny"), "tiny", 40, (1, 40), ((2, 64, 1),)
    else:
        small_cfg, name, length, chunks = SMOLLM2_SHAPE, "smollm2-shape", 300, (1, 64, 300)
        shapes = ((1, 1024, 1), (64, 1024, 1), (1, 0, 1024))
    small = Llama(small_cfg, dtype=jnp.bfloat16, seed=0)
    check_routes(name, small, length, chunks)
    check_k_shards(small_cfg)
    for s, ctx, new in shapes:
        r = time_steps(name, small, s, ctx, new)
        rows.append((name, s, ctx, new, r[True], r[False]))
    del small
    if not (args.skip_8b or args.smoke):
        big = Llama(preset("llama3-8b"), dtype=jnp.bfloat16, seed=0)
        check_routes("llama3-8b", big, 80, (1, 16, 80))
        for s, ctx, new in ((1, 1024, 1), (8, 1024, 1), (64, 1024, 1), (1, 0, 1024)):
            r = time_steps("llama3-8b", big, s, ctx, new)
            rows.append(("llama3-8b", s, ctx, new, r[True], r[False]))
    print("\n| model | seqs | cached ctx | new tokens/seq | bijax ms/step | XLA ms/step | bijax/XLA |")
    print("|---|---|---|---|---|---|---|")
    for m, s, ctx, new, a, b in rows:
        print(f"| {m} | {s} | {ctx} | {new} | {a:.2f} | {b:.2f} | {a / b:.2f} |")
    print(f"\n{len(FAILURES)} failed checks: {FAILURES}" if FAILURES else "\nall checks passed")
    sys.exit(1 if FAILURES else 0)


if __name__ == "__main__":
    main()
