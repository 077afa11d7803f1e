"""LLM / Engine behaviour: finish reasons, stop conditions, seeds, n, top logprobs, abort,
and bad input rejected alone with a clear error."""

from __future__ import annotations

import numpy as np
import pytest

from bijax import SamplingParams as SP
from tests.bijax.test_engine import shared_llm as _llm
from tests.conftest import bits

PROMPT = [5, 17, 42, 99, 123, 7, 8]


@pytest.fixture(scope="module")
def llm():
    return _llm("tiny")


def test_max_tokens_and_finish_reason(llm):
    o = llm.generate(PROMPT, SP(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)[0]
    assert len(o.token_ids) == 5 and o.finish_reason == "length" and o.logprobs.dtype == np.float32
    assert o.prompt_token_ids == PROMPT and o.logprobs.shape == (5,)


def test_stop_token_ids_end_the_output(llm):
    ref = llm.generate(PROMPT, SP(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
    stop = ref.token_ids[2]
    o = llm.generate(
        PROMPT, SP(temperature=0, max_tokens=6, ignore_eos=True, stop_token_ids=[stop]), use_tqdm=False
    )[0]
    first = ref.token_ids.index(stop)
    assert o.token_ids == ref.token_ids[: first + 1] and o.finish_reason == "stop"


def test_seed_reported_and_reproducible(llm):
    sp = SP(temperature=1.0, max_tokens=6)
    a = llm.generate(PROMPT, sp, use_tqdm=False)[0]
    again = llm.generate(PROMPT, SP(temperature=1.0, max_tokens=6, seed=a.seed), use_tqdm=False)[0]
    assert again.seed == a.seed and again.token_ids == a.token_ids
    np.testing.assert_array_equal(bits(again.logprobs), bits(a.logprobs))


def test_n_samples_differ_and_each_is_reproducible(llm):
    o = llm.generate(PROMPT, SP(temperature=1.5, max_tokens=8, n=3, seed=4), use_tqdm=False)[0]
    assert [c.index for c in o.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in o.outputs}) > 1  # sample_index is in the key


def test_top_logprobs(llm):
    o = llm.generate(PROMPT, SP(temperature=0, max_tokens=4, logprobs=3), use_tqdm=False)[0]
    top = o.outputs[0].top_logprobs
    assert len(top) == len(o.token_ids) and all(len(t) == 3 for t in top)
    for step, tok, lp in zip(top, o.token_ids, o.logprobs, strict=True):
        assert step[0][0] == tok and np.float32(step[0][1]) == lp  # greedy: the top-1 is the sample
        assert step[0][1] >= step[1][1] >= step[2][1]


def test_abort_engine_level(llm):
    eng = llm.engine
    eng.add_request("abort-me", PROMPT, SP(max_tokens=50, ignore_eos=True))
    eng.step()
    eng.abort("abort-me")
    outs = eng.step()
    assert any(o.request_id == "abort-me" and o.finished and o.finish_reason == "abort" for o in outs)
    assert not eng.has_unfinished_requests()
    assert eng.blocks.num_free == eng.config.num_kv_blocks - 1  # every block back


@pytest.mark.parametrize(
    "prompt, sp, err, match",
    [
        ([], SP(), ValueError, "empty"),
        ([1, 2, 10**6], SP(), ValueError, "outside the vocabulary"),
        ([1] * 250, SP(max_tokens=10), ValueError, "max_model_len"),
        ("text prompt", SP(), ValueError, "no tokenizer"),
        ([1.5, 2], SP(), TypeError, "token ids"),
        ([1, 2], "not params", TypeError, "SamplingParams"),
    ],
)
def test_bad_requests_are_rejected_alone(llm, prompt, sp, err, match):
    with pytest.raises(err, match=match):
        llm.generate([PROMPT, prompt], [SP(max_tokens=2), sp], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()  # nothing half-added
    ok = llm.generate([PROMPT], SP(max_tokens=2), use_tqdm=False)[0]
    assert len(ok.token_ids) == 2 or ok.finish_reason == "stop"


def test_score_bad_input(llm):
    with pytest.raises(ValueError, match="prompt_lens"):
        llm.score([PROMPT], [0])
    with pytest.raises(ValueError, match="prompt_lens"):
        llm.score([PROMPT], [1, 2])
    with pytest.raises(ValueError, match="temperature"):
        llm.score([PROMPT], [2], temperature=-1.0)


def test_stop_strings_with_a_real_tokenizer():
    smol = _llm("smollm2")
    ref = smol.generate("The capital of France is", SP(temperature=0, max_tokens=12), use_tqdm=False)[0]
    word = ref.text.split()[1] if len(ref.text.split()) > 1 else ref.text.strip()[:3]
    o = smol.generate(
        "The capital of France is", SP(temperature=0, max_tokens=12, stop=[word]), use_tqdm=False
    )[0]
    assert o.finish_reason == "stop" and word not in o.text and ref.text.startswith(o.text)


def test_unknown_model_name_or_path():
    import bijax

    with pytest.raises(FileNotFoundError, match="not a known model name"):
        bijax.LLM("no-such-model")
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        bijax.LLM("tiny", tensor_parallel_size=2)
