"""Start-up time on the GPU, each measure a fresh process (the start-up issue's targets):

  engine   ``LLM(model, max_num_seqs=64, max_num_batched_tokens=2048).warmup()`` on an empty
           persistent compile cache without and with helper processes lowering the steps
           (``bijax.parallel_lowering``; ``BIJAX_LOWERING_PROCESSES=0``, then the default), then
           again in a third process from the filled cache, and on another empty cache with
           the helpers also compiling (``BIJAX_LOWERING_COMPILE=1``); ``engine-whole`` /
           ``engine-layers``: the forward as one program / a chain (``BIJAX_STEP_PROGRAMS``);
  single   one request's first token - ``LLM`` sized as ``bijax generate`` sizes it for one
           prompt (1 sequence, 512 tokens per step), warmed up as it warms up: since 2026-12-06
           (session 49) ``warmup(step_tokens=[prompt])`` on GPUs - decoding runs in the
           prompt's bucket while its own compiles in the background - and
           ``step_tokens=[prompt, 1]`` (row ``single-decode``) where steps wait on compiles
           (from 2026-12-02 session 26; ``max_step_tokens=prompt`` before: one more bucket), then
           ``generate`` of 1 token - on an empty cache, then from the filled cache, timed from
           the process's start.
Each also checks that its warmed-up steps (exported - by a helper or not - or read back from
the cache) give the bits of steps jitted as they come (seeded sampling, 8 tokens; 4 prompts for
the engine).

Each child prints its phases (import, model build, warm-up with compiled / loaded counts, the
first generate); the parent prints the wall time of each process and a table last.

  PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/startup.py [--model llama3-8b]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

T_START = time.perf_counter()


def child(kind: str, model: str) -> None:
    t = {}
    import jax

    import bijax

    jax.devices()
    t["import"] = time.perf_counter() - T_START
    t0 = time.perf_counter()
    if kind == "engine":
        llm = bijax.LLM(model, max_num_seqs=64, max_num_batched_tokens=2048)
    else:
        llm = bijax.LLM(model, max_num_seqs=1, max_num_batched_tokens=512)
    t["load"] = time.perf_counter() - t0
    prompt = list(range(10, 74))  # 64 ids inside any vocabulary
    t0 = time.perf_counter()
    if kind == "engine":
        llm.warmup(progress=False)
    elif kind == "single":  # as ``bijax generate`` warms up for one prompt: its chunk's bucket,
        # and decoding's where a step would wait on its compile (not on GPUs since 2026-12-06:
        # decoding runs in the prompt's bucket while its own compiles in the background)
        decode = [] if llm.engine.compiles_in_background else [1]
        llm.warmup(progress=False, step_tokens=[len(prompt), *decode])
    else:  # "single-decode": both (``bijax generate`` until 2026-12-06)
        llm.warmup(progress=False, step_tokens=[len(prompt), 1])
    t["warmup"] = time.perf_counter() - t0
    r = llm.last_warmup
    t0 = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], bijax.SamplingParams(max_tokens=1), use_tqdm=False)
    t["generate"] = time.perf_counter() - t0
    assert len(out[0].outputs[0].token_ids) == 1
    t["total"] = time.perf_counter() - T_START
    # BIJAX_STEP_PROGRAMS=tiered: the whole forwards compiling in the background since warm-up;
    # "full" is when the last was ready, from the process's start
    t["background"] = llm.engine.pending_upgrades()
    llm.wait_for_upgrades()
    t["full"] = time.perf_counter() - T_START
    # What a later start finds: the cache as this start leaves it, before the check below
    # (whose steps, traced with the step cache off, are no start's) adds to it.
    if os.environ.get("STARTUP_SNAPSHOT"):
        import shutil

        shutil.copytree(os.environ["BIJAX_CACHE_DIR"], os.environ["STARTUP_SNAPSHOT"])
    # Same bits from the warmed-up steps (exported, then compiled) as from steps lowered from
    # tracing as they come: run 8 seeded tokens, then drop the compiled steps and turn exporting
    # off (private doors, for this check only) and run them again.
    import numpy as np

    from bijax import model_runner, step_cache

    sp = bijax.SamplingParams(max_tokens=8, temperature=0.8, seed=1)
    prompts = [{"prompt_token_ids": prompt[: 64 - 7 * i]} for i in range(4 if kind == "engine" else 1)]
    a = [o.outputs[0] for o in llm.generate(prompts, sp, use_tqdm=False)]
    # (tiered: ``a`` ran the whole forwards; ``b`` runs the chain, as nothing is queued again)
    llm.engine.runner._aot.clear()
    llm.engine.runner._copies.clear()  # (BIJAX_LAYER_COPIES: copies of the dropped programs)
    model_runner._shared.clear()
    step_cache.directory = lambda: None
    llm.reset_prefix_cache()
    b = [o.outputs[0] for o in llm.generate(prompts, sp, use_tqdm=False)]
    bits = lambda o: np.asarray(o.logprobs, np.float32).view(np.uint32)  # noqa: E731
    t["aot_vs_jit_same_bits"] = all(
        x.token_ids == y.token_ids and np.array_equal(bits(x), bits(y)) for x, y in zip(a, b, strict=True)
    )
    print(
        "RESULT "
        + json.dumps(
            {
                **t,
                "compiled": r.compiled,
                "loaded": r.loaded_from_cache,
                "buckets": r.num_programs,
                "tracing": r.tracing_seconds,
                "helpers": r.lowered_in_helpers,
            }
        )
    )


def run_child(kind: str, model: str, cache: str, env_extra: dict, snapshot: str | None = None) -> dict:
    """One start in a fresh process on ``cache``, with ``env_extra`` set; ``snapshot``: where
    the child copies the cache as its start leaves it (for a filled-cache row)."""
    env = dict(os.environ, BIJAX_CACHE_DIR=cache, PYTHONUNBUFFERED="1", **env_extra)
    if snapshot:
        env["STARTUP_SNAPSHOT"] = snapshot
    t0 = time.perf_counter()
    p = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", kind, "--model", model],
        env=env,
        text=True,
        capture_output=True,
    )
    wall = time.perf_counter() - t0
    sys.stdout.write(p.stdout[-3000:])
    if p.returncode:
        sys.stdout.write(p.stderr[-3000:])
        raise SystemExit(f"child {kind} failed with exit {p.returncode}")
    line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return {**json.loads(line[len("RESULT ") :]), "wall": wall}


_NO_HELPERS = {"BIJAX_LOWERING_PROCESSES": "0"}
_WHOLE = {"BIJAX_STEP_PROGRAMS": "whole"}  # the forward as one program (the GPU default until 2026-12-04)
_LAYERS = {"BIJAX_STEP_PROGRAMS": "layers"}  # the forward as a chain of programs (the CPU's default)
_LAYERS4 = {"BIJAX_STEP_PROGRAMS": "layers", "BIJAX_LAYERS_PER_PROGRAM": "4"}  # ... 4 layers a program
# ... that first, the whole forwards compiled in the background and run from when each is ready
_TIERED4 = {"BIJAX_STEP_PROGRAMS": "tiered", "BIJAX_LAYERS_PER_PROGRAM": "4"}
# --rows name -> (label, child kind, environment). Each row runs on an empty compile cache of its
# own; a filled row reuses the cache as its empty row's start left it (copied before the bits
# check, whose steps are traced with the step cache off).
ROWS = {
    "engine-no-helpers": ("64 seqs x 2048 tokens, empty cache, no helper processes", "engine", _NO_HELPERS),
    "engine": ("64 seqs x 2048 tokens, empty cache", "engine", {}),
    "engine-filled": ("64 seqs x 2048 tokens, filled cache", "engine", {}),
    "engine-helpers-compile": (
        "64 seqs x 2048 tokens, empty cache, helpers also compile",
        "engine",
        {"BIJAX_LOWERING_COMPILE": "1"},
    ),
    "engine-whole": ("64 seqs x 2048 tokens, empty cache, the forward as one program", "engine", _WHOLE),
    "engine-layers": ("64 seqs x 2048 tokens, empty cache, the forward as a chain", "engine", _LAYERS),
    "engine-from256": (
        "64 seqs x 2048 tokens, empty cache, the chain for token buckets of 256 or more",
        "engine",
        {"BIJAX_STEP_PROGRAMS": "256"},
    ),
    "engine-from256x4": (
        "64 seqs x 2048 tokens, empty cache, the chain of 4 layers a program for token buckets of 256 or more",
        "engine",
        {"BIJAX_STEP_PROGRAMS": "256", "BIJAX_LAYERS_PER_PROGRAM": "4"},
    ),
    "single": ("one request, first token, empty cache", "single", {}),
    "single-filled": ("one request, first token, filled cache", "single", {}),
    "single-decode": (
        "one request, first token, empty cache, the prompt's and decoding's buckets warmed up",
        "single-decode",
        {},
    ),
    "single-no-helpers": (
        "one request, first token, empty cache, no helper processes",
        "single",
        _NO_HELPERS,
    ),
    "single-helper": (
        "one request, first token, empty cache, a helper for 2 programs too",
        "single",
        {"BIJAX_LOWERING_MIN_PROGRAMS": "2"},
    ),
    "single-whole": ("one request, first token, empty cache, the forward as one program", "single", _WHOLE),
    "single-layers": ("one request, first token, empty cache, the forward as a chain", "single", _LAYERS),
    "engine-layersx4": (
        "64 seqs x 2048 tokens, empty cache, the forward as a chain of 4 layers a program",
        "engine",
        _LAYERS4,
    ),
    "single-layersx4": (
        "one request, first token, empty cache, the forward as a chain of 4 layers a program",
        "single",
        _LAYERS4,
    ),
    "engine-tieredx4": (
        "64 seqs x 2048 tokens, empty cache, tiered (4-layer chain first)",
        "engine",
        _TIERED4,
    ),
    "engine-tieredx4-filled": ("64 seqs x 2048 tokens, filled cache, tiered", "engine", _TIERED4),
    "single-tieredx4": (
        "one request, first token, empty cache, tiered (4-layer chain first)",
        "single",
        _TIERED4,
    ),
    "single-tieredx4-filled": ("one request, first token, filled cache, tiered", "single", _TIERED4),
}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--child", choices=("engine", "single", "single-decode"))
    ap.add_argument(
        "--rows",
        default=",".join(ROWS),
        help=f"comma-separated subset of {', '.join(ROWS)} (a filled-cache row follows its empty one)",
    )
    a = ap.parse_args()
    rows_wanted = a.rows.split(",")
    if any(r not in ROWS for r in rows_wanted):
        ap.error(f"--rows takes {', '.join(ROWS)}")
    for i, r in enumerate(rows_wanted):  # a filled-cache row reads what its empty row compiled
        if r.endswith("-filled") and r[: -len("-filled")] not in rows_wanted[:i]:
            ap.error(f"--rows: {r} needs {r[: -len('-filled')]} before it")
    if a.child:
        child(a.child, a.model)
        return 0
    import datetime

    print(
        f"# benchmarks/startup.py --model {a.model} {datetime.date.today()}, {os.cpu_count()} CPU cores",
        flush=True,
    )
    rows = []
    with tempfile.TemporaryDirectory() as base:
        last = {}  # row -> the cache of its last run
        for i, row in enumerate(rows_wanted):
            name, kind, env = ROWS[row]
            snapshot = None
            if row.endswith("-filled"):
                cache = last[row[: -len("-filled")]]
                if not os.path.isdir(cache):
                    raise SystemExit(f"{row}: its empty row left no copy of its cache ({cache})")
            else:
                cache = os.path.join(base, f"{i}-{row}")
                os.makedirs(cache)
                if f"{row}-filled" in rows_wanted:
                    snapshot = last[row] = cache + "-left"
            r = run_child(kind, a.model, cache, env, snapshot)
            print(name, json.dumps(r), flush=True)
            rows.append((name, r))
    for name, r in rows:
        print(f"{name}: warmed-up vs jitted steps, same tokens and logprob bits:", r["aot_vs_jit_same_bits"])
    print(
        "\n| start | process wall s | import s | model s | warm-up s (programs: compiled / loaded;"
        " lowered by helpers) | of it tracing s | first generate s | whole forwards ready s (in background) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, r in rows:
        print(
            f"| {name} | {r['wall']:.1f} | {r['import']:.1f} | {r['load']:.1f} | "
            f"{r['warmup']:.1f} ({r['buckets']}: {r['compiled']} / {r['loaded']}; {r['helpers']}) "
            f"| {r['tracing']:.1f} | {r['generate']:.2f} | "
            + (f"{r['full']:.1f} ({r['background']}) |" if r.get("background") else "- |")
        )
    return 0 if all(r["aot_vs_jit_same_bits"] for _, r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
