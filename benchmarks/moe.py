"""GPU evidence for Qwen3-MoE: the grouped matmul's bits, its kernel time against
``lax.ragged_dot``, and decode throughput of the ``qwen3-30b-a3b`` preset.

Run on the H200 from the repo root, one part per command (each should stay well under 10 minutes):
    PYTHONPATH=. python benchmarks/moe.py --part kernels     # (a) and (b)
    PYTHONPATH=. python benchmarks/moe.py --part engine      # (c): builds the 61 GB preset
``--part all`` runs both; ``--quick`` checks fewer group sizes and launch shapes in (a);
``--smoke``: tiny sizes on CPU (the script's own check; wall-clock times, no CUPTI there).

(a) bits: for qwen3-30b-a3b's expert shapes (gate/up [2048, 768], down [768, 2048], bf16, 128
    experts), a token's row from ``grouped_matmul`` equals ``matmul``'s for the same expert
    weight, bit for bit, when the token is moved between groups of 1 .. 2048 rows at other
    offsets (other groups' sizes changed), under several launch shapes, and for every row of
    every group; the control reports whether ``lax.ragged_dot``'s rows move (not a failure).
(b) kernel time (CUPTI medians, 3 rotated weight copies) of the grouped matmul vs
    ``lax.ragged_dot`` (XLA's default GPU lowering, and jax's Pallas Triton lowering) at
    decode (T = 1, 64 tokens) and prefill (T = 2048) sizes, 8 experts per token chosen at
    random; and of the whole MoE block (router + top-k + experts + combine), invariant vs XLA.
(c) decode tok/s of the qwen3-30b-a3b preset (random bf16 weights) with 1 and 64 sequences,
    invariant and XLA paths, after a warm-up run of the same requests.
A compact table comes last. Exit code 1 if a bit check failed.
"""

from __future__ import annotations

import argparse
import datetime
import math
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import bijax
import pallas_kernels as pk
from benchmarks.kernels import bits, rand
from benchmarks.kernels import kernel_us as cupti_us
from models.configs import preset
from models.llama import Llama
from models.ops import moe
from pallas_kernels.matmul_triton import GpuTiles

FAILURES: list[str] = []
ROWS: list[str] = []  # the compact table


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'PASS' if ok else 'FAIL'} {name} {detail}", flush=True)
    if not ok:
        FAILURES.append(name)


def kernel_us(fn, *args, cupti: bool, iterations: int = 20) -> float:
    """Median per-iteration kernel time (CUPTI on the GPU: kernels.py's; wall clock in --smoke)."""
    if cupti:
        return cupti_us(fn, *args, iterations=iterations)
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(3):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t) * 1e6)
    return statistics.median(times)


def route(t: int, e: int, k: int, seed: int) -> np.ndarray:
    """k distinct random experts per token (what a router does, without one) -> ids [t, k]."""
    rng = np.random.default_rng(seed)
    return np.stack([rng.choice(e, k, replace=False) for _ in range(t)]).astype(np.int32)


# --------------------------------------------------------------------------- (a) bits


def check_bits(shapes, e: int, dtype, group_sizes_of_target, tiles_variants):
    """One static row count (as in an engine bucket) for the moved token, so each launch shape
    compiles once; the group sizes and offsets are the traced values that change. Plus the
    token alone (M = 1) and its group alone (M = the group's size)."""
    target = 37 % e
    m_big = max(group_sizes_of_target) + 40 * e
    for wname, (k, n) in shapes.items():
        w = rand(1, (e, k, n), dtype, k**-0.5)
        token = rand(2, (1, k), dtype)
        want = bits(pk.matmul(token, w[target]))
        base = rand(3, (m_big, k), dtype)
        rng = np.random.default_rng(3)
        moved = []
        for size in group_sizes_of_target:
            for variant in range(2):  # two layouts: other groups (and so the offset) differ
                sizes = rng.integers(0, 3 if variant else 40, e)
                sizes[target] = size
                start = int(sizes[:target].sum())
                at = start + int(rng.integers(0, size))
                x = base.at[at].set(token[0])
                gs = jnp.asarray(sizes, jnp.int32)
                for tiles in [None, *tiles_variants]:
                    y = pk.grouped_matmul(x, w, gs, tiles=tiles)
                    same = np.array_equal(bits(y[at : at + 1]), want)
                    moved.append(same)
                    if not same:
                        print(f"  differs: {wname} group {size} offset {start} tiles {tiles}", flush=True)
                if size == group_sizes_of_target[-1] and variant == 0:
                    # every row of every group == matmul's rows for that group's weight
                    y = pk.grouped_matmul(x, w, gs)
                    ends = np.cumsum(sizes)
                    full = jax.jit(lambda x, wg: pk.matmul(x, wg))  # one M: one compile
                    rows_ok = all(
                        np.array_equal(bits(y[a:b]), bits(full(x, w[g])[a:b]))
                        for g, (a, b) in enumerate(zip(ends - sizes, ends, strict=True))
                        if b > a
                    )
                    check(
                        f"grouped rows == matmul rows, every group ({wname}, {int(ends[-1])} rows)", rows_ok
                    )
                    ref = lax.ragged_dot(x, w, gs, preferred_element_type=jnp.float32)
                    err = float(jnp.abs(y.astype(jnp.float32) - ref).max() / jnp.abs(ref).max())
                    check(f"grouped vs ragged_dot f32 ({wname})", err < 1e-2, f"rel err {err:.1e}")
        for size in (1, group_sizes_of_target[len(group_sizes_of_target) // 2]):  # other static M
            sizes = np.zeros(e, np.int32)
            sizes[target] = size
            x = base[:size].at[size - 1].set(token[0])
            y = pk.grouped_matmul(x, w, jnp.asarray(sizes))
            moved.append(np.array_equal(bits(y[size - 1 : size]), want))
        check(
            f"token moved between groups of {list(group_sizes_of_target)} rows at other offsets, "
            f"{1 + len(tiles_variants)} launch shapes, alone: bits == matmul ({wname})",
            all(moved),
            f"({sum(moved)}/{len(moved)})",
        )
        # Control: does ragged_dot's row move with its group? (reported, not required)
        try:
            xs = base[:2048].at[0].set(token[0])
            ref_rows = []
            for size in (1, 64, 2048):
                sizes = np.zeros(e, np.int32)
                sizes[target] = size
                y = lax.ragged_dot(xs[:size], w, jnp.asarray(sizes), preferred_element_type=jnp.float32)
                ref_rows.append(bits(y[:1].astype(dtype)))
            moves = any(not np.array_equal(r, ref_rows[0]) for r in ref_rows[1:])
            print(
                f"  control: ragged_dot's row {'MOVES' if moves else 'does not move'} with its group size ({wname})"
            )
        except Exception as err:  # noqa: BLE001 - the control is reported, not required
            print(f"  control: ragged_dot failed: {type(err).__name__}: {str(err)[:200]}")


# --------------------------------------------------------------------------- (b) kernel time


MGPU_CONFIGS = ((64, 128, 4, 1), (128, 128, 4, 1), (128, 128, 4, 2), (64, 64, 4, 1))


def mgpu_ragged_dot(cfg):
    """jax's Hopper ragged dot (``pallas.ops.gpu.ragged_dot_mgpu``) at one launch config
    (block_m, block_n, max_concurrent_steps, grid_block_n), as ``op(x, w, group_sizes)``."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    bm, bn, steps, gbn = cfg
    kw = dict(block_m=bm, block_n=bn, block_k=64, max_concurrent_steps=steps, grid_block_n=gbn)
    return lambda x, w, gs, **_: ragged_dot_mgpu.ragged_dot(x, w, group_sizes=gs, **kw)


def best_mgpu_us(timed, n: int) -> float:
    """``timed(op)`` of jax's Hopper ragged dot, best of MGPU_CONFIGS; NaN (reported) where it
    cannot run (no Hopper GPU, shared memory, shapes)."""
    best, last = math.nan, None
    for cfg in MGPU_CONFIGS:
        if n % (cfg[1] * cfg[3]):
            continue
        try:
            us = timed(mgpu_ragged_dot(cfg))
        except Exception as err:  # noqa: BLE001 - a config that does not fit is skipped
            last = err
            continue
        best = us if math.isnan(best) else min(best, us)
    if math.isnan(best) and last is not None:
        print(f"  jax Mosaic GPU ragged_dot failed: {type(last).__name__}: {str(last)[:200]}")
    return best


def time_grouped(shapes, e: int, topk: int, dtype, tokens, cupti: bool):
    print("\n# grouped matmul kernel time (us), 8 random experts per token", flush=True)
    print(
        "| weight | T | rows | bijax grouped | ragged_dot | jax Mosaic GPU ragged_dot (best config) "
        "| gathered-weight einsum | bijax / best baseline |"
    )
    print("|---|---|---|---|---|---|---|---|")
    copies = 3
    for wname, (k, n) in shapes.items():
        ws = [rand(10 + c, (e, k, n), dtype, k**-0.5) for c in range(copies)]
        for t in tokens:
            ids = route(t, e, topk, seed=t)
            sizes = jnp.asarray(np.bincount(ids.reshape(-1), minlength=e), jnp.int32)
            x = rand(5, (t * topk, k), dtype)

            def timed(op, x=x, sizes=sizes, ws=ws):
                fn = jax.jit(lambda x, gs, *ws: [op(x, w, gs) for w in ws])
                return kernel_us(fn, x, sizes, *ws, cupti=cupti) / copies

            ours = timed(lambda x, w, gs: pk.grouped_matmul(x, w, gs))
            try:
                xla = timed(lambda x, w, gs: lax.ragged_dot(x, w, gs))
            except Exception as err:  # noqa: BLE001 - a baseline that does not run is reported
                xla = math.nan
                print(f"  ragged_dot failed: {type(err).__name__}: {str(err)[:200]}")
            jp = best_mgpu_us(timed, n)
            # rows times their expert's gathered weight: reads only the chosen experts (decode)
            expert = jnp.asarray(np.sort(ids.reshape(-1)), jnp.int32)
            try:
                gathered = timed(
                    lambda x, w, gs, expert=expert: jnp.einsum(
                        "rk,rkn->rn", x, w[expert], preferred_element_type=jnp.float32
                    )
                ) if t * topk <= 512 else math.nan  # fmt: skip
            except Exception as err:  # noqa: BLE001 - a baseline that does not run is reported
                gathered = math.nan
                print(f"  gathered-weight einsum failed: {type(err).__name__}: {str(err)[:200]}")
            best = np.nanmin([xla, jp, gathered]) if not np.isnan([xla, jp, gathered]).all() else math.nan
            row = (
                f"| {wname} {k}x{n} | {t} | {t * topk} | {ours:.1f} | {xla:.1f} | {jp:.1f} | {gathered:.1f} "
                f"| {ours / best:.2f} |"
            )
            print(row, flush=True)
            ROWS.append(row)


def time_block(cfg, dtype, tokens, cupti: bool):
    print("\n# whole MoE block (router, top-k, experts, combine), kernel time (us)", flush=True)
    h, i, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    w = [
        rand(20, (h, e), dtype, h**-0.5),
        rand(21, (e, h, i), dtype, h**-0.5),
        rand(22, (e, h, i), dtype, h**-0.5),
        rand(23, (e, i, h), dtype, i**-0.5),
    ]
    for t in tokens:
        x = rand(24, (t, h), dtype)
        res = {}
        for inv in (True, False):
            fn = jax.jit(
                lambda x, *w, inv=inv: moe(
                    x, *w, top_k=cfg.num_experts_per_tok, norm_topk_prob=True, invariant=inv, k_shards=1
                )
            )
            res[inv] = kernel_us(fn, x, *w, cupti=cupti)

        # The XLA path with jax's Hopper ragged dot in place of lax.ragged_dot (the block's
        # strongest baseline on this stack): the reference grouped op swapped for this timing.
        def xla_block_with(op, x=x):
            saved = pk.grouped_matmul_reference
            pk.grouped_matmul_reference = op
            try:
                fn = jax.jit(
                    lambda x, *w: moe(
                        x, *w, top_k=cfg.num_experts_per_tok, norm_topk_prob=True, invariant=False, k_shards=1
                    )
                )
                return kernel_us(fn, x, *w, cupti=cupti)
            finally:
                pk.grouped_matmul_reference = saved

        jp = best_mgpu_us(xla_block_with, min(h, i))
        best = np.nanmin([res[False], jp])
        row = (
            f"| MoE block | {t} | | {res[True]:.1f} | {res[False]:.1f} (XLA path) | {jp:.1f} (XLA path, "
            f"Mosaic GPU ragged dot) | | {res[True] / best:.2f} |"
        )
        print(row, flush=True)
        ROWS.append(row)


# --------------------------------------------------------------------------- (c) decode tok/s


def decode_throughput(name: str, seqs_list, prompt_len: int, new: int, max_len: int):
    print(f"\n# decode throughput, {name} (random bf16 weights)", flush=True)
    t0 = time.perf_counter()
    model = Llama(preset(name), dtype=jnp.bfloat16, seed=0)
    jax.block_until_ready(jax.tree.leaves(model))
    print(f"  built {name} in {time.perf_counter() - t0:.0f}s", flush=True)
    cfg = model.config
    rng = np.random.default_rng(0)
    prompts = {
        n: [list(map(int, rng.integers(3, cfg.vocab_size, prompt_len))) for _ in range(n)] for n in seqs_list
    }
    res = {(inv, n): math.nan for inv in (True, False) for n in seqs_list}
    for inv in (True, False):
        try:
            llm = bijax.LLM(
                model,
                invariant=inv,
                max_model_len=max_len,
                max_num_seqs=max(seqs_list),
                max_num_batched_tokens=min(512, max(seqs_list) * prompt_len),
                num_kv_blocks=max(seqs_list) * -(-max_len // 16) + 8,
                enable_prefix_caching=False,
            )
            for n in seqs_list:
                sp = lambda m: bijax.SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)  # noqa: E731
                wall = {}
                for m in (1, new):
                    llm.generate(prompts[n], sp(m), use_tqdm=False)  # warm-up: compiles this shape's steps
                    llm.wait_for_upgrades()  # tiered (the GPU default): whole forwards ready before timing
                    t = time.perf_counter()
                    llm.generate(prompts[n], sp(m), use_tqdm=False)
                    wall[m] = time.perf_counter() - t
                decode = n * (new - 1) / (wall[new] - wall[1])
                res[inv, n] = decode
                print(
                    f"  {'bijax' if inv else 'XLA'} {n} seq x ({prompt_len} + {new}): generate {wall[new]:.2f}s, "
                    f"prefill-only {wall[1]:.2f}s, decode {decode:.0f} tok/s ({1e3 * n / decode:.1f} ms/step)",
                    flush=True,
                )
            llm.close()
            del llm
        except Exception as err:  # noqa: BLE001 - report and go on to the table
            print(
                f"  {'bijax' if inv else 'XLA'} engine failed: {type(err).__name__}: {str(err)[:300]}",
                flush=True,
            )
            if inv:
                FAILURES.append(f"decode {name} (invariant)")
    for n in seqs_list:
        row = (
            f"| decode tok/s {name} | {n} seq | | {res[True, n]:.0f} | {res[False, n]:.0f} (XLA path) | | "
            f"{res[False, n] / res[True, n]:.2f} |"
        )
        ROWS.append(row)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on CPU: checks the script itself")
    ap.add_argument("--part", choices=("all", "kernels", "engine"), default="all")
    ap.add_argument("--quick", action="store_true", help="fewer group sizes and launch shapes in (a)")
    args = ap.parse_args()
    cupti = not args.smoke
    print(f"# {datetime.date.today()} {jax.devices()[0].device_kind} jax {jax.__version__}", flush=True)
    if args.smoke:
        cfg = preset("tiny-moe")
        shapes = {
            "gate/up": (cfg.hidden_size, cfg.moe_intermediate_size),
            "down": (cfg.moe_intermediate_size, cfg.hidden_size),
        }
        e, topk, sizes, tiles, tokens = cfg.num_experts, cfg.num_experts_per_tok, (1, 7, 40), [], (1, 16)
        engine = ("tiny-moe", (1, 4), 16, 8, 64)
    else:
        cfg = preset("qwen3-30b-a3b")
        shapes = {
            "gate/up": (cfg.hidden_size, cfg.moe_intermediate_size),
            "down": (cfg.moe_intermediate_size, cfg.hidden_size),
        }
        e, topk, tokens = cfg.num_experts, cfg.num_experts_per_tok, (1, 64, 2048)
        sizes = (1, 2, 15, 16, 17, 64, 300, 2048)
        tiles = [
            GpuTiles(16, 32, 2, 4),
            GpuTiles(32, 64, 4, 3),
            GpuTiles(64, 128, 4, 3),
            GpuTiles(128, 128, 8, 3),
        ]
        engine = ("qwen3-30b-a3b", (1, 64), 64, 64, 256)
        if args.quick:
            sizes, tiles = (1, 17, 2048), tiles[2:3]
    dtype = jnp.bfloat16
    if args.part in ("all", "kernels"):
        check_bits(shapes, e, dtype, sizes, tiles)
        time_grouped(shapes, e, topk, dtype, tokens, cupti)
        time_block(cfg, dtype, tokens, cupti)
    if args.part in ("all", "engine"):
        decode_throughput(engine[0], engine[1], engine[2], engine[3], engine[4])
    print("\n| what | T / seqs | rows | bijax | XLA | jax Mosaic GPU | gathered einsum | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(ROWS))
    print(
        "(kernel rows: us, bijax / the best baseline; block rows: us, bijax / the faster XLA path; decode rows: tok/s, XLA / bijax time ratio)"
    )
    print(f"\n{len(FAILURES)} failed: {FAILURES}" if FAILURES else "\nall checks passed")
    sys.exit(1 if FAILURES else 0)


if __name__ == "__main__":
    main()
