"""Qwen3 dense (per-head q/k RMSNorm) through the engine: a request's bits alone == in a batch,
at tensor_parallel_size 1 == 2, and the trainer's logprobs == generate's. (Parity with
transformers: tests/models/test_llama.py, fixture ``qwen3``.)"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

import bijax
from bijax import SamplingParams as SP
from tests.conftest import bits

KW = dict(dtype=jnp.float32, k_shards=8, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32)
PROMPTS = [[5, 9, 13] * 9, [7, 3] * 5, [11] * 40, [2, 4, 6, 8]]
SPS = [SP(temperature=0.8, seed=i, max_tokens=6, ignore_eos=True) for i in range(4)]


def _same(a, b) -> bool:
    return a.outputs[0].token_ids == b.outputs[0].token_ids and np.array_equal(
        bits(a.outputs[0].logprobs), bits(b.outputs[0].logprobs)
    )


def test_qwen3_alone_equals_batched_at_tp_1_and_2_and_trainer_logprobs_match():
    llm = bijax.LLM("tiny-qwen3", **KW)
    assert llm.model.config.qk_norm
    batch = llm.generate(PROMPTS, SPS, use_tqdm=False)
    alone = [llm.generate([p], [s], use_tqdm=False)[0] for p, s in zip(PROMPTS, SPS, strict=True)]
    assert all(_same(a, b) for a, b in zip(alone, batch, strict=True))
    tp2 = bijax.LLM("tiny-qwen3", tensor_parallel_size=2, **KW).generate(PROMPTS, SPS, use_tqdm=False)
    assert all(_same(a, b) for a, b in zip(tp2, batch, strict=True))
    # the trainer side: bijax.logprobs of prompt + completion == generate's logprobs, bit for bit
    out = batch[2]
    tokens = np.asarray([PROMPTS[2] + out.outputs[0].token_ids], np.int32)
    lp = np.asarray(bijax.logprobs(llm.model, tokens, temperature=0.8))[0, len(PROMPTS[2]) :]
    assert np.array_equal(bits(lp), bits(out.outputs[0].logprobs))
    # control: the XLA path's logprobs for the same tokens are not the invariant path's bits
    xla = np.asarray(bijax.logprobs(llm.model, tokens, temperature=0.8, invariant=False))[
        0, len(PROMPTS[2]) :
    ]
    assert not np.array_equal(bits(xla), bits(lp))
