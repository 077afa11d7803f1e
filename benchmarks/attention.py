"""GPU evidence for paged attention: accuracy, bitwise invariance across kernels, tiles, chunks,
batches and block placement, and kernel time (CUPTI) next to cuDNN in the same run.

Run on the H200 from the repo root:  PYTHONPATH=. python benchmarks/attention.py [--checks-only]
Exit code 1 if any check failed. ``--checks-only``: the checks and the two decode cases' default
launch, no other timing (more than one device call's 600 s on an H100). ``--checks-first``:
the checks up to the tokens kernel's launch variants, no timing; ``--checks-rest``: only the
checks after them (window, softcap, moved KV, other head shapes, the control) - the two halves
of ``--checks-only``'s checks, one device call each. ``--timing-only``: the timing tables and the
layout checks, not the accuracy and invariance checks (for a call that has run them at the same
commit). (The GPU kernels' CPU tests, in interpret mode, are in
tests/pallas_kernels/test_attention.py.)
"""

from __future__ import annotations

import datetime
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import attention_triton
from pallas_kernels.attention import AttentionSpec, attention, attention_reference

FAILURES: list[str] = []
BS = 16
# Tile-kernel launch variants compared bit for bit (and timed): (rows per tile, warps, stages,
# bulk: full KV tiles walked without building their mask; False is the kernel before 2026-12-01).
VARIANTS = [(64, 4, 2, True), (64, 4, 2, False), (64, 4, 3, True), (128, 8, 2, True), (128, 8, 3, True)]
# The prefill cases: (sequences, length, query heads, KV heads, head dim).
PREFILL_CASES = ((1, 4096, 32, 8, 128), (1, 4096, 28, 4, 128), (8, 1024, 28, 4, 128), (1, 4096, 9, 3, 64))


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


class Case:
    """num_seqs sequences of ctx cached tokens in shuffled blocks; random q for every position."""

    def __init__(self, num_seqs, ctx, hq, hkv, d, dtype=jnp.bfloat16, seed=0, bs=BS):
        rng = np.random.default_rng(seed)
        self.hq, self.hkv, self.d, self.ctx, self.n = hq, hkv, d, ctx, num_seqs
        per = -(-ctx // bs)
        self.bt = jnp.asarray((1 + rng.permutation(num_seqs * per)).reshape(num_seqs, per).astype(np.int32))
        key = jax.random.key(seed)
        shape = (num_seqs * per + 1, bs, hkv, d)
        self.kc = jax.random.normal(key, shape, jnp.float32).astype(dtype)
        self.vc = jax.random.normal(jax.random.fold_in(key, 1), shape, jnp.float32).astype(dtype)
        self.cl = jnp.full((num_seqs,), ctx, jnp.int32)
        self.q_all = jax.random.normal(jax.random.fold_in(key, 2), (ctx, hq, d), jnp.float32).astype(dtype)

    def tokens(self, seq, pos):
        """q of (seq, pos) pairs: sequence s's query at p is q_all[p] (the same for every s)."""
        seq, pos = np.asarray(seq, np.int32), np.asarray(pos, np.int32)
        return self.q_all[np.maximum(pos, 0)], jnp.asarray(seq), jnp.asarray(pos)

    def run(self, seq, pos, kc=None, bt=None, **kw):
        q, s, p = self.tokens(seq, pos)
        kc = self.kc if kc is None else kc
        bt = self.bt if bt is None else bt
        return attention(q, kc, self.vc if kw.get("vc") is None else kw.pop("vc"), bt, self.cl, s, p, **kw)

    def variant(self, seq, pos, rows, warps, stages=2, bulk=True, **kw):
        """The tiles kernel at a given launch shape (not reachable from ``attention``)."""
        q, s, p = self.tokens(seq, pos)
        spec = AttentionSpec.create(self.d, **kw)
        g = self.hq // self.hkv
        fn = jax.jit(
            lambda q, s, p: attention_triton.attend(
                q.reshape(len(p), self.hkv, g, self.d), self.kc, self.vc, (self.bt, self.cl, s, p),
                spec=spec, interpret=False, kernel="tiles", tile_rows=rows, num_warps=warps,
                num_stages=stages, bulk=bulk,
            ).reshape(len(p), self.hq, self.d)
        )  # fmt: skip
        return fn(q, s, p)


# --------------------------------------------------------------------------- checks


def check_accuracy():
    for dtype, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)):
        lens = [1, BS - 1, BS, BS + 1, 700, 1500]
        c = Case(len(lens), 1536, 32, 8, 128, dtype, seed=3)
        c.cl = jnp.asarray(lens, jnp.int32)
        seq = np.concatenate([np.full(n, s) for s, n in enumerate(lens)])
        pos = np.concatenate([np.arange(n) for n in lens])
        q64, k64, v64 = (np.asarray(a, np.float64) for a in (c.q_all, c.kc, c.vc))
        btn = np.asarray(c.bt)
        pick = np.random.default_rng(0).choice(len(seq), 64, replace=False)
        ref = np.zeros((len(pick), 32, 128))
        for r, t in enumerate(pick):
            j = np.arange(pos[t] + 1)
            k, v = k64[btn[seq[t], j // BS], j % BS], v64[btn[seq[t], j // BS], j % BS]
            for h in range(32):
                s = k[:, h // 4] @ q64[pos[t], h] / np.sqrt(128)
                e = np.exp(s - s.max())
                ref[r, h] = (e / e.sum()) @ v[:, h // 4]
        for kernel in ("tokens", "tiles"):
            out = np.asarray(c.run(seq, pos, gpu_kernel=kernel), np.float64)[pick]
            err = np.abs(out - ref).max() / np.abs(ref).max()
            check(f"accuracy {kernel} {jnp.dtype(dtype).name} lens={lens}", err <= tol, f"{err:.2e}")


def check_invariance(n, ctx, rest=True):
    c = Case(n, ctx, 32, 8, 128)
    last = ctx - 1
    seq, pos = np.arange(n), np.full(n, last)
    batch = bits(c.run(seq, pos))  # decode: every sequence's last token
    picks = (0, n // 3, n - 1)
    alone = [bits(c.run([s], [last]))[0] for s in picks]
    check(
        f"decode: alone == in a batch of {n}",
        all(np.array_equal(a, batch[s]) for a, s in zip(alone, picks, strict=True)),
    )
    check(
        "decode: other slots (reversed batch)", np.array_equal(bits(c.run(seq[::-1], pos[::-1]))[::-1], batch)
    )
    for p_last in (last, ctx // 3):
        ref = bits(c.run([0], [p_last], gpu_kernel="tokens"))[0]
        ok = {}
        for chunk in (1, 3, 17, 100, 512, p_last + 1):
            ps = np.arange(p_last - chunk + 1, p_last + 1)
            for kernel in ("tokens", "tiles"):
                out = bits(c.run(np.zeros(chunk, np.int32), ps, gpu_kernel=kernel))
                ok[f"{kernel}{chunk}"] = np.array_equal(out[-1], ref)
        # the chunk among decode tokens of other sequences (tiles shared by several sequences)
        ps = np.arange(p_last - 40, p_last + 1)
        mix_s = np.concatenate([np.arange(1, 6) % n, np.zeros(41), np.arange(6, 9) % n])
        mix_p = np.concatenate([np.full(5, last), ps, np.full(3, last)])
        for kernel in ("tokens", "tiles"):
            out = bits(c.run(mix_s, mix_p, gpu_kernel=kernel))
            ok[f"mixed-{kernel}"] = np.array_equal(out[5 + 40], ref) and np.array_equal(out[:5], batch[1:6])
        bad = [k for k, v in ok.items() if not v]
        check(
            f"position {p_last}: decode == every chunk, both kernels, mixed",
            not bad,
            f"{len(ok)} cases, differ: {bad}",
        )
    # one prefill chunk through every launch variant of the tiles kernel == the tokens kernel
    ps = np.arange(ctx - 700, ctx)
    zs = np.zeros(700, np.int32)
    want = bits(c.run(zs, ps, gpu_kernel="tokens"))
    same = {}
    for r, w, st, bulk in VARIANTS:
        name = f"{r}x{w}x{st}{'' if bulk else '-masked'}"
        got = bits(c.variant(zs, ps, r, w, st, bulk))
        same[name] = np.array_equal(got, want)
        if not same[name]:
            rows = np.nonzero((got != want).reshape(len(ps), -1).any(axis=1))[0]
            print(f"INFO {name}: {len(rows)} of {len(ps)} tokens differ, positions {ps[rows][:12].tolist()}")
    check("tiles launch variants == tokens kernel (700-token chunk)", all(same.values()), str(same))
    qg = c.tokens(zs, ps)[0].reshape(len(ps), c.hkv, -1, c.d)
    idx = (c.bt, c.cl, jnp.asarray(zs), jnp.asarray(ps, jnp.int32))
    for w, st, bulk in ((4, 2, True), (4, 3, True), (8, 2, True), (2, 3, True), (2, 2, False)):
        got = jax.jit(
            lambda q, w=w, st=st, bulk=bulk: attention_triton.attend(
                q, c.kc, c.vc, idx, spec=AttentionSpec.create(c.d), interpret=False, kernel="tokens",
                num_warps=w, num_stages=st, bulk=bulk,
            )
        )(qg)  # fmt: skip
        check(
            f"tokens kernel {w} warps {st} stages{'' if bulk else ' masked'} == default launch",
            np.array_equal(bits(got.reshape(want.shape[0], c.hq, c.d)), want),
        )
    if rest:
        check_rest(c, zs, ps, last, batch[:2])


def check_rest(c, zs, ps, last, decoded):
    """The rest of ``check_invariance`` (``--checks-rest`` runs only it): window / softcap, KV in
    other blocks (``decoded``: sequences 0 and 1 decoded at ``last``), other head shapes."""
    for kw in (
        {"sliding_window": 300},
        {"logit_softcap": 30.0},
        {"sliding_window": 1000, "logit_softcap": 20.0},
    ):
        a = bits(c.run(zs, ps, gpu_kernel="tokens", **kw))
        b = bits(c.run(zs, ps, gpu_kernel="tiles", **kw))
        masked = bits(c.variant(zs, ps, 64, 4, 2, False, **kw))
        check(
            f"tiles == tokens == masked tiles with {kw}", np.array_equal(a, b) and np.array_equal(b, masked)
        )
    # KV moved to other physical blocks: swap the blocks of sequences 0 and 1
    btn = np.asarray(c.bt)
    b0, b1 = btn[0], btn[1]
    kc2 = c.kc.at[b1].set(c.kc[b0]).at[b0].set(c.kc[b1])
    vc2 = c.vc.at[b1].set(c.vc[b0]).at[b0].set(c.vc[b1])
    moved = btn.copy()
    moved[0], moved[1] = b1, b0
    out = bits(c.run([0, 1], [last, last], kc=kc2, vc=vc2, bt=jnp.asarray(moved)))
    check("decode: KV in other physical blocks", np.array_equal(out, decoded))
    # other head shapes: 28 / 4 (group 7, padded to 8) and SmolLM2's 9 / 3 at D 64
    for hq, hkv, d in ((28, 4, 128), (9, 3, 64)):
        o = Case(4, min(c.ctx, 1500), hq, hkv, d, seed=4)
        ps = np.arange(o.ctx - 300, o.ctx)
        zs = np.zeros(300, np.int32)
        a = bits(o.run(zs, ps, gpu_kernel="tokens"))
        b = bits(o.run(zs, ps, gpu_kernel="tiles"))
        check(f"tiles == tokens, {hq}/{hkv} heads, D {d}", np.array_equal(a, b))
    negative_control(c, last)


def negative_control(c, last):
    """The invariant=False path (XLA) on the same inputs must change the row: sequence 0 with a
    1000-token context alone (dense length 1000) vs next to 4096-token ones (dense length 4096)."""
    short = c.cl.at[0].set(1000)
    q, s, p = c.tokens(np.arange(c.n), np.where(np.arange(c.n) == 0, 999, last))
    batch = bits(attention_reference(q, c.kc, c.vc, c.bt, short, s, p))[0]
    alone = bits(attention_reference(q[:1], c.kc, c.vc, c.bt[:1], short[:1], s[:1], p[:1]))[0]
    check("negative control: XLA reference changes the row", not np.array_equal(alone, batch))


def probe_exp0():
    """The kernels' exponential (``attention_math.EX2_PTX``, inline assembly) inside a Pallas
    Triton kernel at its special values: 2**0 must be exactly 1 (the rescale of a row that a KV
    tile leaves unchanged: ``kv_tile_step``) and 2**-inf exactly 0 (a masked key's p)."""
    from jax.experimental import pallas as pl

    ex2 = attention_triton._exp2(False)

    def kernel(x_ref, o_ref, z_ref):
        x = x_ref[...]
        o_ref[...] = ex2(x - x)
        z_ref[...] = ex2(jnp.full_like(x, -jnp.inf))

    x = jax.random.normal(jax.random.key(0), (1024,), jnp.float32) * 30
    shape = jax.ShapeDtypeStruct(x.shape, jnp.float32)
    one, zero = map(np.asarray, pl.pallas_call(kernel, out_shape=(shape, shape))(x))
    check(
        "ex2(x - x) == 1 and ex2(-inf) == 0 in a Triton kernel",
        bool((one == 1.0).all() and (zero == 0.0).all()),
        f"{(one != 1.0).sum()} of {one.size} values differ from 1.0, {(zero != 0.0).sum()} from 0.0",
    )


# --------------------------------------------------------------------------- timing


def cudnn_us(q, k, v, causal):
    try:
        return kernel_us(
            lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn"),
            q,
            k,
            v,
        )
    except Exception as e:  # noqa: BLE001 - report, do not hide
        print(f"INFO cuDNN unavailable: {type(e).__name__}: {str(e)[:200]}")
        return float("nan")


def time_decode(n, ctx, hq, hkv, d, variants=False):
    c = Case(n, ctx, hq, hkv, d, seed=1)
    q, s, p = c.tokens(np.arange(n), np.full(n, ctx - 1))
    q = jax.random.normal(jax.random.key(5), q.shape, jnp.float32).astype(q.dtype)
    ours = kernel_us(lambda q, k, v: attention(q, k, v, c.bt, c.cl, s, p), q, c.kc, c.vc)
    kd = c.kc[c.bt].reshape(n, -1, hkv, d)[:, :ctx]
    vd = c.vc[c.bt].reshape(n, -1, hkv, d)[:, :ctx]
    cud = cudnn_us(q[:, None], kd, vd, False)
    kv_bytes = 2 * n * ctx * hkv * d * 2
    name = f"decode {n} x {ctx}, {hq}/{hkv} heads, D {d}"
    rate = lambda us: f"{kv_bytes / us / 1e6:.2f} TB/s"
    rows = [(name, "tokens + combine (default)", ours, cud, rate(ours))]
    if variants:
        spec = AttentionSpec.create(d)
        qg = q.reshape(n, hkv, hq // hkv, d)
        idx = (c.bt, c.cl, s, p)
        for w, st, bulk in ((2, 2, False), (2, 3, True), (4, 2, True), (4, 3, True), (8, 2, True)):
            fn = lambda q, k, v, w=w, st=st, bulk=bulk: attention_triton.attend(
                q,
                k,
                v,
                idx,
                spec=spec,
                interpret=False,
                kernel="tokens",
                num_warps=w,
                num_stages=st,
                bulk=bulk,
            )
            us = kernel_us(fn, qg, c.kc, c.vc)
            label = f"tokens {w} warps {st} stages{'' if bulk else ' masked'} + combine"
            rows.append((name, label, us, cud, rate(us)))
        states = lambda q, k, v: attention_triton.token_states(q, k, v, idx, spec=spec, interpret=False)
        rows.append((name, "tokens kernel alone (states)", kernel_us(states, qg, c.kc, c.vc), cud, ""))
        m, l, acc = jax.jit(states)(qg, c.kc, c.vc)
        comb = lambda m, l, a: attention_triton.combine(m, l, a, p, spec=spec, interpret=False, dtype=q.dtype)
        rows.append((name, "combine kernel alone", kernel_us(comb, m, l, acc), cud, ""))
        tiles = lambda q, k, v: attention_triton.attend(
            q, k, v, idx, spec=spec, interpret=False, kernel="tiles"
        )
        us = kernel_us(tiles, qg, c.kc, c.vc)
        rows.append((name, "tiles 64 rows (for comparison)", us, cud, rate(us)))
    return rows


def time_prefill(n, length, hq, hkv, d):
    c = Case(n, length, hq, hkv, d, seed=2)
    seq = np.repeat(np.arange(n), length)
    pos = np.tile(np.arange(length), n)
    q, s, p = c.tokens(seq, pos)
    flops = 4 * n * length * length / 2 * hq * d
    name = f"prefill {n} x {length} causal, {hq}/{hkv} heads, D {d}"
    rows = []
    for r, w, st, bulk in VARIANTS:
        fn = lambda q, k, v, r=r, w=w, st=st, bulk=bulk: attention_triton.attend(
            q.reshape(len(p), hkv, hq // hkv, d), k, v, (c.bt, c.cl, s, p),
            spec=AttentionSpec.create(d), interpret=False, kernel="tiles", tile_rows=r, num_warps=w,
            num_stages=st, bulk=bulk,
        )  # fmt: skip
        us = kernel_us(fn, q, c.kc, c.vc)
        rows.append((name, f"tiles {r} rows, {w} warps, {st} stages{'' if bulk else ', masked'}", us))
    # the same keys in 64-token pages (one page per KV tile: a contiguous load, no page gather)
    c64 = Case(n, length, hq, hkv, d, seed=2, bs=64)
    us = kernel_us(lambda q, k, v: attention(q, k, v, c64.bt, c64.cl, s, p), q, c64.kc, c64.vc)
    rows.append((name, "attention() default, block size 64", us))
    auto = kernel_us(lambda q, k, v: attention(q, k, v, c.bt, c.cl, s, p), q, c.kc, c.vc)
    kd = c.kc[c.bt].reshape(n, length, hkv, d)
    vd = c.vc[c.bt].reshape(n, length, hkv, d)
    cud = cudnn_us(q.reshape(n, length, hq, d), kd, vd, True)
    out = [(n_, v_, us, cud, f"{flops / us / 1e6:.1f} TFLOP/s") for n_, v_, us in rows]
    out.append((name, "attention() default", auto, cud, f"{flops / auto / 1e6:.1f} TFLOP/s"))
    return out


def check_layouts():
    """Row-by-row KV loads, 3 pipeline stages and 64-token pages give the default launch's bits."""
    c = Case(8, 4096, 32, 8, 128)
    ps = np.arange(c.ctx - 700, c.ctx)
    zs = np.zeros(700, np.int32)
    want = bits(c.run(zs, ps, gpu_kernel="tokens"))
    idx = (c.bt, c.cl, jnp.asarray(zs), jnp.asarray(ps, jnp.int32))
    qg = c.tokens(zs, ps)[0].reshape(len(ps), c.hkv, -1, c.d)
    spec = AttentionSpec.create(c.d)
    for kernel, st, rl, bulk in (
        ("tiles", 2, True, True),
        ("tiles", 3, True, True),
        ("tiles", 3, False, True),
        ("tiles", 3, True, False),
        ("tokens", 2, True, True),
        ("tokens", 2, True, False),
        ("tokens", 3, True, False),
        ("tokens", 2, False, False),
    ):
        got = jax.jit(
            lambda q, kernel=kernel, st=st, rl=rl, bulk=bulk: attention_triton.attend(
                q, c.kc, c.vc, idx, spec=spec, interpret=False, kernel=kernel, num_stages=st, row_loads=rl,
                bulk=bulk,
            )
        )(qg)  # fmt: skip
        ok = np.array_equal(bits(got.reshape(len(ps), c.hq, c.d)), want)
        check(f"{kernel} {st} stages row_loads={rl} bulk={bulk} == default (700-token chunk)", ok)
    # the same keys in 64-token pages
    dense_k = c.kc[c.bt].reshape(c.n, -1, c.hkv, c.d)
    dense_v = c.vc[c.bt].reshape(c.n, -1, c.hkv, c.d)
    per = c.ctx // 64
    kc64 = jnp.concatenate([jnp.zeros((1, 64, c.hkv, c.d), c.kc.dtype), dense_k.reshape(-1, 64, c.hkv, c.d)])
    vc64 = jnp.concatenate([jnp.zeros((1, 64, c.hkv, c.d), c.vc.dtype), dense_v.reshape(-1, 64, c.hkv, c.d)])
    bt64 = jnp.asarray(1 + np.arange(c.n * per, dtype=np.int32).reshape(c.n, per))
    got = bits(c.run(zs, ps, kc=kc64, vc=vc64, bt=bt64))
    check("64-token pages == 16-token pages (700-token chunk, tiles)", np.array_equal(got, want))
    seq, pos = np.arange(c.n), np.full(c.n, c.ctx - 1)
    a = bits(c.run(seq, pos))
    b = bits(c.run(seq, pos, kc=kc64, vc=vc64, bt=bt64))
    check("64-token pages == 16-token pages (decode)", np.array_equal(a, b))


def time_quick(prefill=True):
    """The launch choices of 2026-12-01 side by side: stages, row loads, 64-token pages."""
    rows = []
    for args in ((1, 4096, 32, 8, 128), (8, 1024, 28, 4, 128), (1, 4096, 9, 3, 64)) if prefill else ():
        rows += _quick_prefill(*args)
    for args in ((64, 4096, 32, 8, 128), (32, 3000, 28, 4, 128), (1, 32768, 32, 8, 128)):
        rows += _quick_decode(*args)
    return rows


def prefill_case(n, length, hq, hkv, d):
    """A causal prefill of n x length tokens: (Case, q, index, spec, q -> [T, Hkv, G, D], FLOPs,
    name, cuDNN's kernel us on the same keys)."""
    c = Case(n, length, hq, hkv, d, seed=2)
    seq, pos = np.repeat(np.arange(n), length), np.tile(np.arange(length), n)
    q, s, p = c.tokens(seq, pos)
    flops = 4 * n * length * length / 2 * hq * d
    name = f"prefill {n} x {length} causal, {hq}/{hkv} heads, D {d}"
    kd, vd = c.kc[c.bt].reshape(n, length, hkv, d), c.vc[c.bt].reshape(n, length, hkv, d)
    cud = cudnn_us(q.reshape(n, length, hq, d), kd, vd, True)

    def qg(q):
        return q.reshape(len(p), hkv, hq // hkv, d)

    return c, q, (c.bt, c.cl, s, p), AttentionSpec.create(d), qg, flops, name, cud


def _quick_prefill(n, length, hq, hkv, d):
    c, q, idx, spec, qg, flops, name, cud = prefill_case(n, length, hq, hkv, d)
    s, p = idx[2], idx[3]
    rows = []
    for st, rl in ((2, False), (3, False), (2, True), (3, True)):
        fn = lambda q, k, v, st=st, rl=rl: attention_triton.attend(
            qg(q), k, v, idx, spec=spec, interpret=False, kernel="tiles", num_stages=st, row_loads=rl,
        )  # fmt: skip
        us = kernel_us(fn, q, c.kc, c.vc)
        rows.append((name, f"tiles {st} stages, row_loads={rl}", us, cud, f"{flops / us / 1e6:.1f} TFLOP/s"))
        print(rows[-1], flush=True)
    c64 = Case(n, length, hq, hkv, d, seed=2, bs=64)
    us = kernel_us(lambda q, k, v: attention(q, k, v, c64.bt, c64.cl, s, p), q, c64.kc, c64.vc)
    rows.append((name, "default, block size 64", us, cud, f"{flops / us / 1e6:.1f} TFLOP/s"))
    print(rows[-1], flush=True)
    return rows


def decode_case(n, ctx, hq, hkv, d):
    """n sequences decoding their token at position ctx - 1: (Case, q [n, Hkv, G, D], index,
    KV bytes, name, cuDNN's kernel us on the same keys)."""
    c = Case(n, ctx, hq, hkv, d, seed=1)
    q, s, p = c.tokens(np.arange(n), np.full(n, ctx - 1))
    q = jax.random.normal(jax.random.key(5), q.shape, jnp.float32).astype(q.dtype)
    kd, vd = c.kc[c.bt].reshape(n, -1, hkv, d)[:, :ctx], c.vc[c.bt].reshape(n, -1, hkv, d)[:, :ctx]
    cud = cudnn_us(q[:, None], kd, vd, False)
    kv_bytes = 2 * n * ctx * hkv * d * 2
    name = f"decode {n} x {ctx}, {hq}/{hkv} heads, D {d}"
    return c, q.reshape(n, hkv, hq // hkv, d), (c.bt, c.cl, s, p), kv_bytes, name, cud


def _quick_decode(n, ctx, hq, hkv, d):
    c, qg, (_, _, s, p), kv_bytes, name, cud = decode_case(n, ctx, hq, hkv, d)
    rows = []
    variants = [  # (stages, row loads, bulk, warps)
        (2, False, False, 2),
        (2, False, True, 2),
        (2, True, False, 2),
        (2, True, True, 2),
        (3, True, False, 2),
        (3, True, True, 2),
        (2, True, False, 4),
    ]
    for st, rl, bulk, w in variants:
        fn = lambda q, k, v, st=st, rl=rl, bulk=bulk, w=w: attention_triton.attend(
            q, k, v, (c.bt, c.cl, s, p), spec=AttentionSpec.create(d), interpret=False,
            kernel="tokens", num_stages=st, row_loads=rl, bulk=bulk, num_warps=w,
        )  # fmt: skip
        us = kernel_us(fn, qg, c.kc, c.vc)
        label = f"tokens {w} warps {st} stages, row_loads={rl}{'' if bulk else ', masked'}"
        rows.append((name, label, us, cud, f"{kv_bytes / us / 1e6:.2f} TB/s"))
        print(rows[-1], flush=True)
    return rows


# The decode kernel's launch variants (same bits): name -> (DECODE_ROWS_IN_REGISTERS, DECODE_PROGRAMS)
DECODE_VARIANTS = {
    "hbm": (False, None),
    "registers": (True, None),
    "lanes 1024": (False, 1024),
    "lanes 1024, registers": (True, 1024),
}


def time_decode_rows():
    """A/B of the decode kernel's launch variants (``DECODE_VARIANTS``): the head group padded
    to 16 rows by XLA in HBM or in registers (``DECODE_ROWS_IN_REGISTERS``), a program per split
    or ~1024 programs walking their splits (``DECODE_PROGRAMS``) - two alternating rounds, the
    output bits of every variant compared with the first's."""
    rows, default = [], (attention_triton.DECODE_ROWS_IN_REGISTERS, attention_triton.DECODE_PROGRAMS)
    # (sequences, context, q heads, KV heads, D, block-table length in tokens (None: the
    # context's), tokens in the step (None: one per sequence; more: padding tokens, as the
    # engine's 16-token bucket has)). The last two are the engine's decode at its default
    # max_model_len 8192 on the GPU: 16 splits a token, most of the grid with nothing to do.
    for n, ctx, hq, hkv, d, table, bucket in (
        (1, 1024, 32, 8, 128, None, None),
        (64, 1024, 32, 8, 128, None, None),
        (64, 4096, 32, 8, 128, None, None),
        (32, 3000, 28, 4, 128, None, None),
        (64, 2048, 9, 3, 64, None, None),
        (1, 32768, 32, 8, 128, None, None),
        (64, 160, 32, 8, 128, 8192, None),
        (1, 160, 32, 8, 128, 8192, 16),
    ):
        c = Case(n, ctx, hq, hkv, d, seed=1)
        t = bucket or n
        seq = np.concatenate([np.arange(n), np.zeros(t - n, np.int64)])
        q, s, p = c.tokens(seq, np.concatenate([np.full(n, ctx - 1), np.full(t - n, -1)]))
        q = jax.random.normal(jax.random.key(5), q.shape, jnp.float32).astype(q.dtype)
        qg = q.reshape(t, hkv, hq // hkv, d)
        bt = c.bt if table is None else jnp.pad(c.bt, ((0, 0), (0, table // BS - c.bt.shape[1])))
        name = f"decode {n} x {ctx}, {hq}/{hkv} heads, D {d}" + (
            f", table {table} ({t} tokens)" if table else ""
        )
        kv_bytes = 2 * n * ctx * hkv * d * 2
        times, outs = {v: [] for v in DECODE_VARIANTS}, {}
        for variant in list(DECODE_VARIANTS) * 2:
            rows_in_registers, programs = DECODE_VARIANTS[variant]
            attention_triton.DECODE_ROWS_IN_REGISTERS = rows_in_registers
            attention_triton.DECODE_PROGRAMS = programs
            idx, spec = (bt, c.cl, s, p), AttentionSpec.create(d)
            fn = lambda q, k, v, idx=idx, spec=spec: attention_triton.attend(  # noqa: E731 (traced anew: the switches are read then)
                q, k, v, idx, spec=spec, interpret=False, kernel="tokens"
            )
            times[variant].append(kernel_us(fn, qg, c.kc, c.vc))
            if variant not in outs:
                outs[variant] = bits(jax.jit(fn)(qg, c.kc, c.vc))
        attention_triton.DECODE_ROWS_IN_REGISTERS, attention_triton.DECODE_PROGRAMS = default
        first = next(iter(DECODE_VARIANTS))
        for variant in list(DECODE_VARIANTS)[1:]:
            check(f"{name}: {variant} == {first} (bits)", np.array_equal(outs[first], outs[variant]))
        for variant, runs in times.items():
            us = statistics.median(runs)
            label = f"tokens + combine, {variant} ({', '.join(f'{x:.1f}' for x in runs)})"
            rows.append((name, label, us, us, f"{kv_bytes / us / 1e6:.2f} TB/s"))
            print(rows[-1], flush=True)
    print("\n| case | variant (runs us) | median us | TB/s |\n|---|---|---|---|")
    for name, label, us, _, rate in rows:
        print(f"| {name} | {label.split('combine, ')[1]} | {us:.1f} | {rate} |")


def time_decode_latency(cases=None, launches=None):
    """Single-stream decode (few programs: latency-bound) under the tokens kernel's launch
    choices - pipeline stages 2-5 (tiles loaded ahead of the compute), warps and the number of
    lanes (``DECODE_PROGRAMS``: ~512 / 1024 / 2048 programs in all) - and two
    bandwidth-bound batches (whether one stage count can serve every step), each
    compared bit for bit with the default launch, and timed next to cuDNN (CUPTI). Stages 2/3
    and warps 2/4/8 were proven equal on a 700-token chunk (2026-12-01); 4 and 5 are new.
    ``cases`` / ``launches`` ((stages, warps, programs) besides the default): others."""
    rows = []
    for n, ctx, hq, hkv, d in cases or (
        (1, 1024, 32, 8, 128),
        (1, 4096, 32, 8, 128),
        (1, 8192, 32, 8, 128),
        (1, 1024, 28, 4, 128),
        (4, 2048, 32, 8, 128),
        (32, 3000, 28, 4, 128),  # bandwidth-bound: a stage count for all must not cost here
        (64, 1024, 32, 8, 128),  # the engine's 64-sequence decode step (issue 19: 2.38 ms of 7.6)
        (64, 4096, 32, 8, 128),
    ):
        c, qg, idx, kv_bytes, name, cud = decode_case(n, ctx, hq, hkv, d)
        spec = AttentionSpec.create(d)
        want, default_programs = None, attention_triton.DECODE_PROGRAMS
        these = launches or [(3, 2, None), (4, 2, None), (5, 2, None), (4, 4, None)]
        if launches is None:
            these += [(None, None, 512), (None, None, 2048), (4, 2, 512)]  # fewer / more lanes
        for st, w, programs in [(None, None, default_programs), *these]:
            attention_triton.DECODE_PROGRAMS = programs or default_programs  # read when traced

            def fn(q, k, v, st=st, w=w, idx=idx, spec=spec):
                return attention_triton.attend(
                    q, k, v, idx, spec=spec, interpret=False, kernel="tokens", num_stages=st, num_warps=w
                )

            try:
                got = bits(jax.jit(fn)(qg, c.kc, c.vc))
            except Exception as e:  # noqa: BLE001 - a launch that does not compile is a finding
                print(f"INFO {name}: {w} warps {st} stages: {type(e).__name__}: {str(e)[:160]}", flush=True)
                continue
            label = "default launch" if want is None else f"tokens {w or 2} warps {st or 2} stages"
            if programs and want is not None:
                label += f", ~{programs} programs"
            if want is None:
                want = got
            else:
                check(f"{name}: {label} == default launch (bits)", np.array_equal(got, want))
            us = kernel_us(fn, qg, c.kc, c.vc)
            rows.append((name, label, us, cud, f"{kv_bytes / us / 1e6:.2f} TB/s"))
            print(rows[-1], flush=True)
        attention_triton.DECODE_PROGRAMS = default_programs

        def states(q, k, v, idx=idx, spec=spec):
            return attention_triton.token_states(q, k, v, idx, spec=spec, interpret=False)

        rows.append((name, "of it: tokens kernel alone (states)", kernel_us(states, qg, c.kc, c.vc), cud, ""))
        m, l, acc = jax.jit(states)(qg, c.kc, c.vc)

        def comb(m, l, a, pos=idx[3], spec=spec, dtype=qg.dtype):
            return attention_triton.combine(m, l, a, pos, spec=spec, interpret=False, dtype=dtype)

        rows.append((name, "of it: combine kernel alone", kernel_us(comb, m, l, acc), cud, ""))
        print(*rows[-2:], sep="\n", flush=True)
    table(rows)


# ``--decode-warps``: the tokens kernel's warps at few tokens (a single stream's decode is a chain
# of KV tiles a split: more warps split each tile's dots and loads) and on two bandwidth-bound
# batches - (stages, warps) launches besides the default.
DECODE_WARPS_CASES = (
    (1, 1024, 32, 8, 128),
    (1, 4096, 32, 8, 128),
    (4, 2048, 32, 8, 128),
    (32, 3000, 28, 4, 128),
    (64, 1024, 32, 8, 128),
)
DECODE_WARPS = [(5, 4), (5, 8), (6, 4), (4, 8), (8, 4)]


def main():
    print(f"# {datetime.date.today()} {jax.devices()[0].device_kind} jax {jax.__version__}", flush=True)
    if "--decode-warps" in sys.argv:  # the tokens kernel's warps: bits and time
        time_decode_latency(DECODE_WARPS_CASES, [(st, w, None) for st, w in DECODE_WARPS])
        sys.exit(1 if FAILURES else 0)
    if "--decode-latency" in sys.argv:  # single-stream decode: stages / warps launch variants
        time_decode_latency()
        sys.exit(1 if FAILURES else 0)
    if "--decode-rows" in sys.argv:  # the decode kernel's launch variants, A/B (bits and time)
        time_decode_rows()
        sys.exit(1 if FAILURES else 0)
    if "--quick" in sys.argv:  # the layout checks and the launch-choice table only
        check_layouts()
        table(time_quick(prefill="--decode" not in sys.argv))
        sys.exit(1 if FAILURES else 0)
    if "--checks-rest" in sys.argv:  # (a device call's end: the checks after the launch variants)
        c = Case(64, 4096, 32, 8, 128)
        ps = np.arange(4096 - 700, 4096)
        check_rest(c, np.zeros(700, np.int32), ps, 4095, bits(c.run([0, 1], [4095, 4095])))
        print(f"\nchecks failed: {len(FAILURES)} {FAILURES}")
        sys.exit(1 if FAILURES else 0)
    if "--timing-only" not in sys.argv:
        probe_exp0()
        check_accuracy()
        check_invariance(64, 4096, rest="--checks-first" not in sys.argv)
    if "--checks-first" in sys.argv:  # (``--checks-rest`` runs the rest, in another call)
        print(f"\nchecks failed: {len(FAILURES)} {FAILURES}")
        sys.exit(1 if FAILURES else 0)
    if "--checks-only" in sys.argv:  # and the decode cases' default launch
        for args in ((64, 4096, 32, 8, 128), (32, 3000, 28, 4, 128)):
            print(*time_decode(*args), sep="\n", flush=True)
        print(f"\nchecks failed: {len(FAILURES)} {FAILURES}")
        sys.exit(1 if FAILURES else 0)
    rows = []
    for args in (*PREFILL_CASES, (1, 32768, 32, 8, 128)):
        new = time_prefill(*args)
        rows += new
        print(*new, sep="\n", flush=True)
    for args in (
        (64, 4096, 32, 8, 128),
        (32, 3000, 28, 4, 128),
        (64, 2048, 9, 3, 64),
        (1, 32768, 32, 8, 128),
    ):
        rows += time_decode(*args, variants=args[0] == 64 and args[2] == 32)
        print(rows[-1], flush=True)
    check_layouts()
    table(rows)
    sys.exit(1 if FAILURES else 0)


def table(rows):
    print("\n| case | kernel | bijax us | cuDNN us | bijax / cuDNN | bijax achieved |")
    print("|---|---|---|---|---|---|")
    for name, kernel, ours, cud, rate in rows:
        print(f"| {name} | {kernel} | {ours:.1f} | {cud:.1f} | {ours / cud:.2f} | {rate} |")
    print(f"\nchecks failed: {len(FAILURES)} {FAILURES}")


if __name__ == "__main__":
    main()
