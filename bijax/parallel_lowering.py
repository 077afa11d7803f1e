"""Step programs traced and lowered in helper processes, so that a cold start lowers several
buckets at once.

Tracing and lowering a step holds Python's lock: ``ModelRunner.warmup`` compiles in threads but
lowers one program after another, and on the H200 host that was most of a cold start (llama3-8b,
64 sequences x 2048 tokens: 54.5 of 61.6 s lowering 27 programs, 2026-12-02). Here the forward
programs that ``step_cache`` does not hold yet are split among helper processes. Each helper
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
gains nothing from more processes). Each helper takes at least ``MIN_PER_PROCESS`` programs
(starting one costs a few seconds).
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

MIN_PER_PROCESS = 2
MAX_PROCESSES = 8
TIMEOUT_S = 900  # a helper that takes longer is stopped; the parent lowers what is left


def default_processes() -> int:
    """Helper processes a warm-up may start (see top)."""
    env = os.environ.get("BIJAX_LOWERING_PROCESSES")
    if env is not None:
        try:
            n = int(env)
        except ValueError:
            raise ValueError(f"BIJAX_LOWERING_PROCESSES must be an integer, got {env!r}") from None
        return max(0, n)
    if jax.default_backend() != "gpu":
        return 0
    return min(MAX_PROCESSES, (os.cpu_count() or 1) // 2)


_SPEC = {"shape", "dtype", "weak_type", "committed"}


def _spec_of(x) -> dict:
    return dict(
        shape=tuple(x.shape),
        dtype=x.dtype,
        weak_type=bool(getattr(x, "weak_type", False)),
        committed=bool(getattr(x, "committed", True)),
    )


class Helpers:
    """Helper processes exporting programs (``start``). ``as_ready()`` yields each program's key
    as soon as a helper has saved it in the step cache, then the keys they did not save (the
    caller lowers those itself), and warns about helpers that failed; ``exported`` counts the
    saved ones."""

    def __init__(self, keys, procs, tmp):
        self.keys, self.procs, self._tmp, self.exported = keys, procs, tmp, 0
        self._lines = queue.Queue()
        for part, proc in enumerate(procs):
            threading.Thread(target=self._read, args=(part, proc), daemon=True).start()

    def _read(self, part: int, proc) -> None:
        for line in proc.stdout:
            self._lines.put((part, line.rstrip("\n")))
        self._lines.put((part, None))  # end of output: the helper exited

    def as_ready(self):
        done, tails, problems = set(), {p: [] for p in range(len(self.procs))}, []
        running, deadline = len(self.procs), time.monotonic() + TIMEOUT_S
        try:
            while running:
                try:
                    part, line = self._lines.get(timeout=max(0.1, deadline - time.monotonic()))
                except queue.Empty:
                    problems.append(f"helpers stopped after {TIMEOUT_S} s")
                    break
                if line is None:
                    running -= 1
                    rc = self.procs[part].wait()
                    if rc != 0:
                        problems.append(f"helper {part} exited with {rc}: " + " | ".join(tails[part][-8:]))
                elif line.startswith("EXPORTED "):
                    i = int(line.split()[1])
                    done.add(i)
                    self.exported += 1
                    yield self.keys[i]
                else:
                    tails[part].append(line)
                    if line.startswith("MISMATCH ") and not any(p.startswith("MISMATCH") for p in problems):
                        problems.append(line)
        finally:
            for proc in self.procs:
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
                proc.stdout.close()
            self._tmp.cleanup()
        if problems:
            warnings.warn(
                "bijax: lowering step programs in helper processes fell short (this process "
                "lowers the rest; outputs are unaffected): " + "; ".join(problems),
                RuntimeWarning,
                stacklevel=2,
            )
        for i, key in enumerate(self.keys):
            if i not in done:
                yield key


def start(runner, keys, processes: int | None = None) -> Helpers | None:
    """Starts helper processes exporting ``runner``'s programs ``keys`` (``ModelRunner._lowered``'s
    keys) that the step cache lacks; None where helpers do not apply (see top) or for fewer than
    2 * ``MIN_PER_PROCESS`` such programs. The keys of ``Helpers`` are those programs."""
    where = step_cache.directory()
    processes = default_processes() if processes is None else processes
    if where is None or runner.mesh is not None or jax.process_count() > 1 or processes < 2:
        return None
    todo = []
    for key in keys:
        name = runner._shared_name(key)[0]
        if not os.path.exists(os.path.join(where, name)):
            todo.append((key, name))
    processes = min(processes, len(todo) // MIN_PER_PROCESS)
    if processes < 2:
        return None
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
        model_config=runner.model_config,
        programs=todo,
    )
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", PYTHONUNBUFFERED="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    tmp = tempfile.TemporaryDirectory(prefix="bijax-lowering-")
    path = os.path.join(tmp.name, "job.pkl")
    procs = []
    try:
        with open(path, "wb") as f:
            pickle.dump(job, f)
        for part in range(processes):
            cmd = [sys.executable, "-m", "bijax.parallel_lowering", path, str(part), str(processes)]
            procs.append(
                subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
            )
    except Exception as e:  # noqa: BLE001 - a model that does not pickle, no processes left, a full disk
        for proc in procs:
            proc.kill()
            proc.wait()
            proc.stdout.close()
        tmp.cleanup()
        warnings.warn(
            f"bijax: not lowering step programs in helper processes ({type(e).__name__}: {e}); "
            "this process lowers them all (outputs are unaffected)",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    return Helpers([key for key, _ in todo], procs, tmp)


def _child(path: str, part: int, parts: int) -> int:
    """A helper: exports its share (every ``parts``-th program from ``part``) of the job."""
    from bijax.model_runner import ModelRunner  # imports bijax: the persistent cache set up

    with open(path, "rb") as f:
        job = pickle.load(f)
    for name, value in job["config_values"].items():
        if jax.config.values.get(name) != value:
            try:
                jax.config.update(name, value)
            except Exception:  # noqa: BLE001 - a setting this process cannot take: the key check catches it
                pass
    # The parent's step cache (the same as this process's unless the parent chose another) and
    # the kernel choices it set at run time (benchmarks' A/B switches).
    step_cache.directory = lambda: job["directory"]
    step_cache._apply_settings(job["settings"])
    sharding = SingleDeviceSharding(jax.devices()[0], memory_kind=job["memory_kind"])

    def runner(named: bool):
        """A runner whose weights and cache are avals placed as the parent's: with their
        sharding (``named``: what the parent's step keys see) or as JAX lowers them (an
        uncommitted array carries no sharding into the program, a committed one does)."""

        def aval(spec):
            placed = named or spec["committed"]
            return jax.ShapeDtypeStruct(
                spec["shape"],
                spec["dtype"],
                sharding=sharding if placed else None,
                weak_type=spec["weak_type"],
            )

        def is_spec(x):
            return isinstance(x, dict) and set(x) == _SPEC

        return ModelRunner.abstract(
            job["graphdef"],
            jax.tree_util.tree_map(aval, job["params"], is_leaf=is_spec),
            jax.tree_util.tree_map(aval, job["cache"], is_leaf=is_spec),
            job["config"],
            job["model_config"],
        )

    naming, lowering = runner(True), runner(False)
    for i in range(part, len(job["programs"]), parts):
        key, name = job["programs"][i]
        mine = naming._shared_name(key)[0]
        if mine != name:
            print(f"MISMATCH {key}: this helper's key differs from the parent's", flush=True)
            continue
        if step_cache.load(name) is not None:
            continue  # another process saved it meanwhile
        fn, args, kw, donate, _ = lowering._spec(key)
        step_cache.export_step(fn, args, kw, donate=donate, name=name)
        if os.path.exists(os.path.join(step_cache.directory(), name)):  # (an unwritable cache: not)
            print(f"EXPORTED {i} {key}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
