"""SamplingParams: defaults and a clear error per bad field."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from bijax import SamplingParams


def test_defaults_and_normalisation():
    sp = SamplingParams(stop="###", stop_token_ids=[5])
    assert sp.temperature == 1.0 and sp.top_p == 1.0 and sp.top_k == -1 and sp.n == 1
    assert sp.stop == ("###",) and sp.stop_token_ids == (5,)
    assert SamplingParams(top_k=0).top_k == -1  # 0 is "off" too (vLLM, the server), reported as -1
    many = SamplingParams(stop_token_ids=[7, 5, 7] * 1000)  # each id once, in order; a set lookup
    assert many.stop_token_ids == (7, 5) and many.stops_at(5) and not many.stops_at(6)
    assert dataclasses.replace(many, n=2).stops_at(7) and many == SamplingParams(stop_token_ids=[7, 5])


@pytest.mark.parametrize(
    "kw, err, match",
    [
        ({"temperature": -0.1}, ValueError, "temperature"),
        ({"temperature": float("nan")}, ValueError, "temperature"),
        ({"temperature": True}, TypeError, "temperature"),
        ({"temperature": 1e300}, ValueError, r"temperature must be 0 \(greedy\) or in \[1e-30, 1e\+30\]"),
        ({"temperature": 1e-40}, ValueError, "temperature"),  # 1 / T overflows float32
        ({"top_p": 0.0}, ValueError, "top_p"),
        ({"top_p": 1.5}, ValueError, "top_p"),
        ({"top_k": -2}, ValueError, "top_k"),
        ({"top_k": 2.0}, TypeError, "top_k"),
        ({"min_p": 1.5}, ValueError, "min_p"),
        ({"max_tokens": 0}, ValueError, "max_tokens"),
        ({"n": 0}, ValueError, "n"),
        ({"seed": -1}, ValueError, "seed"),
        ({"seed": 2**32}, ValueError, "seed"),
        ({"seed": 1.5}, TypeError, "SamplingParams.seed must be None or an int"),
        ({"logprobs": "5"}, TypeError, "SamplingParams.logprobs"),
        ({"logprobs": 21}, ValueError, "logprobs"),
        ({"stop": [""]}, ValueError, "stop"),
        ({"stop_token_ids": [-3]}, ValueError, "stop_token_ids"),
        ({"ignore_eos": "yes"}, TypeError, "ignore_eos"),
        ({"temperature": [0.5, 1.0]}, TypeError, "SamplingParams.temperature must be one number"),
        ({"top_k": 2**31}, ValueError, "top_k"),
        ({"stop": 5}, TypeError, "SamplingParams.stop"),
        ({"stop_token_ids": 5}, TypeError, "SamplingParams.stop_token_ids"),
        ({"stop_token_ids": np.array([[5]])}, TypeError, "SamplingParams.stop_token_ids"),
    ],
)
def test_bad_values_are_named(kw, err, match):
    with pytest.raises(err, match=match):
        SamplingParams(**kw)


def test_temperature_range_is_what_float32_scales_without_overflow():
    """0 (greedy) or [1e-30, 1e30]: logits / T stays finite in float32 on every platform (a
    subnormal T is 0 on a GPU that flushes it and not on a CPU). Arrays (``score``) too."""
    from bijax.sampling_params import check_temperature

    for t in (0, 0.0, 1e-30, 1e30, 0.7):
        SamplingParams(temperature=t)
    check_temperature(np.array([0.0, 1e-30, 2.0], np.float32))
    with pytest.raises(ValueError, match=r"got 1e-45"):
        check_temperature(np.array([0.0, 1e-45, 2.0]), "temperature")


def test_numpy_values_that_are_scalars_or_id_lists_are_taken():
    sp = SamplingParams(temperature=np.float32(0.5), stop_token_ids=np.array([5, 6]))
    assert sp.stop_token_ids == (5, 6) and all(type(i) is int for i in sp.stop_token_ids)
    assert SamplingParams(stop_token_ids=[np.int64(7)]).stop_token_ids == (7,)
    # numpy integers are ints in every int field, stored as Python ints
    sp = SamplingParams(
        max_tokens=np.int64(4), top_k=np.int32(5), n=np.int64(2), seed=np.uint32(7), logprobs=np.int8(3)
    )
    assert (sp.max_tokens, sp.top_k, sp.n, sp.seed, sp.logprobs) == (4, 5, 2, 7, 3)
    assert all(type(v) is int for v in (sp.max_tokens, sp.top_k, sp.n, sp.seed, sp.logprobs))
    with pytest.raises(ValueError, match="seed"):  # (the range still holds)
        SamplingParams(seed=np.int64(-1))
    # numpy floats in the float fields, stored as the Python floats they hold
    sp = SamplingParams(top_p=np.float32(0.5), min_p=np.float16(0.25))
    assert (sp.top_p, sp.min_p) == (0.5, 0.25) and type(sp.top_p) is float and type(sp.min_p) is float
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=np.float32(1.5))
    # the temperature too: a numpy / JAX scalar or a 0-d array was kept as is (unhashable)
    import jax.numpy as jnp

    for t in (np.float32(0.5), np.array(0.5), jnp.float32(0.5), np.int64(2)):
        sp = SamplingParams(temperature=t)
        assert type(sp.temperature) is float and sp.temperature == float(t) and hash(sp) == hash(sp)
    # ... and JAX scalars in every number field, as numpy's (a bool or a float int is still refused)
    sp = SamplingParams(top_p=jnp.float32(0.5), min_p=jnp.float32(0.25), seed=jnp.int32(3), n=jnp.int32(2))
    assert (sp.top_p, sp.min_p, sp.seed, sp.n) == (0.5, 0.25, 3, 2) and type(sp.seed) is int
    with pytest.raises(TypeError, match="SamplingParams.seed must be None or an int, got 3.0"):
        SamplingParams(seed=jnp.float32(3))
    with pytest.raises(TypeError, match="SamplingParams.top_p must be a finite number"):
        SamplingParams(top_p=jnp.bool_(True))
