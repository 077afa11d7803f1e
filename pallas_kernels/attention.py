"""Batch-invariant paged attention: one code path for prefill chunks and decode tokens.

Inputs are a flat, ragged batch of T query tokens, each with its sequence and absolute
position, against a paged KV cache ``[num_blocks, block_size, Hkv, D]`` addressed through
a block table per sequence. A token at position p attends causally to its sequence's keys
0..p (optionally a sliding window, optionally soft-capped logits).

The reduction structure depends on the token's position and KV only:

* keys are cut into splits of ``split_size`` tokens starting at absolute multiples of the
  split size; a split is reduced on its own into an fp32 softmax state (max, sum, acc);
* GPU (``attention_triton``): inside a split, keys are read in tiles of
  ``max(64, block_size)`` tokens starting at absolute multiples, with an online softmax in
  fp32; CPU (``attention_cpu``): one fixed-shape block per split;
* masked probabilities are exactly 0 (and masked values are zeroed, so stale cache rows
  cannot leak NaN);
* the splits are merged as a left fold in split order - also when there is only one
  (``attention_math.fold_step``, shared by both paths);
* a token's rows (its query heads) share a program only with rows whose arithmetic cannot touch
  theirs: a dot's rows are independent and row sums are dots (``attention_math.kv_tile_step``),
  whether the program holds one token (decode, ``tokens``) or a tile of tokens (``tiles``).

Shapes are static per input bucket; lengths and positions are data. Padding tokens have
position -1 and get zeros. ``write_kv`` stores new K/V rows at their cache slots.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import attention_cpu, attention_triton, runtime
from pallas_kernels.attention_math import HEAD_DIMS, SPLIT_SIZE, AttentionSpec, key_mask, kv_tile
from pallas_kernels.checks import check_float_dtype

__all__ = [
    "SPLIT_SIZE",
    "AttentionSpec",
    "attention",
    "attention_reference",
    "check_write_kv",
    "segment_attention_reference",
    "write_kv",
]


# --------------------------------------------------------------------------- the op


@runtime.kernel_op("attention", static_argnames=("spec", "run"))
def _attention(q, k_cache, v_cache, index, *, spec, run):
    block_tables, context_lens, token_seq, token_pos = index
    # Padding tokens may carry any sequence index: clamp it so no read goes out of bounds.
    token_seq = jnp.clip(token_seq, 0, block_tables.shape[0] - 1)
    index = (block_tables, context_lens, token_seq, token_pos)
    return _attention_vjp(q, k_cache, v_cache, index, spec, run)


# Differentiable in q, k_cache and v_cache: the forward is the kernel (bits unchanged), the
# backward the VJP of the plain XLA ``attention_reference``; the integer index gets no cotangent.
# ``run`` = (backend, interpret, gpu_kernel): how to run it, never what it computes.
@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _attention_vjp(q, k_cache, v_cache, index, spec, run):
    return _attention_impl(q, k_cache, v_cache, index, spec, run)


def _attention_vjp_fwd(q, k_cache, v_cache, index, spec, run):
    return _attention_impl(q, k_cache, v_cache, index, spec, run), (q, k_cache, v_cache, index)


def _attention_vjp_bwd(spec, run, res, g):
    q, k_cache, v_cache, index = res

    def ref(q, k, v):
        return attention_reference(
            q, k, v, *index, scale=spec.scale, sliding_window=spec.window, logit_softcap=spec.softcap
        )

    _, vjp = jax.vjp(ref, q, k_cache, v_cache)
    return (*vjp(g), None)


_attention_vjp.defvjp(_attention_vjp_fwd, _attention_vjp_bwd)


def _attention_impl(q, k_cache, v_cache, index, spec, run):
    backend, interpret, gpu_kernel = run
    t, hq, d = q.shape
    hkv = k_cache.shape[2]
    group = hq // hkv
    qg = q.reshape(t, hkv, group, d)

    def cpu(*args):
        return attention_cpu.attend(*args, spec=spec).astype(q.dtype)

    def gpu(*args):
        return attention_triton.attend(*args, spec=spec, interpret=interpret, kernel=gpu_kernel)

    # Both return the normalised output [T, Hkv, G, D] (platform_dependent needs equal types).
    return runtime.dispatch(backend, cpu, gpu, qg, k_cache, v_cache, index).reshape(t, hq, d)


# --------------------------------------------------------------------------- input checks


def _check_arrays(q, k_cache, v_cache, block_tables, context_lens, token_seq, token_pos):
    """Ranks, dtypes and shapes (static: checked under jit too)."""
    for name, a, nd in (("q", q, 3), ("k_cache", k_cache, 4), ("v_cache", v_cache, 4)):
        if getattr(a, "ndim", None) != nd:
            raise ValueError(f"attention: {name} must be {nd}-D, got shape {getattr(a, 'shape', None)}")
    check_float_dtype("attention", q=q, k_cache=k_cache, v_cache=v_cache)
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise TypeError(
            f"attention: dtype mismatch q={q.dtype}, k_cache={k_cache.dtype}, v_cache={v_cache.dtype}"
        )
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"attention: k_cache {k_cache.shape} and v_cache {v_cache.shape} differ")
    t, hq, d = q.shape
    _, block_size, hkv, dk = k_cache.shape
    if t == 0:
        raise ValueError("attention: q has no tokens (T == 0)")
    if d != dk:
        raise ValueError(f"attention: head dim of q ({d}) != cache's ({dk})")
    if d not in HEAD_DIMS:
        raise ValueError(f"attention: head dim must be one of {HEAD_DIMS}, got {d}")
    if hq % hkv:
        raise ValueError(f"attention: {hq} query heads are not a multiple of {hkv} KV heads")
    if block_size & (block_size - 1):
        raise ValueError(f"attention: block_size must be a power of two, got {block_size}")
    for name, a, shape in (
        ("block_tables", block_tables, None),
        ("context_lens", context_lens, None),
        ("token_seq", token_seq, (t,)),
        ("token_pos", token_pos, (t,)),
    ):
        if not jnp.issubdtype(getattr(a, "dtype", np.float32), jnp.integer):
            raise TypeError(f"attention: {name} must be an integer array")
        if shape is not None and tuple(a.shape) != shape:
            raise ValueError(f"attention: {name} must have shape {shape}, got {tuple(a.shape)}")
    if block_tables.ndim != 2 or context_lens.shape != (block_tables.shape[0],):
        raise ValueError(
            f"attention: block_tables must be [num_seqs, max_blocks] and context_lens [num_seqs]; "
            f"got {tuple(block_tables.shape)} and {tuple(context_lens.shape)}"
        )


def _check_index_values(k_cache, block_tables, context_lens, token_seq, token_pos):
    """The index arrays' values, when they are concrete (eager calls)."""
    num_blocks, block_size = k_cache.shape[:2]
    ctx, pos, seq, bt = map(runtime.concrete, (context_lens, token_pos, token_seq, block_tables))
    if ctx is not None:
        if (ctx < 0).any():
            raise ValueError(f"attention: negative context length {int(ctx.min())}")
        if (ctx > block_tables.shape[1] * block_size).any():
            raise ValueError(
                f"attention: context length {int(ctx.max())} needs more than the block table's "
                f"{block_tables.shape[1]} blocks of {block_size}"
            )
    if seq is not None and pos is not None and ctx is not None:
        real = pos >= 0
        if ((seq[real] < 0) | (seq[real] >= len(ctx))).any():
            raise ValueError("attention: token_seq out of range for a real (position >= 0) token")
        if (pos[real] >= ctx[seq[real]]).any():
            raise ValueError("attention: a token's position is not below its sequence's context length")
    if bt is not None and ((bt < 0) | (bt >= num_blocks)).any():
        raise ValueError(f"attention: block_tables entries must be in [0, {num_blocks})")


# --------------------------------------------------------------------------- public entry points


def attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    block_tables: jax.Array,
    context_lens: jax.Array,
    token_seq: jax.Array,
    token_pos: jax.Array,
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    split_size: int = SPLIT_SIZE,
    backend: str = "auto",
    interpret: bool = False,
    gpu_kernel: str = "auto",
) -> jax.Array:
    """Causal paged attention for a flat, ragged batch of query tokens. Batch invariant.

    Args:
      q: [T, Hq, D] query tokens (any mix of prefill chunks and decode tokens), D in {64, 128}.
      k_cache, v_cache: [num_blocks, block_size, Hkv, D], same dtype as q; Hq % Hkv == 0.
      block_tables: int [num_seqs, max_blocks] physical block of each logical block.
      context_lens: int [num_seqs] tokens in each sequence's cache (this step's included).
      token_seq, token_pos: int [T] sequence index and absolute position of each token;
        padding tokens have position -1 (their output is zeros).
      scale: logit scale (default D ** -0.5); sliding_window: keys p - window < j <= p;
      logit_softcap: ``c * tanh(s / c)`` on the scaled logits.
      split_size: fixed split size in tokens (a multiple of max(64, block_size)); part of
        the numerics: a token's bits depend on it, never on the batch.
      gpu_kernel: "auto", "tokens" (a program per token and split) or "tiles" (a program per
        tile of tokens, splits folded in registers): how the GPU runs it, never its bits.
    Returns [T, Hq, D] in q's dtype.

    The KV of this step's tokens must already be in the cache (``write_kv``). Differentiable
    in q, k_cache and v_cache (``jax.custom_vjp``: the backward is the VJP of
    ``attention_reference``, plain XLA over each token's densely gathered keys).
    """
    runtime.check_backend(backend, interpret)
    if gpu_kernel not in attention_triton.GPU_KERNELS:
        raise ValueError(
            f"attention: gpu_kernel must be one of {attention_triton.GPU_KERNELS}, got {gpu_kernel!r}"
        )
    index = (block_tables, context_lens, token_seq, token_pos)
    _check_arrays(q, k_cache, v_cache, *index)
    spec = AttentionSpec.create(
        q.shape[-1],
        scale=scale,
        sliding_window=sliding_window,
        logit_softcap=logit_softcap,
        split_size=split_size,
    )
    if spec.split_size % kv_tile(k_cache.shape[1]):
        raise ValueError(
            f"attention: split_size ({spec.split_size}) must be a multiple of max(64, block_size); "
            f"got block_size={k_cache.shape[1]}"
        )
    _check_index_values(k_cache, *index)
    index = tuple(jnp.asarray(a, jnp.int32) for a in index)
    return _attention(q, k_cache, v_cache, index, spec=spec, run=(backend, interpret, gpu_kernel))


@runtime.kernel_op("write_kv", donate_argnums=(0, 1))
def _write_kv(k_cache, v_cache, k, v, slots):
    block_size = k_cache.shape[1]
    null = jnp.arange(slots.shape[0], dtype=jnp.int32) % block_size  # padding -> reserved block 0
    slots = jnp.where(slots < 0, null, slots)
    blk, off = slots // block_size, slots % block_size
    return k_cache.at[blk, off].set(k), v_cache.at[blk, off].set(v)


def check_write_kv(op: str, k_cache, v_cache, k, v, slot_mapping, *, cast: bool = False) -> None:
    """``write_kv``'s input checks (``cast``: k, v may have another dtype than the caches)."""
    for name, a in (("k_cache", k_cache), ("v_cache", v_cache)):
        if getattr(a, "ndim", None) != 4:
            raise ValueError(
                f"{op}: {name} must be [num_blocks, block_size, Hkv, D], got {getattr(a, 'shape', None)}"
            )
    for name, a in (("k", k), ("v", v)):
        if getattr(a, "ndim", None) != 3:
            raise ValueError(f"{op}: {name} must be a [T, Hkv, D] array, got {type(a).__name__}")
    if k.shape != v.shape or k.shape[1:] != k_cache.shape[2:] or v_cache.shape != k_cache.shape:
        raise ValueError(f"{op}: k {k.shape} / v {v.shape} do not fit cache rows {k_cache.shape[2:]}")
    if not cast and (k.dtype != k_cache.dtype or v.dtype != v_cache.dtype):
        raise TypeError(f"{op}: dtype mismatch k={k.dtype}, cache={k_cache.dtype}")
    if not hasattr(slot_mapping, "shape"):
        raise TypeError(f"{op}: slot_mapping must be an int array of shape ({k.shape[0]},), got a "
                        f"{type(slot_mapping).__name__}")  # fmt: skip
    if tuple(slot_mapping.shape) != (k.shape[0],):
        raise ValueError(
            f"{op}: slot_mapping must have shape ({k.shape[0]},), got {tuple(slot_mapping.shape)}"
        )
    if not jnp.issubdtype(slot_mapping.dtype, jnp.integer):
        raise TypeError(f"{op}: slot_mapping must be an integer array, got {slot_mapping.dtype}")
    slots = runtime.concrete(slot_mapping)
    capacity = k_cache.shape[0] * k_cache.shape[1]
    if slots is not None:
        if (slots >= capacity).any():
            raise ValueError(f"{op}: slot {int(slots.max())} is outside the cache's {capacity} slots")
        real = slots[slots >= 0]
        if len(np.unique(real)) != len(real):
            raise ValueError(f"{op}: two tokens write the same cache slot")


def write_kv(k_cache, v_cache, k, v, slot_mapping):
    """Stores k, v [T, Hkv, D] at ``slot_mapping`` [T] (= block * block_size + offset) of the caches.

    Slots of real tokens must be unique; a negative slot marks a padding token, which writes
    into the reserved null block 0 (never read unmasked). The caches are donated.
    """
    check_write_kv("write_kv", k_cache, v_cache, k, v, slot_mapping)
    return _write_kv(k_cache, v_cache, k, v, jnp.asarray(slot_mapping, jnp.int32))


# --------------------------------------------------------------------------- references (plain XLA)


def attention_reference(
    q,
    k_cache,
    v_cache,
    block_tables,
    context_lens,
    token_seq,
    token_pos,
    *,
    scale=None,
    sliding_window=None,
    logit_softcap=None,
):
    """Plain XLA attention over each token's densely gathered KV (batch-VARIANT negative control).

    The dense KV length is the longest context in the batch, so a token's reduction length
    (and with it XLA's summation order) depends on the other sequences.
    """
    t, hq, d = q.shape
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    scale = d**-0.5 if scale is None else scale
    longest = (
        int(np.max(np.asarray(context_lens)))
        if runtime.concrete(context_lens) is not None
        else block_tables.shape[1] * block_size
    )
    nblk = max(1, -(-longest // block_size))
    phys = block_tables[token_seq][:, :nblk]  # [T, nblk]
    k = k_cache[phys].reshape(t, nblk * block_size, hkv, d)
    v = v_cache[phys].reshape(t, nblk * block_size, hkv, d)
    qg = q.reshape(t, hkv, hq // hkv, d).astype(jnp.float32)
    s = jnp.einsum("thgd,tkhd->thgk", qg, k.astype(jnp.float32)) * scale
    if logit_softcap is not None:
        s = logit_softcap * jnp.tanh(s / logit_softcap)
    j = jnp.arange(nblk * block_size)
    ok = key_mask(j[None, :], token_pos[:, None], context_lens[token_seq][:, None], sliding_window)
    s = jnp.where(ok[:, None, None, :], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    p = jnp.where(ok[:, None, None, :], p, 0.0)
    v = jnp.where(ok[:, :, None, None], v.astype(jnp.float32), 0.0)
    out = jnp.einsum("thgk,tkhd->thgd", p, v)
    out = jnp.where((token_pos >= 0)[:, None, None, None], out, 0.0)
    return out.reshape(t, hq, d).astype(q.dtype)


def segment_attention_reference(q, k, v, segment_ids):
    """Plain XLA attention over B packed rows of L tokens (the batch-variant trainer baseline).

    q [B*L, Hq, D], k, v [B*L, Hkv, D], segment_ids int [B, L]: token i sees tokens j <= i of
    its own segment of its row (padding, segment -1, sees earlier padding: never NaN, never
    used). Returns [B*L, Hq, D] in q's dtype.
    """
    b, length = segment_ids.shape
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
    g = hq // hkv
    q = q.reshape(b, length, hkv, g, d)
    k = k.reshape(b, length, hkv, d)
    v = v.reshape(b, length, hkv, d)
    s = jnp.einsum("bqhgd,bkhd->bhgqk", q, k, preferred_element_type=jnp.float32) * np.float32(d**-0.5)
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    mask = same & jnp.tril(jnp.ones((length, length), bool))[None]
    s = jnp.where(mask[:, None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bhgqk,bkhd->bqhgd", p, v.astype(jnp.float32))
    return o.reshape(b * length, hq, d).astype(q.dtype)
