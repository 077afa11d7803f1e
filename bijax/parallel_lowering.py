"""Step programs traced and lowered in helper processes, so that a cold start lowers several
buckets at once.

Tracing and lowering a step holds Python's lock: ``ModelRunner.warmup`` compiles in threads but
lowers one program after another, and on the H200 host that was most of a cold start (llama3-8b,
64 sequences x 2048 tokens: 54.5 of 61.6 s lowering 27 programs, 2026-12-02). Here the forward
programs that ``step_cache`` does not hold yet are split among helper processes and this one
(which lowers its share while the helpers start). Each helper
imports bijax, rebuilds the runner's inputs as shapes only (the weights and the KV cache never
leave the parent: a helper sees ``ShapeDtypeStruct``s placed like them), exports its share
with ``step_cache.export_step`` - the same function the parent uses - and exits. The parent's
warm-up reads each program back as soon as a helper has saved it (as it reads a second start's
programs) and compiles it in its thread pool while the helpers lower the next ones.

A helper exports a program only under the name the parent computed for it (``step_cache.step_key``
of the same label, avals, shardings and static arguments, with the parent's JAX configuration
applied): if its own key differs, the program is left to the parent, never saved under a name
that does not describe it. What a helper did not export (a mismatch, a crash, a time-out), the
parent lowers itself, as before: outputs never depend on this, only start-up time. A failed
helper is reported with a warning.

Helpers run where the step cache is on, without tensor parallelism, in a single-process JAX
run; how many: ``BIJAX_LOWERING_PROCESSES`` (0 turns them off), by default one per two CPU
cores, at most 8, on GPUs, and none on CPU (compiling dominates there, and a 2-core machine
gains nothing from more processes), and at most one per ``MIN_PER_PROCESS`` programs to make
(starting one costs a few seconds, about what lowering one program takes).

``BIJAX_LOWERING_COMPILE=1`` (off by default; a measurement switch, ``benchmarks/startup.py``):
a helper also compiles each program it exported, as the parent would compile it read back, so
that JAX's persistent cache holds the executable and the parent's compile becomes a load -
compiling then runs in the helpers' processes instead of the parent's threads. Only where the
persistent cache keeps programs (each must take at least its minimum compile time).

``BIJAX_LOWERING_MIN_PROGRAMS`` (default 3; a measurement switch, ``benchmarks/startup.py``):
the fewest programs to make for which helpers start (a helper needs ``MIN_PER_PROCESS`` programs
anyway, so values below 2 act as 2).
"""

from __future__ import annotations

import os
import pickle
import queue
import subprocess
import sys
import tempfile
import threading
import time
import warnings

import jax
from jax.sharding import SingleDeviceSharding

from bijax import step_cache
from pallas_kernels import runtime

MIN_PER_PROCESS = 2
MIN_PROGRAMS = 3  # fewer programs to make: no helpers (BIJAX_LOWERING_MIN_PROGRAMS overrides)
MAX_PROCESSES = 8
TIMEOUT_S = 900  # a helper that takes longer is stopped; the parent lowers what is left


def _env_int(name: str, fallback: int, meaning: str) -> int | None:
    """The integer in environment variable ``name``; None where it is unset or empty; with a
    warning, ``fallback`` where it is not an integer (``meaning`` says what that means)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        warnings.warn(
            f"bijax: {name} must be an integer, got {raw!r}: {meaning}", RuntimeWarning, stacklevel=4
        )
        return fallback


def default_processes() -> int:
    """Helper processes a warm-up may start (see top)."""
    env = _env_int("BIJAX_LOWERING_PROCESSES", 0, "no helper processes")
    if env is not None:
        return max(0, env)
    if jax.default_backend() != "gpu":
        return 0
    try:
        cores = len(os.sched_getaffinity(0))  # the cores this process may use (containers)
    except AttributeError:
        cores = os.cpu_count() or 1
    return min(MAX_PROCESSES, cores // 2)


_SPEC = {"shape", "dtype", "weak_type"}


def _spec_of(x) -> dict:
    return dict(
        shape=tuple(x.shape),
        dtype=x.dtype,
        weak_type=bool(getattr(x, "weak_type", False)),
    )


class Helpers:
    """Helper processes exporting programs (``start``); helper ``p`` takes every
    ``len(procs)``-th program from the p-th. ``as_ready()`` yields each program's key as soon as
    a helper has saved it in the step cache, and the keys a helper did not save as soon as that
    helper is done (the caller lowers those itself), warning about helpers that fell short;
    ``exported`` counts the saved ones. ``close()`` (also at the end of ``as_ready``) stops the
    helpers and removes the job."""

    def __init__(self, keys, procs, tmp):
        self.keys, self.procs, self._tmp, self.exported = keys, procs, tmp, 0
        self._finished: set[int] = set()  # helpers that said DONE or exited
        self._lines = queue.Queue()
        self._readers = [
            threading.Thread(target=self._read, args=(part, proc), daemon=True)
            for part, proc in enumerate(procs)
        ]
        for t in self._readers:
            t.start()

    def _read(self, part: int, proc) -> None:
        try:
            for line in proc.stdout:
                self._lines.put((part, line.rstrip("\n")))
        except (OSError, ValueError):
            pass  # the pipe closed under us (``close``)
        finally:
            self._lines.put((part, None))  # end of output: the helper exited

    def as_ready(self):
        parts = len(self.procs)
        handed, tails, problems = set(), {p: [] for p in range(parts)}, []
        running, deadline = set(range(parts)), time.monotonic() + TIMEOUT_S

        def leftovers(part):  # a finished helper's programs it did not save, for the caller
            for i in range(part, len(self.keys), parts):
                if i not in handed:
                    handed.add(i)
                    yield self.keys[i]

        try:
            while running:
                left = deadline - time.monotonic()
                if left <= 0:
                    problems.append(f"helpers stopped after {TIMEOUT_S} s")
                    break
                try:
                    part, line = self._lines.get(timeout=left)
                except queue.Empty:
                    continue
                if part not in running:
                    continue  # output after its DONE (shutdown noise)
                if line is None or line == "DONE":
                    running.discard(part)
                    self._finished.add(part)
                    if line is None:
                        rc = self.procs[part].wait()
                        problems.append(f"helper {part} exited with {rc}: " + " | ".join(tails[part][-8:]))
                    yield from leftovers(part)
                elif line.startswith("EXPORTED "):
                    i = int(line.split()[1])
                    if i not in handed:
                        handed.add(i)
                        self.exported += 1
                        yield self.keys[i]
                else:
                    tails[part].append(line)
                    if line.startswith(("MISMATCH ", "FAILED ")) and len(problems) < 3:
                        problems.append(line)
        finally:
            self.close()
        if problems:
            warnings.warn(
                "bijax: lowering step programs in helper processes fell short (this process "
                "lowers the rest; outputs are unaffected): " + "; ".join(problems),
                RuntimeWarning,
                stacklevel=2,
            )
        for part in range(parts):
            yield from leftovers(part)

    def close(self) -> None:
        """Stops the helpers (a helper that said DONE is let exit first), closes their pipes,
        removes the job; idempotent."""
        for part, proc in enumerate(self.procs):
            if proc.poll() is None:
                try:
                    proc.wait(timeout=5 if part in self._finished else 0)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        for t in self._readers:
            t.join(timeout=5)
        for proc in self.procs:
            proc.stdout.close()
        self._tmp.cleanup()


def start(runner, keys, processes: int | None = None) -> Helpers | None:
    """Starts helper processes exporting a share of ``runner``'s programs ``keys``
    (``ModelRunner._lowered``'s keys) that the step cache lacks - the caller lowers the rest -
    at most one per ``MIN_PER_PROCESS`` of them; None where helpers do not apply (see top) or
    for fewer than ``MIN_PROGRAMS`` such programs (with 2, a helper's start-up was thought to
    cost what it saves; ``benchmarks/startup.py``'s single rows measure it). The keys of
    ``Helpers`` are the helpers' programs."""
    where = step_cache.directory()
    if where is None or runner.mesh is not None or jax.process_count() > 1:
        return None
    processes = default_processes() if processes is None else processes
    todo = []
    for key in keys:
        name = runner._shared_name(key)[0]
        if not os.path.exists(os.path.join(where, name)):
            todo.append((key, name))
    processes = min(processes, len(todo) // MIN_PER_PROCESS)
    fewest = _env_int("BIJAX_LOWERING_MIN_PROGRAMS", MIN_PROGRAMS, f"using {MIN_PROGRAMS}")
    if processes < 1 or len(todo) < (MIN_PROGRAMS if fewest is None else fewest):
        return None
    # This process lowers a share too while the helpers start - the last programs in bucket
    # order (most sequences, then most tokens: big compiles, started first) - as many as a
    # helper lowers plus about one for the helpers' start-up (so a helper may get a single
    # program: with 3, 1 there and 2 here was 15.4 s of warm-up on the H200, 2026-12-02, where
    # one helper lowering all 3 left this process idle: 21.6 s).
    own = min(len(todo) - processes, round((len(todo) + processes) / (processes + 1)))
    todo = todo[: len(todo) - own]
    leaves = jax.tree_util.tree_leaves((runner.params, runner.cache))
    kinds = {getattr(x, "sharding", None) for x in leaves}
    if len(kinds) != 1 or not isinstance(next(iter(kinds)), SingleDeviceSharding):
        return None  # weights or cache not on one device as a whole: not a layout a helper rebuilds
    sharding = next(iter(kinds))
    if sharding.device_set != {jax.devices()[0]}:
        return None
    job = dict(
        directory=where,
        config_values=dict(jax.config.values),
        settings=step_cache._settings(),
        memory_kind=sharding.memory_kind,
        graphdef=runner.graphdef,
        params=jax.tree_util.tree_map(_spec_of, runner.params),
        cache=jax.tree_util.tree_map(_spec_of, runner.cache),
        config=runner.config,
        switches=runner.switches(),
        model_config=runner.model_config,
        programs=todo,
        compile=os.environ.get("BIJAX_LOWERING_COMPILE", "0").strip() not in ("", "0"),
    )
    # XLA_FLAGS exactly as this process has them (part of every program's name): bijax's own
    # flag requests are not repeated in the helpers (here they may have been refused)
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", PYTHONUNBUFFERED="1")
    env[runtime.KEEP_XLA_FLAGS] = "1"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    tmp, procs = None, []
    try:
        tmp = tempfile.TemporaryDirectory(prefix="bijax-lowering-")
        path = os.path.join(tmp.name, "job.pkl")
        with open(path, "wb") as f:
            pickle.dump(job, f)
        for part in range(processes):
            # -P: not the working directory first on the path (another checkout there would
            # make every name differ); -c, not -m: the module is imported once, as itself
            cmd = [sys.executable, "-P", "-c", _HELPER, path, str(part), str(processes)]
            procs.append(
                subprocess.Popen(
                    cmd,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    env=env,
                    text=True,
                    errors="replace",
                )
            )
        return Helpers([key for key, _ in todo], procs, tmp)
    except Exception as e:  # noqa: BLE001 - a model that does not pickle, no processes left, a full disk
        for proc in procs:
            proc.kill()
            proc.wait()
            proc.stdout.close()
        if tmp is not None:
            tmp.cleanup()
        warnings.warn(
            f"bijax: not lowering step programs in helper processes ({type(e).__name__}: {e}); "
            "this process lowers them all (outputs are unaffected)",
            RuntimeWarning,
            stacklevel=3,
        )
        return None


def _child(path: str, part: int, parts: int) -> int:
    """A helper: exports its share (every ``parts``-th program from ``part``) of the job."""
    from bijax.model_runner import ModelRunner  # imports bijax: the persistent cache set up

    with open(path, "rb") as f:
        job = pickle.load(f)
    refused = []  # settings this process cannot take (its names then differ: MISMATCH says why)
    for name, value in job["config_values"].items():
        if jax.config.values.get(name) != value:
            try:
                jax.config.update(name, value)
            except Exception:  # noqa: BLE001 - reported with the mismatch it causes
                refused.append(name)
    # The parent's step cache (the same as this process's unless the parent chose another) and
    # the kernel choices it set at run time (benchmarks' A/B switches).
    step_cache.directory = lambda: job["directory"]
    step_cache._apply_settings(job["settings"])
    sharding = SingleDeviceSharding(jax.devices()[0], memory_kind=job["memory_kind"])

    def runner():
        """A runner whose weights and cache are avals placed as the parent's (with their
        sharding: what the parent's step keys see, and what ``step_cache`` lowers for)."""

        def aval(spec):
            return jax.ShapeDtypeStruct(
                spec["shape"], spec["dtype"], sharding=sharding, weak_type=spec["weak_type"]
            )

        def is_spec(x):
            return isinstance(x, dict) and set(x) == _SPEC

        return ModelRunner.abstract(
            job["graphdef"],
            jax.tree_util.tree_map(aval, job["params"], is_leaf=is_spec),
            jax.tree_util.tree_map(aval, job["cache"], is_leaf=is_spec),
            job["config"],
            job["model_config"],
            job["switches"],
        )

    naming = lowering = runner()
    for i in range(part, len(job["programs"]), parts):
        key, name = job["programs"][i]
        try:
            mine = naming._shared_name(key)[0]
            if mine != name:
                why = f" (settings not taken: {refused})" if refused else ""
                print(f"MISMATCH {key}: this helper's name for it differs from the parent's{why}", flush=True)
                continue
            fn, args, kw, donate, _ = lowering._spec(key)
            if step_cache.load(name) is None:  # (else another process saved it meanwhile)
                step_cache.export_step(fn, args, kw, donate=donate, name=name)
            if job["compile"]:  # the parent's compile of it, read back, then loads this executable
                step_cache.lower(fn, args, kw, donate=donate, name=name).compile(
                    lowering._compiler_options(key)
                )
            if os.path.exists(os.path.join(step_cache.directory(), name)):  # (an unwritable cache: not)
                print(f"EXPORTED {i} {key}", flush=True)
        except Exception as e:  # noqa: BLE001 - the parent lowers this one; the next may work
            print(f"FAILED {key}: {type(e).__name__}: {str(e)[:300]}", flush=True)
    print("DONE", flush=True)
    return 0


# A helper's program (``python -P -c _HELPER job part parts``). It exits without the runtime's
# shutdown: everything is saved by then, and nothing is left to wait for or hang on.
_HELPER = (
    "import os, sys\n"
    "from bijax.parallel_lowering import _child\n"
    "_child(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))\n"
    "os._exit(0)\n"
)
