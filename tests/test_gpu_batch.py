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


def test_attention_trace_reader_shares_a_warpgroups_span_among_its_ranges():
    """benchmarks/attention_trace.py: a program's consumer and producer traces (Mosaic GPU's
    profiler events; trace id 1 + warpgroup + 3 x program) -> each range's count and cycles,
    nested ranges inside their outer one (a tile's parts named after it), and the span outside every outermost range; an end
    without its start is refused."""
    import pytest

    from benchmarks.attention_trace import summarize

    def ev(name, ph, ts, tid):
        return {"name": name, "ph": ph, "ts": ts, "tid": tid, "pid": 1}

    events = [  # program 0: consumer warpgroup 0 (tid 1) and the producer (warpgroup 2, tid 3)
        ev("begin", "B", 10.0, 1), ev("begin", "E", 10.1, 1),
        ev("walk", "B", 10.2, 1), ev("tile_full", "B", 10.25, 1), ev("qk", "B", 10.3, 1),
        ev("qk", "E", 10.4, 1), ev("tile_full", "E", 10.65, 1),
        ev("walk", "E", 10.7, 1), ev("store", "B", 10.9, 1), ev("store", "E", 11.0, 1),
        ev("producer_loads", "B", 10.0, 3), ev("producer_loads", "E", 10.5, 3),
    ]  # fmt: skip
    kinds = summarize({"traceEvents": events}, warpgroups=3, producer=2)
    cons, prod = kinds["consumer"], kinds["producer"]
    assert cons["traces"] == 1 and abs(cons["span"] - 1000.0) < 1e-6
    assert cons["ranges"]["walk"][0] == 1 and abs(cons["ranges"]["walk"][1] - 500.0) < 1e-6
    assert abs(cons["ranges"]["tile_full"][1] - 400.0) < 1e-6  # (inside walk: not a gap)
    assert abs(cons["ranges"]["tile_full/qk"][1] - 100.0) < 1e-6 and "qk" not in cons["ranges"]
    assert abs(cons["gaps"] - (1000.0 - 100.0 - 500.0 - 100.0)) < 1e-6
    assert prod["traces"] == 1 and abs(prod["gaps"]) < 1e-6
    from benchmarks.attention_trace import engine_launch
    from benchmarks.kernel_modules import parse_launch

    launch = engine_launch(parse_launch("overlap=True,pingpong=True,stages=2"))  # (--launch)
    assert launch["pingpong"] is True and launch["stages"] == 2 and launch["consumers"] == 2
    with pytest.raises(ValueError, match="end of 'walk' without its start"):
        summarize({"traceEvents": [ev("walk", "E", 1.0, 1)]}, warpgroups=3, producer=2)


def test_ptx_offline_report_reads_registers_spills_and_serialized_wgmma_notes():
    """benchmarks/ptx_offline.py's reading of ptxas's output (the text of session 58's device
    run): registers, spill bytes, and the notes that say every wgmma was serialized."""
    from benchmarks.ptx_offline import report

    serialized = (
        "ptxas info    : (C7514) Potential Performance Loss: wgmma.mma_async instructions are "
        "serialized due to non wgmma instructions reading accumulator registers of  a wgmma\n"
        "ptxas warning : Registers are spilled to local memory in function 'k', 12 bytes spill "
        "stores, 16 bytes spill loads\n"
        "    8 bytes stack frame, 12 bytes spill stores, 16 bytes spill loads\n"
        "ptxas info    : Used 168 registers, used 16 barriers, 8 bytes cumulative stack size\n"
    )
    assert report(serialized) == ("168", "12/16,12/16", 1)
    clean = "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\nptxas info    : Used 168 registers\n"
    assert report(clean) == ("168", "0/0", 0)
    assert report("")[0] == "?"  # nothing written: no registers to report
