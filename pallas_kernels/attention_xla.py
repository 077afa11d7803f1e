"""The baseline's paged attention (``invariant=False``): the fastest bounded ops JAX offers, batch-VARIANT.

``attention_reference`` gathers every token's keys densely up to the block table's width
(``max_model_len``): exact, but under jit a 2048-token step of a 16k-context engine
materializes [2048, 16384, Hkv, D] in float32 - the baseline that crashed with
RESOURCE_EXHAUSTED and ran single streams at half the invariant path's speed. This is what a
non-invariant engine would run instead, for the same flat ragged batch:

* tokens whose sequence starts in this step (a prompt's first chunk: no keys cached before
  the step) see only this step's keys: one fused attention over the step's own q/k/v under a
  same-sequence causal mask - cuDNN flash attention on GPU (``jax.nn.dot_product_attention``),
  XLA's on CPU. No cache read at all;
* every other token (decode tokens, speculative verify chunks, later prompt chunks, prefix
  cache hits) reads its cached keys 0..pos: on GPU as one query row of cuDNN's paged flash
  attention, which reads the pool through the row's block table up to pos (no gather, no
  host sync); on CPU in a loop over KV chunks with an online softmax, running only as many
  iterations as the longest such context needs (a dynamic trip count: blocks past it are never
  gathered), each gathering at most ``GATHER_BYTES`` of K (and of V). Memory is bounded for
  any bucket and any ``max_model_len``. (A later chunk's rows each read their whole context:
  correct and bounded, not fast - the case a real engine runs a prefix-aware kernel for.)

The chunk size depends on the bucket's token count and the trip count on the other
sequences' lengths, so a token's summation order depends on its batch: this stays the
negative control. Precision matches a plain engine: bf16/f16 operands, float32 scores and
accumulators.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["GATHER_BYTES", "attention_xla", "chunk_blocks"]

GATHER_BYTES = 64 << 20  # K gathered per loop iteration (V the same): the loop's memory bound
CHUNK_TOKENS = 256  # keys per iteration at most: short contexts gather little past their end
CUDNN_MIN_TOKENS = 64  # below this a step's own-keys attention is a few tiny dots: XLA's


def chunk_blocks(
    num_tokens: int, block_size: int, num_kv_heads: int, head_dim: int, itemsize: int, max_blocks: int
) -> int:
    """KV blocks gathered per loop iteration: a power of two, at least 1, at most the table's
    width and ``CHUNK_TOKENS`` keys, with ``num_tokens`` rows of K within ``GATHER_BYTES``."""
    per_block = num_tokens * block_size * num_kv_heads * head_dim * itemsize
    n = max(1, min(GATHER_BYTES // per_block, CHUNK_TOKENS // block_size))
    n = 1 << (int(n).bit_length() - 1)
    return int(min(n, max_blocks))


def _on_gpu() -> bool:
    return jax.default_backend() in ("gpu", "cuda")


def _dot_operands(*xs):
    """``xs`` as the dots take them: float16 widened to float32 on the CPU, whose dot has no
    float16 x float16 -> float32 form (XLA: "precision 'F16_F16_F32' is not supported")."""
    if _on_gpu():
        return xs
    return tuple(x.astype(jnp.float32) if x.dtype == jnp.float16 else x for x in xs)


def _own_keys(q, k, v, mask, scale):
    """Attention of the step's tokens over the step's own keys (mask [T, T]); [T, Hq, D]."""
    # cuDNN where the process runs on a GPU (its wrapper cannot even be traced without cuDNN,
    # so ``lax.platform_dependent`` is no choice here); tiny steps are a few dots either way.
    impl = "cudnn" if _on_gpu() and q.shape[0] >= CUDNN_MIN_TOKENS else "xla"
    # is_causal in flat order (tiles above the diagonal skipped) is exact because a sequence's
    # tokens sit in the step in position order; the mask adds the sequence boundaries.
    dtype = q.dtype
    q, k, v = _dot_operands(q, k, v)
    out = jax.nn.dot_product_attention(
        q[None], k[None], v[None], mask=mask[None, None], scale=scale, is_causal=True, implementation=impl
    )
    return out[0].astype(dtype)


def _paged_decode(q_rows, k_cache, v_cache, block_tables, context_lens, scale):
    """cuDNN paged flash attention, one query row per table row (q_rows [R, Hq, D], block_tables
    [R, W]) over keys 0..context_lens-1 read through the table.

    JAX's public wrapper checks that the pool holds exactly num_seqs x table-width blocks (a pool
    per batch); a shared pool never does and the kernel reads only through the table, so this
    calls the layer below that check (pinned jax 0.11.2).
    """
    from jax._src.cudnn import fused_attention_stablehlo as fa

    num_rows = block_tables.shape[0]
    q = q_rows[:, None]  # [S, 1, Hq, D]
    tables = block_tables.astype(jnp.int32)[:, None, :, None]
    none = jnp.zeros(0, q.dtype)
    out = fa._dot_product_attention(
        q, k_cache, v_cache, none,
        jnp.ones(num_rows, jnp.int32), context_lens.astype(jnp.int32), none, none,
        tables, tables, scale, 42, 0.0, (False, False),
        fa.MaskType.PADDING, fa.AttentionLayout.BTNH.value, None, fa.check_cudnn_version(), False,
    )  # fmt: skip
    return out[:, 0]


def _cached_keys(q, k_cache, v_cache, block_tables, seq, pos, need, scale):
    """Attention of the tokens marked ``need`` over their sequence's cached keys 0..pos, in a loop
    over KV chunks (online softmax in float32); other rows come back as zeros."""
    t, hq, d = q.shape
    _, block_size, hkv, _ = k_cache.shape
    g = hq // hkv
    max_blocks = block_tables.shape[1]
    cb = chunk_blocks(t, block_size, hkv, d, k_cache.dtype.itemsize, max_blocks)
    width = cb * block_size
    num_chunks = -(-max_blocks // cb)
    tables = jnp.pad(block_tables, ((0, 0), (0, num_chunks * cb - max_blocks)))
    span = jnp.where(need, pos + 1, 0)  # keys 0..pos (this step's own keys are already written)
    trips = (jnp.max(span) + width - 1) // width
    qg = q.reshape(t, hkv, g, d)

    def body(c, state):
        m, l, acc = state
        cols = lax.dynamic_slice_in_dim(tables, c * cb, cb, axis=1)  # [S, cb]
        blocks = jnp.where(need[:, None], cols[seq], 0)  # rows that need nothing read the null block
        kk = k_cache[blocks].reshape(t, width, hkv, d)
        vv = v_cache[blocks].reshape(t, width, hkv, d)
        s = jnp.einsum("thgd,tkhd->thgk", *_dot_operands(qg, kk), preferred_element_type=jnp.float32) * scale
        j = c * width + jnp.arange(width)
        key_ok = j[None, :] < span[:, None]  # [T, width]
        vv = jnp.where(key_ok[:, :, None, None], vv, jnp.zeros_like(vv))  # stale rows may hold NaN
        ok = key_ok[:, None, None, :]
        s = jnp.where(ok, s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(-1))
        m_ref = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.where(ok, jnp.exp(s - m_ref[..., None]), 0.0)
        alpha = jnp.exp(m - m_ref)
        pv = jnp.einsum(
            "thgk,tkhd->thgd", *_dot_operands(p.astype(vv.dtype), vv), preferred_element_type=jnp.float32
        )
        return m_new, l * alpha + p.sum(-1), acc * alpha[..., None] + pv

    init = (
        jnp.full((t, hkv, g), -jnp.inf, jnp.float32),
        jnp.zeros((t, hkv, g), jnp.float32),
        jnp.zeros((t, hkv, g, d), jnp.float32),
    )
    _, l, acc = lax.fori_loop(0, trips, body, init)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    return out.reshape(t, hq, d)


def attention_xla(q, k, v, k_cache, v_cache, block_tables, context_lens, token_seq, token_pos, *, scale=None):
    """Causal paged attention for a flat ragged batch, plain JAX/cuDNN (batch-VARIANT baseline).

    Args as ``attention`` (whose checks the caller has passed), plus this step's own k, v
    [T, Hkv, D] (already written to the caches at their slots). A sequence's tokens must appear
    in the step in position order (as the engine lays out its chunks). Returns [T, Hq, D] in q's dtype;
    padding tokens (position -1) get zeros.
    """
    t, hq, d = q.shape
    num_seqs = block_tables.shape[0]
    scale = float(d**-0.5 if scale is None else scale)
    real = token_pos >= 0
    seq = jnp.clip(token_seq, 0, num_seqs - 1)
    in_step = jax.ops.segment_sum(real.astype(jnp.int32), seq, num_segments=num_seqs)
    cached_before = (context_lens - in_step)[seq] > 0
    need = real & cached_before

    same = (seq[:, None] == seq[None, :]) & real[:, None] & real[None, :]
    mask = same & (token_pos[None, :] <= token_pos[:, None])
    mask = mask | jnp.eye(t, dtype=bool)  # no empty row (padding): cuDNN would return NaN
    own = _own_keys(q, k.astype(q.dtype), v.astype(q.dtype), mask, scale)
    if _on_gpu():  # every such token is a query row of cuDNN's paged kernel (no host sync)
        ctx = jnp.where(need, token_pos + 1, 1)  # rows that need nothing read the null block
        cached = _paged_decode(q, k_cache, v_cache, block_tables[seq], ctx, scale)
    else:
        cached = _cached_keys(q, k_cache, v_cache, block_tables, seq, token_pos, need, scale)
    out = jnp.where(need[:, None, None], cached.astype(q.dtype), own)
    return jnp.where(real[:, None, None], out, jnp.zeros_like(out)).astype(q.dtype)
