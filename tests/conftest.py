"""Shared helpers: bit views, random inputs (never zeros), float64 references."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# Tensor-parallel tests shard over 8 fake CPU devices (set before JAX starts its CPU backend);
# everything else runs on device 0 as before.
jax.config.update("jax_num_cpu_devices", 8)

TOL = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 1e-2, jnp.dtype(jnp.float16): 1e-2}
_SEED = [0]


def bits(a) -> np.ndarray:
    """The raw bits of a float array, as unsigned ints (compare these, never floats)."""
    a = np.asarray(jax.device_get(a))
    return a.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def rand(shape, dtype=jnp.float32, scale=1.0) -> jax.Array:
    """Fresh standard-normal values (a new seed every call; numpy, so no compile per shape)."""
    _SEED[0] += 1
    x = np.random.default_rng(_SEED[0]).standard_normal(shape, dtype=np.float32) * np.float32(scale)
    return jnp.asarray(x).astype(dtype)


def rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(out - ref).max() / np.abs(ref).max())


def prefix_mismatches(fn, x, ms) -> list[int]:
    """The m in ms for which fn(x[:m]) is not bit-identical to fn(x)[:m]."""
    full = bits(fn(x))
    return [m for m in ms if not np.array_equal(bits(fn(x[:m])), full[:m])]


def position_mismatch(fn, x, shift: int) -> bool:
    """True when rolling the rows of x changes some row's bits."""
    full = bits(fn(x))
    rolled = bits(fn(jnp.roll(x, shift, axis=0)))
    return not np.array_equal(np.roll(rolled, -shift, axis=0), full)


@pytest.fixture(autouse=True)
def _cpu_only():
    assert jax.default_backend() == "cpu", "the CI suite runs on CPU"
