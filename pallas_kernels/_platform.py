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
from collections.abc import Callable
from typing import Any

import jax
from jax import lax

BACKENDS = ("auto", "jnp", "triton")

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
    """Decorator: ``jax.jit`` under the name ``bijax_op_<name>`` (visible in jaxprs as the pjit name)."""

    def wrap(fn):
        fn.__name__ = fn.__qualname__ = KERNEL_PREFIX + name
        return jax.jit(fn, **jit_kwargs)

    return wrap


def check_backend(backend: str, interpret: bool) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if interpret and backend != "triton":
        raise ValueError("interpret=True only applies to backend='triton'")


def dispatch(backend: str, jnp_fn: Callable, triton_fn: Callable, *args: Any) -> Any:
    """Calls ``jnp_fn`` or ``triton_fn`` on ``args`` according to ``backend``."""
    if backend == "jnp":
        return jnp_fn(*args)
    if backend == "triton":
        return triton_fn(*args)
    # No default branch: on another platform JAX refuses to lower (no silent fallback).
    return lax.platform_dependent(*args, cpu=jnp_fn, cuda=triton_fn)


@contextlib.contextmanager
def abstract_gpu(device_kind: str = "NVIDIA H200", num_cores: int = 132):
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
