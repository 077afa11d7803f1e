"""The engine's single-stream step under XLA's command-buffer update modes (host time per step).

A step's forward is one XLA program whose kernels run as a CUDA graph (a command buffer). Its
inputs are new device buffers every step, so by default XLA updates the recorded graph on the
host every step before launching it: ``command_buffer::update`` took 1.56 ms of a traced
single-stream step on the H200's host (``profile_step.py --engine 1 --trace``, 2026-12-04),
next to ~5.0 ms of kernels. XLA's ``--xla_gpu_command_buffer_update_mode`` (SKIP_TEMP,
SKIP_PROFILED: allocations at fixed virtual addresses, so fewer updates) is meant to remove that.

Each mode runs in a fresh process (XLA reads its flags once): ``LLM.generate`` of one sequence
(64 prompt + 128 sampled tokens, seeded) after a warm-up run and the background compiles, then
five timed runs; the child prints the median ms per step and a digest of the token ids and
float32 logprob bits - the kernels are the same in every mode, so the digest must be too (the
parent checks). The KV pool is given (``--num-kv-blocks``): under those modes XLA allocates
through its VMM allocator, whose memory statistics read 0 bytes, so the pool cannot be sized
from them.

  PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/cmdbuf_modes.py [--modes default,SKIP_TEMP]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time

MODES = ("default", "SKIP_TEMP", "SKIP_PROFILED")


def child(a) -> None:
    import numpy as np

    import bijax

    llm = bijax.LLM(
        a.model,
        max_num_seqs=a.seqs,
        max_num_batched_tokens=max(512, 64 * a.seqs),
        num_kv_blocks=a.num_kv_blocks,
    )
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
    print("RESULT " + json.dumps(dict(ms_per_step=round(ms, 3), runs=runs, digest=h.hexdigest()[:16])))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--seqs", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--num-kv-blocks", type=int, default=4096)
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {', '.join(MODES)}")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a)
        return 0
    modes = a.modes.split(",")
    if any(m not in MODES for m in modes):
        ap.error(f"--modes takes {', '.join(MODES)}")
    rows = []
    for mode in modes:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if mode != "default":
            flag = f"--xla_gpu_command_buffer_update_mode={mode}"
            env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flag}".strip()
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
            print(f"{mode}: failed (exit {p.returncode}): {p.stderr[-1500:]}")
            rows.append((mode, None))
            continue
        r = json.loads(line.split(" ", 1)[1])
        print(f"{mode}: {r}")
        rows.append((mode, r))
    digests = {r["digest"] for _, r in rows if r is not None}
    print(f"\n{a.model}, {a.seqs} seq x (64 + {a.tokens}), median of 5 runs")
    print("| XLA command-buffer update mode | ms per step | tok/s | digest |")
    print("|---|---|---|---|")
    for mode, r in rows:
        if r is None:
            print(f"| {mode} | failed | - | - |")
        else:
            print(
                f"| {mode} | {r['ms_per_step']:.2f} | {a.seqs * 1e3 / r['ms_per_step']:.1f} | {r['digest']} |"
            )
    same = len(digests) <= 1
    print("same tokens and logprob bits in every mode:", same)
    return 0 if same and all(r is not None for _, r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
