"""Engine steps exported to disk, so that a second start skips tracing and lowering them.

JAX's persistent compilation cache (``bijax.compile_cache``) skips compiling, but not tracing and
lowering: to find a cached executable JAX first needs the lowered module. For llama3-8b on the
H200 host that is 1-3 s per step bucket, ~38 s for the 21 buckets of a 64-sequence engine -
more than loading all of them. So ``ModelRunner.warmup`` builds each bucket's step through
``jax.export``: the exported program (StableHLO, a few hundred kB) is written here, and a later
start reads it back (~0.1 s) and compiles it, which the persistent cache then answers.

A file's name is a hash of everything the traced program depends on: the source of ``bijax``,
``pallas_kernels`` and ``models``; the jax and jaxlib versions; the backend, its version and
its devices; ``XLA_FLAGS``; JAX's configuration; and the step's static arguments and the shapes,
dtypes and shardings of its inputs. A change in any of them names another file, so a stale
program is never read. Files live next to the persistent cache (``<cache dir>/bijax-steps``),
so ``BIJAX_COMPILATION_CACHE=0`` turns this off too; then warm-up exports without saving.
The compiled program is the one a direct ``jit`` of the step compiles (the tests compare the
bits of steps compiled both ways).
"""

from __future__ import annotations

import functools
import hashlib
import os
import tempfile

import jax
from jax import export

from bijax import compile_cache

# At most this many programs are kept (the oldest go first): each source change names new ones.
MAX_FILES = 256

# The programs are read back only by this machine's same jax version (the key says so), so the
# export format's stability guarantees for custom calls (Triton and Mosaic GPU kernels,
# cuDNN) do not matter here.
_CHECKS = [export.DisabledSafetyCheck.custom_call("ALL")]


@functools.lru_cache(maxsize=1)
def _source_digest() -> str:
    """SHA-256 of every .py file of the packages a step is built from."""
    import bijax
    import models
    import pallas_kernels

    h = hashlib.sha256()
    for pkg in (bijax, pallas_kernels, models):
        root = os.path.dirname(os.path.abspath(pkg.__file__))
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for name in sorted(f for f in filenames if f.endswith(".py")):
                path = os.path.join(dirpath, name)
                h.update(os.path.relpath(path, root).encode() + b"\0")
                with open(path, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()


def key(*parts) -> str:
    """A file name for the step described by ``parts`` (static arguments, input avals and
    shardings, ...) built by this process's code, jax and devices."""
    import flax
    import jaxlib
    import numpy

    backend = jax.extend.backend.get_backend()
    h = hashlib.sha256()
    for part in (
        _source_digest(),
        jax.__version__,
        jaxlib.__version__,
        flax.__version__,
        numpy.__version__,
        backend.platform,
        backend.platform_version,
        [(d.id, d.device_kind) for d in jax.devices()],
        os.environ.get("XLA_FLAGS", ""),
        sorted(jax.config.values.items()),
        *parts,
    ):
        h.update(repr(part).encode() + b"\0")
    return h.hexdigest()


def directory() -> str | None:
    """Where exported steps are kept; None: steps are lowered from tracing as they always were
    - when the persistent cache is off, and on GPUs: in jax 0.11.2 a step with Mosaic GPU
    kernels read back from an export fails to compile in a fresh process ("Failed to lookup
    host symbol: ..._mosaic_gpu", H200, 2026-12-01)."""
    base = compile_cache.directory()
    if base is None or jax.default_backend() != "cpu":
        return None
    return os.path.join(base, "bijax-steps")


def load(name: str) -> export.Exported | None:
    """The exported step saved under ``name``, or None: not saved, or not readable (the
    serialization library missing, a truncated or foreign file - whatever the error, the
    program is then exported again and the file replaced)."""
    where = directory()
    if where is None:
        return None
    path = os.path.join(where, name)
    try:
        with open(path, "rb") as f:
            exported = export.deserialize(bytearray(f.read()))
        os.utime(path)  # recently used: pruned last
        return exported
    except Exception:  # noqa: BLE001 - a cache entry that cannot be read is a miss
        return None


def save(name: str, exported: export.Exported) -> None:
    """Writes ``exported`` under ``name`` (atomically: a reader never sees half a file); a
    cache that cannot be written is skipped."""
    where = directory()
    if where is None:
        return
    try:
        blob = exported.serialize()
        os.makedirs(where, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=where, prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
        os.replace(tmp, os.path.join(where, name))
        _prune(where)
    except (OSError, ImportError):
        return


def _prune(where: str) -> None:
    """Deletes the oldest programs beyond ``MAX_FILES`` (by modification time)."""
    files = [e for e in os.scandir(where) if e.is_file() and not e.name.startswith(".tmp-")]
    if len(files) <= MAX_FILES:
        return
    files.sort(key=lambda e: e.stat().st_mtime)
    for e in files[: len(files) - MAX_FILES]:
        try:
            os.remove(e.path)
        except OSError:
            pass  # another process removed it first


def export_fn(fn, *args) -> export.Exported:
    """``jax.export`` of the jitted ``fn`` at ``args`` (arrays or ShapeDtypeStructs)."""
    return export.export(fn, disabled_checks=_CHECKS)(*args)
