"""bijax.step_cache: exported programs on disk, named by what they were built from."""

import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bijax import compile_cache, step_cache
from tests.conftest import bits


def test_key_names_what_the_program_depends_on():
    a = step_cache.key("step", (2, 16), "float32")
    assert a == step_cache.key("step", (2, 16), "float32")  # same inputs, same name
    assert a != step_cache.key("step", (2, 32), "float32")
    assert a != step_cache.key("step", (2, 16), "bfloat16")


def test_key_follows_the_kernel_choices_tracing_reads(monkeypatch):
    """A program traced with another prefill kernel or decode launch rule (benchmarks' A/B
    switches) is saved under another name. Control: the same settings give the same name."""
    from pallas_kernels import attention_triton, matmul_triton

    a = step_cache.key("step", (2, 16))
    assert a == step_cache.key("step", (2, 16))
    monkeypatch.setattr(attention_triton, "PREFILL_KERNEL", "tiles")
    b = step_cache.key("step", (2, 16))
    monkeypatch.setattr(matmul_triton, "DECODE_WIDE_PROGRAMS", 1 << 30)
    assert len({a, b, step_cache.key("step", (2, 16))}) == 3


def test_key_leaves_out_where_caches_live_and_what_is_logged_not_what_is_traced():
    """The name does not change with the cache's directory or JAX's logging (a cache copied
    elsewhere is still found); it changes with a setting tracing reads (control)."""
    a = step_cache.key("step", (2, 16))
    before = jax.config.jax_compilation_cache_dir
    try:
        with jax.log_compiles(True):
            jax.config.update("jax_compilation_cache_dir", "/elsewhere/bijax-cache")
            assert step_cache.key("step", (2, 16)) == a
        with jax.numpy_rank_promotion("raise"):
            assert step_cache.key("step", (2, 16)) != a
    finally:
        jax.config.update("jax_compilation_cache_dir", before)


def test_saved_programs_read_back_and_the_oldest_are_pruned(tmp_path, monkeypatch):
    monkeypatch.setattr(compile_cache, "directory", lambda: str(tmp_path))
    monkeypatch.setattr(step_cache, "MAX_FILES", 2)
    x = np.arange(4, dtype=np.float32)
    for i, scale in enumerate((2.0, 3.0, 4.0)):
        step_cache.save(f"p{i}", step_cache.export_fn(jax.jit(lambda v, s=scale: v * s), x))
        time.sleep(0.02)  # distinct modification times
    assert sorted(os.listdir(tmp_path / "bijax-steps")) == ["p1", "p2"]
    assert step_cache.load("p0") is None
    np.testing.assert_array_equal(step_cache.load("p2").call(jnp.asarray(x)), x * 4.0)
    monkeypatch.setattr(compile_cache, "directory", lambda: None)  # cache off: nothing kept
    assert step_cache.directory() is None and step_cache.load("p2") is None


def test_warmup_lowers_missing_steps_in_helper_processes(tmp_path, monkeypatch):
    """Forward programs the step cache lacks are exported by helper processes (shapes only)
    and read back by the warm-up: the same bits as an engine that traced and compiled its own
    steps. Control: a program whose name the helper computes differently from the parent's
    (the parent's made wrong here) is not saved by the helper - it says so, the warm-up warns
    and lowers that one itself."""
    from bijax import LLM, SamplingParams, model_runner, parallel_lowering
    from bijax.model_runner import num_compiled_steps
    from pallas_kernels import matmul_triton

    monkeypatch.setattr(compile_cache, "directory", lambda: str(tmp_path))  # empty: every step missing
    monkeypatch.setattr(parallel_lowering, "MIN_PER_PROCESS", 1)
    # as in a process whose backend started before bijax was imported: bijax's flag request was
    # refused here, and the helpers must not make it either (XLA_FLAGS is part of every name)
    import bijax

    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if f != bijax.GPU_GRAPH_UPDATE_MODE]
    monkeypatch.setenv("XLA_FLAGS", " ".join(flags))
    # a kernel choice set at run time (as benchmarks/ab.py does) reaches the helpers: else every
    # name would differ
    monkeypatch.setattr(matmul_triton, "DECODE_WIDE_PROGRAMS", 7)
    exports = []  # programs this process exported itself
    export_step = step_cache.export_step
    monkeypatch.setattr(step_cache, "export_step", lambda *a, **k: exports.append(1) or export_step(*a, **k))
    started = []
    start = parallel_lowering.start
    monkeypatch.setattr(parallel_lowering, "start", lambda *a: started.append(start(*a)) or started[-1])
    make = lambda: LLM("tiny", max_model_len=64, max_num_seqs=1, max_num_batched_tokens=64, num_kv_blocks=10)
    llm = make()
    runner = llm.engine.runner
    forwards = [k for s, t in runner.bucket_pairs() for k in runner.forward_keys(s, t, s)]
    assert len(forwards) == 3 * 3  # 3 buckets: each an embedding, a layer and a head program
    wrong = ("block", 1, 32, 0)
    runner._names[wrong] = "0" * 64
    with pytest.warns(RuntimeWarning, match="MISMATCH"):
        tracing = runner.warmup(runner.bucket_pairs(), processes=2)
    assert len(started) == 1 and not os.path.exists(started[0]._tmp.name)  # the job removed
    helped = started[0].keys  # the helpers' share (the parent lowers the largest buckets' programs)
    assert wrong in helped and ("block", 1, 64, 0) not in helped
    # every program of the helpers' share but the one whose name the helper refused
    assert runner.programs_lowered_elsewhere == len(helped) - 1
    # here: the parent's share, the refused one, and sampling with and without filters
    assert len(exports) == len(forwards) - len(helped) + 1 + 2
    assert 0 < tracing
    steps = sorted(os.listdir(tmp_path / "bijax-steps"))
    assert "0" * 64 in steps and len(steps) == len(forwards) + 2  # and sampling with and without filters
    prompts, sp = [[5] * 40, [7] * 3], SamplingParams(temperature=0.8, seed=3, max_tokens=6)
    before = num_compiled_steps()
    out = llm.generate(prompts, sp, use_tqdm=False)
    assert num_compiled_steps() == before  # every step warmed up
    monkeypatch.setattr(model_runner, "_shared", {})
    monkeypatch.setattr(step_cache, "directory", lambda: None)  # traced here, not exported
    ref = make().generate(prompts, sp, use_tqdm=False)
    for a, b in zip(out, ref, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert np.array_equal(bits(a.outputs[0].logprobs), bits(b.outputs[0].logprobs))


_HELPERS_COMPILE = """
import jax
import bijax
# every compiled program kept (tiny's embedding and head programs compile in well under the
# default 0.1 s); the helper takes this process's JAX configuration
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
llm = bijax.LLM("tiny", max_model_len=64, max_num_seqs=1, max_num_batched_tokens=64, num_kv_blocks=10)
llm.warmup(progress=False)
r = llm.last_warmup
print("REPORT", r.num_programs, r.loaded_from_cache, r.compiled, r.lowered_in_helpers)
"""


@pytest.mark.parametrize("compile_in_helpers", ["1", "0"])
def test_helpers_that_compile_fill_the_persistent_cache(tmp_path, compile_in_helpers):
    """BIJAX_LOWERING_COMPILE=1: the helpers compile what they export, so the warm-up (on an
    empty cache) loads those executables instead of compiling them - the helpers' programs key
    the persistent cache as the parent's do. Control: without it the warm-up compiles all."""
    import subprocess
    import sys

    env = dict(
        os.environ,
        BIJAX_CACHE_DIR=str(tmp_path),
        JAX_PLATFORMS="cpu",
        BIJAX_LOWERING_PROCESSES="1",
        BIJAX_LOWERING_COMPILE=compile_in_helpers,
    )
    env.pop("BIJAX_COMPILATION_CACHE", None)
    r = subprocess.run([sys.executable, "-c", _HELPERS_COMPILE], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    n, loaded, compiled, helped = (int(x) for x in r.stdout.split("REPORT")[1].split()[:4])
    # 3 buckets' 9 forward programs - 4 by the helper, 5 here (the parent's share: about one
    # more than a helper's) - and here the sampling with and without filters
    assert helped == 4 and n == 9 + 2
    if compile_in_helpers == "1":
        assert loaded == helped and compiled == n - helped
    else:
        assert loaded == 0 and compiled == n


def test_every_ab_switch_is_a_setting_the_helpers_receive():
    """``benchmarks/ab.py`` sets module-level kernel choices; each must be among
    ``step_cache._SETTINGS`` (the names programs are saved under, and what the helpers are
    given), else a helper would lower under the committed value. Control: a made-up switch
    is not."""
    from benchmarks import ab

    switches = ab.settings_set()
    assert switches <= set(step_cache._SETTINGS)
    assert not switches | {("attention_triton", "NO_SUCH_SWITCH")} <= set(step_cache._SETTINGS)
