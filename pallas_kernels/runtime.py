"""Which implementation of an op runs on which device.

Every public op takes ``backend`` as a keyword-only static argument:

* ``"auto"`` - decided when the computation is lowered, per platform, with
  ``jax.lax.platform_dependent``: CPU gets the fixed-shape jnp formulation, CUDA
  the Pallas kernel (Triton lowering). Because the choice is made at lowering
  time, a CPU machine can export the CUDA lowering (see ``cuda_export``).
* ``"jnp"`` - the fixed-shape jnp formulation (any platform; invariant on CPU).
* ``"triton"`` - the Pallas kernel with the Triton lowering; with
  ``interpret=True`` it runs on CPU in Pallas interpret mode (small shapes only).

There is no silent fallback: a platform with no invariant implementation
raises at lowering time instead of running XLA's own (batch-variant) op.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax import lax

from pallas_kernels.plan import H200_SMS

BACKENDS = ("auto", "jnp", "triton")

# --------------------------------------------------------------------------- CPU numerics
#
# By default XLA's CPU compiler may pick code by the CPU it runs on ("platform dependent
# math"): rsqrt through the CPU's approximate instruction plus a Newton step, and YNNPACK dot
# kernels chosen by ISA, whose block sizes decide where a dot's K reduction is cut. Measured on
# one build (jaxlib 0.11.2): lax.rsqrt gave different bits on AVX-512 Zen 4, AVX2 Haswell and
# AVX2 Zen 2 (the last two under qemu-x86_64), and the `tiny` preset's digest differed between
# the first two. With this flag off, XLA asks YNNPACK for consistent arithmetic (kernels and
# tiling independent of the hardware) and uses its own math: the same build gives the same bits
# on any x86-64 with AVX2+FMA (benchmarks/RESULTS.md, "CPU numerics"). XLA reads XLA_FLAGS once,
# when JAX starts its first backend, so it is set here, on import, before anything runs.
CPU_CONSISTENT_MATH = "--xla_cpu_enable_platform_dependent_math=false"
_CPU_MATH_FLAG = CPU_CONSISTENT_MATH.split("=")[0]


# --------------------------------------------------------------------------- JAX settings
#
# Some of JAX's global settings change what a traced function computes, not only how it is
# checked: the PRNG (``jax_default_prng_impl``, ``jax_threefry_partitionable``) decides the
# sampler's Gumbel noise and a preset's random weights; ``jax_default_matmul_precision`` an XLA
# dot's passes on GPU; ``jax_disable_jit`` runs a program op by op, which XLA rounds otherwise
# (unfused RoPE and log-softmax: other last bits); ``jax_numpy_rank_promotion="raise"`` and
# ``jax_legacy_prng_key="error"`` refuse code that is correct under JAX's defaults. bijax's bits
# are defined under JAX's defaults, so everything it traces, lowers or runs op by op does so
# under them, whatever a caller set (found by a probe: a trainer's ``threefry_partitionable=
# False`` gave other sampled tokens and other preset weights, silently).
_PINNED = (
    (jax.disable_jit, False),
    (jax.threefry_partitionable, True),
    (jax.default_prng_impl, "threefry2x32"),
    (jax.legacy_prng_key, "allow"),
    (jax.default_matmul_precision, None),
    (jax.numpy_rank_promotion, "allow"),
    (jax.numpy_dtype_promotion, "standard"),
)


@contextlib.contextmanager
def pinned_config():
    """JAX's default values of the settings that change what bijax's programs compute (above),
    for this thread, inside the block. Config contexts are per thread: each thread that traces
    enters it (``step_cache`` and the other entry points do)."""
    with contextlib.ExitStack() as stack:
        for setting, value in _PINNED:
            stack.enter_context(setting(value))
        yield


def pinned(fn: Callable) -> Callable:
    """``fn`` run under ``pinned_config`` (a decorator; keeps ``fn``'s name)."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        with pinned_config():
            return fn(*args, **kwargs)

    return call


# Set in the environment of a process that must run with XLA_FLAGS exactly as given (bijax's
# lowering helpers: their program names include XLA_FLAGS, and must equal their parent's, whose
# own requests may have been refused because its backend had started before bijax was imported).
KEEP_XLA_FLAGS = "_BIJAX_KEEP_XLA_FLAGS"


def xla_flag_named(flag: str) -> bool:
    """Whether XLA_FLAGS names ``flag``'s ``--name`` (any value): exactly that name, not a longer
    flag that starts with it."""
    name = flag.split("=")[0]
    return any(f.split("=")[0] == name for f in os.environ.get("XLA_FLAGS", "").split())


def request_xla_flag(flag: str) -> bool:
    """Adds ``flag`` (``--name=value``) to XLA_FLAGS unless the user set ``--name`` (the user
    chose), a backend already started (XLA read its flags then) or the environment says to keep
    XLA_FLAGS as given (``KEEP_XLA_FLAGS``). Returns whether it was added."""
    if os.environ.get(KEEP_XLA_FLAGS) or xla_flag_named(flag):
        return False
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        return False
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
    return True


request_xla_flag(CPU_CONSISTENT_MATH)  # cpu_math_is_consistent() tells whether it took effect


@functools.cache
@pinned
def cpu_math_is_consistent() -> bool:
    """Whether this process compiles CPU code with the consistent-math setting: a probe (rsqrt of
    4096 values, whose platform-dependent form differs from the consistent one in ~1 of 3 values
    on every CPU measured) compiled with the process defaults must equal the same probe compiled
    with the setting forced on."""
    cpu = jax.local_devices(backend="cpu")[0]  # this process's own (several processes under TP)
    forced = {_CPU_MATH_FLAG.lstrip("-"): False}
    # (run now even when first asked inside a caller's jit: there the probe's jits would be
    # staged into the caller's program and give tracers)
    with jax.ensure_compile_time_eval():
        x = jax.device_put(np.linspace(1e-3, 7.0, 4096, dtype=np.float32), cpu)
        default = np.asarray(jax.jit(lax.rsqrt)(x))
        consistent = np.asarray(jax.jit(lax.rsqrt, compiler_options=forced)(x))
    return bool(np.array_equal(default.view(np.uint32), consistent.view(np.uint32)))


def require_consistent_cpu_math() -> None:
    """Raises RuntimeError when CPU code in this process would take CPU-model-dependent bits."""
    if cpu_math_is_consistent():
        return
    raise RuntimeError(
        "bijax: XLA's CPU compiler in this process uses platform-dependent math, so CPU results "
        "would depend on the CPU model. Import bijax (or pallas_kernels) before JAX runs anything, "
        f"or start Python with XLA_FLAGS='{CPU_CONSISTENT_MATH}' (and do not set that flag to true)."
    )


# --------------------------------------------------------------------------- lowering speed
#
# MLIR's Python bindings look up a dialect's Python module by its name under their search
# prefixes (jaxlib.mlir.dialects, jaxlib.mosaic.python, ...) whenever they hand back a value of
# that dialect, and cache only a module they found. JAX keeps the Triton dialect's module at
# jaxlib.triton.dialect, which no prefix reaches, so every "tt" value built while lowering a
# Pallas Triton kernel was three failed imports through sys.path (1,734 in a 4-layer llama3-8b
# decode program's export). Naming the module where MLIR looks first ends the misses; the
# module is the one JAX's lowering imports (already loaded with jax.experimental.pallas), so
# nothing else changes: the exported text is byte-identical. Measured on a 2-core CPU
# (benchmarks/lowering_ab.py, RESULTS.md session 42): the whole llama3-8b decode program's
# second export (lowering) 0.29-0.32 s against 0.42-0.83, its first 0.98-1.07 against
# 1.15-1.56; a 512-token prefill program's no different (its Mosaic kernel dominates).
TRITON_DIALECT_MODULE = "jaxlib.mlir.dialects.tt"


def _name_the_triton_dialect_module() -> None:
    import importlib.util
    import sys

    try:
        from jax._src.lib.triton import dialect
    except ImportError:  # (a jaxlib without Triton: nothing to lower, nothing to name)
        return
    if TRITON_DIALECT_MODULE in sys.modules or importlib.util.find_spec(TRITON_DIALECT_MODULE):
        return  # (a jaxlib that ships the module where MLIR looks: nothing to do)
    sys.modules[TRITON_DIALECT_MODULE] = dialect


_name_the_triton_dialect_module()


# Custom-call targets under which XLA embeds Pallas Triton and Mosaic GPU kernels.
TRITON_CUSTOM_CALL = "__gpu$xla.gpu.triton"
MOSAIC_GPU_CUSTOM_CALL = "mosaic_gpu_v2"


def is_hopper() -> bool:
    """Whether the CUDA target is a Hopper GPU (sm_90): the abstract mesh's device under
    ``abstract_gpu`` / ``cuda_export``, else the first device."""
    mesh = jax.sharding.get_abstract_mesh()
    dev = getattr(mesh, "abstract_device", None) or jax.devices()[0]
    cc = getattr(dev, "compute_capability", None)
    if cc is not None:
        return str(cc) == "9.0"
    return any(s in str(getattr(dev, "device_kind", "")) for s in ("H100", "H200", "H800", "GH200"))


# Jitted kernel entry points are named with this prefix, so a jaxpr walk can tell the
# reductions that run inside pallas_kernels from any that do not (the invariance audit).
KERNEL_PREFIX = "bijax_op_"


def kernel_op(name: str, **jit_kwargs):
    """Decorator: ``jax.jit`` under the name ``bijax_op_<name>`` (visible in jaxprs as the pjit
    name), under ``pinned_config``."""

    def wrap(fn):
        fn.__name__ = fn.__qualname__ = KERNEL_PREFIX + name
        # (pinned around the call, which traces it: under a caller's ``disable_jit`` it runs
        # the program, not its ops one by one)
        jitted = jax.jit(fn, **jit_kwargs)
        call = pinned(jitted)
        call.lower = jitted.lower
        return call

    return wrap


def check_backend(backend: str, interpret: bool) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if interpret and backend != "triton":
        raise ValueError("interpret=True only applies to backend='triton'")


def concrete(a) -> np.ndarray | None:
    """``a`` as a numpy array, or None when it is traced (the value checks of the ops and the
    model run on concrete inputs only)."""
    if isinstance(a, jax.core.Tracer):  # (asking a tracer for its value builds a costly error)
        return None
    try:
        return np.asarray(a)
    except (TypeError, jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def unbatched(fn: Callable) -> Callable:
    """``fn`` - a CPU row op's jnp form - that under ``jax.vmap`` runs once per batch element
    (``lax.map``), on the shapes it was written for: XLA's CPU reductions take their order from
    the shape they see, and a batched [B, 16, H] tile gave other bits than [16, H] did (a row's
    bits then hung on the vmapped size). Arguments may be None (never batched)."""
    f = jax.custom_batching.custom_vmap(fn)

    @f.def_vmap
    def _rule(axis_size, in_batched, *args):
        mapped = [a if b is True else None for a, b in zip(args, in_batched, strict=True)]

        def one(xs):
            return f(*(x if b is True else a for a, b, x in zip(args, in_batched, xs, strict=True)))

        out = lax.map(one, mapped)
        return out, jax.tree_util.tree_map(lambda _: True, out)

    return f


def dispatch(backend: str, jnp_fn: Callable, triton_fn: Callable, *args: Any) -> Any:
    """Calls ``jnp_fn`` or ``triton_fn`` on ``args`` according to ``backend``."""
    if backend == "jnp":
        return jnp_fn(*args)
    if backend == "triton":
        return triton_fn(*args)
    # No default branch: on another platform JAX refuses to lower (no silent fallback).
    return lax.platform_dependent(*args, cpu=jnp_fn, cuda=triton_fn)


@contextlib.contextmanager
def abstract_gpu(device_kind: str = "NVIDIA H200", num_cores: int = H200_SMS):
    """Lets a machine without a GPU lower Pallas Triton kernels for ``device_kind``."""
    device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=num_cores, platform="cuda")
    mesh = jax.sharding.AbstractMesh(
        (1,), ("_bijax",), (jax.sharding.AxisType.Explicit,), abstract_device=device
    )
    with jax.sharding.use_abstract_mesh(mesh):
        yield


def cuda_export(fn: Callable, *args: Any, device_kind: str = "NVIDIA H200") -> str:
    """Exports ``fn(*args)`` for CUDA (works on CPU-only machines); returns the StableHLO text."""
    with abstract_gpu(device_kind):
        exported = jax.export.export(
            jax.jit(fn),
            platforms=["cuda"],
            disabled_checks=[
                jax.export.DisabledSafetyCheck.custom_call(TRITON_CUSTOM_CALL),
                jax.export.DisabledSafetyCheck.custom_call(MOSAIC_GPU_CUSTOM_CALL),
            ],
        )(*args)
    return exported.mlir_module()
