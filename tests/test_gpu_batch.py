"""benchmarks/gpu_batch.py (the device-call runner): a step past its time limit is killed with
the processes it started, steps run in order with their logs, and the budget stops later steps."""

import os
import sys
import time

from benchmarks import gpu_batch


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_runner_kills_steps_past_their_limit_with_their_children(tmp_path, monkeypatch, capsys):
    pidfile = tmp_path / "child.pid"
    hang = (
        "import subprocess, sys, time; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        f"open({str(pidfile)!r}, 'w').write(str(p.pid)); time.sleep(60)"
    )
    steps = {
        "hang": ([sys.executable, "-c", hang], 2, "sleeps past its limit, with a child"),
        "ok": ([sys.executable, "-c", "print('done')"], 30, "succeeds"),
        "fails": ([sys.executable, "-c", "raise SystemExit(3)"], 30, "fails"),
        "long": ([sys.executable, "-c", "print('ran')"], 60, "needs a third of its 60 s left to start"),
    }
    monkeypatch.setattr(gpu_batch, "STEPS", steps)
    t0 = time.perf_counter()
    rows = gpu_batch.run_group(["hang", "ok"], str(tmp_path), parallel=True)
    assert time.perf_counter() - t0 < 20
    assert [(name, status) for name, status, _ in rows] == [("hang", "killed at 2 s"), ("ok", "ok")]
    child = int(pidfile.read_text())
    deadline = time.time() + 5
    while _alive(child) and time.time() < deadline:  # killed with its group (reaped by init)
        time.sleep(0.1)
    assert not _alive(child)
    assert (tmp_path / "ok.log").read_text().strip() == "done"
    assert gpu_batch.run_group(["fails"], str(tmp_path), parallel=False)[0][1] == "exit 3"
    # what is left of the call caps a step's limit (its partial log still comes back)
    assert gpu_batch.run_group(["hang"], str(tmp_path), parallel=False, cap=1)[0][1] == "killed at 1 s"
    # the budget: a step with less than a third of its limit left is not started
    monkeypatch.setattr(sys, "argv", ["gpu_batch.py", "ok", "long", "--out", str(tmp_path), "--budget", "15"])
    assert gpu_batch.main() == 1
    table = capsys.readouterr().out
    assert "| ok | ok |" in table and "| long | not started (budget) | 0 |" in table
    combined = (tmp_path / "gpu_batch.log").read_text()  # one file: a section per step that ran
    assert "######## ok: ok" in combined and "done" in combined and "long" not in combined


def test_sass_spills_finds_local_memory_and_loops():
    """The SASS reader of ``mgpu-ptxas`` (where the prefill kernel's spills sit): a spill before a
    loop, one inside it (between its label and the branch back) and one after; none in a kernel
    without STL / LDL."""
    from benchmarks.attention_mgpu import sass_spills

    sass = "\n".join(
        [
            "        /*0000*/                   MOV R1, c[0x0][0x28] ;",
            "        /*0010*/                   STL [R1], R2 ;",
            ".L_x_3:",
            "        /*0020*/                   FADD R3, R3, R4 ;",
            "        /*0030*/                   LDL.64 R4, [R1+0x8] ;",
            "        /*0040*/                   @P0 BRA `(.L_x_3) ;",
            "        /*0050*/                   LDL R6, [R1] ;",
            "        /*0060*/                   EXIT ;",
        ]
    )
    report = sass_spills(sass)
    assert report.startswith("3 STL / LDL instructions (1 stores), 1 inside loops")
    assert "line 4 [L_x_3, loop]" in report and "line 1 [(entry), straight-line]" in report
    assert "line 6 [L_x_3, straight-line]" in report
    assert sass_spills(sass.replace("STL", "STS").replace("LDL", "LDS")) == "no STL / LDL"


def test_launch_selection_by_part_or_whole_name(monkeypatch):
    """``BIJAX_MGPU_LAUNCHES`` (a device call about a few Mosaic attention launches): "|"-separated
    parts of names, or "=" and a whole name; unset, every launch."""
    from benchmarks.attention_mgpu import LAUNCHES, selected

    monkeypatch.delenv("BIJAX_MGPU_LAUNCHES", raising=False)
    assert selected(LAUNCHES) == LAUNCHES
    monkeypatch.setenv("BIJAX_MGPU_LAUNCHES", "=heaviest, dense rows|fold and q")
    assert list(selected(LAUNCHES)) == [
        "heaviest, dense rows",
        "pair, 3 stages, heaviest, one drain, dense rows, fold and q in SMEM",
    ]


def test_digests_without_a_record_for_this_device_name_the_records_they_equal(tmp_path):
    """gpu_digests on a device class with no record of its own says which other classes'
    records its digest equals or differs from (how the H100 was seen to give the H200's bits, session 42);
    a preset with no record anywhere gets nothing; the control: another digest differs."""
    import json
    import shutil

    from benchmarks import gpu_digests

    src = os.path.join(gpu_digests.HERE, "nvidia-h200-llama3-8b-bfloat16.json")  # (this NUMERICS_VERSION's)
    shutil.copy(src, tmp_path / "nvidia-h200-llama3-8b-bfloat16.json")
    with open(src) as f:
        rec = json.load(f)
    got = rec["digest"]
    assert gpu_digests.other_classes(str(tmp_path), "llama3-8b", "bfloat16", got) == (
        f" (digest equals: {rec['fingerprint']['device_class']})"
    )
    assert "differs" in gpu_digests.other_classes(str(tmp_path), "llama3-8b", "bfloat16", "0" * 64)
    assert gpu_digests.other_classes(str(tmp_path), "llama3-8b", "float32", got) == ""
