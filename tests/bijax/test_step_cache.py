"""bijax.step_cache: exported programs on disk, named by what they were built from."""

import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from bijax import compile_cache, step_cache


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
