"""CPU speed of the invariant kernels vs XLA on SmolLM2-sized shapes (wall time, medians).

Run: make bench-cpu   (or PYTHONPATH=. python benchmarks/cpu_kernels.py)
Target (foundation issue): no matmul slower than 3x XLA at M=8 and M=300.
"""

from __future__ import annotations

import datetime
import math
import statistics
import time

import jax
import jax.numpy as jnp

import pallas_kernels as pk
from pallas_kernels.attention import attention, attention_reference

SHAPES = [(576, 1536), (1536, 576), (576, 49152)]


def wall_ms(fn, *args, reps: int = 15) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main():
    print(f"# {datetime.date.today()} CPU ({jax.devices()[0].device_kind}), jax {jax.__version__}")
    print("| op | dtype | shape | rows | XLA ms | bijax ms | ratio |")
    print("|---|---|---|---|---|---|---|")
    ratios = []
    ours, xla = jax.jit(lambda x, w: pk.matmul(x, w)), jax.jit(lambda x, w: pk.matmul_reference(x, w))
    for dtype in (jnp.float32, jnp.bfloat16):
        for k, n in SHAPES:
            w = jax.random.normal(jax.random.key(1), (k, n), jnp.float32).astype(dtype)
            for m in (8, 300):
                x = jax.random.normal(jax.random.key(2), (m, k), jnp.float32).astype(dtype)
                a, b = wall_ms(xla, x, w), wall_ms(ours, x, w)
                ratios.append(b / a)
                print(
                    f"| matmul | {jnp.dtype(dtype).name} | {k}x{n} | {m} | {a:.2f} | {b:.2f} | {b / a:.2f} |",
                    flush=True,
                )
    rms, rms_ref = (
        jax.jit(lambda x, g: pk.rms_norm(x, g, eps=1e-5)),
        jax.jit(lambda x, g: pk.rms_norm_reference(x, g, eps=1e-5)),
    )
    for t in (8, 300):
        x = jax.random.normal(jax.random.key(3), (t, 576), jnp.float32)
        g = jnp.ones((576,), jnp.float32)
        a, b = wall_ms(rms_ref, x, g), wall_ms(rms, x, g)
        print(f"| rms_norm | float32 | H=576 | {t} | {a:.2f} | {b:.2f} | {b / a:.2f} |")
    lsm, lsm_ref = jax.jit(pk.log_softmax), jax.jit(pk.log_softmax_reference)
    for t in (8, 300):
        x = jax.random.normal(jax.random.key(4), (t, 49152), jnp.float32)
        a, b = wall_ms(lsm_ref, x), wall_ms(lsm, x)
        print(f"| log_softmax | float32 | V=49152 | {t} | {a:.2f} | {b:.2f} | {b / a:.2f} |")
    # paged attention, SmolLM2-135M shapes (9 query / 3 KV heads, D=64), one layer
    bs, max_blocks, seqs = 16, 128, 8  # max_model_len 2048
    kc = jax.random.normal(jax.random.key(5), (seqs * max_blocks + 1, bs, 3, 64), jnp.float32)
    vc = jax.random.normal(jax.random.key(6), kc.shape, jnp.float32)
    bt = (1 + jnp.arange(seqs * max_blocks, dtype=jnp.int32)).reshape(seqs, max_blocks)
    cl = jnp.full((seqs,), 512, jnp.int32)
    attn, attn_ref = jax.jit(attention), jax.jit(attention_reference)
    for name, seq, pos in (
        ("decode 8 seqs @ 512", jnp.arange(8, dtype=jnp.int32), jnp.full((8,), 511, jnp.int32)),
        ("prefill chunk 256", jnp.zeros((256,), jnp.int32), jnp.arange(256, 512, dtype=jnp.int32)),
    ):
        q = jax.random.normal(jax.random.key(7), (seq.shape[0], 9, 64), jnp.float32)
        a = wall_ms(attn_ref, q, kc, vc, bt, cl, seq, pos)
        b = wall_ms(attn, q, kc, vc, bt, cl, seq, pos)
        print(f"| attention | float32 | {name} | {seq.shape[0]} | {a:.2f} | {b:.2f} | {b / a:.2f} |")
    print(
        f"\nmatmul: worst ratio {max(ratios):.2f}, geometric mean {math.exp(sum(map(math.log, ratios)) / len(ratios)):.2f}"
    )


if __name__ == "__main__":
    main()
