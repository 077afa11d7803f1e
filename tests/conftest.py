"""Shared helpers: bit views, random inputs (never zeros), float64 references."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import zlib

# One fresh compilation cache per test run, shared by its workers and the processes tests start
# (set here, in the controller, before pytest-xdist spawns the workers, which inherit it): a run
# never loads executables that an earlier run or another version wrote - loading a stale entry
# from a long-lived ~/.cache crashed a worker (segfault in JAX's cache read) - and each run
# is what CI on a fresh machine sees. BIJAX_CACHE_DIR, if set, wins.
if "BIJAX_CACHE_DIR" not in os.environ and "PYTEST_XDIST_WORKER" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="bijax-test-cache-")
    os.environ["BIJAX_CACHE_DIR"] = _cache
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

# Tensor-parallel tests shard over 8 fake CPU devices (set before JAX starts its CPU backend);
# everything else runs on device 0 as before.
jax.config.update("jax_num_cpu_devices", 8)


def memory_mappings() -> int:
    """How many memory mappings this process has (Linux; 0 where /proc is not there)."""
    try:
        with open(f"/proc/{os.getpid()}/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def _mapping_limit() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 65530


# Every CPU executable XLA loads takes ~3 memory mappings until it is freed, and a pytest worker
# that runs half the suite keeps thousands in JAX's caches: a worker that reached the kernel's
# limit (vm.max_map_count, 65,530 by default) failed to map the next one ("LLVM compilation
# error: Cannot allocate memory") and died - in JAX's cache read or write, a segfault or an
# abort (three CI runs, 2026-12-05). After a test file, a worker past a third of the limit
# drops JAX's caches: what no test holds (shared engines keep their own programs) is freed.
MAPPINGS_HIGH = _mapping_limit() // 3


def release_unused_executables(high: int) -> bool:
    """Drops JAX's caches (and collects) when this process has more than ``high`` mappings."""
    if memory_mappings() <= high:
        return False
    import gc

    jax.clear_caches()
    gc.collect()
    return True


@pytest.fixture(autouse=True, scope="module")
def _release_unused_executables():
    yield
    release_unused_executables(MAPPINGS_HIGH)


TOL = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 1e-2, jnp.dtype(jnp.float16): 1e-2}
_SEED = [0]


def _start_rand_at(nodeid: str) -> None:
    """``rand``'s counter from a test's (or module's) own id: its inputs are the same whatever
    ran before it in its worker - a failure in CI reproduces alone. (The counter was shared by
    a worker's tests: inputs, and so data-dependent failures, followed the test order.)"""
    _SEED[0] = zlib.crc32(nodeid.encode()) << 20


@pytest.fixture(autouse=True, scope="module")
def _rand_per_module(request):
    """(module-scoped fixtures' draws: before any of them, autouse first)"""
    _start_rand_at(request.node.nodeid)


@pytest.fixture(autouse=True)
def _rand_per_test(request):
    _start_rand_at(request.node.nodeid)


def bits(a) -> np.ndarray:
    """The raw bits of a float array, as unsigned ints (compare these, never floats)."""
    a = np.asarray(jax.device_get(a))
    return a.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def rand(shape, dtype=jnp.float32, scale=1.0) -> jax.Array:
    """Fresh standard-normal values (a new seed every call, counted from the test's own start:
    ``_start_rand_at``; numpy, so no compile per shape)."""
    _SEED[0] += 1
    x = np.random.default_rng(_SEED[0]).standard_normal(shape, dtype=np.float32) * np.float32(scale)
    return jnp.asarray(x).astype(dtype)


def rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(out - ref).max() / np.abs(ref).max())


def prefix_mismatches(fn, x, ms, *, first=False) -> list[int]:
    """The m in ms for which fn(x[:m]) is not bit-identical to fn(x)[:m] (``first``: only the
    first such m - what a negative control needs)."""
    full = bits(fn(x))
    found = []
    for m in ms:
        if not np.array_equal(bits(fn(x[:m])), full[:m]):
            found.append(m)
            if first:
                break
    return found


def position_mismatch(fn, x, shift: int) -> bool:
    """True when rolling the rows of x changes some row's bits."""
    full = bits(fn(x))
    rolled = bits(fn(jnp.roll(x, shift, axis=0)))
    return not np.array_equal(np.roll(rolled, -shift, axis=0), full)


@pytest.fixture(autouse=True)
def _cpu_only():
    assert jax.default_backend() == "cpu", "the CI suite runs on CPU"
