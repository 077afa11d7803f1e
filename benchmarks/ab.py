"""A/B of an engine choice that never changes bits (so only time differs): one process per side,
running ``benchmarks/async_scheduling.py`` with the arguments after the side.

    PYTHONPATH=. python3 benchmarks/ab.py decode-launch old|new [async_scheduling.py args]
    PYTHONPATH=. python3 benchmarks/ab.py prefill-kernel tiles|tiles_mgpu [async_scheduling.py args]
    PYTHONPATH=. python3 benchmarks/ab.py decode-splits all|used [async_scheduling.py args]
    PYTHONPATH=. python3 benchmarks/ab.py decode-rows hbm|registers [async_scheduling.py args]
    PYTHONPATH=. python3 benchmarks/ab.py decode-lanes splits|lanes [async_scheduling.py args]
    PYTHONPATH=. python3 benchmarks/ab.py decode-kernel old|new [async_scheduling.py args]
    PYTHONPATH=. python3 benchmarks/ab.py step-programs layers|whole [async_scheduling.py args]
    PYTHONPATH=. python3 benchmarks/ab.py matmul-shared each|shared [async_scheduling.py args]
    PYTHONPATH=. python3 benchmarks/ab.py fusions off|on [async_scheduling.py args]
    PYTHONPATH=. python3 benchmarks/ab.py qkv-combine xla|kernel [async_scheduling.py args]

``decode-launch``: ``matmul_triton.gpu_tiles``'s 16-row launch (64 columns, 4 warps, 8 stages)
off (``old``: 32 columns, 2 warps, 4 stages) or on (``new``, committed). ``prefill-kernel``:
``attention_triton.PREFILL_KERNEL`` (the kernel attention's "auto" runs for prefill steps).
``decode-splits``: ``attention_triton.STORE_USED_SPLITS_ONLY`` off (``all``: the decode kernel
stores every split of its grid and the combine folds them all) or on (``used``, committed).
``decode-rows``: ``attention_triton.DECODE_ROWS_IN_REGISTERS`` off (``hbm``: q padded to 16 rows
by an XLA pad, 16 rows stored and combined, the output sliced) or on (``registers``, the
default since 2026-12-02 session 28). ``decode-lanes``: ``attention_triton.DECODE_PROGRAMS``
None (``splits``: a program per split) or 1024 (``lanes``: ~1024 programs walking their splits,
the default since session 28).
``decode-kernel``: both of the last two at once - ``old`` (rows in HBM, a program per split) or
``new`` (rows in registers, lanes). ``step-programs``: a step's forward as a chain of programs
(``layers``: the embedding, a program per layer, the LM head; the CPU's default) or one
program (``whole``, the GPU's) - ``BIJAX_STEP_PROGRAMS`` (``bijax.step_programs``); ``copies`` / ``nocmdbuf``: the
chain with ``BIJAX_LAYER_COPIES=1`` / ``BIJAX_LAYER_COMMAND_BUFFERS=0``.
``matmul-shared``: ``matmul_triton.SHARED_LAUNCH`` off (``each``: q, k, v and gate, up a launch
each) or on (``shared``: one launch per group where the launch shapes agree; the default).
``shared-mid``: ``old`` - q, k, v as three Mosaic launches at 33-64 rows and gate, up a launch
each at every M - or ``new`` (the default since 2026-12-06 session 47): the shared Triton launch
up to 64 rows, gate and up shared from 17 rows.
``fusions``: ``matmul_norm.FUSED`` and ``rope.FUSED`` off (``off``: o / down's leaf partials
combined by XLA before the norm kernel; RoPE and the KV write as XLA's five kernels) or on
(``on``: the norm kernel combines the leaves; one RoPE + KV-write kernel a layer; the default).
``qkv-combine``: ``rope.QKV_COMBINE_IN_KERNEL`` off (``xla``: q, k, v's leaf partials combined
by XLA before the RoPE kernel) or on (``kernel``: the RoPE kernel combines them; the default).
``decode-stages``: ``attention_triton.DECODE_FEW_TOKENS`` 0 (``two``: the decode kernel at 2
pipeline stages everywhere, as before 2026-12-06 session 50) or 16 (``few``: 5 stages up to 16
tokens; the default).
``s50``: ``decode-stages`` and ``swiglu`` together, both off (``old``) or both on (``new``).
``swiglu``: ``mlp.FUSED`` off (``xla``: gate and up a launch each, SiLU(gate) * up an XLA
fusion) or on (``fused``: one launch of both with SwiGLU in its epilogue at decode rows; the
default since 2026-12-06 session 50).
``--script NAME args``: runs ``benchmarks/NAME`` with ``args`` under the switch instead (e.g.
``profile_step.py --cases decode1 --paths invariant``).
Default arguments: llama3-8b, 1 and 64 sequences x (64 + 128) tokens, 3 timed runs; for a
prefill-bound run e.g. ``--seqs 8 --input-len 4096 --output-len 8``. Alternate the sides.
"""

import importlib
import os
import runpy
import sys

# switch -> {side: ((module under pallas_kernels, attribute, value), ...)}; module None: an
# environment variable (read when the engine is made, which the helper processes inherit)
# the pair launch at the 3 stages that fit with two folds in shared memory (D 128); also
# benchmarks/attention_mgpu.py's launches
PAIR3 = {"stages": 3, "consumers": 2, "order": "heaviest", "one_drain": True, "packing": "dense"}
# the engine's prefill launch of session 53 (each token's first row for the walk tables)
TOKEN_WALK = {
    **PAIR3,
    "fold_in_smem": True,
    "persistent": True,
    "prefetch_q": True,
    "direct_io": True,
    "token_walk": True,
}
SWITCHES = {
    # 1 << 30: no weight has this many programs, so the wide-launch rule is off
    "decode-launch": {"old": (("matmul_triton", "DECODE_WIDE_PROGRAMS", 1 << 30),), "new": ()},
    "prefill-kernel": {
        side: (("attention_triton", "PREFILL_KERNEL", side),) for side in ("tiles", "tiles_mgpu")
    },
    # the Mosaic GPU prefill kernel's launch (tiles_mgpu arguments): one warpgroup, or two
    # consumers and a producer (one program per SM, q from shared memory or registers); tiles in
    # order or heaviest first; a wait per wgmma or one for p @ ones and p @ v; a tile's rows
    # packed with the query-head group padded to a power of two or not ("dense": groups of 3, 7)
    "prefill-launch": {
        side: (("attention_triton", "MGPU_PREFILL_LAUNCH", tuple(launch.items())),)
        for side, launch in (
            ("one", {"stages": 3, "consumers": 1, "order": "ascending", "one_drain": False}),
            ("heaviest", {"stages": 3, "consumers": 1, "order": "heaviest"}),
            ("drain", {"stages": 3, "consumers": 1, "one_drain": True}),
            ("pair", {"stages": 4, "consumers": 2}),
            ("pair-smem-q", {"stages": 4, "consumers": 2, "q_from_smem": True}),
            ("pair-all", {"stages": 4, "consumers": 2, "order": "heaviest", "one_drain": True}),
            ("dense", {"stages": 3, "consumers": 1, "packing": "dense"}),
            ("pair-dense", {"stages": 4, "consumers": 2, "packing": "dense"}),
            ("heaviest-dense", {"stages": 3, "consumers": 1, "order": "heaviest", "packing": "dense"}),
            (
                "pair-all-dense",
                {"stages": 4, "consumers": 2, "order": "heaviest", "one_drain": True, "packing": "dense"},
            ),
            (  # the split fold's accumulator in SMEM (session 41): one warpgroup, and the pair
                "heaviest-dense-fold",
                {"stages": 3, "consumers": 1, "order": "heaviest", "packing": "dense", "fold_in_smem": True},
            ),
            ("pair-all-dense-fold", {**PAIR3, "fold_in_smem": True}),
            ("pair-all-dense-fold-q", {**PAIR3, "fold_in_smem": True, "q_from_smem": True}),
            ("pair-all-dense-fold-persistent", {**PAIR3, "fold_in_smem": True, "persistent": True}),
            (
                "pair-all-dense-fold-persistent-prefetch-q",
                {**PAIR3, "fold_in_smem": True, "persistent": True, "prefetch_q": True},
            ),
            (  # q / the output copied a tile at a time, no XLA transposes (session 52)
                "direct-io",
                {**PAIR3, "fold_in_smem": True, "persistent": True, "prefetch_q": True, "direct_io": True},
            ),
            # ... and the walk tables from each token's first row (session 53)
            ("token-walk", TOKEN_WALK),
            # ... and the full tiles without selects (session 56)
            ("bare-full", {**TOKEN_WALK, "bare_full": True}),
            # ... and the masked tiles' lean key mask, the row sums' columns apart (session 57)
            ("lean-wide", {**TOKEN_WALK, "bare_full": True, "lean_mask": True, "wide_sum": True}),
            # ... with each item's order entry and walk length read an item ahead (written in
            # session 59; the engine's since session 60)
            (
                "early-reads",
                {**TOKEN_WALK, "bare_full": True, "lean_mask": True, "wide_sum": True, "early_reads": True},
            ),
        )
    },
    "decode-splits": {
        side: (("attention_triton", "STORE_USED_SPLITS_ONLY", value),)
        for side, value in (("all", False), ("used", True))
    },
    "decode-rows": {
        side: (("attention_triton", "DECODE_ROWS_IN_REGISTERS", value),)
        for side, value in (("hbm", False), ("registers", True))
    },
    "decode-lanes": {
        side: (("attention_triton", "DECODE_PROGRAMS", value),)
        for side, value in (("splits", None), ("lanes", 1024))
    },
    "decode-kernel": {
        side: (
            ("attention_triton", "DECODE_ROWS_IN_REGISTERS", rows),
            ("attention_triton", "DECODE_PROGRAMS", lanes),
        )
        for side, rows, lanes in (("old", False, None), ("new", True, 1024))
    },
    "matmul-shared": {
        side: (("matmul_triton", "SHARED_LAUNCH", value),)
        for side, value in (("each", False), ("shared", True))
    },
    # session 47's mid-M rule: the shared launch up to 64 rows over Mosaic launches, and gate,
    # up shared from 17 rows (``new``, the default) or neither (``old``)
    "shared-mid": {
        "old": (
            ("matmul_triton", "SHARED_OVER_MGPU_ROWS", 0),
            ("matmul_triton", "GATE_UP_SHARED_MIN_ROWS", 1 << 30),
        ),
        "new": (),
    },
    "fusions": {
        "off": (("matmul_norm", "FUSED", False), ("rope", "FUSED", False)),
        "on": (),
    },
    "decode-stages": {  # the decode kernel's stages: 2 everywhere, or 5 up to 16 tokens
        "two": (("attention_triton", "DECODE_FEW_TOKENS", 0),),
        "few": (("attention_triton", "DECODE_FEW_TOKENS", 16),),
    },
    # session 50's two decode-step changes together: both off (``old``) or both on (``new``)
    "s50": {
        "old": (("attention_triton", "DECODE_FEW_TOKENS", 0), ("mlp", "FUSED", False)),
        "new": (("attention_triton", "DECODE_FEW_TOKENS", 16), ("mlp", "FUSED", True)),
    },
    "swiglu": {  # gate, up and SiLU(gate) * up in one launch at decode rows, or 2 launches + XLA
        "xla": (("mlp", "FUSED", False),),
        "fused": (("mlp", "FUSED", True),),
    },
    # the fused gate/up launch up to 16 rows (``old``) or 64 (``new``, the default since session
    # 51: over the shared launch + XLA fusion at 17-32 rows and the Mosaic launches at 33-64)
    "swiglu-mid": {
        "old": (("mlp", "FUSED_MAX_ROWS", 16),),
        "new": (("mlp", "FUSED_MAX_ROWS", 64),),
    },
    "qkv-combine": {
        "xla": (("rope", "QKV_COMBINE_IN_KERNEL", False),),
        "kernel": (),
    },
    "step-programs": {
        "layers": ((None, "BIJAX_STEP_PROGRAMS", "layers"),),
        "whole": ((None, "BIJAX_STEP_PROGRAMS", "whole"),),
        # the chain, each layer with a loaded copy of its own of the layer program
        "copies": ((None, "BIJAX_STEP_PROGRAMS", "layers"), (None, "BIJAX_LAYER_COPIES", "1")),
        # the chain, the layer programs compiled without XLA's command buffers
        "nocmdbuf": ((None, "BIJAX_STEP_PROGRAMS", "layers"), (None, "BIJAX_LAYER_COMMAND_BUFFERS", "0")),
        # the chain for token buckets of 256 or more (prefill), one program for the others
        "from256": ((None, "BIJAX_STEP_PROGRAMS", "256"),),
        # ... with 4 layers a block program (11 programs a chain step, not 35)
        "from256x4": ((None, "BIJAX_STEP_PROGRAMS", "256"), (None, "BIJAX_LAYERS_PER_PROGRAM", "4")),
        # the chain everywhere, 4 layers a program
        "layersx4": ((None, "BIJAX_STEP_PROGRAMS", "layers"), (None, "BIJAX_LAYERS_PER_PROGRAM", "4")),
        # the 4-layer chain first, each bucket's whole forward compiled in the background (timed
        # after it is ready: the step the tiered engine settles on)
        "tieredx4": ((None, "BIJAX_STEP_PROGRAMS", "tiered"), (None, "BIJAX_LAYERS_PER_PROGRAM", "4")),
    },
}


def settings_set() -> set:
    """Every (module, attribute) some side of some switch sets (environment variables aside)."""
    return {
        (m, a)
        for sides in SWITCHES.values()
        for changes in sides.values()
        for m, a, _ in changes
        if m is not None
    }


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] not in SWITCHES or sys.argv[2] not in SWITCHES[sys.argv[1]]:
        sys.exit("usage: ab.py " + " | ".join(f"{k} {'|'.join(v)}" for k, v in SWITCHES.items()) + " [args]")
    switch, side, rest = sys.argv[1], sys.argv[2], sys.argv[3:]
    for module, attribute, value in SWITCHES[switch][side]:  # an empty side: as committed
        if module is None:
            os.environ[attribute] = value
        else:
            setattr(importlib.import_module(f"pallas_kernels.{module}"), attribute, value)
    print(f"# A/B {switch} = {side}", flush=True)
    if rest[:1] == ["--script"]:  # another benchmark under the switch, e.g. profile_step.py
        script, rest = rest[1], rest[2:]
        sys.argv = [script, *rest]
        runpy.run_path(f"benchmarks/{script}", run_name="__main__")
        sys.exit(0)
    default = ["--model", "llama3-8b", "--seqs", "1,64", "--output-len", "128", "--repeats", "3"]
    sys.argv = ["async_scheduling.py", *default, *rest]  # later arguments override the defaults
    runpy.run_path("benchmarks/async_scheduling.py", run_name="__main__")
