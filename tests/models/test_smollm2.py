"""The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against transformers.

Reference: transformers loading the same GGUF (fixtures from make_gguf_fixtures.py):
last-position float32 logits of three chat prompts and 16 greedy tokens.
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.llama import Llama
from models.loading import embedded_model_path, load_model
from tests.conftest import bits
from tests.models.harness import greedy

FIX = os.path.join(os.path.dirname(__file__), "fixtures", "smollm2_gguf")
REF = np.load(os.path.join(FIX, "reference.npz"), allow_pickle=False)
PROMPTS = [REF[f"prompt_ids_{i}"] for i in range(3)]
_FWD = nnx.jit(Llama.forward, static_argnames="invariant")


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2-135m")


def _rel(out, ref):
    return float(np.abs(np.asarray(out, np.float64) - ref).max() / np.abs(ref).max())


def test_default_model_is_the_embedded_gguf(smollm2):
    assert embedded_model_path("smollm2-135m").endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    c = smollm2.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.vocab_size) == (30, 576, 9, 3, 49152)
    assert c.tie_word_embeddings and smollm2.dtype == jnp.float32


def _padded_batch():
    """The three prompts right-padded into one [3, L] batch (causal: padding never reaches them)."""
    n = max(len(p) for p in PROMPTS)
    batch = np.zeros((3, n), np.int32)
    for i, p in enumerate(PROMPTS):
        batch[i, : len(p)] = p
    return jnp.asarray(batch)


@pytest.mark.parametrize("invariant", [True, False])
def test_last_logits_match_transformers(smollm2, invariant):
    out = np.asarray(_FWD(smollm2, _padded_batch(), invariant=invariant))
    for i, (ids, ref) in enumerate(zip(PROMPTS, REF["last_logits"], strict=True)):
        assert _rel(out[i, len(ids) - 1], ref) <= 1e-4


@pytest.fixture(scope="module")
def decoded(smollm2):
    bucket = -(-max(len(p) for p in PROMPTS) // 16) * 16
    blocks = -(-(bucket + 16) // 16)  # one cache size: the three share their compiled steps
    return [greedy(smollm2, ids, 16, prefill_bucket=bucket, blocks=blocks) for ids in PROMPTS]


def test_greedy_16_tokens_match_transformers(decoded):
    for (got, _), want in zip(decoded, REF["greedy"], strict=True):
        assert got == [int(t) for t in want]


def test_decode_logits_equal_prefill_logits_bitwise(smollm2, decoded):
    """Prefill vs decode at model level on the real model: each decoded step's logits equal the
    full forward's logits at that position (one batch of all three sequences), bit for bit."""
    seqs = [
        np.concatenate([ids, got[:-1]]).astype(np.int32)
        for ids, (got, _) in zip(PROMPTS, decoded, strict=True)
    ]
    n = max(len(s) for s in seqs)
    batch = np.zeros((3, n), np.int32)
    for i, s in enumerate(seqs):
        batch[i, : len(s)] = s
    full = np.asarray(_FWD(smollm2, jnp.asarray(batch)))
    for i, (ids, (_, step_logits)) in enumerate(zip(PROMPTS, decoded, strict=True)):
        np.testing.assert_array_equal(bits(step_logits), bits(full[i, len(ids) - 1 : len(seqs[i])]))


def test_config_matches_transformers_reading_of_the_gguf(smollm2):
    import json

    from models.configs import LlamaConfig

    ref = LlamaConfig.from_hf(json.load(open(os.path.join(FIX, "hf_config.json"))))
    ours = smollm2.config
    for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads"):
        assert getattr(ours, f) == getattr(ref, f), f
    assert (ours.head_dim, ours.rope_theta, ours.tie_word_embeddings) == (ref.head_dim, ref.rope_theta, True)
    assert np.float32(ours.rms_norm_eps) == np.float32(ref.rms_norm_eps)
    np.testing.assert_array_equal(ours.inv_freq(), ref.inv_freq())
