"""Engine steps exported to disk, so that a second start skips tracing and lowering them.

JAX's persistent compilation cache (``bijax.compile_cache``) skips compiling, but not tracing and
lowering: to find a cached executable JAX first needs the lowered module. For llama3-8b on the
H200 host that is 1-3 s per step bucket, ~38 s for the 21 buckets of a 64-sequence engine -
more than loading all of them. So ``ModelRunner.warmup`` lowers each bucket's step through
``lower``: the step's exported program (``jax.export``, StableHLO, a few hundred kB) is written
here, and a later start reads it back and compiles it, which the persistent cache then answers.

A file's name is a hash of everything the traced program depends on: the source of ``bijax``,
``pallas_kernels`` and ``models``; the jax, jaxlib, flax, numpy and ml_dtypes versions; the
backend, its version and its devices; ``XLA_FLAGS``; JAX's configuration (less where the caches
are and what is logged); and the step's static
arguments and its inputs' tree, shapes, dtypes, weak types and shardings (each part by its
``repr``, which must be complete and stable). A change in any of them names another file, so a
stale program is never read. Files live next to the persistent cache (``<cache dir>/bijax-steps``,
at most ``MAX_FILES`` of them, not counted in ``BIJAX_CACHE_MAX_GB``); with the cache off
(``BIJAX_COMPILATION_CACHE=0``) steps are traced as they come (``lower_flat``: the same
function of flat leaves, not saved). The compiled program is the one tracing the step compiles:
the tests compare the bits of steps built both ways.

On GPUs the Mosaic GPU custom call finds its runtime library through
``MOSAIC_GPU_RUNTIME_LIB_PATH``, which importing ``jax.experimental.mosaic.gpu`` sets; a process
that reads every step back never lowers a Mosaic kernel and so would never import it (the H200
then failed with "Failed to lookup host symbol: ..._mosaic_gpu"), so ``directory`` imports it.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import os
import tempfile

import jax
import jax.extend
from jax import export

from bijax import compile_cache
from pallas_kernels.runtime import pinned

# At most this many programs are kept (the least recently used go first): each source change
# names new ones.
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


# Module-level choices that tracing reads and a process may set (the A/B switches of
# ``benchmarks/ab.py`` and ``gpu_digests.py --prefill-kernel``): a program traced under one
# value must not be read back under another. (module, attribute)
_SETTINGS = (
    ("attention_triton", "PREFILL_KERNEL"),
    ("attention_triton", "MGPU_PREFILL_LAUNCH"),
    ("matmul_triton", "DECODE_WIDE_PROGRAMS"),
    ("attention_triton", "STORE_USED_SPLITS_ONLY"),
    ("attention_triton", "DECODE_ROWS_IN_REGISTERS"),
    ("attention_triton", "DECODE_PROGRAMS"),
    ("matmul_triton", "SHARED_LAUNCH"),
    ("matmul_triton", "SHARED_OVER_MGPU_ROWS"),
    ("matmul_triton", "GATE_UP_SHARED_MIN_ROWS"),
    ("matmul_norm", "FUSED"),
    ("rope", "FUSED"),
    ("rope", "QKV_COMBINE_IN_KERNEL"),
    ("attention_triton", "DECODE_FEW_TOKENS"),
    ("attention_triton", "DECODE_FEW_STAGES"),
    ("mlp", "FUSED"),
    ("mlp", "PAIR_TILES"),
    ("mlp", "FUSED_MAX_ROWS"),
)


def _settings() -> tuple:
    """The values of ``_SETTINGS`` in this process."""
    return tuple(getattr(importlib.import_module(f"pallas_kernels.{m}"), a) for m, a in _SETTINGS)


def _apply_settings(values: tuple) -> None:
    """Sets ``_SETTINGS`` to ``values`` (another process's: ``parallel_lowering``'s helpers)."""
    for (m, a), v in zip(_SETTINGS, values, strict=True):
        setattr(importlib.import_module(f"pallas_kernels.{m}"), a, v)


# JAX settings that say where compiled code is kept and what is logged - not what a traced
# program is: left out of the key (with the cache directory in it, a cache copied elsewhere or
# ``BIJAX_CACHE_DIR`` spelled another way named every program anew).
_UNTRACED = (
    "jax_compilation_cache_",
    "jax_persistent_cache_",
    "jax_enable_compilation_cache",
    "jax_raise_persistent_cache_errors",
    "jax_log_compiles",
    "jax_explain_cache_misses",
    "jax_debug_log_modules",
    "jax_logging_level",
    "jax_compiler_detailed_logging_min_ops",
    "jax_dump_ir_",
)


def _traced_config() -> list:
    """JAX's configuration, less ``_UNTRACED``."""
    return sorted((k, v) for k, v in jax.config.values.items() if not k.startswith(_UNTRACED))


def key(*parts) -> str:
    """A file name for the program described by ``parts`` (static arguments, input avals and
    shardings, ...; each by its repr) built by this process's code, libraries and devices."""
    import flax
    import jaxlib
    import ml_dtypes
    import numpy

    backend = jax.extend.backend.get_backend()
    h = hashlib.sha256()
    for part in (
        _source_digest(),
        jax.__version__,
        jaxlib.__version__,
        flax.__version__,
        numpy.__version__,
        ml_dtypes.__version__,
        backend.platform,
        backend.platform_version,
        [(d.id, d.device_kind) for d in jax.devices()],
        os.environ.get("XLA_FLAGS", ""),
        _traced_config(),
        _settings(),
        *parts,
    ):
        h.update(repr(part).encode() + b"\0")
    return h.hexdigest()


def directory() -> str | None:
    """Where exported steps are kept; None (steps are traced as they always were) when the
    persistent cache is off."""
    base = compile_cache.directory()
    if base is None:
        return None
    if jax.default_backend() == "gpu":
        importlib.import_module("jax.experimental.mosaic.gpu")  # sets the runtime's path (module docstring)
    return os.path.join(base, "bijax-steps")


def load(name: str) -> export.Exported | None:
    """The program saved under ``name``, or None: not saved, or not readable (the
    serialization library missing, a truncated or foreign file - whatever the error, the
    program is then exported again and the file replaced)."""
    where = directory()
    if where is None:
        return None
    path = os.path.join(where, name)
    try:
        with open(path, "rb") as f:
            exported = export.deserialize(bytearray(f.read()))
        exported.mlir_module()  # the module's bytes parse
    except Exception:  # noqa: BLE001 - a cache entry that cannot be read is a miss
        return None
    try:
        os.utime(path)  # recently used: pruned last
    except OSError:
        pass  # a read-only cache, or another process pruned it: the program is still good
    return exported


def save(name: str, exported: export.Exported) -> export.Exported:
    """Writes ``exported`` under ``name`` (atomically: a reader never sees half a file) and
    returns it as a later ``load`` will read it back; a cache that cannot be written is skipped
    (``exported`` returned as given)."""
    where = directory()
    if where is None:
        return exported
    tmp = None
    try:
        blob = exported.serialize()
        os.makedirs(where, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=where, prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
        os.replace(tmp, os.path.join(where, name))
        tmp = None
    except (OSError, ImportError):
        return exported
    finally:
        if tmp is not None:
            try:
                os.remove(tmp)  # a half-written file (disk full)
            except OSError:
                pass
    _prune(where)
    return export.deserialize(blob)


def _prune(where: str) -> None:
    """Deletes the least recently used programs beyond ``MAX_FILES``; never fails (another
    process may be pruning the same files)."""
    try:
        files = []
        for e in os.scandir(where):
            if e.is_file() and not e.name.startswith(".tmp-"):
                files.append((e.stat().st_mtime, e.path))
    except OSError:
        return
    files.sort()
    for _, path in files[: max(0, len(files) - MAX_FILES)]:
        try:
            os.remove(path)
        except OSError:
            pass


class FlatStep:
    """A step lowered from its exported program, which takes and returns flat leaves. Its
    ``compile()`` gives a callable taking the step's arguments as the jitted step does and
    returning what it returns: (out, new value of the donated argument), or out when nothing
    is donated (``donated_tree`` None)."""

    def __init__(self, lowered, in_tree, donated_tree):
        self.lowered, self.in_tree, self.donated_tree, self.compiled = lowered, in_tree, donated_tree, None

    def compile(self, compiler_options: dict | None = None) -> FlatStep:
        """Compiles it (XLA ``compiler_options``: a measurement switch of ``model_runner``)."""
        self.compiled = self.lowered.compile(compiler_options) if compiler_options else self.lowered.compile()
        return self

    def copy(self) -> FlatStep:
        """Another loaded instance of the compiled program (serialized and loaded again): the
        same code, its own state on the device - e.g. its own CUDA graphs, which XLA re-records
        whenever a launch's buffers differ from the one before."""
        from jax.experimental import serialize_executable

        payload, in_tree, out_tree = serialize_executable.serialize(self.compiled)
        other = FlatStep(self.lowered, self.in_tree, self.donated_tree)
        devices = self.compiled._executable.xla_executable.local_devices()
        other.compiled = serialize_executable.deserialize_and_load(
            payload, in_tree, out_tree, execution_devices=devices
        )
        return other

    def __call__(self, *args, flat=None):
        """``flat``: (leaves, treedef) of ``args`` when the caller has them (a model's weights
        flatten in Python, ~1 ms for llama3-8b: the engine flattens them once)."""
        leaves, tree = jax.tree_util.tree_flatten(args) if flat is None else flat
        if tree != self.in_tree:
            raise TypeError(f"step arguments changed structure since warm-up: {tree} != {self.in_tree}")
        # (a compiled program runs as it is under a caller's ``disable_jit``, which JAX refuses
        # for AOT programs; the check alone when it is off, ~0.1 us: this is every step's call)
        with jax.disable_jit(False) if jax.config.jax_disable_jit else contextlib.nullcontext():
            out = self.compiled(*leaves)
        if self.donated_tree is None:
            return out
        out, donated = out
        return out, jax.tree_util.tree_unflatten(self.donated_tree, donated)


def export_fn(fn, *args) -> export.Exported:
    """``jax.export`` of the jitted ``fn`` at ``args`` (arrays or ShapeDtypeStructs)."""
    return export.export(fn, disabled_checks=_CHECKS)(*args)


def _donation(args: tuple, donate: int | None):
    """(tree of ``args[donate]``, its leaves' positions among the flat leaves of ``args``)."""
    if donate is None:
        return None, ()
    donated_tree = jax.tree_util.tree_structure(args[donate])
    first = sum(jax.tree_util.tree_structure(a).num_leaves for a in args[:donate])
    return donated_tree, tuple(range(first, first + donated_tree.num_leaves))


def _flat(fn, tree, kw: dict, donate: int | None):
    """``fn(*args, **kw)`` as a function of the flat leaves of ``args`` (``tree``), returning the
    donated argument's leaves (a jitted function of pytrees flattens them in Python at every
    call; an engine step calls its layer program once per layer)."""

    def flat(*leaves):
        result = fn(*jax.tree_util.tree_unflatten(tree, leaves), **kw)
        if donate is None:
            return result
        out, donated = result
        return out, jax.tree_util.tree_leaves(donated)

    return flat


def _specs(leaves: list) -> list:
    """``leaves`` with each array as a ShapeDtypeStruct placed as it is. A program is exported
    and lowered for these, not for the arrays: an array made by ``jnp.zeros`` (the KV cache at
    the start) is not committed to its device, the same array once a step returned it is, and
    the lowered text - so the persistent cache's key - differs between the two (a sharding
    annotation). A program lowered after the first step (tiered's background compiles, a bucket
    compiled as it comes) would then be compiled again by the next start, which lowers it
    before any. (``parallel_lowering``'s helpers lower for the same placed avals.)"""
    return [
        jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding, weak_type=getattr(x, "weak_type", False))
        if isinstance(x, jax.Array)
        else x
        for x in leaves
    ]


@pinned
def lower_flat(fn, args: tuple, kw: dict, *, donate: int | None) -> FlatStep:
    """``fn(*args, **kw)`` lowered as ``lower`` does, but traced here and never saved (the step
    cache off): a ``FlatStep`` all the same."""
    leaves, tree = jax.tree_util.tree_flatten(args)
    donated_tree, donate_argnums = _donation(args, donate)
    lowered = jax.jit(_flat(fn, tree, kw, donate), donate_argnums=donate_argnums).lower(*_specs(leaves))
    return FlatStep(lowered, tree, donated_tree)


@pinned
def lower(fn, args: tuple, kw: dict, *, donate: int | None, name: str) -> FlatStep:
    """``fn(*args, **kw)`` lowered through its exported program - ``fn`` a jitted function of
    pytree ``args`` and static ``kw`` that returns (out, new value of ``args[donate]``), which is
    donated, or just out when ``donate`` is None - read back when a previous start saved it
    under ``name`` (``step_key`` of a label and these arguments), else exported and saved now.
    Call only when ``directory()`` is not None."""
    leaves, tree = jax.tree_util.tree_flatten(args)
    donated_tree, donate_argnums = _donation(args, donate)

    def via(exported):
        return FlatStep(
            jax.jit(exported.call, donate_argnums=donate_argnums).lower(*_specs(leaves)), tree, donated_tree
        )

    exported = load(name)
    if exported is not None:
        try:
            return via(exported)
        except Exception:  # noqa: BLE001 - a program that read back but does not lower: rebuild it
            pass
    # Compiled as read back (when it could be written), so this start and the next compile the
    # same text and the persistent cache answers the next one.
    return via(export_step(fn, args, kw, donate=donate, name=name))


@pinned
def export_step(fn, args: tuple, kw: dict, *, donate: int | None, name: str) -> export.Exported:
    """Exports ``fn(*args, **kw)`` as ``lower`` runs it (a function of the flat leaves of
    ``args``, returning the donated argument's leaves) and saves it under ``name``; returns it
    as read back. ``args`` may be ShapeDtypeStructs (``parallel_lowering``'s helpers)."""
    leaves, tree = jax.tree_util.tree_flatten(args)
    return save(name, export_fn(jax.jit(_flat(fn, tree, kw, donate)), *_specs(leaves)))


def step_key(label: str, args: tuple, kw: dict) -> str:
    """``key`` of a step ``label`` at these arguments (their tree, shapes, dtypes, weak types
    and shardings) and static keyword arguments."""
    leaves, tree = jax.tree_util.tree_flatten(args)
    avals = [
        (x.shape, str(x.dtype), bool(getattr(x, "weak_type", False)), getattr(x, "sharding", None))
        for x in leaves
    ]
    return key(label, tree, avals, sorted(kw.items()))
