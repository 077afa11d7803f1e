"""H200 evidence for the Mosaic GPU attention ``tiles`` kernel (``pallas_kernels/attention_mgpu``):
does it give the Triton kernel's bits, and how fast is it next to Triton and cuDNN.

Run on the H200 from the repo root:  PYTHONPATH=. python benchmarks/attention_mgpu.py [--no-timing]
(each stage runs in a child process with a time limit: probe, smoke, bits, timing; the device
tool's 600 s per call may need ``--no-timing``, then ``--timing-only into+two|add+two|into+fma|...``
in a second call).

1. Elementwise probes: the operations a tile's arithmetic uses outside the dots (exp, a * b + c,
   a * b + c * d, x / y), each in a Triton and a Mosaic GPU kernel, on the same inputs - where
   the bits differ, the kernels cannot agree; and which rounding each compiler gives a * b + c
   (one, fused, or two), against fp64 references, with Mosaic GPU's explicit fma and mul.rn.
2. Bits of the variants (``pv`` "into" / "add" x ``rounding`` "two" / "compiler" / "fma")
   against the Triton ``tiles`` kernel (== the ``tokens`` kernel, benchmarks/attention.py): each
   on one KV tile (no rescale across tiles), two tiles, two splits; the variants that match
   there on every check attention.py runs on the Triton kernel (a chunk among decode tokens,
   overlapped scores and 2 / 3 stages, a window, other head shapes, 64-token pages, a whole
   4096-token prompt).
3. Kernel time (CUPTI) of the prefill cases: Mosaic GPU (2 and 3 stages), Triton, cuDNN.
4. ``--child launches`` / ``--child launch-timing``: the kernel's other launches (warp
   specialization, heaviest-first order; ``LAUNCHES``) against its default launch, bit for bit,
   and their prefill kernel time next to it, Triton and cuDNN (gpu_batch.py mgpu-launches,
   mgpu-launch-timing).
Exit code 1 if a check failed.
"""

from __future__ import annotations

import datetime
import os
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from benchmarks.ab import PAIR3 as _PAIR3  # the pair launch at the 3 stages that fit (D 128)
from benchmarks.attention import FAILURES, PREFILL_CASES, Case, bits, check, kernel_us, prefill_case
from pallas_kernels import attention_mgpu, attention_triton
from pallas_kernels.attention import AttentionSpec
from pallas_kernels.attention_math import row_tiles, tile_tokens


def _mosaic_elementwise(fn, args, block=16):
    """fn over [N, 128] f32 arrays in a Mosaic GPU kernel: TMA in, registers, TMA out."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    rows = args[0].shape[0]
    f32 = jnp.float32

    def body(*refs):
        ins, out = refs[: len(args)], refs[len(args)]
        i = lax.axis_index("x")
        part = pl.ds(i * block, block)

        def scoped(*scratch):
            smem, o_smem, bar = scratch[: len(args)], scratch[len(args)], scratch[-1]
            for src, dst in zip(ins, smem, strict=True):
                plgpu.copy_gmem_to_smem(src.at[part], dst, bar)
            plgpu.barrier_wait(bar)
            o_smem[...] = fn(*(r[...] for r in smem))
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, out.at[part])
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(
            scoped, *[plgpu.SMEM((block, 128), f32)] * (len(args) + 1), plgpu.Barrier(num_arrivals=len(args))
        )

    return plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct(args[0].shape, f32), grid=(rows // block,), grid_names=("x",)
    )(*args)


def _triton_elementwise(fn, args, block=16):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pltriton

    spec = pl.BlockSpec((block, 128), lambda i: (i, 0))

    def kernel(*refs):
        refs[-1][...] = fn(*(r[...] for r in refs[:-1]))

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(args[0].shape, jnp.float32),
        grid=(args[0].shape[0] // block,),
        in_specs=[spec] * len(args),
        out_specs=spec,
        compiler_params=pltriton.CompilerParams(num_warps=4),
    )(*args)


def probe_math():
    """Bits of elementwise f32 operations in Triton vs Mosaic GPU kernels (same inputs). (``exp``
    here is ``jnp.exp``, the kernels' exponential before NUMERICS_VERSION 6; since then both take
    ``attention_math.EX2_PTX`` as inline assembly, the same instruction by construction.)"""
    n = 1 << 20
    key = jax.random.key(7)
    a, b, c, e = (
        jax.random.normal(jax.random.fold_in(key, i), (n // 128, 128), jnp.float32) for i in range(4)
    )
    x = -jnp.abs(a) * 30.0  # exp's range in the kernel: s - max <= 0
    ops = {
        "exp(x), x <= 0": (lambda x: jnp.exp(x), (x,)),
        "a * b + c": (lambda a, b, c: a * b + c, (a, b, c)),
        "a * b + c * d": (lambda a, b, c, e: a * b + c * e, (a, b, c, e)),
        "a / b": (lambda a, b: a / b, (a, b)),
        "bf16(exp(x))": (lambda x: jnp.exp(x).astype(jnp.bfloat16).astype(jnp.float32), (x,)),
    }
    for name, (fn, args) in ops.items():
        try:
            tri, mg, xla = _triton_elementwise(fn, args), _mosaic_elementwise(fn, args), jax.jit(fn)(*args)
            print(
                f"INFO probe {name}: Triton vs Mosaic GPU differ in {int((bits(tri) != bits(mg)).sum())}"
                f" of {n}; Triton vs XLA {int((bits(tri) != bits(xla)).sum())}",
                flush=True,
            )
        except Exception as err:  # noqa: BLE001 - report and go on
            print(f"INFO probe {name}: failed: {type(err).__name__}: {str(err)[:300]}", flush=True)
    # Which rounding each kernel's a * b + c has: one (fused multiply-add) or two. The fp64
    # product of two fp32 is exact, so fp32(fp64(a) * b + c) is the fused result (up to a rare
    # double rounding) and fp32(fp32(a * b) + c) the unfused one.
    a64, b64, c64 = (np.asarray(v, np.float64) for v in (a, b, c))
    fused = (a64 * b64 + c64).astype(np.float32)
    unfused = ((a64 * b64).astype(np.float32) + np.asarray(c, np.float32)).astype(np.float32)
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def wgmma(f):  # an inline Mosaic GPU function on the kernel's WGMMA layout (64-row blocks)
        return lambda *v: f(*(plgpu.layout_cast(x, plgpu.Layout.WGMMA) for x in v))

    fn = lambda a, b, c: a * b + c  # noqa: E731
    ways = {
        "Triton": lambda: _triton_elementwise(fn, (a, b, c)),
        "Mosaic GPU": lambda: _mosaic_elementwise(fn, (a, b, c)),
        "XLA": lambda: jax.jit(fn)(a, b, c),
        "Mosaic GPU explicit fma": lambda: _mosaic_elementwise(
            wgmma(attention_mgpu._fma), (a, b, c), block=64
        ),
        "Mosaic GPU mul.rn then add": lambda: _mosaic_elementwise(
            wgmma(attention_mgpu._mul_rn_add), (a, b, c), block=64
        ),
    }
    outs = {}
    for name, way in ways.items():
        try:
            outs[name] = way()
        except Exception as err:  # noqa: BLE001 - report and go on
            print(f"INFO probe rounding, {name}: failed: {type(err).__name__}: {str(err)[:300]}", flush=True)
    for name, out in outs.items():
        out = np.asarray(out, np.float32)
        print(
            f"INFO rounding of a * b + c, {name}: equals fused {int((out == fused).sum())}, "
            f"unfused {int((out == unfused).sum())} of {out.size} (the two differ in "
            f"{int((fused != unfused).sum())})",
            flush=True,
        )


# (pv, rounding): where the rescaled accumulator meets p @ v, and how a * b + c is rounded
# (see pallas_kernels/attention_mgpu.py); tried in this order.
VARIANTS = [("into", "two"), ("add", "two"), ("into", "compiler"), ("into", "fma")]


def label(variant):
    return f"{variant[0]}+{variant[1]}"


def parse(text):
    pv, _, rounding = text.partition("+")
    return pv, rounding or "compiler"


def _mgpu(c, zs, ps, variant, stages=3, overlap=False, launch=None, **kw):
    """The Mosaic kernel on Case ``c``'s tokens; ``launch``: more tiles_mgpu launch arguments
    (consumers, order, and stages / overlap over the ones given)."""
    q, s, p = c.tokens(zs, ps)
    spec = AttentionSpec.create(c.d, **kw)
    g = c.hq // c.hkv
    pv, rounding = variant
    launch = {"stages": stages, "overlap": overlap, **(launch or {})}
    fn = jax.jit(
        lambda q, s, p: attention_mgpu.tiles_mgpu(
            q.reshape(len(p), c.hkv, g, c.d),
            c.kc,
            c.vc,
            (c.bt, c.cl, s, p),
            spec=spec,
            pv=pv,
            rounding=rounding,
            **launch,
        ).reshape(len(p), c.hq, c.d)
    )
    return fn(q, s, p)


# Launches of the Mosaic kernel besides the measured one (3 stages, one warpgroup, tiles in
# order): warp specialization (two consumer warpgroups + a producer, benchmarks/attention_plan.md
# item 4) at 4 / 5 stages, the heaviest-first order (item 1), one wgmma wait for p @ ones and
# p @ v (item 3), and combinations. Launch choices: each
# must give the default launch's bits (``check_launches``) - interpret mode on CPU says so for
# the walk, the H200 must say so for wgmma and the compiled barriers.
_ENGINE = "pair, 3 stages, heaviest, one drain, dense rows, fold in SMEM, persistent, prefetch q, direct io, token walk"
_ENGINE_LAUNCH = {
    **_PAIR3,
    "fold_in_smem": True,
    "persistent": True,
    "prefetch_q": True,
    "direct_io": True,
    "token_walk": True,
}
LAUNCHES = {
    "heaviest": {"order": "heaviest"},
    "one drain": {"one_drain": True},
    "pair, 4 stages": {"consumers": 2, "stages": 4},
    "pair, 4 stages, q from SMEM": {"consumers": 2, "stages": 4, "q_from_smem": True},
    "pair, 5 stages": {"consumers": 2, "stages": 5},
    "pair, 4 stages, heaviest": {"consumers": 2, "stages": 4, "order": "heaviest"},
    "pair, 4 stages, overlapped": {"consumers": 2, "stages": 4, "overlap": True},
    "dense rows": {"packing": "dense"},
    "pair, 4 stages, dense rows": {"consumers": 2, "stages": 4, "packing": "dense"},
    "heaviest, dense rows": {"order": "heaviest", "packing": "dense"},
    "pair, 4 stages, heaviest, one drain, dense rows": {
        "consumers": 2,
        "stages": 4,
        "order": "heaviest",
        "one_drain": True,
        "packing": "dense",
    },
    "pair, 4 stages, heaviest, one drain": {
        "consumers": 2,
        "stages": 4,
        "order": "heaviest",
        "one_drain": True,
    },
    # session 41: the split fold's accumulator in SMEM (64 registers a thread fewer through the
    # tile loop; one warpgroup then has room for 2 stages - hence the 2-stage control)
    "heaviest, dense rows, stages=2": {"order": "heaviest", "packing": "dense", "stages": 2},
    "heaviest, dense rows, fold in SMEM": {"order": "heaviest", "packing": "dense", "fold_in_smem": True},
    "heaviest, dense rows, fold in SMEM, overlapped": {
        "order": "heaviest",
        "packing": "dense",
        "fold_in_smem": True,
        "overlap": True,
    },
    "heaviest, dense rows, fold in SMEM, one drain": {
        "order": "heaviest",
        "packing": "dense",
        "fold_in_smem": True,
        "one_drain": True,
    },
    # (two warpgroups' folds take 64 KB: 3 stages fit at D 128, not 4 - hence the 3-stage control)
    "pair, 3 stages, heaviest, one drain, dense rows": _PAIR3,
    "pair, 3 stages, heaviest, one drain, dense rows, fold in SMEM": {**_PAIR3, "fold_in_smem": True},
    "pair, 3 stages, heaviest, one drain, dense rows, fold and q in SMEM": {
        **_PAIR3,
        "fold_in_smem": True,
        "q_from_smem": True,
    },
    # session 43: persistent programs (one an SM, each running its list of (tile pair, KV head)
    # items through one ring: the next item's first loads overlap the last one's end)
    "pair, 3 stages, heaviest, one drain, dense rows, fold in SMEM, persistent": {
        **_PAIR3,
        "fold_in_smem": True,
        "persistent": True,
    },
    # session 44: the next item's q loaded at an item's start (in flight for the whole walk),
    # the output staged in its own SMEM buffer and stored by TMA (2 stages at D 128: what fits)
    "pair, 3 stages, heaviest, one drain, dense rows, fold in SMEM, persistent, prefetch q": {
        **_PAIR3,
        "fold_in_smem": True,
        "persistent": True,
        "prefetch_q": True,
    },
    # q read / the output written by TMA straight from / into [T, Hkv, G, D], without XLA's
    # transposes: since session 52 one copy a tile (the engine's); session 51's form, a copy a
    # token, was slower than the transposes at 16 and 21 tokens a tile (removed). (The consumers
    # taking turns on the tensor cores - FlashAttention-3's ping-pong - was 1.02-1.07x slower on
    # the H100 and deadlocked on programs with empty items: removed; session 55's form below.)
    "pair, 3 stages, heaviest, one drain, dense rows, fold in SMEM, persistent, prefetch q, direct io": {
        **_PAIR3,
        "fold_in_smem": True,
        "persistent": True,
        "prefetch_q": True,
        "direct_io": True,
    },
    # session 52: the walk tables from each token's first row (XLA work before the kernel: 18-31
    # us of each case above; the same segments, a narrower table) - the engine's since session 53
    _ENGINE: _ENGINE_LAUNCH,
    # session 53: the engine's launch with each consumer's next q @ k.T issued before this
    # tile's softmax (``overlap``, FlashAttention-3's intra-warpgroup overlap): every check
    # PASSes, 1.01-1.28x slower on the H100 (RESULTS.md session 53) - not in the engine's launch
    "pair, 3 stages, heaviest, one drain, dense rows, fold in SMEM, persistent, prefetch q, direct io, overlapped": {
        **_PAIR3,
        "fold_in_smem": True,
        "persistent": True,
        "prefetch_q": True,
        "direct_io": True,
        "overlap": True,
    },
    # session 55: the engine's launch with overlapped scores, and with the consumers taking
    # turns to issue a tile's p @ v, p @ ones and the next q @ k.T (``pingpong``,
    # FlashAttention-3's ping-pong schedule: one consumer's softmax while the other's dots run).
    # (The persistent launch's producer now fences its reads of a segments buffer before
    # refilling it: these all run with that.)
    f"{_ENGINE}, overlapped": {**_ENGINE_LAUNCH, "overlap": True},
    f"{_ENGINE}, overlapped, ping-pong": {**_ENGINE_LAUNCH, "overlap": True, "pingpong": True},
    # ... and turns without overlapped scores: q @ k.T in a turn, p @ ones and p @ v in the next
    # (no next tile's scores held: 32 registers a thread fewer)
    f"{_ENGINE}, ping-pong": {**_ENGINE_LAUNCH, "pingpong": True},
    # session 56: the full tiles without selects (``bare_full``: 64 a thread and tile fewer, the
    # logit scaling mul.rn in every tile - the same values; 0.92-0.96x on the H100, the
    # engine's launch since; ``_ENGINE`` names the one before)
    f"{_ENGINE}, bare full tiles": {**_ENGINE_LAUNCH, "bare_full": True},
    # session 57: ... and the masked tiles' key mask from each row's key range, without the
    # probabilities' select (``lean_mask``: a masked tile was ~2x a full one)
    f"{_ENGINE}, bare full tiles, lean mask": {**_ENGINE_LAUNCH, "bare_full": True, "lean_mask": True},
    # ... with the row sums' 16 columns carried apart until the split's fold (``wide_sum``: no
    # shuffles between a tile's dots and the next q @ k.T; the engine's since session 57), and
    # with overlapped scores again. (q as an SMEM operand - no 32 register moves a tile before
    # q @ k.T - is refused with ``prefetch_q``: a second q buffer does not fit.)
    **{
        f"{_ENGINE}, bare full tiles, lean mask{name}": {
            **_ENGINE_LAUNCH,
            "bare_full": True,
            "lean_mask": True,
            **extra,
        }
        for name, extra in (
            (", wide sum", {"wide_sum": True}),
            (", wide sum, overlapped", {"wide_sum": True, "overlap": True}),
            # ... (overlapped: each tile waited out a whole K load in the 2-slot ring) with a K
            # ring one slot longer than the V ring (``k_ahead``), and with ping-pong on top
            (", wide sum, K ahead", {"wide_sum": True, "k_ahead": True}),
            (", wide sum, K ahead, overlapped", {"wide_sum": True, "k_ahead": True, "overlap": True}),
            (
                ", wide sum, K ahead, overlapped, ping-pong",
                {"wide_sum": True, "k_ahead": True, "overlap": True, "pingpong": True},
            ),
            # (sessions 57-59: FlashAttention-3's schedule on top, ``defer_pv`` - 1.06-1.10x
            # slower, removed.) Session 59: each consumer's output staged in its own fold rows
            # (``out_in_fold``: 2 x 21 KB less SMEM at 28 / 4 - 3 V slots there instead of 2,
            # and room for ``k_ahead``; 0.99-1.01x on the H100)
            (", wide sum, output in fold", {"wide_sum": True, "out_in_fold": True}),
            # ... and each item's launch-order entry and walk length read from GMEM an item
            # ahead (``early_reads``: no scalar load waited for between items)
            (", wide sum, early reads", {"wide_sum": True, "early_reads": True}),
        )
    },
}
DEFAULT_VARIANT = ("into", "two")
# Measurement probes: timed next to the launches, never bit-checked (they give other bits).
# exact exp: 2**y as libdevice's exact exp of y * ln 2 (NUMERICS_VERSION 5's exponential, two
# multiplies more) - about what the one-instruction ex2 (attention_math.EX2_PTX) saves. unmasked: every KV tile on the
# full tiles' path (no key mask, no V zeroing) - what the causal diagonal's masked tiles cost.
# base-2 logits: log2 e folded into the logit scale, each tile exponential ex2 of the difference
# (one multiply an element less) - what that numerics change would save (session 45: the
# interpret-mode discrepancy that stopped it in session 44 was XLA's CPU contraction, not the
# kernel's: attention_math.rounded_product).
PROBES = {
    # session 56: what a tile's softmax parts cost (the parts trace: the softmax is ~54% of a
    # full tile) - its exponentials (no MUFU work), its rescale (64 multiplies a thread), both
    **{
        f"probe: {_ENGINE}, bare full tiles, no {what}": {
            **_ENGINE_LAUNCH,
            "bare_full": True,
            "probe_skip": skip,
        }
        for what, skip in (
            ("exp", ("exp",)),
            ("rescale", ("rescale",)),
            ("exp or rescale", ("exp", "rescale")),
        )
    },
    "probe: pair, 3 stages, heaviest, one drain, dense rows, fold in SMEM, persistent, exact exp": {
        **_PAIR3,
        "fold_in_smem": True,
        "persistent": True,
        "probe_exact_exp": True,
    },
    "probe: pair, 3 stages, heaviest, one drain, dense rows, fold in SMEM, persistent, unmasked": {
        **_PAIR3,
        "fold_in_smem": True,
        "persistent": True,
        "probe_unmasked": True,
    },
    "probe: pair, 3 stages, heaviest, one drain, dense rows, fold in SMEM, persistent, base-2 logits": {
        **_PAIR3,
        "fold_in_smem": True,
        "persistent": True,
        "probe_log2_scores": True,
    },
}


# Page-size probe (session 45): the same launch on the same kind of keys in 64-token pages (one
# page a 64-key tile) and in 128-token pages - where the kernel takes 128-key tiles
# (``kv_tile(128)``): a rescale, a row max and a ``p @ ones`` every 128 keys instead of 64, what
# FlashAttention-3 does at D 128. Other bits (the tile is part of the numerics): timed, never
# bit-checked. Without the fold in SMEM: two stages of 128-key tiles at D 128 do not fit with it.
PAGE_PROBES = {
    "64-token pages, pair, 3 stages, heaviest, one drain, dense rows": (64, _PAIR3),
    "probe: 128-key tiles (128-token pages), pair, 3 stages, heaviest, one drain, dense rows": (128, _PAIR3),
}


def selected(launches: dict) -> dict:
    """``launches`` that the environment's ``BIJAX_MGPU_LAUNCHES`` names (unset: all) - a device
    call that asks about a few launches: "|"-separated items, each a part of a launch's name, or
    "=" and a whole name."""
    items = [w.strip() for w in os.environ.get("BIJAX_MGPU_LAUNCHES", "").split("|") if w.strip()]

    def named(k):
        return any(k == w[1:] if w.startswith("=") else w in k for w in items)

    return {k: v for k, v in launches.items() if not items or named(k)}


def check_launches():
    """Each of LAUNCHES against the default launch, bit for bit: first a small call each (a
    launch that hangs - a barrier never completes - shows here, within the stage's limit), then
    the walks of the bits suite plus ragged prefills whose tile pairs straddle sequences."""
    c = Case(2, 300, 32, 8, 128, seed=5)
    ps, zs = np.arange(200, 300), np.zeros(100, np.int32)
    want = bits(_mgpu(c, zs, ps, DEFAULT_VARIANT))
    runs = []
    for name, launch in selected(LAUNCHES).items():
        try:
            got = bits(_mgpu(c, zs, ps, DEFAULT_VARIANT, launch=launch))
        except Exception as err:  # noqa: BLE001 - a compile failure is a finding: report it
            traceback.print_exc(limit=-6)
            check(f"[{name}] runs", False, f"{type(err).__name__}: {str(err)[:300]}")
            continue
        if _compare(f"[{name}] smoke: 100-token chunk", got, want, ps):
            runs.append(name)
    big = Case(8, 4096, 32, 8, 128)
    last = big.ctx - 1
    mix_s = np.concatenate([np.arange(1, 6), np.zeros(41, np.int32), np.arange(6, 8)])
    mix_p = np.concatenate([np.full(5, last), np.arange(last - 40, last + 1), np.full(2, last)])
    ragged = Case(3, 400, 32, 8, 128, seed=6)
    rag_s = np.concatenate([np.zeros(100, np.int32), np.ones(333, np.int32), np.full(77, 2, np.int32)])
    rag_p = np.concatenate([np.arange(100), np.arange(333), np.arange(77)])
    o28, o9 = Case(4, 1500, 28, 4, 128, seed=4), Case(4, 1500, 9, 3, 64, seed=4)
    ragged28 = Case(3, 400, 28, 4, 128, seed=7)
    cases = [
        ("700-token chunk at 3396..4095", big, np.zeros(700, np.int32), np.arange(3396, 4096), {}),
        ("chunk among decode tokens", big, mix_s, mix_p, {}),
        ("sliding window 300", big, np.zeros(700, np.int32), np.arange(3396, 4096), {"sliding_window": 300}),
        ("ragged prefill 100 + 333 + 77", ragged, rag_s, rag_p, {}),
        ("ragged prefill 100 + 333 + 77, 28/4 heads", ragged28, rag_s, rag_p, {}),
        ("28/4 heads, D 128", o28, np.zeros(300, np.int32), np.arange(1200, 1500), {}),
        ("9/3 heads, D 64", o9, np.zeros(300, np.int32), np.arange(1200, 1500), {}),
        (
            "64-token pages",
            Case(2, 2048, 32, 8, 128, bs=64),
            np.zeros(500, np.int32),
            np.arange(1548, 2048),
            {},
        ),
        (
            "a whole 4096-token prompt",
            Case(1, 4096, 32, 8, 128, seed=2),
            np.zeros(4096, np.int32),
            np.arange(4096),
            {},
        ),
    ]
    for what, case, zs, ps, kw in cases:
        want = bits(_mgpu(case, zs, ps, DEFAULT_VARIANT, **kw))
        for name in runs:
            try:
                got = bits(_mgpu(case, zs, ps, DEFAULT_VARIANT, launch=LAUNCHES[name], **kw))
            except ValueError as err:  # a launch that does not fit this shape says so: not run
                if "shared memory" not in str(err):
                    raise
                print(f"REFUSED [{name}] {what}: {err}")
                continue
            _compare(f"[{name}] {what}", got, want, ps)


def _kernel_breakdown(fn, *args) -> str:
    """The kernels of one call of ``fn`` and their median times (us), largest first: where the
    walk tables' XLA time goes (how many kernels, and which)."""
    import statistics

    from jax.experimental.mosaic.gpu import profiler

    try:
        _, per_iter = profiler.measure(jax.jit(fn), aggregate=False, iterations=10)(*args)
    except Exception as e:  # (a breakdown only: the timing rows go on without it)
        return f"not measured ({type(e).__name__}: {e})"
    names = [name for name, _ in per_iter[0]]
    same = [it for it in per_iter if [name for name, _ in it] == names]
    med = [statistics.median(it[i][1] for it in same) * 1e3 for i in range(len(names))]
    parts = sorted(zip(med, names, strict=True), reverse=True)
    return f"{len(parts)} kernels: " + ", ".join(f"{n} {t:.1f}" for t, n in parts)


def _time_launches_on(n, length, hq, hkv, d):
    """One prefill case: rows (case, kernel, us, cuDNN us, rate) for Triton and every launch."""
    c, q, idx, spec, qg, flops, name, cud = prefill_case(n, length, hq, hkv, d)

    def triton(q, k, v):
        return attention_triton.attend(qg(q), k, v, idx, spec=spec, interpret=False, kernel="tiles")

    tri = kernel_us(triton, q, c.kc, c.vc)
    rows = [(name, "Triton tiles", tri, cud, f"{flops / tri / 1e6:.1f} TFLOP/s")]

    def tables(q, token_rows=None):  # the XLA work before the engine's launch: its walks, no kernel
        _, rpos, rseq, _ = row_tiles(qg(q), idx[2], idx[3], attention_mgpu.ROWS, "dense")
        launch = dict(attention_triton.MGPU_PREFILL_LAUNCH)
        return attention_mgpu.walk_tables(
            rpos,
            rseq,
            idx[1],
            idx[0].shape[0],
            consumers=launch["consumers"],
            order=launch["order"],
            window=None,
            token_rows=token_rows,
        )

    def token_tables(q):  # the same from each token's first row (``token_walk``)
        return tables(q, tile_tokens(hq // hkv, attention_mgpu.ROWS, "dense"))

    rows.append((name, "walk tables only (XLA, inside every launch below)", kernel_us(tables, q), cud, "-"))
    rows.append((name, "walk tables from tokens (token walk)", kernel_us(token_tables, q), cud, "-"))
    print(f"walk tables, {name}: {_kernel_breakdown(tables, q)}", flush=True)
    print(f"walk tables from tokens, {name}: {_kernel_breakdown(token_tables, q)}", flush=True)
    launches = {"Mosaic, default launch": {}, **selected(LAUNCHES), **selected(PROBES)}
    runs = [(what, launch, c, q, idx) for what, launch in launches.items()]
    for what, (bs, launch) in selected(PAGE_PROBES).items():  # the same kind of keys, other pages
        cp = Case(n, length, hq, hkv, d, seed=2, bs=bs)
        qp, sp, pp = cp.tokens(np.repeat(np.arange(n), length), np.tile(np.arange(length), n))
        runs.append((what, launch, cp, qp, (cp.bt, cp.cl, sp, pp)))
    for what, launch, case, qq, index in runs:

        def mosaic(q, k, v, launch=launch, index=index):
            return attention_mgpu.tiles_mgpu(
                qg(q), k, v, index, spec=spec, pv="into", rounding="two", **launch
            )

        try:
            us = kernel_us(mosaic, qq, case.kc, case.vc)
        except Exception as err:  # noqa: BLE001
            print(f"INFO timing {name} [{what}] failed: {type(err).__name__}: {str(err)[:200]}")
            continue
        rows.append((name, what, us, cud, f"{flops / us / 1e6:.1f} TFLOP/s"))
    for r in rows:
        print(r, flush=True)
    return rows


def time_launches():
    """Prefill kernel time of each launch next to the default launch, Triton and cuDNN."""
    rows = []
    for case in PREFILL_CASES:
        rows += _time_launches_on(*case)
    print("\n| case | kernel | us | cuDNN us | / cuDNN | achieved |")
    print("|---|---|---|---|---|---|")
    for name, kernel, us, cud, rate in rows:
        print(f"| {name} | {kernel} | {us:.1f} | {cud:.1f} | {us / cud:.2f} | {rate} |")


PTXAS_LAUNCHES = {
    "in order (old default)": {},
    "heaviest, dense rows (default)": {"order": "heaviest", "packing": "dense"},
    **{
        name: LAUNCHES[name]
        for name in (
            "pair, 4 stages",
            "pair, 5 stages",
            "pair, 4 stages, heaviest, one drain, dense rows",
            "heaviest, dense rows, fold in SMEM",
            "pair, 3 stages, heaviest, one drain, dense rows, fold in SMEM",
            "pair, 3 stages, heaviest, one drain, dense rows, fold and q in SMEM",
            _ENGINE,
            f"{_ENGINE}, overlapped",
            f"{_ENGINE}, overlapped, ping-pong",
            f"{_ENGINE}, ping-pong",
            f"{_ENGINE}, bare full tiles",
            f"{_ENGINE}, bare full tiles, lean mask",
            f"{_ENGINE}, bare full tiles, lean mask, wide sum",
            f"{_ENGINE}, bare full tiles, lean mask, wide sum, overlapped",
            f"{_ENGINE}, bare full tiles, lean mask, wide sum, K ahead, overlapped",
            f"{_ENGINE}, bare full tiles, lean mask, wide sum, output in fold",
        )
    },
}


def sass_spills(sass: str, context: int = 2) -> str:
    """Where a kernel's SASS touches local memory (STL / LDL: register spills): how many, and
    each with the label of the basic block it sits in, whether it lies inside a loop (between a
    label and a later branch back to it: paid every iteration, e.g. every KV tile) and its
    neighbours."""
    import re

    lines = sass.splitlines()
    block, current, line_of = [], "(entry)", {}
    for n, line in enumerate(lines):
        m = re.match(r"\s*\.?(L_x_\d+):", line)
        if m:
            current = m.group(1)
            line_of[current] = n
        block.append(current)
    loops = {}  # label -> the last line that branches back to it
    for n, line in enumerate(lines):
        for target in re.findall(r"BRA[^`]*`\(\.?(L_x_\d+)\)", line):
            if line_of.get(target, n + 1) <= n:
                loops[target] = max(loops.get(target, n), n)
    spans = [(line_of[t], end) for t, end in loops.items()]
    spills = [n for n, line in enumerate(lines) if re.search(r"\b(STL|LDL)\b", line)]
    if not spills:
        return "no STL / LDL"
    looped = [n for n in spills if any(a <= n <= b for a, b in spans)]
    out = [
        f"{len(spills)} STL / LDL instructions ({sum('STL' in lines[n] for n in spills)} stores), "
        f"{len(looped)} inside loops"
    ]
    for n in spills[:40]:
        where = "loop" if n in looped else "straight-line"
        out.append(f"  line {n} [{block[n]}, {where}]: {lines[n].strip()[:120]}")
        out += [
            f"      {lines[k].strip()[:120]}"
            for k in range(max(0, n - context), min(len(lines), n + context + 1))
            if k != n
        ]
    if len(spills) > 40:
        out.append(f"  ... {len(spills) - 40} more")
    return "\n".join(out)


def ptxas_report():
    """What ptxas says of each launch's kernel (registers, spills, shared memory): the pair
    launches' consumers hold two score tiles' worth of registers each - do they spill? Each
    launch is compiled on a whole 4096-token prompt (32 / 8 heads) with ``MOSAIC_GPU_DUMP_TO``
    set to a fresh directory; the ``.ptxas`` files written there are printed, then a table.
    The SASS is dumped too (``sass_spills``: where the STL / LDL sit) and, under ``$OUT``, each
    launch's PTX is kept as ``$OUT/ptxas/<launch>.ptx`` (a device call brings back 8 files: the
    SASS is made from it off the device - ptxas and nvdisasm from NVIDIA's wheels, any x86
    machine: ``benchmarks/attention_plan.md``, session 57)."""
    import glob
    import os
    import re
    import shutil
    import tempfile

    from benchmarks.ptx_offline import report as ptxas_summary

    c = Case(1, 4096, 32, 8, 128, seed=2)
    ps, zs = np.arange(4096), np.zeros(4096, np.int32)
    rows = []
    dumps = {"MOSAIC_GPU_DUMP_SASS": "1", "MOSAIC_GPU_DUMP_PTX": "1"}  # where the spills sit
    launches = {k: v for k, v in PTXAS_LAUNCHES.items() if "(default)" in k} | selected(PTXAS_LAUNCHES)
    for name, launch in launches.items():
        out = tempfile.mkdtemp(prefix="ptxas-")
        os.environ["MOSAIC_GPU_DUMP_TO"] = out
        os.environ.update(dumps)
        try:
            np.asarray(_mgpu(c, zs, ps, DEFAULT_VARIANT, launch=launch))
        except Exception as err:  # noqa: BLE001 - a compile failure is a finding: report it
            check(f"[{name}] compiles", False, f"{type(err).__name__}: {str(err)[:300]}")
            continue
        finally:
            for k in ("MOSAIC_GPU_DUMP_TO", *dumps):
                del os.environ[k]
        if os.environ.get("OUT"):  # the PTX comes back with the call ($OUT/ptxas/<launch>.ptx)
            keep = os.path.join(os.environ["OUT"], "ptxas")
            os.makedirs(keep, exist_ok=True)
            for i, f in enumerate(sorted(glob.glob(os.path.join(out, "*.ptx")))):
                slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
                shutil.copy(f, os.path.join(keep, f"{slug}{'-' + str(i) if i else ''}.ptx"))
        for f in sorted(
            g for g in glob.glob(os.path.join(out, "*")) if "sass" in os.path.basename(g).lower()
        ):
            print(
                f"\n## SASS spills, {name} ({os.path.basename(f)})\n{sass_spills(open(f).read())}", flush=True
            )
        text = "".join(open(f).read() for f in sorted(glob.glob(os.path.join(out, "*.ptxas"))))
        print(f"\n## ptxas, {name}\n{text.strip() or '(no .ptxas file written)'}", flush=True)
        # (registers, spills, ptxas's C7514 / C7515 notes: wgmmas it had to serialize - no
        # overlap of dots and softmax; read as ptx_offline.py reads its own compiles)
        regs, spills, serialized = ptxas_summary(text)
        stack = re.findall(r"(\d+) bytes stack frame", text)
        rows.append((name, regs, spills, ",".join(stack) or "?", str(serialized)))
        check(f"[{name}] ptxas output found", bool(text.strip()), f"nothing in {out}")
    print(
        "\n| launch | registers | spill stores / loads (bytes) | stack frame (bytes) | wgmma serialized notes |"
    )
    print("|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")


def _differ(got, want, ps):
    """'' if equal, else which tokens differ."""
    if np.array_equal(got, want):
        return ""
    rows = np.nonzero((got != want).reshape(len(ps), -1).any(axis=1))[0]
    frac = float((got != want).mean())
    return f"{len(rows)} of {len(ps)} tokens differ ({frac:.2%} of values), positions {ps[rows][:8].tolist()}"


def _compare(name, got, want, ps):
    detail = _differ(got, want, ps)
    check(name, not detail, detail)
    return not detail


def check_bits():
    """Which variants give the Triton tiles kernel's bits: each on the smallest walks first (one
    KV tile: no rescale across tiles, one split; two tiles; two splits), then the variants that
    match there on every check attention.py runs on the Triton kernel. Returns those that pass."""
    small = []
    for ctx in (64, 128, 1024):
        c = Case(1, ctx, 32, 8, 128, seed=3)
        ps, zs = np.arange(ctx), np.zeros(ctx, np.int32)
        small.append((f"one sequence 0..{ctx - 1}", c, zs, ps, bits(c.run(zs, ps, gpu_kernel="tiles"))))
    passing = []
    for v in VARIANTS:
        try:
            results = [
                (name, _differ(bits(_mgpu(c, zs, ps, v)), want, ps)) for name, c, zs, ps, want in small
            ]
        except Exception as err:  # noqa: BLE001 - a compile failure is a finding: report it
            traceback.print_exc(limit=-6)
            print(f"INFO [{label(v)}] does not run: {type(err).__name__}: {str(err)[:300]}", flush=True)
            continue
        for name, detail in results:
            print(f"INFO [{label(v)}] {name}: {'same bits' if not detail else detail}", flush=True)
        if not any(detail for _, detail in results):
            passing.append(v)
    good = [v for v in passing if _full_suite(v)]
    check(
        "a variant gives the Triton kernel's bits on every check", bool(good), str([label(v) for v in good])
    )
    return good


def _full_suite(v):
    name = label(v)
    print(f"\n## bits, {name}", flush=True)
    try:
        c = Case(8, 4096, 32, 8, 128)
        last = c.ctx - 1
        ps, zs = np.arange(c.ctx - 700, c.ctx), np.zeros(700, np.int32)
        want = bits(c.run(zs, ps, gpu_kernel="tiles"))
        ok = [_compare(f"[{name}] 700-token chunk at 3396..4095", bits(_mgpu(c, zs, ps, v)), want, ps)]
        ok.append(_compare(f"[{name}] same, 2 stages", bits(_mgpu(c, zs, ps, v, stages=2)), want, ps))
        for st in (2, 3):
            got = bits(_mgpu(c, zs, ps, v, stages=st, overlap=True))
            ok.append(_compare(f"[{name}] same, overlapped scores, {st} stages", got, want, ps))
        mix_s = np.concatenate([np.arange(1, 6), np.zeros(41, np.int32), np.arange(6, 8)])
        mix_p = np.concatenate([np.full(5, last), np.arange(last - 40, last + 1), np.full(2, last)])
        want = bits(c.run(mix_s, mix_p, gpu_kernel="tokens"))
        got = bits(_mgpu(c, mix_s, mix_p, v))
        ok.append(_compare(f"[{name}] chunk among decode tokens == tokens kernel", got, want, mix_p))
        kw = {"sliding_window": 300}
        want = bits(c.run(zs, ps, gpu_kernel="tiles", **kw))
        ok.append(_compare(f"[{name}] sliding window 300", bits(_mgpu(c, zs, ps, v, **kw)), want, ps))
        for hq, hkv, d in ((28, 4, 128), (9, 3, 64)):
            o = Case(4, 1500, hq, hkv, d, seed=4)
            ps2, zs2 = np.arange(o.ctx - 300, o.ctx), np.zeros(300, np.int32)
            want = bits(o.run(zs2, ps2, gpu_kernel="tiles"))
            ok.append(_compare(f"[{name}] {hq}/{hkv} heads, D {d}", bits(_mgpu(o, zs2, ps2, v)), want, ps2))
        c64 = Case(2, 2048, 32, 8, 128, bs=64)
        ps2, zs2 = np.arange(2048 - 500, 2048), np.zeros(500, np.int32)
        want = bits(c64.run(zs2, ps2, gpu_kernel="tiles"))
        ok.append(_compare(f"[{name}] 64-token pages", bits(_mgpu(c64, zs2, ps2, v)), want, ps2))
        whole = Case(1, 4096, 32, 8, 128, seed=2)
        ps2, zs2 = np.arange(4096), np.zeros(4096, np.int32)
        want = bits(whole.run(zs2, ps2, gpu_kernel="tiles"))
        ok.append(_compare(f"[{name}] a whole 4096-token prompt", bits(_mgpu(whole, zs2, ps2, v)), want, ps2))
        return all(ok)
    except Exception as err:  # noqa: BLE001
        traceback.print_exc(limit=-6)
        check(f"[{name}] full suite runs", False, f"{type(err).__name__}: {str(err)[:300]}")
        return False


def time_prefill(n, length, hq, hkv, d, variant):
    c, q, idx, spec, qg, flops, name, cud = prefill_case(n, length, hq, hkv, d)
    rows = []
    tri = kernel_us(
        lambda q, k, v: attention_triton.attend(qg(q), k, v, idx, spec=spec, interpret=False, kernel="tiles"),
        q,
        c.kc,
        c.vc,
    )
    rows.append((name, "Triton tiles (default)", tri, cud, f"{flops / tri / 1e6:.1f} TFLOP/s"))
    for stages, overlap in ((2, False), (3, False), (3, True), (2, True)):
        try:
            us = kernel_us(
                lambda q, k, v, st=stages, ov=overlap: attention_mgpu.tiles_mgpu(
                    qg(q), k, v, idx, spec=spec, pv=variant[0], rounding=variant[1], stages=st, overlap=ov
                ),
                q,
                c.kc,
                c.vc,
            )
        except Exception as err:  # noqa: BLE001
            print(f"INFO timing {name} mgpu {stages} stages failed: {type(err).__name__}: {str(err)[:200]}")
            continue
        what = f"Mosaic GPU tiles, {stages} stages, {label(variant)}{', overlapped' if overlap else ''}"
        rows.append((name, what, us, cud, f"{flops / us / 1e6:.1f} TFLOP/s"))
    for r in rows:
        print(r, flush=True)
    return rows


def smoke():
    """One small call of each variant: a kernel that hangs (a barrier never completes) or
    faults shows here, in a child process the parent can time out."""
    c = Case(2, 300, 32, 8, 128, seed=5)
    ps, zs = np.arange(200, 300), np.zeros(100, np.int32)
    for v in VARIANTS:
        for overlap in (False, True):
            out = np.asarray(_mgpu(c, zs, ps, v, overlap=overlap), np.float32)
            print(f"INFO smoke {label(v)} overlap={overlap}: finite {np.isfinite(out).all()}", flush=True)


STAGES = {
    "probe": probe_math,
    "smoke": smoke,
    "launches": check_launches,
    "launch-timing": time_launches,
    "ptxas": ptxas_report,
}


def _child(stage):
    print(f"# {datetime.date.today()} {jax.devices()[0].device_kind} jax {jax.__version__}", flush=True)
    if stage in STAGES:
        STAGES[stage]()
    elif stage == "bits":
        good = [label(v) for v in check_bits()]
        print(f"\nINFO variants with the Triton kernel's bits: {good}", flush=True)
        print(f"GOOD {','.join(good)}", flush=True)
    elif stage.startswith("timing"):
        variant = parse(stage.split(":", 1)[1] if ":" in stage else "into+two")
        rows = []
        for args in PREFILL_CASES:
            rows += time_prefill(*args, variant=variant)
        print("\n| case | kernel | us | cuDNN us | / cuDNN | achieved |")
        print("|---|---|---|---|---|---|")
        for name, kernel, us, cud, rate in rows:
            print(f"| {name} | {kernel} | {us:.1f} | {cud:.1f} | {us / cud:.2f} | {rate} |")
    print(f"\nchecks failed: {len(FAILURES)} {FAILURES}", flush=True)
    sys.exit(1 if FAILURES else 0)


def main():
    """Each stage in its own process with a time limit, so a kernel that hangs costs its limit
    only; a stage that hangs or fails at smoke stops the rest."""
    import subprocess

    def run(stage, limit):
        print(f"\n### stage {stage} (limit {limit} s)", flush=True)
        try:
            proc = subprocess.run(
                [sys.executable, __file__, "--child", stage], capture_output=True, text=True, timeout=limit
            )
        except subprocess.TimeoutExpired as err:
            out = err.stdout.decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
            print(out + f"\nFAIL stage {stage}: no result in {limit} s (hang?)", flush=True)
            return None, out
        print(proc.stdout + proc.stderr[-3000:], flush=True)
        return proc.returncode, proc.stdout

    failed = []
    if "--timing-only" in sys.argv:  # a second device call (each call has 600 s)
        variant = sys.argv[sys.argv.index("--timing-only") + 1]  # e.g. into+two
        rc, _ = run(f"timing:{variant}", 540)
        sys.exit(rc != 0)
    run("probe", 120)
    rc, _ = run("smoke", 150)
    if rc != 0:
        print("\nsmoke failed: bits and timing not run")
        sys.exit(1)
    rc, out = run("bits", 300)
    failed += [] if rc == 0 else ["bits"]
    good = [line.split(" ", 1)[1] for line in out.splitlines() if line.startswith("GOOD ") and " " in line]
    if "--no-timing" not in sys.argv:
        variant = good[0].split(",")[0] if good and good[0] else "into+two"
        rc, _ = run(f"timing:{variant}", 300)
        failed += [] if rc == 0 else ["timing"]
    print(f"\nstages failed: {failed}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    if "--child" in sys.argv:
        _child(sys.argv[sys.argv.index("--child") + 1])
    else:
        main()
