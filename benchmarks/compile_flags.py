"""Where one forward program's XLA compile time goes, and which compiler options shorten it -
the start-up issue's next question after ``compile_scaling.py`` (H200, 2026-12-02: a 32-layer
program compiles in 5.3 s (64 x 64) and 10.2 s (16 x 2048), ~0.11 and ~0.19 s of it per layer).

For each bucket: the engine's forward program traced and lowered once, then compiled once per
variant of XLA compiler options (the persistent cache off: every compile is real), in the order
given, the baseline first and last (drift). The baseline's first compile runs with XLA's phase
timers logged (``TF_CPP_VMODULE``); the slowest phases are printed. An option that shortens the
compile is only a candidate: compiled code may differ, so it needs the bit checks
(``gpu_digests.py``) and the decode step time before it is used.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/compile_flags.py [--model llama3-8b]
``--smoke``: the ``tiny`` preset on CPU with the CPU-valid options (a check of the script).
"""

from __future__ import annotations

import os
import re
import sys
import tempfile

os.environ["BIJAX_COMPILATION_CACHE"] = "0"  # every compile here must be real
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "0")
os.environ.setdefault("TF_CPP_VMODULE", "gpu_compiler=1,nvptx_compiler=1,compile_module_to_llvm_ir=1")
# XLA logs to the process's stderr (fd 2): keep it in a file, read back after each compile
_LOG = tempfile.NamedTemporaryFile(prefix="xla-", suffix=".log", delete=False)
_saved_stderr = os.dup(2)
os.dup2(_LOG.fileno(), 2)

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import bijax  # noqa: E402
from models.configs import preset  # noqa: E402
from models.llama import Llama  # noqa: E402

GPU_VARIANTS = {
    "baseline": {},
    "llvm-parallel": {"xla_gpu_enable_llvm_module_compilation_parallelism": True},
    "parallelism-16": {
        "xla_gpu_enable_llvm_module_compilation_parallelism": True,
        "xla_gpu_force_compilation_parallelism": 16,
    },
    "no-expensive-llvm": {"xla_llvm_disable_expensive_passes": True},
    "autotune-0": {"xla_gpu_autotune_level": 0},
    "no-command-buffer": {"xla_gpu_enable_command_buffer": ""},
    "baseline-again": {"xla_embed_ir_in_executable": False},  # (its default: a no-op that misses JAX's cache)
}
CPU_VARIANTS = {
    "baseline": {},
    "no-expensive-llvm": {"xla_llvm_disable_expensive_passes": True},
    "baseline-again": {"xla_embed_ir_in_executable": False},
}
_TIMER = re.compile(r"\] (.*?): ([0-9.]+) (s|ms|us)\b")


def _log_since(offset: int) -> tuple[str, int]:
    with open(_LOG.name, "rb") as f:
        f.seek(offset)
        data = f.read()
    return data.decode(errors="replace"), offset + len(data)


def _slowest(text: str, n: int = 14) -> list[tuple[float, str]]:
    scale = {"s": 1.0, "ms": 1e-3, "us": 1e-6}
    found = [(float(v) * scale[u], label.strip()[:110]) for label, v, u in _TIMER.findall(text)]
    return sorted(found, reverse=True)[:n]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--buckets", default="16x2048,64x64", help="comma-separated SEQSxTOKENS forward buckets")
    ap.add_argument("--variants", default=None, help="comma-separated names (default: all)")
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    out = os.fdopen(os.dup(1), "w", buffering=1)
    name = "tiny" if a.smoke else a.model
    variants = CPU_VARIANTS if a.smoke else GPU_VARIANTS
    if a.variants:
        variants = {k: variants[k] for k in a.variants.split(",")}
    buckets = [tuple(int(v) for v in b.split("x")) for b in a.buckets.split(",")]
    if a.smoke:
        buckets = [(1, 16)]
    print(
        f"# {datetime.date.today()} {jax.devices()[0].device_kind} jax {jax.__version__} model {name}",
        file=out,
    )
    cfg = preset(name)
    model = Llama(dataclasses.replace(cfg), dtype=jnp.bfloat16, seed=0)
    s_max, t_max = max(s for s, _ in buckets), max(t for _, t in buckets)
    llm = bijax.LLM(model, max_num_seqs=s_max, max_num_batched_tokens=t_max, max_model_len=max(t_max, 1024))
    runner = llm.engine.runner
    rows = []
    offset = 0
    for s, t in buckets:
        fn, args, kw, _, _ = runner._spec(("forward", s, t, s))
        t0 = time.perf_counter()
        lowered = fn.lower(*args, **kw)
        print(f"{s} x {t}: traced and lowered in {time.perf_counter() - t0:.2f} s", file=out)
        _, offset = _log_since(offset)
        for i, (label, opts) in enumerate(variants.items()):
            t0 = time.perf_counter()
            try:
                lowered.compile(compiler_options=dict(opts))  # {} too: a fresh compile
                took, status = time.perf_counter() - t0, "ok"
            except Exception as e:  # an option this XLA does not know: say so, go on
                took, status = float("nan"), f"{type(e).__name__}: {str(e).splitlines()[0][:90]}"
            text, offset = _log_since(offset)
            rows.append((f"{s} x {t}", label, took, status))
            print(f"{s} x {t} {label}: {took:.2f} s {status}", file=out)
            if i == 0:
                print(
                    f"  slowest timed phases of the first compile ({len(text.splitlines())} log lines):",
                    file=out,
                )
                for sec, phase in _slowest(text):
                    print(f"    {sec:8.3f} s  {phase}", file=out)
    print("\n| bucket | options | compile s | status |\n|---|---|---|---|", file=out)
    for b, label, took, status in rows:
        print(f"| {b} | {label} | {took:.2f} | {status} |", file=out)
    return 0


if __name__ == "__main__":
    try:
        code = main()
    finally:  # stderr back (a traceback or argparse's error must be seen), the XLA log removed
        os.dup2(_saved_stderr, 2)
        os.unlink(_LOG.name)
    sys.exit(code)
