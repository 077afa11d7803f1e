"""A step's forward as a chain of programs (the embedding, one layer program per layer, the LM
head) and as one program: the same bits, whichever runs which token bucket
(``bijax.step_programs``; the GPU's default is the whole forward, the CPU's the chain)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import bijax
from bijax import step_programs
from models.configs import preset
from models.llama import Llama
from tests.conftest import bits

# Greedy and seeded sampling, a prompt longer than a step (chunked prefill), a short one.
PROMPTS = [[5 + i % 40 for i in range(50)], [7, 8, 9]]
SPS = [
    bijax.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
    bijax.SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=6, ignore_eos=True),
]


def _run(monkeypatch, setting: str, model=None):
    """(outputs, the runner) of an engine whose forwards run as ``BIJAX_STEP_PROGRAMS=setting``."""
    monkeypatch.setenv("BIJAX_STEP_PROGRAMS", setting)
    model = Llama(preset("tiny"), dtype=jnp.float32, seed=0) if model is None else model
    llm = bijax.LLM(model, max_model_len=128, max_num_seqs=2, max_num_batched_tokens=32, num_kv_blocks=24)
    outs = [o.outputs[0] for o in llm.generate(PROMPTS, SPS, use_tqdm=False)]
    return outs, llm


def _same(a, b) -> bool:
    return all(
        x.token_ids == y.token_ids and np.array_equal(bits(x.logprobs), bits(y.logprobs))
        for x, y in zip(a, b, strict=True)
    )


@pytest.fixture(scope="module")
def runs():
    """The chain everywhere, the whole forward everywhere, the chain from 32 tokens only."""
    mp = pytest.MonkeyPatch()
    try:
        return {s: _run(mp, s) for s in ("layers", "whole", "32")}
    finally:
        mp.undo()


def test_chain_and_whole_forward_give_the_same_bits(runs):
    (chain, llm_chain), (whole, llm_whole) = runs["layers"], runs["whole"]
    assert _same(chain, whole)
    # each ran what it says: the chain's programs, or only whole forwards
    assert {k[0] for k in llm_chain.engine.runner._aot} == {"embed", "block", "head", "sample"}
    assert {k[0] for k in llm_whole.engine.runner._aot} == {"forward", "sample"}


def test_the_bits_check_sees_a_tiny_weight_change(runs, monkeypatch):
    """Control: the same comparison fails when the last layer's down projection is scaled by
    1 + 2**-12 (the check can fail on a change far below any tolerance)."""
    chain, _ = runs["layers"]
    model = Llama(preset("tiny"), dtype=jnp.float32, seed=0)
    w = model.layers[-1].mlp.w_down
    w[...] = w[...] * jnp.float32(1 + 2**-12)
    changed, _ = _run(monkeypatch, "whole", model)
    assert not _same(chain, changed)


def test_chain_from_a_token_bucket(runs):
    """``BIJAX_STEP_PROGRAMS=32``: 16-token steps run the whole forward, longer ones the chain -
    and the bits are the chain's."""
    outs, llm = runs["32"]
    assert _same(outs, runs["layers"][0])
    keys = set(llm.engine.runner._aot)
    assert any(k[0] == "forward" and k[2] == 16 for k in keys)
    assert any(k[0] == "block" and k[2] == 32 for k in keys)
    assert not any(k[0] == "forward" and k[2] == 32 for k in keys)


def test_the_setting_is_checked_and_defaults_to_the_chain_on_cpu(monkeypatch):
    monkeypatch.delenv("BIJAX_STEP_PROGRAMS", raising=False)
    assert step_programs.chain_from() == 0  # CPU: every bucket as the chain
    for value, want in (("layers", 0), ("whole", None), ("256", 256)):
        monkeypatch.setenv("BIJAX_STEP_PROGRAMS", value)
        assert step_programs.chain_from() == want
    for bad in ("wholes", "-1", "1.5"):
        monkeypatch.setenv("BIJAX_STEP_PROGRAMS", bad)
        with pytest.raises(ValueError, match="BIJAX_STEP_PROGRAMS"):
            step_programs.chain_from()
