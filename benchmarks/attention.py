"""GPU evidence for paged attention: correctness, bitwise invariance, kernel time vs XLA and cuDNN.

Run on the H200 from the repo root:  PYTHONPATH=. python benchmarks/attention.py
Decode: 64 sequences x 4096 context; prefill: 4096 causal tokens; 32 query / 8 KV heads,
D = 128, bf16, block_size 16. Exit code 1 if any check failed.
"""

from __future__ import annotations

import datetime
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.attention import attention, attention_reference

FAILURES: list[str] = []
HQ, HKV, D, BS = 32, 8, 128, 16
N, CTX = 64, 4096  # decode batch and context (smaller with --smoke)


def check(name, ok, detail=""):
    print(f"{'PASS' if ok else 'FAIL'} {name} {detail}", flush=True)
    if not ok:
        FAILURES.append(name)


def bits(a):
    a = np.asarray(jax.device_get(a))
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


def kernel_us(fn, *args):
    from jax.experimental.mosaic.gpu import profiler

    _, times = profiler.measure(jax.jit(fn), iterations=10)(*args)
    return statistics.median(times) * 1e3


def setup(num_seqs, ctx, dtype, seed=0):
    rng = np.random.default_rng(seed)
    per = -(-ctx // BS)
    nblocks = num_seqs * per + 1  # block 0: the null block
    bt = (1 + rng.permutation(num_seqs * per)).reshape(num_seqs, per).astype(np.int32)
    key = jax.random.key(seed)
    kc = jax.random.normal(key, (nblocks, BS, HKV, D), jnp.float32).astype(dtype)
    vc = jax.random.normal(jax.random.fold_in(key, 1), (nblocks, BS, HKV, D), jnp.float32).astype(dtype)
    return jnp.asarray(bt), jnp.full((num_seqs,), ctx, jnp.int32), kc, vc


def run(q, kc, vc, bt, cl, seq, pos, **kw):
    return attention(q, kc, vc, bt, cl, jnp.asarray(seq, jnp.int32), jnp.asarray(pos, jnp.int32), **kw)


def check_correctness():
    for dtype, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)):
        lens = [1, BS - 1, BS, BS + 1, 700, 1500]
        bt, _, kc, vc = setup(len(lens), 1536, dtype, seed=3)
        cl = jnp.asarray(lens, jnp.int32)
        seq = np.concatenate([np.full(n, s) for s, n in enumerate(lens)]).astype(np.int32)
        pos = np.concatenate([np.arange(n) for n in lens]).astype(np.int32)
        q = jax.random.normal(jax.random.key(7), (len(seq), HQ, D), jnp.float32).astype(dtype)
        out = np.asarray(run(q, kc, vc, bt, cl, seq, pos), np.float64)
        # float64 dense reference
        q64, k64, v64 = (np.asarray(a, np.float64) for a in (q, kc, vc))
        btn = np.asarray(bt)
        ref = np.zeros_like(out)
        for t in range(len(seq)):
            j = np.arange(pos[t] + 1)
            k, v = k64[btn[seq[t], j // BS], j % BS], v64[btn[seq[t], j // BS], j % BS]
            for h in range(HQ):
                s = k[:, h // (HQ // HKV)] @ q64[t, h] / np.sqrt(D)
                p = np.exp(s - s.max())
                ref[t, h] = (p / p.sum()) @ v[:, h // (HQ // HKV)]
        err = np.abs(out - ref).max() / np.abs(ref).max()
        check(f"attention accuracy {jnp.dtype(dtype).name} lens={lens}", err <= tol, f"{err:.2e}")


def check_invariance():
    dtype = jnp.bfloat16
    bt, cl, kc, vc = setup(N, CTX, dtype)
    last = CTX - 1
    # every sequence's last token, decoded together
    seq, pos = np.arange(N, dtype=np.int32), np.full(N, last, np.int32)
    q_all = jax.random.normal(jax.random.key(1), (CTX, HQ, D), jnp.float32).astype(dtype)  # q per position
    q_dec = jnp.broadcast_to(q_all[last], (N, HQ, D))
    batch = bits(run(q_dec, kc, vc, bt, cl, seq, pos))
    picks = (0, N // 3, N - 1)
    alone = [bits(run(q_dec[s : s + 1], kc, vc, bt, cl, seq[s : s + 1], pos[s : s + 1]))[0] for s in picks]
    check(
        f"decode: alone == in a batch of {N}",
        all(np.array_equal(a, batch[s]) for a, s in zip(alone, picks, strict=True)),
    )
    rev = bits(run(q_dec[::-1], kc, vc, bt, cl, seq[::-1], pos[::-1]))[::-1]
    check("decode: other slots (reversed batch)", np.array_equal(rev, batch))
    # seq 0's tokens inside prefill chunks of several sizes == decode of the same token
    for p_last in (last, CTX // 3):
        ref = bits(run(q_all[p_last : p_last + 1], kc, vc, bt, cl, [0], [p_last]))[0]
        ok = {}
        for c in (1, 3, 17, 512):
            ps = np.arange(p_last - c + 1, p_last + 1, dtype=np.int32)
            out = bits(run(q_all[ps], kc, vc, bt, cl, np.zeros(c, np.int32), ps))
            ok[c] = np.array_equal(out[-1], ref)
        # the chunk mixed with decode tokens of other sequences
        ps = np.arange(p_last - 16, p_last + 1, dtype=np.int32)
        qd = jnp.broadcast_to(q_all[last], (8, HQ, D))
        mixq = jnp.concatenate([qd[:5], q_all[ps], qd[:3]])
        mixs = np.concatenate([np.arange(1, 6) % N, np.zeros(17), np.arange(6, 9) % N]).astype(np.int32)
        mixp = np.concatenate([np.full(5, last), ps, np.full(3, last)]).astype(np.int32)
        out = bits(run(mixq, kc, vc, bt, cl, mixs, mixp))
        ok["mixed"] = np.array_equal(out[5 + 16], ref)
        check(f"prefill chunks == decode at position {p_last}", all(ok.values()), str(ok))
    # seq 0's KV moved to other physical blocks: swap the blocks of sequences 0 and 1
    btn = np.asarray(bt)
    b0, b1 = btn[0], btn[1]
    kc2 = kc.at[b1].set(kc[b0]).at[b0].set(kc[b1])
    vc2 = vc.at[b1].set(vc[b0]).at[b0].set(vc[b1])
    moved = btn.copy()
    moved[0], moved[1] = b1, b0
    out = bits(run(q_dec[:2], kc2, vc2, jnp.asarray(moved), cl, [0, 1], [last, last]))
    check("decode: KV in other physical blocks", np.array_equal(out, batch[:2]))
    negative_control(q_dec, kc, vc, bt, cl, last)


def negative_control(q_dec, kc, vc, bt, cl, last):
    """The invariant=False path (XLA) on the same inputs must change the row somewhere."""
    ref = lambda q, bt, cl, seq, pos: bits(
        attention_reference(q, kc, vc, bt, cl, jnp.asarray(seq, jnp.int32), jnp.asarray(pos, jnp.int32))
    )
    batch = ref(q_dec, bt, cl, np.arange(N), np.full(N, last))
    alone = ref(q_dec[:1], bt[:1], cl[:1], [0], [last])  # the same token, batch of 1
    short = cl.at[0].set(1000)
    alone_short = ref(q_dec[:1], bt[:1], short[:1], [0], [999])  # dense length 1000 ...
    batch_short = ref(q_dec, bt, short, np.arange(N), np.where(np.arange(N) == 0, 999, last))  # ... vs 4096
    differs = {
        "batch 1 vs N": not np.array_equal(alone[0], batch[0]),
        "short seq alone vs with long ones": not np.array_equal(alone_short[0], batch_short[0]),
    }
    check("negative control: XLA reference changes the row", any(differs.values()), str(differs))


def timing():
    rows = []
    dtype = jnp.bfloat16
    bt, cl, kc, vc = setup(64, 4096, dtype)
    q = jax.random.normal(jax.random.key(2), (64, HQ, D), jnp.float32).astype(dtype)
    seq, pos = jnp.arange(64, dtype=jnp.int32), jnp.full((64,), 4095, jnp.int32)
    kv_bytes = 2 * 64 * 4096 * HKV * D * 2
    ours = kernel_us(lambda q, k, v: attention(q, k, v, bt, cl, seq, pos), q, kc, vc)
    xla = kernel_us(lambda q, k, v: attention_reference(q, k, v, bt, cl, seq, pos), q, kc, vc)
    kd = kc[bt].reshape(64, 4096, HKV, D)
    vd = vc[bt].reshape(64, 4096, HKV, D)
    try:
        cudnn = kernel_us(
            lambda q, k, v: jax.nn.dot_product_attention(q[:, None], k, v, implementation="cudnn"), q, kd, vd
        )
    except Exception as e:  # noqa: BLE001 - report, do not hide
        print(f"INFO cuDNN decode unavailable: {type(e).__name__}: {str(e)[:200]}")
        cudnn = float("nan")
    rows.append(("decode 64 x 4096 ctx", ours, xla, cudnn, f"{kv_bytes / ours / 1e6:.2f} TB/s"))
    del kd, vd
    # prefill: one sequence, 4096 causal tokens
    bt1, cl1, kc1, vc1 = setup(1, 4096, dtype, seed=5)
    q1 = jax.random.normal(jax.random.key(3), (4096, HQ, D), jnp.float32).astype(dtype)
    s1, p1 = jnp.zeros(4096, jnp.int32), jnp.arange(4096, dtype=jnp.int32)
    flops = 4 * 4096 * 4096 / 2 * HQ * D
    ours = kernel_us(lambda q, k, v: attention(q, k, v, bt1, cl1, s1, p1), q1, kc1, vc1)
    xla = kernel_us(lambda q, k, v: attention_reference(q, k, v, bt1, cl1, s1, p1), q1, kc1, vc1)
    kd, vd = kc1[bt1[0]].reshape(1, 4096, HKV, D), vc1[bt1[0]].reshape(1, 4096, HKV, D)
    try:
        cudnn = kernel_us(
            lambda q, k, v: jax.nn.dot_product_attention(
                q[None], k, v, is_causal=True, implementation="cudnn"
            ),
            q1,
            kd,
            vd,
        )
    except Exception as e:  # noqa: BLE001
        print(f"INFO cuDNN prefill unavailable: {type(e).__name__}: {str(e)[:200]}")
        cudnn = float("nan")
    rows.append(("prefill 4096 causal", ours, xla, cudnn, f"{flops / ours / 1e6:.1f} TFLOP/s"))
    return rows


def main():
    global N, CTX
    smoke = "--smoke" in sys.argv  # CPU check of this script: small sizes, no timing
    if smoke:
        N, CTX = 4, 1536
    print(f"# {datetime.date.today()} {jax.devices()[0].device_kind} jax {jax.__version__}")
    if "--negative-only" in sys.argv:
        bt, cl, kc, vc = setup(N, CTX, jnp.bfloat16)
        q = jax.random.normal(jax.random.key(1), (N, HQ, D), jnp.float32).astype(jnp.bfloat16)
        negative_control(q, kc, vc, bt, cl, CTX - 1)
        print(f"\nchecks failed: {len(FAILURES)} {FAILURES}")
        sys.exit(1 if FAILURES else 0)
    if not smoke:
        check_correctness()
    check_invariance()
    rows = [] if smoke else timing()
    print(
        "\n| case | bijax us | XLA reference us | cuDNN us | bijax / XLA | bijax / cuDNN | bijax achieved |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, ours, xla, cudnn, rate in rows:
        print(
            f"| {name} | {ours:.1f} | {xla:.1f} | {cudnn:.1f} | {ours / xla:.2f} | {ours / cudnn:.2f} | {rate} |"
        )
    print(f"\nchecks failed: {len(FAILURES)} {FAILURES}")
    sys.exit(1 if FAILURES else 0)


if __name__ == "__main__":
    main()
