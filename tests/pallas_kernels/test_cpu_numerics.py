"""CPU bits must not depend on the CPU model: XLA compiles CPU code with consistent math.

Importing pallas_kernels sets ``--xla_cpu_enable_platform_dependent_math=false`` before JAX
starts a backend; an engine on a CPU whose process runs without it is refused.
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import numpy as np
from jax import lax

import pallas_kernels as pk
from tests.conftest import bits

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_this_process_compiles_cpu_code_with_consistent_math():
    assert pk.CPU_CONSISTENT_MATH in os.environ["XLA_FLAGS"]
    assert pk.cpu_math_is_consistent()


def test_the_probe_runs_when_first_asked_inside_a_jit():
    """A trainer's first bijax call is often inside its jitted step: the probe must run there
    too (its own jits were staged into the caller's trace: a TracerArrayConversionError)."""
    pk.runtime.cpu_math_is_consistent.cache_clear()
    out = jax.jit(lambda x: x + pk.cpu_math_is_consistent())(np.float32(1.0))
    assert float(out) == 2.0 and pk.cpu_math_is_consistent()


def test_the_probe_tells_the_two_settings_apart():
    """Negative control for the probe: rsqrt compiled with platform-dependent math differs from
    the consistent build on this CPU (XLA then uses the CPU's approximate rsqrt)."""
    x = np.linspace(1e-3, 7.0, 4096, dtype=np.float32)
    platform_math = jax.jit(lax.rsqrt, compiler_options={"xla_cpu_enable_platform_dependent_math": True})
    assert not np.array_equal(bits(platform_math(x)), bits(jax.jit(lax.rsqrt)(x)))


def test_an_engine_is_refused_when_jax_started_before_bijax():
    """JAX reads XLA_FLAGS once, when its first backend starts: a process that ran JAX before
    importing bijax has platform-dependent CPU math, and a CPU engine there is a clear error."""
    code = (
        "import jax; jax.numpy.ones(3).block_until_ready()\n"
        "import bijax\n"
        "import pallas_kernels as pk\n"
        "print('consistent', pk.cpu_math_is_consistent())\n"
        "try:\n"
        "    bijax.LLM('tiny', max_model_len=64, num_kv_blocks=8)\n"
        "except RuntimeError as e:\n"
        "    print('refused:', e)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env | {"PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu", "BIJAX_COMPILATION_CACHE": "0"},
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr
    assert "consistent False" in out.stdout
    assert "refused: bijax: XLA's CPU compiler in this process uses platform-dependent math" in out.stdout
    assert "Import bijax (or pallas_kernels) before JAX runs anything" in out.stdout
