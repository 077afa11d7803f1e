"""Step programs traced and lowered in helper processes, so that a cold start lowers several
buckets at once.

Tracing and lowering a step holds Python's lock: ``ModelRunner.warmup`` compiles in threads but
lowers one program after another, and on the H200 host that was most of a cold start (llama3-8b,
64 sequences x 2048 tokens: 54.5 of 61.6 s lowering 27 programs, 2026-12-02). Here the forward
programs that ``step_cache`` does not hold yet are split among helper processes. Each helper
imports bijax, rebuilds the runner's inputs as shapes only (the weights and the KV cache never
leave the parent: a helper sees ``ShapeDtypeStruct``s placed like them), exports its share
with ``step_cache.export_step`` - the same function the parent uses - and exits. The parent's
warm-up then reads them back as it reads a second start's programs, and compiles them.

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
import subprocess
import sys
import tempfile
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


def lower_elsewhere(runner, keys, processes: int | None = None) -> int:
    """Exports ``runner``'s programs ``keys`` (``ModelRunner._lowered``'s keys) that the step
    cache lacks, in helper processes; returns how many the helpers saved. Does nothing (0) where
    helpers do not apply (see top) or for fewer than 2 * ``MIN_PER_PROCESS`` programs."""
    where = step_cache.directory()
    processes = default_processes() if processes is None else processes
    if where is None or runner.mesh is not None or jax.process_count() > 1 or processes < 2:
        return 0
    todo = []
    for key in keys:
        name = runner._shared_name(key)[0]
        if not os.path.exists(os.path.join(where, name)):
            todo.append((key, name))
    processes = min(processes, len(todo) // MIN_PER_PROCESS)
    if processes < 2:
        return 0
    leaves = jax.tree_util.tree_leaves((runner.params, runner.cache))
    kinds = {getattr(x, "sharding", None) for x in leaves}
    if len(kinds) != 1 or not isinstance(next(iter(kinds)), SingleDeviceSharding):
        return 0  # weights or cache not on one device as a whole: not a layout a helper rebuilds
    sharding = next(iter(kinds))
    if sharding.device_set != {jax.devices()[0]}:
        return 0
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
    with tempfile.TemporaryDirectory(prefix="bijax-lowering-") as tmp:
        path = os.path.join(tmp, "job.pkl")
        with open(path, "wb") as f:
            pickle.dump(job, f)
        procs = []
        for part in range(processes):
            log = open(os.path.join(tmp, f"{part}.log"), "w+")  # noqa: SIM115 - closed below
            cmd = [sys.executable, "-m", "bijax.parallel_lowering", path, str(part), str(processes)]
            procs.append((log, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)))
        saved, problems = 0, []
        for part, (log, proc) in enumerate(procs):
            try:
                rc = proc.wait(timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                rc = None
            log.seek(0)
            lines = log.read().splitlines()
            log.close()
            saved += sum(line.startswith("EXPORTED ") for line in lines)
            if rc is None:
                problems.append(f"helper {part} stopped after {TIMEOUT_S} s")
            elif rc != 0:
                problems.append(f"helper {part} exited with {rc}: " + " | ".join(lines[-8:]))
            problems += [line for line in lines if line.startswith("MISMATCH ")][:1]
    if problems:
        warnings.warn(
            "bijax: lowering step programs in helper processes fell short (this process lowers the "
            "rest; outputs are unaffected): " + "; ".join(problems),
            RuntimeWarning,
            stacklevel=3,
        )
    return saved


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
    for key, name in job["programs"][part::parts]:
        mine = naming._shared_name(key)[0]
        if mine != name:
            print(f"MISMATCH {key}: this helper's key differs from the parent's", flush=True)
            continue
        if step_cache.load(name) is not None:
            continue  # another process saved it meanwhile
        fn, args, kw, donate, _ = lowering._spec(key)
        step_cache.export_step(fn, args, kw, donate=donate, name=name)
        if os.path.exists(os.path.join(step_cache.directory(), name)):  # (an unwritable cache: not)
            print(f"EXPORTED {key}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
