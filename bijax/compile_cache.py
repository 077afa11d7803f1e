"""JAX's persistent compilation cache, switched on when bijax is imported.

A SmolLM2 step takes ~10 s to compile on a 2-core CPU (and seconds on a GPU) per bucket; with
the cache on disk a second start loads the compiled steps instead. The cache holds compiled
code, not numerics choices: a step loaded from it gives the same bits as a fresh compile.

``BIJAX_COMPILATION_CACHE=0`` leaves JAX's configuration alone; ``BIJAX_CACHE_DIR`` moves the
cache (default ``~/.cache/bijax/jax``), ``BIJAX_CACHE_MAX_GB`` bounds it (default 16; least
recently used entries are evicted, and reads and writes take a file lock, so processes can share
it). A cache directory the user configured already wins.
"""

from __future__ import annotations

import os
import threading

import jax

DEFAULT_DIR = os.path.join(os.path.expanduser("~"), ".cache", "bijax", "jax")
# Programs that compile faster than this are not written to the cache (they compile again).
MIN_COMPILE_SECONDS = 0.1
# The cache's size bound (least recently used entries go first): BIJAX_CACHE_MAX_GB, default 16.
MAX_BYTES = int(float(os.environ.get("BIJAX_CACHE_MAX_GB", "16")) * 2**30)


def enable(path: str | os.PathLike | None = None) -> str | None:
    """Points JAX's persistent compilation cache at ``path`` (or the default); returns the
    directory in use, or None when disabled. Call before the first compilation: JAX decides
    once per process whether the cache is used."""
    if os.environ.get("BIJAX_COMPILATION_CACHE", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    current = jax.config.jax_compilation_cache_dir
    if current and path is None:
        return current
    path = os.fspath(path or os.environ.get("BIJAX_CACHE_DIR") or DEFAULT_DIR)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:
        return None  # an unwritable home: run without the cache rather than fail to import
    jax.config.update("jax_compilation_cache_dir", path)
    # Cache every step program and kernel that took noticeable time to compile - the small
    # sampling programs too (~0.3 s on a 2-core CPU: loading them is faster) - but not the
    # many tiny eager-op programs.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    if jax.config.jax_compilation_cache_max_size == -1:
        # A bound makes JAX's cache an LRU under a file lock (the `filelock` package). Without
        # it, reads and writes are unlocked, and a process can load an entry that another
        # process is still writing - a segfault seen with two pytest workers.
        jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    return path


def directory() -> str | None:
    """The persistent cache directory JAX uses now (None: off)."""
    return jax.config.jax_compilation_cache_dir or None


_counts = {"hits": 0, "misses": 0}
_lock = threading.Lock()


def _on_event(event: str, **_) -> None:
    key = {"/jax/compilation_cache/cache_hits": "hits", "/jax/compilation_cache/cache_misses": "misses"}.get(
        event
    )
    if key is not None:
        with _lock:
            _counts[key] += 1


jax.monitoring.register_event_listener(_on_event)


def counts() -> tuple[int, int]:
    """(programs loaded from the persistent cache, programs compiled and written to it) in this
    process so far: the difference over a warm-up says how much of it was loading."""
    with _lock:
        return _counts["hits"], _counts["misses"]
