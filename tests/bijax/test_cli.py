"""The `bijax` CLI (generate / check / bench), `LLM.chat`, warm-up and the compilation cache.

Engine flags match `tests.bijax.test_engine._llm` so the compiled steps are shared.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import io
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

import bijax
from bijax import SamplingParams as SP
from bijax import cli
from bijax.model_runner import num_compiled_steps
from tests.bijax.test_engine import shared_llm as _llm
from tests.bijax.test_engine import shared_model
from tests.conftest import bits

SMOL = [
    "--model", "smollm2-135m", "--max-model-len", "256", "--max-num-seqs", "8",
    "--max-num-batched-tokens", "64", "--num-kv-blocks", "160", "--model-seed", "1", "--no-warmup",
]  # fmt: skip
TINY_CHECK = [
    "--model", "tiny", "--dtype", "float32", "--requests", "4", "--max-tokens", "5",
    "--max-num-seqs", "2", "--max-num-batched-tokens", "32", "--max-model-len", "128",
]  # fmt: skip


def small_llm(**kw) -> bijax.LLM:
    """`tiny` in float32 on a small engine (2 sequences, 32 tokens a step); ``kw`` overrides."""
    limits = dict(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32, num_kv_blocks=20)
    return bijax.LLM("tiny", dtype=np.float32, **{**limits, **kw})


def _json_lines(text):
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_generate_json_equals_llm_generate(capsys):
    prompts = ["The capital of France is", "Once upon a time"]
    rc = cli.main(
        ["generate", *prompts, "--json", "--temperature", "0.8", "--seed", "3", "--max-tokens", "6", *SMOL]
    )
    assert rc == 0
    got = _json_lines(capsys.readouterr().out)
    ref = _llm("smollm2").generate(prompts, SP(temperature=0.8, seed=3, max_tokens=6), use_tqdm=False)
    assert [g["prompt"] for g in got] == prompts
    for g, r in zip(got, ref, strict=True):
        o = g["outputs"][0]
        assert g["prompt_token_ids"] == r.prompt_token_ids and g["seed"] == 3
        assert o["token_ids"] == r.token_ids and o["text"] == r.text
        # JSON floats carry the float32 bits exactly.
        assert np.array_equal(bits(np.asarray(o["logprobs"], np.float32)), bits(r.logprobs))


def test_generate_streams_text_and_chat_matches_llm_chat(capsys):
    msg = "Name a colour."
    rc = cli.main(["generate", "--chat", msg, "--temperature", "0", "--max-tokens", "8", *SMOL])
    assert rc == 0
    out = capsys.readouterr()
    ref = _llm("smollm2").chat(
        [{"role": "user", "content": msg}], SP(temperature=0, max_tokens=8), use_tqdm=False
    )
    assert out.out == ref[0].text + "\n"
    ids = _llm("smollm2").tokenizer.encode_chat([{"role": "user", "content": msg}])
    assert ref[0].prompt_token_ids == ids
    assert "tok/s" in out.err


def test_generate_reads_stdin_and_headers_for_several_prompts(capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("The sky is\n"))
    assert cli.main(["generate", "--temperature", "0", "--max-tokens", "4", *SMOL]) == 0
    ref = _llm("smollm2").generate(["The sky is"], SP(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert capsys.readouterr().out == ref.text + "\n"
    assert cli.main(["generate", "A", "B", "--temperature", "0", "--max-tokens", "3", *SMOL]) == 0
    out = capsys.readouterr().out
    assert out.index("--- [0] A") < out.index("--- [1] B")
    # each header once: also with n > 1 (no text streams) and while a stop string holds text back
    for extra in (["--n", "2", "--seed", "1"], ["--stop", "the", "--stop", "."]):
        assert cli.main(["generate", "A", "B", "--temperature", "0", "--max-tokens", "5", *extra, *SMOL]) == 0
        out = capsys.readouterr().out
        assert out.count("--- [0] A") == 1 and out.count("--- [1] B") == 1, out


@pytest.mark.parametrize(
    "flag", ["--max-num-seqs", "--max-num-batched-tokens", "--num-kv-blocks", "--max-model-len"]
)
def test_engine_limits_of_zero_are_refused_not_taken_as_the_default(flag, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["check", flag, "0"])
    assert e.value.code == 2 and f"argument {flag}: must be a positive int, got 0" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", "   "], "prompt 0 is empty"),
        (["generate", "hi", "--temperature", "-1"], "temperature"),
        (["generate", "hi", "--top-p", "0"], "top_p"),
        (["generate", "hi", "--model", "/nonexistent/model.gguf"], "nonexistent"),
        (["generate", "hi", "--system", "be brief"], "--system needs --chat"),
        (["generate", "hi", "--system", ""], "--system needs --chat"),  # (an empty one too)
        (["generate", "hi", "--logprobs", "2"], "--logprobs needs --json"),
        (["generate", "hi", "--max-tokens", "100000"], "max_model_len"),
        (["generate", "hi", "--tensor-parallel-size", "3"], "tensor_parallel_size"),
        (["check", "--requests", "1"], "--requests must be >= 2"),  # (before the model loads)
        (["check", "--model", "tiny", "--record", "/tmp"], "is a directory"),
        (["check", "--model", "tiny", "--record", "/nonexistent-dir/x.json"], "no such directory"),
        (["generate", "hi", "--top-k", "3000000000"], "top_k must be -1 or 0 (off) or in [1, 2147483647]"),
        (["bench", "--model", "tiny", "--temperature", "-1"], "temperature"),  # (before the model loads)
        (
            [
                "generate",
                "hi",
                "--speculative-config",
                '{"method": "ngram", "num_speculative_tokens": 2, "k": 1}',
            ],
            "unknown key 'k'",
        ),
    ],
)
def test_bad_input_exits_2_with_a_message(argv, message, capsys):
    extra = [] if argv[0] != "generate" or "--model" in argv else SMOL
    assert cli.main(argv + extra) == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith("bijax: error:") and message in last and "Traceback" not in err


def test_bench_refuses_work_longer_than_max_model_len_before_loading(capsys):
    argv = ["bench", "--model", "tiny", "--input-len", "60", "--output-len", "20", "--max-model-len", "64"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "= 80 exceeds max_model_len (64)" in err and "loaded in" not in err
    # without --max-model-len: a preset's default limit, also before its weights are built
    # (llama3-8b's would take a while)
    argv = ["bench", "--model", "llama3-8b", "--input-len", "9000", "--output-len", "20"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "exceeds max_model_len (1024)" in err and "loaded in" not in err, err


def test_text_prompt_without_tokenizer_is_a_clear_error(capsys, tmp_path):
    # a preset is refused before its weights are built (llama3-8b's would take a while)
    assert cli.main(["generate", "hi", "--model", "tiny", "--no-warmup", "--max-model-len", "64"]) == 2
    err = capsys.readouterr().err
    assert "--model tiny is a preset (random weights, no tokenizer)" in err and "loaded in" not in err
    # a checkpoint without a tokenizer, after loading
    from models.loading import save_orbax

    save_orbax(shared_model("tiny")[0], tmp_path / "ckpt")
    assert (
        cli.main(
            ["generate", "hi", "--model", str(tmp_path / "ckpt"), "--no-warmup", "--max-model-len", "64"]
        )
        == 2
    )
    assert "has no tokenizer" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", "x", "--dtype", "float64"], "argument --dtype: invalid choice: 'float64'"),
        (["generate", "x", "--speculative-config", "{bad"], "argument --speculative-config: not valid JSON"),
        (["generate", "x", "--stop-token-ids", "abc"], "must be token ids separated by commas, got 'abc'"),
        (["bench", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (["--no-such-flag", "bench"], "unrecognized arguments: --no-such-flag"),  # bijax's, not bench's
    ],
)
def test_argparse_errors_are_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and message in err, err
    prog = "bijax" if argv[0].startswith("-") else f"bijax {argv[0]}"
    assert err.startswith(f"{prog}: error:") and f"(see {prog} --help)" in err


def test_check_passes_on_tiny_and_control_detects(capsys):
    spec = '{"method": "draft_model", "model": "tiny", "num_speculative_tokens": 2}'
    rc = cli.main(["check", *TINY_CHECK, "--speculative-config", spec])
    out = capsys.readouterr().out
    assert rc == 0, out
    for dim in (
        "batch 1 vs N",
        "needle in a batch",
        "prefill vs decode",
        "chunk sizes",
        "prefix cache hit/miss",
        "preemption",
        "speculative vs plain",
    ):
        line = next(x for x in out.splitlines() if x.startswith(dim))
        assert " PASS " in line, line
    assert "0 preemptions" not in out and "(0 cached blocks" not in out
    control = next(x for x in out.splitlines() if x.startswith("negative control"))
    assert control.split()[2] == "DETECTED" and "stopped at the first difference" in control


def test_check_runs_its_engines_with_the_engine_flags(capsys, monkeypatch):
    """`bijax check --tensor-parallel-size 2 --no-async-scheduling --no-prefix-caching`: every
    engine of the suite splits the model over 2 devices and schedules synchronously; prefix
    caching off (its dimension then says none happened). The suite itself is replaced by a probe
    here (the TP bits are test_tp's); without the flags the engines are TP 1, async."""
    from bijax import check

    seen = []

    def probe(suite, *, invariant, first_diff=False):
        seen.append(suite.config)
        return [("probe", (1, 1, 1), "")]

    monkeypatch.setattr(check, "_dimensions", probe)
    argv = ["check", *TINY_CHECK, "--no-control", "--k-shards", "2"]
    assert (
        cli.main([*argv, "--tensor-parallel-size", "2", "--no-async-scheduling", "--no-prefix-caching"]) == 0
    )
    assert cli.main(argv) == 0
    capsys.readouterr()
    flags = [(c.tensor_parallel_size, c.async_scheduling, c.enable_prefix_caching) for c in seen]
    assert flags == [(2, False, False), (1, True, True)], flags


def test_check_with_prefix_caching_off_skips_that_dimension_by_name():
    """run_check(enable_prefix_caching=False): the prefix-cache row says SKIPPED (not N/A with
    advice to use more requests), the others run and pass."""
    from bijax.check import run_check

    report = run_check(
        _llm("tiny").model, num_requests=2, max_tokens=2, max_num_seqs=2, max_num_batched_tokens=32,
        max_model_len=64, control=False, progress=False, enable_prefix_caching=False,
    )  # fmt: skip
    status = {r.dimension: r.status for r in report.rows}
    assert status.pop("prefix cache hit/miss") == "SKIPPED" and report.ok, report.table()
    assert set(status.values()) <= {"PASS", "N/A"} and "batch 1 vs N" in status
    assert "prefix cache hit/miss: skipped, as the engine flags ask" in report.summary()
    for bad in (0, True):  # (True passed as 1 before the shared positive-int rule)
        with pytest.raises(ValueError, match="max_tokens must be a positive int"):
            run_check(_llm("tiny").model, max_tokens=bad, progress=False)


def test_check_says_na_where_its_settings_exercise_nothing():
    """With one sequence a step no batch forms, so "needle in a batch" and "batch 1 vs N" are N/A
    (they said PASS); at 16 tokens a step the chunk row prefills in chunks of 8 - a real
    comparison (it compared 16 with 16: PASS for nothing)."""
    from bijax.check import run_check

    report = run_check(
        _llm("tiny").model, num_requests=2, max_tokens=2, max_num_seqs=1, max_num_batched_tokens=16,
        max_model_len=64, control=False, progress=False,
    )  # fmt: skip
    rows = {r.dimension: r for r in report.rows}
    assert rows["needle in a batch"].status == rows["batch 1 vs N"].status == "N/A", report.table()
    assert "one sequence at a time" in rows["batch 1 vs N"].detail
    assert rows["chunk sizes"].status == "PASS" and "chunks of 8 vs 16" in rows["chunk sizes"].detail
    assert report.ok


TINY_DIGEST = [
    "--model", "tiny", "--dtype", "float32", "--max-num-seqs", "2", "--max-num-batched-tokens", "32",
    "--max-model-len", "128",
]  # fmt: skip


def _against(path, capsys, *extra):
    rc = cli.main(["check", *TINY_DIGEST, *extra, "--against", str(path)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _resealed(record: dict) -> dict:
    """``record`` with its digest recomputed from its completions (as a machine whose bits
    differ would have written it): SHA-256 of each completion's int64 ids and uint32 bits."""
    h = hashlib.sha256()
    for c in record["completions"]:
        h.update(np.asarray(c["token_ids"], np.int64).tobytes())
        h.update(np.asarray([int(x, 16) for x in c["logprobs_f32"]], np.uint32).tobytes())
    return record | {"digest": h.hexdigest()}


def test_check_record_and_against(tmp_path, capsys):
    """--record writes the suite's digest and fingerprint; --against on the same install says
    MATCH (exit 0); a one-ulp flip or a changed token in the file is a MISMATCH naming the
    completion (exit 1); another model, dtype, NUMERICS_VERSION or a non-record is a clear error
    (exit 2)."""
    from bijax import digest

    rec = tmp_path / "tiny.json"
    assert cli.main(["check", *TINY_DIGEST, "--record", str(rec)]) == 0
    assert "recorded digest" in capsys.readouterr().out
    record = json.loads(rec.read_text())
    ref = bijax.LLM("tiny", dtype="float32", max_model_len=128, max_num_seqs=2, max_num_batched_tokens=32)
    assert record["digest"] == digest.digest(digest.run_suite(ref))
    short = bijax.LLM("tiny", dtype="float32", max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32)
    with pytest.raises(ValueError, match=r"the digest suite needs max_model_len >= 85 .* has 64"):
        digest.run_suite(short)  # (the limit is named, not one of the suite's fixed prompts)
    short.close()
    assert record["numerics_version"] == bijax.NUMERICS_VERSION and len(record["completions"]) == 5
    assert record["fingerprint"]["device_class"] == digest.device_class()

    rc, out, _ = _against(rec, capsys)
    assert rc == 0 and "MATCH" in out and "MISMATCH" not in out, out

    flipped = json.loads(rec.read_text())
    c = flipped["completions"][2]
    c["logprobs_f32"][4] = f"{int(c['logprobs_f32'][4], 16) ^ 1:08x}"  # one ulp
    (tmp_path / "flip.json").write_text(json.dumps(_resealed(flipped)))
    rc, out, _ = _against(tmp_path / "flip.json", capsys)
    assert rc == 1 and "MISMATCH: 1 of 5" in out, out
    line = next(x for x in out.splitlines() if x.strip().startswith("request 2 sample 0"))
    assert "token ids equal" in line and "max |dlogprob| 0 " not in line

    changed = json.loads(rec.read_text())
    changed["completions"][4]["token_ids"][3] += 1
    (tmp_path / "tok.json").write_text(json.dumps(_resealed(changed)))
    rc, out, _ = _against(tmp_path / "tok.json", capsys)
    assert rc == 1 and "request 3 sample 1: first differing token 3" in out, out

    old = json.loads(rec.read_text()) | {"numerics_version": bijax.NUMERICS_VERSION - 1}
    (tmp_path / "old.json").write_text(json.dumps(old))
    for path, extra, message in (
        (rec, ["--dtype", "bfloat16"], "dtype 'float32' there, 'bfloat16' here"),
        (rec, ["--model-seed", "5"], "weights"),
        (tmp_path / "old.json", [], f"recorded at NUMERICS_VERSION {bijax.NUMERICS_VERSION - 1}"),
    ):
        rc, _, err = _against(path, capsys, *extra)
        assert rc == 2 and message in err, err
    # a record cut short, edited without its digest, or malformed: refused, never a MATCH
    # "as far as it goes" (an empty or cut record said MATCH; a missing key was a traceback)
    whole = json.loads(rec.read_text())
    cut = _resealed(whole | {"completions": whole["completions"][:3]})
    zeroed = whole | {"digest": "0" * 64}
    no_ids = whole | {"completions": [{"request": 0, "sample": 0, "logprobs_f32": []}]}
    bad_hex = json.loads(rec.read_text())
    bad_hex["completions"][0]["logprobs_f32"][0] = "zzzz"
    for name, bad, message in (
        ("empty", _resealed(whole | {"completions": []}), "it holds 0 completions"),
        ("cut", cut, "it holds 3 completions"),
        ("zeroed", zeroed, "is not the one of its completions"),
        ("edited", flipped, "the file was edited or cut"),
        ("no_ids", no_ids, "lacks request, sample, token_ids"),
        ("bad_hex", bad_hex, "one 8-digit hex string per token"),
    ):
        (tmp_path / f"{name}.json").write_text(json.dumps(bad))
        rc, out, err = _against(tmp_path / f"{name}.json", capsys)
        assert rc == 2 and message in err and f"{name}.json" in err and "MATCH" not in out, (name, err)
    (tmp_path / "junk.json").write_text("[1, 2]")
    rc, _, err = _against(tmp_path / "junk.json", capsys)
    assert rc == 2 and "not a bijax digest record" in err
    rc, _, err = _against(tmp_path / "missing.json", capsys)
    assert rc == 2 and "no such file" in err
    assert cli.main(["check", *TINY_DIGEST, "--record", str(rec), "--against", str(rec)]) == 2


def test_check_full_control_runs_every_control_dimension(capsys):
    assert cli.main(["check", *TINY_CHECK, "--full-control", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    control = next(r for r in report["rows"] if r["dimension"] == "negative control")
    assert control["result"] == "DETECTED" and "stopped" not in control["detail"]


def test_check_fails_when_the_engine_is_not_invariant(capsys, monkeypatch):
    """Negative control of the command itself: run the 'invariant' side on the XLA path and
    the command must report FAIL and exit 1."""
    import bijax.check as chk

    real = chk._dimensions
    monkeypatch.setattr(chk, "_dimensions", lambda suite, invariant, **kw: real(suite, invariant=False))
    rc = cli.main(["check", *TINY_CHECK, "--no-control", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 1 and not report["ok"]
    assert any(r["result"] == "FAIL" for r in report["rows"])


def test_check_says_so_when_the_control_finds_nothing(capsys, monkeypatch):
    import bijax.check as chk

    real = chk._dimensions
    monkeypatch.setattr(chk, "_dimensions", lambda suite, invariant, **kw: real(suite, invariant=True))
    assert cli.main(["check", *TINY_CHECK]) == 0
    out = capsys.readouterr().out
    assert "NO DIFF" in out and "could not tell" in out
    assert cli.main(["check", *TINY_CHECK, "--strict"]) == 3


BENCH = ["bench", "--model", "tiny", "--dtype", "float32", "--num-prompts", "3", "--input-len", "40",
         "--output-len", "4", "--max-num-seqs", "2", "--max-num-batched-tokens", "32", "--max-model-len", "128",
         "--json"]  # fmt: skip


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_bench_reports_both_paths_and_compiles_nothing_in_timed_runs(capsys, monkeypatch, prefix_caching):
    from bijax.cli import bench

    made = []

    def make_llm(args, **kw):  # the XLA engine is built once the invariant one freed its KV pool
        if kw.get("model") is not None:
            assert kw["model"].engine.closed and kw["model"].engine.runner.cache is None
        made.append(bench_make(args, **kw))
        return made[-1]

    bench_make = bench.make_llm
    monkeypatch.setattr(bench, "make_llm", make_llm)
    argv = BENCH + ([] if prefix_caching else ["--no-prefix-caching"])
    assert cli.main(argv) == 0
    assert len(made) == 2 and all(m.engine.closed for m in made)
    r = json.loads(capsys.readouterr().out)
    assert [x["path"] for x in r["rows"]] == ["invariant", "XLA (--no-invariant)"]
    assert all(x["seconds"] > 0 and x["output_tok_per_s"] > 0 for x in r["rows"])
    assert all(x["compiles_in_timed_runs"] == 0 and x["itl_p50_s"] > 0 for x in r["rows"])
    assert r["invariant_over_xla_time"] == pytest.approx(r["rows"][0]["seconds"] / r["rows"][1]["seconds"])
    assert r["weight_bytes"] > 0 and r["flop_per_token"] > 0
    assert all(x["warmup_runs"] == 1 for x in r["rows"])  # (the CPU's default: no tiered programs)


def test_close_frees_the_kv_cache_and_keeps_the_weights():
    """``LLM.close`` deletes the KV cache now; the closed LLM refuses work with a clear error,
    and a new LLM on the same model gives the same bits (the weights were not touched)."""
    sp = SP(temperature=0.8, seed=3, max_tokens=4)
    with small_llm() as llm:
        a = llm.generate([[5, 6, 7, 8]], sp, use_tqdm=False)[0]
        cache = jax.tree_util.tree_leaves(llm.engine.runner.cache)
        assert cache and not any(x.is_deleted() for x in cache)  # (control: live before close)
    assert all(x.is_deleted() for x in cache) and llm.engine.closed
    for what, call in (
        ("generate", lambda: llm.generate([[5, 6, 7, 8]], sp, use_tqdm=False)),
        ("generate", lambda: llm.generate([], sp, use_tqdm=False)),  # (an empty batch too)
        ("score", lambda: llm.score([[5, 6, 7, 8]], [2])),
        ("warmup", lambda: llm.warmup(progress=False)),
    ):
        with pytest.raises(RuntimeError, match=f"{what}: this (LLM|engine) was closed"):
            call()
    before = jax.tree_util.tree_leaves(nnx.state(llm.model, nnx.Param))
    changed = jax.tree_util.tree_map(lambda x: x + 1, nnx.to_pure_dict(nnx.state(llm.model, nnx.Param)))
    with pytest.raises(RuntimeError, match="this LLM was closed"):  # refused before the model changes
        llm.update_weights(changed)
    after = jax.tree_util.tree_leaves(nnx.state(llm.model, nnx.Param))
    assert all(np.array_equal(bits(a), bits(b)) for a, b in zip(before, after, strict=True))
    llm.close()  # a second close does nothing
    again = bijax.LLM(
        llm.model, max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32, num_kv_blocks=20
    )
    b = again.generate([[5, 6, 7, 8]], sp, use_tqdm=False)[0]
    assert a.token_ids == b.token_ids and np.array_equal(bits(a.logprobs), bits(b.logprobs))
    with pytest.raises(RuntimeError, match="no generation is in flight"):  # close waits for idle
        again.engine.add_request("r", [5, 6, 7], sp)
        again.close()
    assert not again.engine.closed
    # a background compile that failed (it warned then) does not keep close from freeing
    again.engine.release(["r"])
    runner = again.engine.runner
    runner._upgrader = concurrent.futures.ThreadPoolExecutor(1)
    runner._upgrades = [runner._upgrader.submit(lambda: 1 / 0)]
    cache = jax.tree_util.tree_leaves(runner.cache)
    again.close()
    assert again.engine.closed and all(x.is_deleted() for x in cache) and again.engine.pending_upgrades() == 0


def test_bench_with_speculation_compiles_every_bucket_before_timing(capsys):
    """Adaptive n-gram drafting decides from measured times, so a timed run may draft where the
    warm-up runs did not: bench compiles every bucket first, and the timed runs compile nothing."""
    spec = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}'
    assert cli.main([*BENCH, "--repeats", "2", "--speculative-config", spec]) == 0
    out = capsys.readouterr()
    assert "compiling every step bucket (speculative decoding" in out.err
    assert all(x["compiles_in_timed_runs"] == 0 for x in json.loads(out.out)["rows"])


def test_bench_warms_up_again_on_tiered_programs(capsys, monkeypatch):
    """Tiered step programs (the GPUs' default): the first warm-up run runs the chain while the
    whole forwards compile in the background; bench waits for them and warms up again on them,
    so the timed runs are not their first runs, and times only whole forwards. Control: the
    default CPU engine (nothing compiles in the background) warms up once (test above)."""
    monkeypatch.setenv("BIJAX_STEP_PROGRAMS", "tiered")
    assert cli.main(BENCH) == 0
    r = json.loads(capsys.readouterr().out)
    for x in r["rows"]:
        assert x["warmup_runs"] == 2 and x["compiles_in_timed_runs"] == 0
        assert x["chain_steps_in_timed_runs"] == 0 and x["larger_bucket_steps_in_timed_runs"] == 0


def test_bench_counts_compiles_and_fails_on_them(capsys, monkeypatch):
    """The compile counter sees compiles (a run on an engine nothing warmed up), and bench exits 1
    when a timed run compiled: the check can fail."""
    from bijax.cli import bench

    llm = small_llm(max_model_len=128, num_kv_blocks=40)
    reqs = [([3] * 40, SP(temperature=0, max_tokens=3))]
    assert bench._bench_run(llm, reqs)[4] > 0
    assert bench._bench_run(llm, reqs)[4] == 0
    real = bench._bench_run
    calls = []

    def compiling(llm, reqs):  # every second call (the timed runs) reports a compile
        calls.append(1)
        out = real(llm, reqs)
        return out[:4] + (len(calls) % 2 == 0,) + out[5:]

    monkeypatch.setattr(bench, "_bench_run", compiling)
    assert cli.main(BENCH) == 1
    assert "compiled inside timed runs" in capsys.readouterr().err


def test_chat_equals_generate_on_the_template_and_checks_input():
    llm = _llm("smollm2")
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    sp = SP(temperature=0.7, seed=11, max_tokens=5)
    a = llm.chat(conv, sp, use_tqdm=False)
    b = llm.generate({"prompt_token_ids": llm.tokenizer.encode_chat(conv)}, sp, use_tqdm=False)
    assert a[0].token_ids == b[0].token_ids and np.array_equal(bits(a[0].logprobs), bits(b[0].logprobs))
    two = llm.chat([conv, conv[1:]], sp, use_tqdm=False)
    assert len(two) == 2 and two[0].token_ids == a[0].token_ids
    with pytest.raises(TypeError, match="conversation 0"):
        llm.chat(["hello"], sp)
    parts = [
        conv[0],
        {"role": "user", "content": [{"type": "text", "text": "H"}, {"type": "text", "text": "i!"}]},
    ]
    with pytest.raises(TypeError, match="add_generation_prompt must be a bool, got 'no'"):
        llm.chat(conv, sp, add_generation_prompt="no")
    with pytest.raises(ValueError, match="not valid Unicode: '\\\\ud800' at character 1"):
        llm.generate("a\ud800b", sp)  # (half of a surrogate pair)
    joined = [conv[0], {"role": "user", "content": "H\ni!"}]  # OpenAI's text parts, joined as vLLM does
    assert llm.tokenizer.encode_chat(parts) == llm.tokenizer.encode_chat(joined)
    assert llm.tokenizer.encode_chat(parts) != llm.tokenizer.encode_chat(conv)  # (control)
    for content in (5, None, [], [{"type": "text", "text": 5}], [{"type": "image_url"}]):
        with pytest.raises(TypeError, match="conversation 0: message 1's content must be a string"):
            llm.chat([conv[0], {"role": "user", "content": content}], sp)
    from models.tokenizer import message_text

    call = {"role": "assistant", "content": None, "tool_calls": [{"type": "function"}]}
    assert message_text(call, "x") is None  # a tool call has no content: the template renders it
    with pytest.raises(TypeError, match=r"messages\[1\]\.tool_calls must be a list of objects, got 5"):
        message_text({**call, "tool_calls": 5}, "messages[1].content")
    assert (
        message_text({**call, "content": "x", "tool_calls": []}, "x") == "x"
    )  # ([]: no calls, as clients send)
    with pytest.raises(TypeError, match="x must be a string"):  # (but no content needs calls)
        message_text({**call, "tool_calls": []}, "x")
    with pytest.raises(ValueError, match="no tokenizer"):
        _llm("tiny").chat(conv, sp)


@pytest.mark.parametrize("tp,exported", [(1, True), (2, True), (1, False)])
def test_warmup_compiles_every_bucket_so_generate_compiles_nothing(tp, exported, monkeypatch):
    """Warm-up compiles the buckets ahead of time, in parallel threads; generate then runs those
    executables (compiles nothing) and gives the bits of an engine that compiled each program
    when a step first needed it, from tracing - also with the step inside shard_map over 2
    devices, and both when the warmed-up steps come through ``step_cache`` (exported) and when
    they are lowered from tracing."""
    from bijax import step_cache

    if not exported:
        monkeypatch.setattr(step_cache, "directory", lambda: None)
    make = lambda: small_llm(k_shards=8, tensor_parallel_size=tp)
    prompts, sp = [[5] * 40, [7] * 3], SP(temperature=0.8, seed=3, max_tokens=6)
    llm = make()
    llm.warmup(progress=False)
    assert llm.engine.stats().num_compiled_buckets == 2  # (2, 16), (2, 32): sequence buckets start at 16
    assert bool(step_cache.directory() and os.listdir(step_cache.directory())) == exported
    assert 0 < llm.last_warmup.tracing_seconds <= llm.last_warmup.seconds
    before = num_compiled_steps()
    kv = jax.tree_util.tree_leaves(llm.engine.runner.cache)[0]
    out = llm.generate(prompts, sp, use_tqdm=False)
    assert num_compiled_steps() == before
    assert kv.is_deleted()  # the KV cache is donated to the warmed-up step, not copied
    # An engine that compiles each program when a step first needs it, lowered from tracing
    # (not exported), sharing nothing with the first.
    from bijax import model_runner

    monkeypatch.setattr(model_runner, "_shared", {})
    monkeypatch.setattr(step_cache, "directory", lambda: None)
    lazy = make().generate(prompts, sp, use_tqdm=False)
    assert num_compiled_steps() > before
    for a, b in zip(out, lazy, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert np.array_equal(bits(a.outputs[0].logprobs), bits(b.outputs[0].logprobs))


_CACHE_PROBE = """
import jax, sys
hits = []
jax.monitoring.register_event_listener(lambda e, **kw: hits.append(e) if e.endswith("cache_hits") else None)
import bijax
assert bijax.compile_cache.directory() == sys.argv[1], bijax.compile_cache.directory()
# bounded, so JAX takes a file lock around cache reads and writes (processes share the cache)
assert jax.config.jax_compilation_cache_max_size == bijax.compile_cache.MAX_BYTES > 0
exports = []
export_fn = bijax.step_cache.export_fn
bijax.step_cache.export_fn = lambda *a: exports.append(1) or export_fn(*a)
llm = bijax.LLM("tiny", max_model_len=64, max_num_seqs=1, max_num_batched_tokens=16, num_kv_blocks=10)
llm.warmup(progress=False)
r = llm.last_warmup
print("HITS", len(hits), "REPORT", r.num_programs, r.loaded_from_cache, r.compiled, "EXPORTS", len(exports))
print("TOKENS", llm.generate([[5, 6, 7]], bijax.SamplingParams(max_tokens=4), use_tqdm=False)[0].outputs[0].token_ids)
"""


def test_second_start_loads_compiled_steps_from_the_persistent_cache(tmp_path):
    """The second start reads each step's exported program (no tracing) and loads its compiled
    code from the persistent cache; an unreadable exported file is rebuilt, not trusted."""
    env = dict(os.environ, BIJAX_CACHE_DIR=str(tmp_path), JAX_PLATFORMS="cpu")
    env.pop("BIJAX_COMPILATION_CACHE", None)

    def start():
        r = subprocess.run(
            [sys.executable, "-c", _CACHE_PROBE, str(tmp_path)], env=env, capture_output=True, text=True
        )
        assert r.returncode == 0, r.stderr[-2000:]
        return r

    runs = [start(), start()]
    exports = [int(r.stdout.split("EXPORTS")[1].split()[0]) for r in runs]
    tokens = {r.stdout.split("TOKENS")[1].strip() for r in runs}
    steps = tmp_path / "bijax-steps"
    assert exports[0] > 0 and exports[1] == 0 and len(list(steps.iterdir())) == exports[0]
    for f in steps.iterdir():
        f.write_bytes(b"not an exported program")
    third = start()
    assert int(third.stdout.split("EXPORTS")[1].split()[0]) == exports[0]
    tokens.add(third.stdout.split("TOKENS")[1].strip())
    assert len(tokens) == 1, tokens
    first, second = (int(r.stdout.split("HITS")[1].split()[0]) for r in runs)
    assert first == 0 and second > 0 and any(tmp_path.iterdir())
    # LLM.last_warmup: the first start compiled its step programs, the second loaded them
    (n1, loaded1, compiled1), (n2, loaded2, compiled2) = (
        tuple(int(x) for x in r.stdout.split("REPORT")[1].split()[:3]) for r in runs
    )
    # (a program that compiles in under the cache's threshold, 0.1 s, is compiled at every start)
    assert n1 == n2 > 0 and loaded1 == 0 and compiled1 == n1 and loaded2 > 0 and loaded2 + compiled2 == n2
    off = dict(env, BIJAX_COMPILATION_CACHE="0")
    r = subprocess.run(
        [sys.executable, "-c", "import bijax; print(bijax.compile_cache.directory())"],
        env=off,
        capture_output=True,
        text=True,
    )
    assert r.stdout.strip() == "None"


def test_warmup_bounded_by_the_work_compiles_only_what_it_needs():
    """``max_step_tokens`` (the CLI passes its prompts' total): only the token buckets a step of
    that size needs; such work then compiles nothing, and a bad bound is a clear error."""
    llm = small_llm()
    assert llm.engine.pending_buckets(max_step_tokens=7) == [(2, 16)]
    assert llm.engine.pending_buckets(max_step_tokens=17) == [(2, 16), (2, 32)]
    assert llm.engine.pending_buckets(max_step_tokens=1000) == [(2, 16), (2, 32)]
    with pytest.raises(ValueError, match="max_step_tokens"):
        llm.warmup(progress=False, max_step_tokens=0)
    llm.warmup(progress=False, max_step_tokens=7)
    assert llm.engine.stats().num_compiled_buckets == 1
    before = num_compiled_steps()
    llm.generate([[7] * 3, [5] * 4], SP(max_tokens=3), use_tqdm=False)
    assert num_compiled_steps() == before


def test_warmup_after_generate_makes_the_rest_of_a_used_bucket():
    """A bucket a step already ran in has only the sampling program that step used: a later
    ``warmup`` makes the others (top-k / top-p), so such a request then compiles nothing."""
    llm = small_llm()
    llm.generate([[7] * 3], SP(max_tokens=2, temperature=0), use_tqdm=False)
    llm.warmup(progress=False, max_step_tokens=7)
    before = num_compiled_steps()
    llm.generate([[7] * 3], SP(max_tokens=2, temperature=0.8, top_k=3, seed=1), use_tqdm=False)
    assert num_compiled_steps() == before
    for bad in (1.5, True, "8"):
        with pytest.raises(ValueError, match="max_step_tokens must be an int >= 1"):
            llm.warmup(progress=False, max_step_tokens=bad)
    with pytest.raises(ValueError, match="step_tokens must be a non-empty list"):
        llm.warmup(progress=False, step_tokens=5)
    llm.warmup(progress=False, step_tokens=[np.int64(3)])  # numpy ints are ints


def test_warmup_of_known_steps_skips_the_buckets_between():
    """``step_tokens`` (the CLI passes one prompt's chunks and 1 for decoding): only those
    steps' token buckets compile - for a 40-token prompt 64 and 16, not 32 - and that request
    then compiles nothing. Control: a 20-token prompt needs the skipped bucket (32) and
    compiles it; bad counts are a clear error."""
    llm = small_llm(max_num_seqs=1, max_num_batched_tokens=64, max_model_len=128)
    assert llm.engine.pending_buckets(step_tokens=[40, 1]) == [(1, 16), (1, 64)]
    assert llm.engine.pending_buckets(step_tokens=[64, 36, 1]) == [(1, 16), (1, 64)]
    for bad in ([], [0], [True], [2.0]):
        with pytest.raises(ValueError, match="step_tokens"):
            llm.warmup(progress=False, step_tokens=bad)
    with pytest.raises(ValueError, match="not both"):
        llm.warmup(progress=False, step_tokens=[1], max_step_tokens=8)
    llm.warmup(progress=False, step_tokens=[40, 1])
    assert llm.engine.stats().num_compiled_buckets == 2
    sp = SP(max_tokens=3, temperature=0.8, seed=1)
    before = num_compiled_steps()
    llm.generate([[7] * 40], sp, use_tqdm=False)
    assert num_compiled_steps() == before
    llm.generate([[9] * 20], sp, use_tqdm=False)  # control (no prefix-cache hit on the [7]s)
    assert num_compiled_steps() > before


def test_warm_steps_are_dropped_when_the_model_config_changes():
    """Ahead-of-time steps are compiled for one model structure and config; set_weights with
    another config (here rms_norm_eps) must not keep running them."""
    import dataclasses

    from models.configs import preset
    from models.llama import Llama

    kw = dict(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32, num_kv_blocks=20)
    other = Llama(dataclasses.replace(preset("tiny"), rms_norm_eps=0.5), dtype=np.float32, seed=0)
    sp = SP(temperature=0.8, seed=2, max_tokens=4)
    want = bijax.LLM(other, **kw).generate([[5] * 20], sp, use_tqdm=False)[0].outputs[0]
    llm = small_llm()
    llm.warmup(progress=False)
    llm.engine.set_weights(other)
    got = llm.generate([[5] * 20], sp, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == want.token_ids and np.array_equal(bits(got.logprobs), bits(want.logprobs))


def test_summary_says_when_the_control_was_not_run():
    from bijax.check import Report, Row

    assert "was not run" in Report([Row("batch 1 vs N", "PASS", "")], 1.0).summary()
    with_control = Report([Row("batch 1 vs N", "PASS", ""), Row("negative control", "DETECTED", "")], 1.0)
    assert "shows the plain-XLA path is not" in with_control.summary()
