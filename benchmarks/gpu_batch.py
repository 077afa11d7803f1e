"""Runs named GPU benchmark steps one after another in a single device call, each in its own
process with a time limit, its log under ``--out``, and a short table last - so that one call of
the device tool (600 s, a machine that goes back 30 s after the call) does many things.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/gpu_batch.py digests+mgpu-bits spec --out $OUT

Steps are run in the order given; steps joined by "+" run at the same time (bit checks only:
each gets ``XLA_PYTHON_CLIENT_PREALLOCATE=false``; never join steps that time something). A
step starts only while a third of its time limit is left of ``--budget`` seconds. The logs go
into one file, ``<out>/gpu_batch.log``, a section per step (the device tool brings back at most
8 files). ``--list`` prints the steps. Exit code 1 if a step failed or ran out of time.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time


def _py(script, *args):
    return [sys.executable, f"benchmarks/{script}", *args]


def _with(env: str, script, *args):
    """``_py`` under the environment settings ``env`` ("NAME=value NAME='a value'", shell-quoted)."""
    return ["env", *shlex.split(env), *_py(script, *args)]


def _startup(rows: str):
    """startup.py for the comma-separated ``rows`` (fresh processes, empty caches)."""
    return _py("startup.py", "--rows", rows)


def _launches(*names: str) -> str:
    """The environment setting (for ``_with``) that selects attention_mgpu.py's launches by
    their whole names."""
    return "'BIJAX_MGPU_LAUNCHES=" + "|".join("=" + n for n in names) + "'"


_FOLD = "BIJAX_MGPU_LAUNCHES=fold|stages=2"  # attention_mgpu.py's launches with the fold in SMEM
# the session-42 launch, its persistent form (the engine's since session 43), prefetch q (early
# q: session 44, out) and the base-2 logits probe (session 45: what folding log2 e would save)
_P42 = "pair, 3 stages, heaviest, one drain, dense rows, fold in SMEM"
_PAGES = "pair, 3 stages, heaviest, one drain, dense rows"  # the page-size probe's launch (no fold in SMEM)
_PERSIST_NAMES = (
    _P42,
    f"{_P42}, persistent",
    f"{_P42}, persistent, prefetch q",
    f"probe: {_P42}, persistent, base-2 logits",
    f"64-token pages, {_PAGES}",
    f"probe: 128-key tiles (128-token pages), {_PAGES}",
)
_PERSIST = "'BIJAX_MGPU_LAUNCHES=" + "|".join("=" + n for n in _PERSIST_NAMES) + "'"
# the launch of session 48 and the same with q and the output copied straight from / into
# [T, Hkv, G, D] (session 51: a copy a token; since session 52: a copy a tile)
_S51 = [f"{_P42}, persistent, prefetch q{x}" for x in ("", ", direct io")]
_DIRECT = "'BIJAX_MGPU_LAUNCHES=" + "|".join("=" + n for n in _S51) + "'"
# ... and the session-52 launch with the walk tables from each token's first row (the engine's
# since session 53) and with overlapped scores (slower, session 53)
# ... and the engine's launch, with overlapped scores and with ping-pong turns too (session 55)
_PINGPONG = (
    "'BIJAX_MGPU_LAUNCHES="
    + "|".join(
        "=" + n
        for n in (
            f"{_S51[1]}, token walk{x}"
            for x in ("", ", overlapped", ", overlapped, ping-pong", ", ping-pong")
        )
    )
    + "'"
)
# ... and (session 56) the engine's launch with the full tiles' selects left out, and the
# probes of its softmax parts (timing only)
_BARE = (
    "'BIJAX_MGPU_LAUNCHES="
    + "|".join("=" + n for n in (f"{_S51[1]}, token walk", f"{_S51[1]}, token walk, bare full tiles"))
    + "|bare full tiles, no'"
)
# ... and (session 57) the engine's launch (bare full tiles) with the masked tiles' lean key mask
_LEAN_NAME = f"{_S51[1]}, token walk, bare full tiles, lean mask"
_LEAN = _launches(f"{_S51[1]}, token walk, bare full tiles", _LEAN_NAME)
# ... and (later) with the row sums' columns apart (wide sum), and overlapped scores
_WIDE = _launches(_LEAN_NAME, f"{_LEAN_NAME}, wide sum", f"{_LEAN_NAME}, wide sum, overlapped")
# ... and the overlapped scores from a K ring a slot longer (K ahead)
_KA = f"{_LEAN_NAME}, wide sum"
_KAHEAD_TIMING = _launches(_KA, f"{_KA}, K ahead, overlapped", f"{_KA}, K ahead, overlapped, ping-pong")
_KAHEAD_BITS = _launches(f"{_KA}, K ahead, overlapped")
# (sessions 57-59: FlashAttention-3's schedule on top, ``defer_pv`` - slower, removed)
# ... and (session 59) each consumer's output in its own fold rows (``out_in_fold``: room for K
# ahead at 28 / 4, 3 V slots there)
_FOLD_OUT = _launches(_KA, f"{_KA}, output in fold")
_FOLD_OUT_BITS = _launches(f"{_KA}, output in fold")
# ... and each item's launch-order entry and walk length read an item ahead (``early_reads``)
_EARLY = _launches(_KA, f"{_KA}, early reads")
_EARLY_BITS = _launches(f"{_KA}, early reads")
_TOKEN_WALK = (
    "'BIJAX_MGPU_LAUNCHES="
    + "|".join("=" + n for n in (_S51[1], f"{_S51[1]}, token walk", f"{_S51[1]}, overlapped"))
    + "'"
)
_PREFILL_CASES = ("--cases", "prefill,prefill64", "--paths", "invariant")
_CHECK_LIMITS = ("--max-num-seqs", "2", "--max-num-batched-tokens", "32", "--requests", "4", "--max-tokens", "6",
                 "--max-model-len", "512")  # fmt: skip


# The engine A/B runs (benchmarks/ab.py): decode with its default workload, prefill on 8 x 4096 prompts.
_PREFILL = (
    "--model",
    "llama3-8b",
    "--seqs",
    "8",
    "--input-len",
    "4096",
    "--output-len",
    "8",
    "--repeats",
    "3",
)
_PREFILL_SMOLLM2 = ("--model", "smollm2-shape", *_PREFILL[2:])
# ... and decode at the engine's default max_model_len (8192 on the GPU: 16 splits a token)
_LONG = ("--max-model-len", "8192", "--modes", "async", "--repeats", "5")
_AB = {
    f"ab-{name}": (_py("ab.py", switch, side, *extra), 200, f"A/B {switch}: {side}")
    for name, switch, side, extra in (
        ("decode-old", "decode-launch", "old", ()),
        ("decode-new", "decode-launch", "new", ()),
        ("prefill-tiles", "prefill-kernel", "tiles", _PREFILL),
        ("prefill-mgpu", "prefill-kernel", "tiles_mgpu", _PREFILL),
        ("launch-one", "prefill-launch", "one", _PREFILL),
        ("launch-pair", "prefill-launch", "pair", _PREFILL),
        ("launch-pair-smem-q", "prefill-launch", "pair-smem-q", _PREFILL),
        ("launch-pair-all", "prefill-launch", "pair-all", _PREFILL),
        ("launch-heaviest", "prefill-launch", "heaviest", _PREFILL),
        ("launch-pair-all-dense", "prefill-launch", "pair-all-dense", _PREFILL),
        ("launch-heaviest-dense", "prefill-launch", "heaviest-dense", _PREFILL),
        ("launch-heaviest-dense-fold", "prefill-launch", "heaviest-dense-fold", _PREFILL),
        ("launch-pair-all-dense-fold", "prefill-launch", "pair-all-dense-fold", _PREFILL),
        ("launch-direct-io", "prefill-launch", "direct-io", _PREFILL),
        ("launch-token-walk", "prefill-launch", "token-walk", _PREFILL),
        ("launch-pair-all-dense-fold-q", "prefill-launch", "pair-all-dense-fold-q", _PREFILL),
        (
            "launch-pair-all-dense-fold-persistent",
            "prefill-launch",
            "pair-all-dense-fold-persistent",
            _PREFILL,
        ),
        (
            "launch-pair-all-dense-fold-persistent-prefetch-q",
            "prefill-launch",
            "pair-all-dense-fold-persistent-prefetch-q",
            _PREFILL,
        ),
        # a 3-head query group (SmolLM2's shape): where packing="dense" changes the tiles
        ("launch-one-smollm2", "prefill-launch", "one", _PREFILL_SMOLLM2),
        ("launch-dense-smollm2", "prefill-launch", "dense", _PREFILL_SMOLLM2),
        ("splits-all", "decode-splits", "all", _LONG),
        ("splits-used", "decode-splits", "used", _LONG),
        ("rows-hbm", "decode-rows", "hbm", _LONG),
        ("rows-registers", "decode-rows", "registers", _LONG),
        ("lanes-splits", "decode-lanes", "splits", _LONG),
        ("lanes-on", "decode-lanes", "lanes", _LONG),
        ("kernel-old", "decode-kernel", "old", _LONG),
        ("kernel-new", "decode-kernel", "new", _LONG),
        ("programs-layers", "step-programs", "layers", _LONG),
        ("programs-whole", "step-programs", "whole", _LONG),
        ("programs-copies", "step-programs", "copies", _LONG),
        ("programs-nocmdbuf", "step-programs", "nocmdbuf", _LONG),
        ("programs-from256", "step-programs", "from256", _LONG),
        ("programs-from256x4", "step-programs", "from256x4", _LONG),
        ("programs-layersx4", "step-programs", "layersx4", _LONG),
        ("programs-tieredx4", "step-programs", "tieredx4", _LONG),
        ("shared-each", "matmul-shared", "each", _LONG),
        ("shared-on", "matmul-shared", "shared", _LONG),
        ("fusions-off", "fusions", "off", _LONG),
        ("fusions-on", "fusions", "on", _LONG),
        ("decode-stages-two", "decode-stages", "two", ()),
        ("decode-stages-few", "decode-stages", "few", ()),
        ("s50-old", "s50", "old", ()),
        ("s50-new", "s50", "new", ()),
        ("swiglu-xla", "swiglu", "xla", ()),
        ("swiglu-fused", "swiglu", "fused", ()),
        ("swiglu-mid-old", "swiglu-mid", "old", ()),
        ("swiglu-mid-new", "swiglu-mid", "new", ()),
        ("qkv-xla", "qkv-combine", "xla", _LONG),
        ("qkv-kernel", "qkv-combine", "kernel", _LONG),
        ("shared-mid-old", "shared-mid", "old", ()),
        ("shared-mid-new", "shared-mid", "new", ()),
    )
}
_PROFILE_DECODE = ("--script", "profile_step.py", "--cases", "decode1,decode64", "--paths", "invariant")
# profile_step.py's decode cases under each side of a switch: "profile-<name>-<side>"
_AB.update(
    {
        f"profile-{name}-{side}": (
            _py("ab.py", switch, side, *_PROFILE_DECODE),
            200,
            f"profile, {switch} {side}",
        )
        for name, switch, sides in (
            ("shared", "matmul-shared", ("each", "shared")),
            ("fusions", "fusions", ("off", "on")),
            ("qkv", "qkv-combine", ("xla", "kernel")),
            ("shared-mid", "shared-mid", ("old", "new")),
            ("swiglu", "swiglu", ("xla", "fused")),
            ("decode-stages", "decode-stages", ("two", "few")),
            ("s50", "s50", ("old", "new")),
            ("swiglu-mid", "swiglu-mid", ("old", "new")),
        )
        for side in sides
    }
)


def _launch_steps(
    name: str, env: str, limits: tuple[int, int], what: str, bits_env: str | None = None
) -> dict:
    """``mgpu-<name>-launches`` (bits against the default launch) and ``mgpu-<name>-timing``
    (kernel time next to the default launch, Triton and cuDNN) for the launches ``env`` selects
    (``bits_env``: the bits step's own, e.g. the new launch alone)."""
    return {
        f"mgpu-{name}-launches": (
            _with(bits_env or env, "attention_mgpu.py", "--child", "launches"),
            limits[0],
            f"{what} == the default launch's bits",
        ),
        f"mgpu-{name}-timing": (
            _with(env, "attention_mgpu.py", "--child", "launch-timing"),
            limits[1],
            f"{what} vs the default launch vs Triton vs cuDNN kernel time",
        ),
    }


def _ptxas(env: str, limit: int, what: str) -> tuple:
    """attention_mgpu.py's ptxas report (registers, spills; each launch's PTX under
    ``$OUT/ptxas/``) for the launches ``env`` selects."""
    return (_with(env, "attention_mgpu.py", "--child", "ptxas"), limit, f"ptxas on {what}")


def _parts_trace(launch: str, what: str) -> tuple:
    """attention_trace.py at level "parts" on the engine's prefill launch with ``launch``
    (``k=v,...``) over it."""
    extra = ("--launch", launch) if launch else ()
    return (
        _py("attention_trace.py", "--levels", "parts", *extra),
        150,
        f"the prefill kernel traced inside (tile parts), {what}",
    )


# name -> (command, time limit s, what it is for)
STEPS = {
    "digests": (_py("gpu_digests.py"), 300, "engine bits vs the records (4 configs; ~210 s on an H100)"),
    "digests-write": (
        [
            "sh",
            "-c",
            f'{shlex.quote(sys.executable)} benchmarks/gpu_digests.py --write --dir "${{OUT:-.}}/digests"',
        ],
        300,
        "the records written for this device class (after a NUMERICS_VERSION bump), into $OUT/digests "
        "(the environment's OUT, the device tool's folder)",
    ),
    "digests-mgpu": (
        _py("gpu_digests.py", "--prefill-kernel", "tiles_mgpu"),
        240,
        "the same with the Mosaic GPU prefill kernel under 'auto'",
    ),
    **{
        f"digests-{side}": (
            _py("gpu_digests.py", "--prefill-launch", side),
            300,
            f"engine bits vs the records with the Mosaic prefill launch '{side}' (ab.py prefill-launch)",
        )
        for side in (
            "pair",
            "pair-smem-q",
            "pair-all",
            "heaviest",
            "drain",
            "dense",
            "pair-dense",
            "pair-all-dense",
            "heaviest-dense",
            "heaviest-dense-fold",
            "pair-all-dense-fold",
            "pair-all-dense-fold-q",
            "pair-all-dense-fold-persistent",
            "pair-all-dense-fold-persistent-prefetch-q",
            "direct-io",
            "token-walk",
            "early-reads",
        )
    },
    "mgpu-bits": (_py("attention_mgpu.py", "--child", "bits"), 270, "Mosaic attention == Triton bits"),
    "mgpu-timing": (
        _py("attention_mgpu.py", "--child", "timing:into+two"),
        150,
        "Mosaic attention vs Triton vs cuDNN kernel time",
    ),
    "mgpu-launches": (
        _py("attention_mgpu.py", "--child", "launches"),
        330,
        "Mosaic attention launches (warp specialization, heaviest first, dense rows) == its default launch's bits",
    ),
    "mgpu-launch-timing": (
        _py("attention_mgpu.py", "--child", "launch-timing"),
        280,
        "Mosaic attention launches vs default launch vs Triton vs cuDNN kernel time",
    ),
    **_launch_steps(
        "fold", _FOLD, (240, 260), "the split fold's accumulator in SMEM (and the 2-stage control)"
    ),
    **_launch_steps(
        "persist",
        _PERSIST,
        (240, 260),
        "the session-42 prefill launch, its persistent form (the engine's) and prefetch q",
    ),
    **_launch_steps(
        "s51",
        _DIRECT,
        (200, 220),
        "the session-48 prefill launch and with q / the output copied a tile at a time (the engine's since session 52)",
    ),
    **_launch_steps(
        "s52",
        _TOKEN_WALK,
        (200, 220),
        "the engine's prefill launch, the same with the walk tables from each token's first row, and with overlapped scores",
    ),
    **_launch_steps(
        "s55",
        _PINGPONG,
        (260, 240),
        "the engine's prefill launch, the same with overlapped scores, with turns (ping-pong) and with both",
    ),
    **_launch_steps(
        "s56",
        _BARE,
        (200, 240),
        "the engine's prefill launch and the same with bare full tiles (+ probes: no exp, no rescale)",
    ),
    **_launch_steps(
        "s57",
        _LEAN,
        (200, 200),
        "the engine's prefill launch and the same with the masked tiles' lean key mask",
    ),
    "mgpu-s57-ptxas": _ptxas(
        _LEAN,
        150,
        "the engine's prefill launch and with the lean key mask: registers, spills; PTX under $OUT/ptxas/",
    ),
    **_launch_steps(
        "s57b",
        _WIDE,
        (330, 240),
        "the engine's launch with the lean key mask, and with the row sums' columns apart (wide sum), and overlapped scores",
    ),
    **_launch_steps(
        "s57c",
        _KAHEAD_TIMING,
        (200, 200),
        "overlapped scores from a K ring a slot longer (K ahead), and with ping-pong (bits: the first alone)",
        bits_env=_KAHEAD_BITS,
    ),
    **_launch_steps(
        "s59",
        _FOLD_OUT,
        (300, 240),
        "the output staged in the fold's SMEM (3 V slots at 28/4; room for K ahead there)",
        bits_env=_FOLD_OUT_BITS,
    ),
    **_launch_steps(
        "s59b",
        _EARLY,
        (240, 160),
        "each item's launch-order entry and walk length read from GMEM an item ahead (early reads)",
        bits_env=_EARLY_BITS,
    ),
    "attention-trace-kahead": _parts_trace(
        "k_ahead=True,overlap=True", "the engine's launch with overlapped scores from a K ring a slot longer"
    ),
    "mgpu-s57b-ptxas": _ptxas(
        _WIDE,
        200,
        "the lean-mask launch, with wide sum, and overlapped scores; PTX under $OUT/ptxas/",
    ),
    "mgpu-s56-ptxas": _ptxas(
        _BARE,
        150,
        "the engine's prefill launch and with bare full tiles: registers, spills, serialized wgmmas, SASS",
    ),
    "mgpu-s55-ptxas": _ptxas(
        _PINGPONG,
        150,
        "the engine's prefill launch, with overlapped scores, with ping-pong: registers, spills, serialized wgmmas",
    ),
    "attention-trace-parts": _parts_trace("", "the engine's launch: where a KV tile's cycles go"),
    "attention-trace-pingpong": _parts_trace(
        "overlap=True,pingpong=True", "with overlapped scores and the consumers taking turns"
    ),
    "attention-trace-lean": _parts_trace("lean_mask=True", "the engine's launch with the lean key mask"),
    "attention-trace-turns": _parts_trace(
        "pingpong=True", "with the consumers taking turns, q @ k.T and the dots apart"
    ),
    "mgpu-fold-ptxas": (
        _with(_FOLD, "attention_mgpu.py", "--child", "ptxas"),
        150,
        "ptxas registers / spills and SASS of the launches with the split fold's accumulator in SMEM",
    ),
    "mgpu-ptxas": (
        _py("attention_mgpu.py", "--child", "ptxas"),
        240,
        "ptxas registers / spills / stack of the Mosaic attention launches (default, pair); SASS: where the spills sit",
    ),
    "attention": (_py("attention.py"), 400, "attention kernels: bits and time vs cuDNN"),
    "attention-checks": (
        _py("attention.py", "--checks-first"),
        480,
        "attention kernels' checks, first half: the exponential's special values, accuracy, invariance "
        "across batches, slots, chunks and launches (bits); ~450 s next to digests-write on an H100",
    ),
    "attention-checks-rest": (
        _py("attention.py", "--checks-rest"),
        240,
        "attention kernels' checks, second half: window / softcap, KV in other blocks, 28/4 and 9/3 heads, "
        "control (~150 s on an H100)",
    ),
    "attention-rows": (
        _py("attention.py", "--decode-rows"),
        200,
        "decode kernel launch variants: rows padded in HBM / registers, a program per split / lanes (bits, CUPTI time)",
    ),
    "attention-decode-latency": (
        _py("attention.py", "--decode-latency"),
        240,
        "single-stream decode attention: tokens kernel stages 2-5 / warps (bits vs default, time vs cuDNN)",
    ),
    "decode-warps": (
        _py("attention.py", "--decode-warps"),
        180,
        "decode attention: the tokens kernel's warps at 1-64 tokens (bits vs default, time vs cuDNN)",
    ),
    "kernels": (_py("kernels.py", "--skip-checks"), 200, "matmul / rows kernel time vs XLA"),
    "decode-sweep": (_py("kernels.py", "--decode-sweep"), 150, "decode-row matmul launches"),
    "bits-sweep": (_py("kernels.py", "--bits-sweep"), 300, "bits: shared launch, Mosaic vs Triton rows"),
    "fusions": (
        _py("kernels.py", "--fusions"),
        360,
        "matmul_norm, rope_write_kv, qkv_rope_write_kv: bits and time vs unfused",
    ),
    "qkv-fusion": (_py("kernels.py", "--qkv"), 200, "qkv_rope_write_kv: bits and time vs unfused"),
    "kernels-mid-tiles": (_py("kernels.py", "--mid-tiles"), 200, "Mosaic GPU launches at M 256, 384"),
    "mid-rows": (_py("kernels.py", "--mid-rows"), 420, "matmul launches at 32 / 64 rows: bits, time, floor"),
    "kernels-shared": (
        _py("kernels.py", "--shared", "--mid-m"),
        200,
        "weights sharing x in one launch; 64 < M < 512: Triton vs Mosaic GPU",
    ),
    "gate-up": (
        _py("kernels.py", "--gate-up"),
        240,
        "gate_up_swiglu (gate, up and SwiGLU in one launch): bits vs the unfused ops, launches' time at decode rows",
    ),
    "digests-swiglu": (
        _py("ab.py", "swiglu", "fused", "--script", "gpu_digests.py"),
        300,
        "engine bits vs the records with mlp.FUSED on",
    ),
    "digests-swiglu-mid": (
        _py("ab.py", "swiglu-mid", "new", "--script", "gpu_digests.py"),
        300,
        "engine bits vs the records with the fused gate/up launch up to 64 rows",
    ),
    "swiglu-bits": (
        _py("swiglu_bits.py"),
        90,
        "SwiGLU in a Pallas Triton kernel vs the XLA fusion, every bf16 gate value: can a matmul kernel fuse it with the same bits?",
    ),
    # several GPUs (nvidia-h200-x2 / -x4 / -x8): issue 24's runs
    "collectives": (
        _py("collectives.py"),
        240,
        "tree_psum gather / scatter vs psum per rank count (2, 4, 8 as the machine has) and message size",
    ),
    **{
        name: (
            _py("tp.py", "--model", model, "--runs", runs, "--requests", str(requests)),
            limit,
            f"{model}, path:TP:k_shards {runs}, {requests} requests: invariant bits equal across TP, "
            "XLA's differ (control); decode tok/s",
        )
        for name, model, runs, requests, limit in (
            ("tp-x2", "llama3-8b", "inv:1:8,inv:2:8,xla:1:8,xla:2:8", 8, 300),
            ("tp-x4", "llama3-8b", "inv:1:8,inv:2:8,inv:4:8,xla:1:8,xla:4:8", 8, 400),
            ("tp-x8", "llama3-8b", "inv:1:8,inv:2:8,inv:4:8,inv:8:8,xla:1:8,xla:8:8", 8, 500),
            ("tp-x8-64", "llama3-8b", "inv:1:8,inv:8:8,xla:1:8,xla:8:8", 64, 500),
            ("tp70-x4", "llama3-70b", "inv:4:8,xla:4:8", 8, 500),  # built in its shards
            ("tp70-x8", "llama3-70b", "inv:4:8,inv:8:8,xla:4:8,xla:8:8", 8, 580),
        )
    },
    # `bijax check` with its suite's engines at TP P (since 2026-12-05: before, only the model's
    # build saw --tensor-parallel-size); the TP 2 check's engine limits, as on 2026-11-30
    **{
        name: (
            [
                sys.executable,
                "-m",
                "bijax.cli",
                "check",
                "--model",
                model,
                "--k-shards",
                "8",
                "--tensor-parallel-size",
                str(tp),
                *_CHECK_LIMITS,
            ],
            limit,
            f"bijax check on {model} at TP {tp} (every dimension; the control DETECTED)",
        )  # fmt: skip
        for name, model, tp, limit in (
            ("check-x2", "llama3-8b", 2, 300),
            ("check-x4", "llama3-8b", 4, 300),
            ("check70-x4", "llama3-70b", 4, 580),
        )
    },
    "spec": (
        _py("speculative.py", "--workloads", "repeat,random"),
        280,
        "speculation vs plain: repeat and random",
    ),
    "spec-cycle": (_py("speculative.py", "--workloads", "cycle"), 200, "speculation: cycle"),
    "spec-random": (
        _py("speculative.py", "--workloads", "random", "--repeats", "9"),
        280,
        "speculation vs plain on random prompts, 9 runs each",
    ),
    **_AB,
    "profile": (_py("profile_step.py"), 300, "where a step's time goes"),
    "bench": (
        _py("baseline.py", "--part", "bench"),
        450,
        "bijax bench llama3-8b 64 x (256 + 128), invariant vs the XLA baseline",
    ),
    "bench-single": (
        _py("baseline.py", "--part", "bench", "--single"),
        300,
        "bijax bench llama3-8b, one stream 64 + 256, invariant vs the XLA baseline",
    ),
    # session 39 asked whether staged inputs help (session 41: no; off by default since): this
    # step is bench-single with them on
    "bench-single-staged": (
        _with("BIJAX_STAGED_INPUTS=1", "baseline.py", "--part", "bench", "--single"),
        300,
        "bench-single with the step inputs copied into the same buffers every step (BIJAX_STAGED_INPUTS=1)",
    ),
    # the same question in one process: two engines on one model, runs interleaved, with the
    # host time spent staging (does the copy into donated buffers wait for the step in flight?)
    "staged-ab": (
        _py("staged_ab.py", "--runs", "6"),
        300,
        "staged vs unstaged step inputs, one process, llama3-8b 1 x (64 + 256), runs interleaved",
    ),
    "staged-ab-64": (
        _py(
            "staged_ab.py",
            "--seqs",
            "64",
            "--input-len",
            "256",
            "--output-len",
            "128",
            "--runs",
            "3",
            "--num-kv-blocks",
            "2048",
        ),
        400,
        "staged vs unstaged step inputs, one process, llama3-8b 64 x (256 + 128), runs interleaved",
    ),
    "startup": (
        _py("startup.py"),
        540,
        "cold / warm start-up (fresh processes; cold without helper processes, with them, with them compiling)",
    ),
    "startup-single": (
        _startup("single"),
        120,
        "start-up: one request's first token, empty cache",
    ),
    "startup-programs": (
        _startup("engine-layers,engine-whole,single-layers,single-whole"),
        420,
        "start-up, empty caches: the forward as a chain of programs / as one program",
    ),
    "startup-threshold": (
        _startup("engine-from256,engine-whole"),
        300,
        "start-up, empty caches: the chain for token buckets of 256 or more, one program for the others / one program",
    ),
    "startup-runs": (
        _startup("engine-from256x4,engine-from256,engine-whole"),
        330,
        "start-up, empty caches: the chain (4 layers a program / 1) for token buckets of 256 or more / one program",
    ),
    "startup-from256x4": (
        _startup("engine-from256x4,engine-whole"),
        240,
        "start-up, empty caches: the chain of 4 layers a program for token buckets of 256 or more / one program",
    ),
    "startup-chain4": (
        _startup("engine-layersx4,engine-whole,single-layersx4,single-whole"),
        420,
        "start-up, empty caches: the forward as a chain of 4 layers a program / as one program (64 x 2048 engine; one request)",
    ),
    "startup-tiered": (
        _startup(
            "engine-tieredx4,engine-tieredx4-filled,single-tieredx4,single-tieredx4-filled,engine-whole"
        ),
        480,
        "start-up: tiered (the 4-layer chain first, whole forwards in the background), empty and filled caches / one program",
    ),
    "startup-default": (
        _startup("engine,engine-filled,single,single-filled,engine-whole"),
        420,
        "start-up with the defaults (tiered on GPUs since 2026-12-04), empty and filled caches / one program",
    ),
    "host-inputs": (
        _py(
            "profile_step.py",
            "--cases",
            "decode1",
            "--paths",
            "invariant",
            "--placed-inputs",
            "--trace",
            "/tmp/bijax-trace-inputs",
        ),
        150,
        "traced single-stream step, new input buffers every step / the same ones: does XLA update the CUDA graph for them?",
    ),
    "cmdbuf-modes": (
        _py("cmdbuf_modes.py", "--num-kv-blocks", "0"),
        260,
        "single-stream engine step: XLA's command-buffer update mode (ALWAYS_UPDATE, SKIP_TEMP) x inputs staged or not",
    ),
    "startup-decode": (
        _startup("single-decode,single,single-decode,single"),
        240,
        "start-up: one request's first token, empty caches, the prompt's and decoding's buckets warmed up / the prompt's only",
    ),
    "startup-single-ab": (
        _startup("single-helper,single"),
        150,
        "start-up: one request's first token, empty cache, without / with a helper for its 2 programs",
    ),
    "compile-scaling": (
        _py("compile_scaling.py"),
        300,
        "one forward program's lower / compile time at 1, 4, 16, 32 layers (per layer or per program?)",
    ),
    "compile-flags": (
        _py("compile_flags.py"),
        300,
        "where a 32-layer forward's compile goes; XLA options that might shorten it",
    ),
    "long": (_py("long_context.py"), 500, "a 32k-token prompt through the engine"),
    "attention-timing": (
        _py("attention.py", "--timing-only"),
        330,
        "attention kernels' time vs cuDNN (no accuracy / invariance checks: run `attention` for them)",
    ),
    "attention-trace": (
        _py("attention_trace.py"),
        240,
        "the engine's prefill kernel traced inside (Mosaic GPU's profiler): cycles per item and tile",
    ),
    "weights-build": (_py("weights_build.py"), 120, "a preset's random-weight build: compile vs draws"),
    "profile-prefill-chain": (
        _with("BIJAX_STEP_PROGRAMS=layers", "profile_step.py", *_PREFILL_CASES),
        150,
        "prefill steps (1 x 2048, 64 x 32) with the forward as the chain of programs",
    ),
    "profile-chain4": (
        _with(
            "BIJAX_STEP_PROGRAMS=layers BIJAX_LAYERS_PER_PROGRAM=4",
            "profile_step.py",
            *("--cases", "decode1,decode64,prefill,prefill64", "--paths", "invariant"),
        ),
        200,
        "decode and prefill steps with the forward as the chain of 4 layers a program",
    ),
    "digests-chain4": (
        # every step as the chain (the digests' engine takes 64 tokens a step: under 256)
        _with("BIJAX_STEP_PROGRAMS=layers BIJAX_LAYERS_PER_PROGRAM=4", "gpu_digests.py"),
        240,
        "engine bits vs the records (4 configs), the forward as the chain of 4 layers a program",
    ),
    "digests-tiered": (
        # the chain first, each bucket's steps switching to its whole forward when it is ready
        _with("BIJAX_STEP_PROGRAMS=tiered BIJAX_LAYERS_PER_PROGRAM=4", "gpu_digests.py"),
        240,
        "engine bits vs the records (4 configs), tiered: the 4-layer chain, then whole forwards",
    ),
    "profile-prefill-whole": (
        _with("BIJAX_STEP_PROGRAMS=whole", "profile_step.py", *_PREFILL_CASES),
        150,
        "prefill steps (1 x 2048, 64 x 32) with the forward as one program",
    ),
}

# Steps that run on an empty compilation cache of their own: those that time compiles, and the
# layer copies (copies of an executable read back from the cache failed on CPU; on GPU untried).
FRESH_CACHE = {"long", "ab-programs-copies"}


def run_group(names, out_dir, parallel, cap=None):
    """Runs ``names`` at the same time (``parallel``) or the one step; each step's log is
    ``<out_dir>/<name>.log``; a step is killed at its time limit, or at ``cap`` seconds if that
    is sooner (what is left of the call: a step's partial log still comes back). Returns
    (name, status, seconds) per step."""
    procs = []
    for name in names:
        env = dict(os.environ)
        if parallel:
            env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
        if name in FRESH_CACHE:
            env["BIJAX_CACHE_DIR"] = tempfile.mkdtemp(prefix=f"bijax-{name}-")
        cmd, limit, _ = STEPS[name]
        limit = limit if cap is None else min(limit, cap)
        log = open(os.path.join(out_dir, f"{name}.log"), "w")  # noqa: SIM115 - closed below
        procs.append(
            (
                name,
                limit,
                log,
                time.perf_counter(),
                subprocess.Popen(cmd, stdout=log, stderr=log, env=env, start_new_session=True),
            )
        )
    rows = []
    for name, limit, log, t0, proc in procs:
        try:
            rc = proc.wait(timeout=max(1.0, limit - (time.perf_counter() - t0)))
            status = "ok" if rc == 0 else f"exit {rc}"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # its children too (startup.py runs some)
            proc.wait()
            status = f"killed at {limit:.0f} s"
        log.close()
        rows.append((name, status, time.perf_counter() - t0))
        print(f"## {name}: {status} ({rows[-1][2]:.0f} s)", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("steps", nargs="*", help='step names; "a+b" runs a and b at the same time')
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="directory for the logs")
    ap.add_argument("--budget", type=float, default=570, help="start no step after this many seconds")
    ap.add_argument("--list", action="store_true")
    a = ap.parse_args()
    if a.list or not a.steps:
        for name, (_cmd, limit, what) in STEPS.items():
            print(f"{name:18} {limit:4d} s  {what}")
        return 0
    groups = [g.split("+") for g in a.steps]
    unknown = [n for g in groups for n in g if n not in STEPS]
    if unknown:
        sys.exit(f"unknown steps {unknown}; --list shows them")
    os.makedirs(a.out, exist_ok=True)
    combined = os.path.join(a.out, "gpu_batch.log")
    logs = tempfile.mkdtemp(prefix="gpu-batch-")
    start, rows = time.perf_counter(), []
    for group in groups:
        left = a.budget - (time.perf_counter() - start)
        if left < max(STEPS[n][1] for n in group) / 3:
            rows += [(n, "not started (budget)", 0.0) for n in group]
            continue
        done = run_group(group, logs, parallel=len(group) > 1, cap=max(1.0, left + 15))
        rows += done
        with open(combined, "a") as out:
            for name, status, secs in done:
                out.write(f"\n######## {name}: {status} ({secs:.0f} s): {' '.join(STEPS[name][0][1:])}\n")
                with open(os.path.join(logs, f"{name}.log"), errors="replace") as f:
                    out.write(f.read())
    print("\n| step | status | s |\n|---|---|---|")
    for name, status, secs in rows:
        print(f"| {name} | {status} | {secs:.0f} |")
    return 0 if all(status == "ok" for _, status, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
