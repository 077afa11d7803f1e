"""The engine's single-stream step under XLA's command-buffer update modes, with the step's
inputs staged in the same device buffers every step or not (host time per step).

A step's forward is one XLA program whose kernels run as a CUDA graph (a command buffer). XLA
re-records the graph on the host before a run whenever one of the program's buffers moved since
the last run: ``command_buffer::update`` took 1.56 ms of a traced single-stream step on the
H200's host (``profile_step.py --engine 1 --trace``, 2026-12-04), next to ~5.0 ms of kernels.
Two things move: the step's inputs (new device buffers every step, unless the runner copies
them into the same ones: ``ModelRunner._staged``, on with ``BIJAX_STAGED_INPUTS=1``, off by
default since 2026-12-05) and XLA's
scratch buffer (kept at fixed virtual addresses by ``--xla_gpu_command_buffer_update_mode=
SKIP_TEMP``, which bijax asks for on import with ``BIJAX_STAGED_INPUTS=1`` only, since
session 42). Each variant here names its mode in XLA_FLAGS itself.

Each variant runs in a fresh process (XLA reads its flags once): ``LLM.generate`` of one
sequence (64 prompt + 128 sampled tokens, seeded) after a warm-up run and the background
compiles, then five timed runs; the child prints the median ms per step, the KV pool it was
given and a digest of the token ids and float32 logprob bits - the kernels are the same in every
variant, so the digest must be too (the parent checks). ``--num-kv-blocks 0`` sizes the pool
from ``gpu_memory_utilization`` (under SKIP_TEMP XLA's VMM allocator keeps no statistics: the
engine then asks the CUDA driver).

  PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/cmdbuf_modes.py \
      [--variants ALWAYS_UPDATE:unstaged,ALWAYS_UPDATE,SKIP_TEMP:unstaged,SKIP_TEMP]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time

MODES = ("ALWAYS_UPDATE", "SKIP_TEMP", "SKIP_PROFILED")
VARIANTS = ("ALWAYS_UPDATE:unstaged", "ALWAYS_UPDATE", "SKIP_TEMP:unstaged", "SKIP_TEMP")


def child(a) -> None:
    import jax
    import numpy as np

    import bijax

    llm = bijax.LLM(
        a.model,
        max_num_seqs=a.seqs,
        max_num_batched_tokens=max(512, 64 * a.seqs),
        num_kv_blocks=a.num_kv_blocks or None,
    )
    stats = jax.devices()[0].memory_stats() or {}
    prompts = [{"prompt_token_ids": [10 + (i + j) % 50 for j in range(64)]} for i in range(a.seqs)]
    sp = bijax.SamplingParams(temperature=0.8, seed=1, max_tokens=a.tokens, ignore_eos=True)
    llm.warmup(progress=False, max_step_tokens=64 * a.seqs)
    llm.generate(prompts, sp, use_tqdm=False)
    llm.wait_for_upgrades()
    runs, out = [], None
    for _ in range(5):
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        out = llm.generate(prompts, sp, use_tqdm=False)
        runs.append(time.perf_counter() - t0)
    h = hashlib.sha256()
    for o in out:
        h.update(np.asarray(o.outputs[0].token_ids, np.int32).tobytes())
        h.update(np.asarray(o.outputs[0].logprobs, np.float32).view(np.uint32).tobytes())
    ms = sorted(runs)[len(runs) // 2] / a.tokens * 1e3
    kv = llm.engine.config.num_kv_blocks
    print(
        "RESULT "
        + json.dumps(dict(ms_per_step=round(ms, 3), runs=runs, digest=h.hexdigest()[:16], kv_blocks=kv))
    )
    print("memory statistics:", {k: v for k, v in stats.items() if k in ("bytes_limit", "bytes_in_use")})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--seqs", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--num-kv-blocks", type=int, default=4096, help="0: sized from gpu_memory_utilization")
    ap.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"comma-separated MODE or MODE:unstaged, MODE one of {', '.join(MODES)}",
    )
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a)
        return 0
    variants = a.variants.split(",")
    if any(v.split(":")[0] not in MODES or v.split(":")[1:] not in ([], ["unstaged"]) for v in variants):
        ap.error(f"--variants takes MODE or MODE:unstaged, MODE one of {', '.join(MODES)}")
    rows = []
    for variant in variants:
        mode = variant.split(":")[0]
        env = dict(os.environ, PYTHONUNBUFFERED="1", BIJAX_STAGED_INPUTS="0" if ":" in variant else "1")
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_gpu_command_buffer_update_mode={mode}".strip()
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--child",
            "--model",
            a.model,
            "--seqs",
            str(a.seqs),
        ]
        cmd += ["--tokens", str(a.tokens), "--num-kv-blocks", str(a.num_kv_blocks)]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True)
        line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if p.returncode != 0 or line is None:
            print(f"{variant}: failed (exit {p.returncode}): {p.stderr[-1500:]}")
            rows.append((variant, None))
            continue
        r = json.loads(line.split(" ", 1)[1])
        print(f"{variant}: {r}")
        print(next((ln for ln in p.stdout.splitlines() if ln.startswith("memory statistics")), ""))
        rows.append((variant, r))
    digests = {r["digest"] for _, r in rows if r is not None}
    print(f"\n{a.model}, {a.seqs} seq x (64 + {a.tokens}), median of 5 runs")
    print("| XLA command-buffer update mode : inputs | ms per step | tok/s | KV blocks | digest |")
    print("|---|---|---|---|---|")
    for variant, r in rows:
        name = variant if ":" in variant else f"{variant}:staged"
        if r is None:
            print(f"| {name} | failed | - | - | - |")
        else:
            tok_s = a.seqs * 1e3 / r["ms_per_step"]
            print(f"| {name} | {r['ms_per_step']:.2f} | {tok_s:.1f} | {r['kv_blocks']} | {r['digest']} |")
    same = len(digests) <= 1
    print("same tokens and logprob bits in every variant:", same)
    return 0 if same and all(r is not None for _, r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
