"""The baseline's paged attention (``attention_xla``): accuracy on mixed steps, bounded memory
where the reference is not, and batch-variance (it is the negative control)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.attention import attention_reference
from pallas_kernels.attention_xla import GATHER_BYTES, attention_xla, chunk_blocks
from tests.conftest import bits
from tests.pallas_kernels.test_attention import Paged


def run_xla(paged, tokens, *, max_blocks=None):
    """tokens: (seq, pos) pairs, pos -1 = padding; a sequence's in-step tokens are its last ones."""
    seq = np.array([s for s, _ in tokens], np.int32)
    pos = np.array([p for _, p in tokens], np.int32)
    start = np.concatenate([[0], np.cumsum(paged.lens)])
    q = jnp.concatenate(paged.q)[np.where(pos >= 0, start[seq] + pos, 0)]
    k = jnp.concatenate(paged.k)[np.where(pos >= 0, start[seq] + pos, 0)]
    v = jnp.concatenate(paged.v)[np.where(pos >= 0, start[seq] + pos, 0)]
    bt = paged.bt if max_blocks is None else np.pad(paged.bt, ((0, 0), (0, max_blocks - paged.bt.shape[1])))
    lens = np.array(paged.lens, np.int32)
    return jax.jit(attention_xla)(q, k, v, paged.kc, paged.vc, bt, lens, seq, pos)


def test_mixed_step_matches_float64():
    # seq 0: a first chunk (no cached keys: the own-keys path); seq 1: a decode token; seq 2: a
    # later chunk after 100 cached keys; seq 3: a verify-like chunk of 3; padding in between.
    paged = Paged([37, 150, 120, 70], d=128)
    tokens = [(0, p) for p in range(37)] + [(1, 149), (0, -1)] + [(2, p) for p in range(100, 120)]
    tokens += [(3, 67), (3, 68), (3, 69), (0, -1)]
    out = np.asarray(run_xla(paged, tokens), np.float64)
    real = [i for i, (_, p) in enumerate(tokens) if p >= 0]
    ref = np.stack([paged.f64(s, p) for s, p in tokens if p >= 0])
    assert np.abs(out[real] - ref).max() / np.abs(ref).max() <= 1e-5
    pad = [i for i, (_, p) in enumerate(tokens) if p < 0]
    assert not np.asarray(out[pad]).any()


def test_memory_is_bounded_where_the_reference_is_not():
    # a 512-token step of a 16k-token table: the reference gathers every token's whole table
    paged = Paged([600, 40], hq=8, hkv=2, d=128, dtype=jnp.bfloat16)
    t, max_blocks = 512, 1024
    args = (
        jnp.zeros((t, 8, 128), jnp.bfloat16),
        paged.kc,
        paged.vc,
        jnp.zeros((2, max_blocks), jnp.int32),
        jnp.array([600, 40], jnp.int32),
        jnp.zeros(t, jnp.int32),
        jnp.arange(t, dtype=jnp.int32),
    )
    kv = jnp.zeros((t, 2, 128), jnp.bfloat16)

    def temp(fn, *a):
        return jax.jit(fn).lower(*a).compile().memory_analysis().temp_size_in_bytes

    ours = temp(attention_xla, args[0], kv, kv, *args[1:])
    ref = temp(attention_reference, *args)
    assert ref > 10 * ours, (ref, ours)
    assert ours < 8 * GATHER_BYTES
    assert chunk_blocks(t, 16, 2, 128, 2, max_blocks) * 16 * t * 2 * 128 * 2 <= GATHER_BYTES


def test_batch_variant_control():
    # the same decode token in a small and a large bucket: the chunk size follows the bucket's
    # token count, so the token's keys are folded in other pieces and its bits differ - the
    # negative control's premise (a bits check of the baseline must be able to fail)
    paged = Paged([3000, 40], hq=8, hkv=2, d=128, seed=3)
    small = run_xla(paged, [(0, 2999)] + [(1, -1)] * 63)[0]
    large = run_xla(paged, [(0, 2999)] + [(1, -1)] * 1023)[0]
    np.testing.assert_allclose(np.asarray(small), np.asarray(large), rtol=1e-5, atol=1e-6)
    assert (bits(small) != bits(large)).any()


def test_float16_runs_on_the_cpu():
    """float16 operands on the CPU, whose dot has no float16 x float16 -> float32 form: the
    own-keys and cached-keys paths widen them (a user-level probe: `bijax check --dtype float16`
    died in its XLA control). float16 out, close to the float32 run of the same values."""
    paged = Paged([37, 150], hq=8, hkv=2, d=64, dtype=jnp.float16)
    tokens = [(0, p) for p in range(37)] + [(1, 149), (0, -1)]
    out = run_xla(paged, tokens)
    assert out.dtype == jnp.float16
    real = [i for i, (_, p) in enumerate(tokens) if p >= 0]
    ref = np.stack([paged.f64(s, p) for s, p in tokens if p >= 0])
    assert np.abs(np.asarray(out, np.float64)[real] - ref).max() / np.abs(ref).max() <= 2e-3
