"""SamplingParams: defaults and a clear error per bad field."""

from __future__ import annotations

import pytest

from bijax import SamplingParams


def test_defaults_and_normalisation():
    sp = SamplingParams(stop="###", stop_token_ids=[5])
    assert sp.temperature == 1.0 and sp.top_p == 1.0 and sp.top_k == -1 and sp.n == 1
    assert sp.stop == ("###",) and sp.stop_token_ids == (5,)


@pytest.mark.parametrize(
    "kw, err, match",
    [
        ({"temperature": -0.1}, ValueError, "temperature"),
        ({"temperature": float("nan")}, ValueError, "temperature"),
        ({"temperature": True}, TypeError, "temperature"),
        ({"top_p": 0.0}, ValueError, "top_p"),
        ({"top_p": 1.5}, ValueError, "top_p"),
        ({"top_k": 0}, ValueError, "top_k"),
        ({"top_k": -2}, ValueError, "top_k"),
        ({"top_k": 2.0}, TypeError, "top_k"),
        ({"min_p": 1.5}, ValueError, "min_p"),
        ({"max_tokens": 0}, ValueError, "max_tokens"),
        ({"n": 0}, ValueError, "n"),
        ({"seed": -1}, ValueError, "seed"),
        ({"seed": 2**32}, ValueError, "seed"),
        ({"logprobs": 21}, ValueError, "logprobs"),
        ({"stop": [""]}, ValueError, "stop"),
        ({"stop_token_ids": [-3]}, ValueError, "stop_token_ids"),
        ({"ignore_eos": "yes"}, TypeError, "ignore_eos"),
    ],
)
def test_bad_values_are_named(kw, err, match):
    with pytest.raises(err, match=match):
        SamplingParams(**kw)
