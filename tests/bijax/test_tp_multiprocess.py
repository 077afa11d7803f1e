"""Tensor parallelism across processes: two processes on this machine, one CPU device each, joined
by ``jax.distributed.initialize`` (CPU collectives: gloo), serve the fixed requests of
``tests/bijax/tp_worker.py`` at tensor_parallel_size=2 and get the bits of one process at
tensor_parallel_size=1: token ids, generate's float32 logprobs and ``score``'s, compared as uint32.

Negative control: the same two processes on the XLA path (invariant=False: XLA dots, the
library's all-reduce over gloo) do not give that path's one-process bits, and the comparison sees
a one-ulp change. Cold (empty compilation cache) ~1 min on 2 CPU cores; ~30 s warm.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import bijax
from tests.bijax import tp_worker as worker

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300  # both workers together; a cold start takes ~1 min on 2 CPU cores
FIELDS = ("token_ids", "logprob_bits", "score_bits")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Workers:
    """The two worker processes (started at once, so the test's own reference run overlaps them)."""

    def __init__(self, tmp: Path):
        port = _free_port()
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        self.outs = [tmp / f"process{i}.json" for i in range(2)]
        self.logs = [(tmp / f"process{i}.stdout", tmp / f"process{i}.stderr") for i in range(2)]
        self.procs = []
        for i in range(2):
            out, err = self.logs[i]
            cmd = [sys.executable, "-m", "tests.bijax.tp_worker", str(port), str(i), str(self.outs[i])]
            with open(out, "w") as fo, open(err, "w") as fe:
                self.procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=fo, stderr=fe))
        self.start = time.monotonic()
        self.records = None

    def wait(self) -> list[dict]:
        """Both records; fails with each worker's exit status and output tail if either failed,
        or both after TIMEOUT_S (one that dies leaves the other waiting on a collective)."""
        if self.records is not None:
            return self.records
        while None in (codes := [p.poll() for p in self.procs]):
            if any(codes) or time.monotonic() - self.start > TIMEOUT_S:  # one failed, or too long
                break
            time.sleep(0.2)
        if all(p.returncode == 0 for p in self.procs):
            self.records = [json.loads(o.read_text()) for o in self.outs]
            return self.records
        elapsed = time.monotonic() - self.start
        status = [f"exit status {p.returncode}" if p.returncode is not None else "killed" for p in self.procs]
        self.kill()
        report = []
        for i, st in enumerate(status):
            out, err = (f.read_text()[-6000:] for f in self.logs[i])
            report.append(f"--- process {i}: {st}\n[stdout]\n{out}\n[stderr]\n{err}")
        pytest.fail(
            f"two-process tensor-parallel run failed after {elapsed:.0f} s (limit {TIMEOUT_S} s):\n"
            + "\n".join(report)
        )

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    w = _Workers(tmp_path_factory.mktemp("tp_multiprocess"))
    yield w
    w.kill()


@functools.cache
def _model():
    return worker.model()  # tiny, float32, k_shards=8, seed=0: what the workers build


def _record(size: int, invariant: bool = True) -> dict:
    """The workers' record, from one process (``size`` of conftest's 8 fake CPU devices)."""
    return worker.record(bijax.LLM(_model(), tensor_parallel_size=size, invariant=invariant, **worker.ENGINE))


@pytest.fixture(scope="module")
def reference():
    return _record(1)


def _mismatches(a: dict, b: dict) -> list[str]:
    """The entries (``field[i]``) whose token ids or uint32 bits differ."""
    bad = []
    for f in FIELDS:
        if len(a[f]) != len(b[f]):
            bad.append(f"{f} (count {len(a[f])} vs {len(b[f])})")
            continue
        for i, (x, y) in enumerate(zip(a[f], b[f], strict=True)):
            if not np.array_equal(np.asarray(x, np.uint32), np.asarray(y, np.uint32)):
                bad.append(f"{f}[{i}]")
    return bad


def test_two_processes_same_bits_as_one(workers, reference):
    # ``workers`` comes first: the two processes run while ``reference`` computes here.
    recs = workers.wait()
    prompts, params = worker.requests()
    assert len(reference["token_ids"]) == sum(p.n for p in params) == len(reference["logprob_bits"])
    assert len(reference["score_bits"]) == len(prompts)
    for i, rec in enumerate(recs):
        assert rec["process_index"] == i and rec["process_count"] == 2
        assert rec["collectives"] == "gloo"
        assert rec["mesh_processes"] == [0, 1]  # one mesh over both processes' devices ...
        k, m = rec["wq_shape"]  # ... holding half of each column-parallel weight per process
        assert not rec["wq_fully_addressable"] and rec["wq_local_shards"] == [[k, m // 2]]
        bad = _mismatches(rec["invariant"], reference)
        assert bad == [], f"process {i} (TP=2 over 2 processes) differs from TP=1 in {bad}"


def test_negative_control(workers, reference):
    """The same comparison flags the XLA path (invariant=False: XLA dots, the library's
    all-reduce): the two processes' bits differ from its one-process bits on these requests.
    And it sees the lowest bit of one logprob flipped."""
    xla = _record(1, invariant=False)
    for rec in workers.wait():
        assert _mismatches(rec["xla"], xla)
    flipped = json.loads(json.dumps(reference))
    flipped["logprob_bits"][1][2] ^= 1
    assert _mismatches(flipped, reference) == ["logprob_bits[1]"]
