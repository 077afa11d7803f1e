"""Do CPU bits depend on the CPU model? Runs probes natively and under `qemu-x86_64 -cpu MODEL`
(user-mode emulation: the emulated CPUID reports that model's features and cache sizes, so XLA
and YNNPACK pick their code for it) and compares bit hashes.

    PYTHONPATH=. python benchmarks/cpu_portability.py                 # probes, 4 models (~8 min)
    PYTHONPATH=. python benchmarks/cpu_portability.py --golden        # + golden digests (~10 min a model)

Needs `qemu-user` 10 or later (Debian bookworm-backports): QEMU 7.2 mis-emulates something on
the Intel Skylake-and-later models (the tiny digest changed and a probe segfaulted under 7.2;
the same runs under 10.0.2 match the host). QEMU's TCG emulates up to AVX2: the emulated
models run without AVX-512 whatever their name says - itself a second ISA next to the host's.

Probes, each compiled two ways - XLA's default (platform-dependent math: the negative control)
and the consistent math bijax sets - hashing the float32 bits: lax.rsqrt on 196608 values, a
[16, 1536] x [1536, 576] bf16 dot (YNNPACK), and pallas_kernels.rms_norm.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = ("Haswell-v4", "EPYC-Rome", "Skylake-Client-v4", "Cascadelake-Server-v5")


def probe() -> dict:
    """{probe@setting: hash} in this process."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax

    import pallas_kernels as pk

    def h(a):
        return hashlib.sha256(np.asarray(a, np.float32).view(np.uint32).tobytes()).hexdigest()[:16]

    rng = np.random.default_rng(0)
    pos = jnp.asarray(np.abs(rng.standard_normal((4, 49152))) + 1e-3, jnp.float32)
    x = jnp.asarray(rng.standard_normal((16, 1536)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((1536, 576)) * 0.05, jnp.bfloat16)
    g = jnp.ones((1536,), jnp.float32)
    xf = x.astype(jnp.float32)
    fns = {
        "rsqrt": (lax.rsqrt, (pos,)),
        "dot_bf16": (lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32), (x, w)),
        "rms_norm": (lambda a, b: pk.rms_norm(a, b, eps=1e-5, backend="jnp"), (xf, g)),
    }
    out = {}
    for setting, consistent in (("platform", False), ("consistent", True)):
        opts = {"xla_cpu_enable_platform_dependent_math": not consistent}
        for name, (fn, args) in fns.items():
            out[f"{name}@{setting}"] = h(jax.jit(fn, compiler_options=opts)(*args))
    return out


def _run(cmd: list[str], timeout: int) -> str:
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu", BIJAX_COMPILATION_CACHE="0")
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=timeout)
    if r.returncode:
        raise RuntimeError(f"{' '.join(cmd[:4])}... failed: {r.stderr[-2000:]}")
    return r.stdout.strip().splitlines()[-1]


def main():
    p = argparse.ArgumentParser(description="CPU bits across CPU models (native and qemu-x86_64)")
    p.add_argument("--models", nargs="*", default=list(MODELS))
    p.add_argument("--golden", action="store_true", help="also the golden digests (slow under qemu)")
    p.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.probe:
        print(json.dumps(probe()))
        return
    if not shutil.which("qemu-x86_64"):
        sys.exit("qemu-x86_64 not found: apt-get install qemu-user")
    runs = {"native": []} | {m: ["qemu-x86_64", "-cpu", m] for m in args.models}
    table = {}
    for name, prefix in runs.items():
        table[name] = json.loads(_run([*prefix, sys.executable, __file__, "--probe"], 1800))
        if args.golden:
            golden = json.loads(_run([*prefix, sys.executable, "-m", "tests.bijax.golden", "--json"], 3600))
            table[name] |= {f"golden {k}": v[:16] for k, v in golden.items()}
        print(f"{name}: done", file=sys.stderr, flush=True)
    keys = list(table["native"])
    print("| value | " + " | ".join(runs) + " | same everywhere |")
    print("|---|" + "---|" * (len(runs) + 1))
    for k in keys:
        vals = [table[n].get(k, "-") for n in runs]
        print(f"| {k} | " + " | ".join(vals) + f" | {'yes' if len(set(vals)) == 1 else 'NO'} |")


if __name__ == "__main__":
    main()
