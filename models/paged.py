"""The paged layout the model's engine forward reads and writes: the step batch and the KV cache.

A step is a flat, ragged batch of T tokens (prefill chunks and decode tokens mixed) of S
sequences, padded to a bucket. ``PagedBatch`` carries it from whoever schedules it (the
engine's runner, a test harness, a benchmark) to ``Llama.forward_paged`` and on to the
kernels under the kernels' own names (``pallas_kernels.attention`` / ``write_kv``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from models.configs import LlamaConfig

KVCache = list  # per layer: (k [num_blocks, block_size, Hkv, D], v [same])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedBatch:
    """One step's inputs (numpy on the host, arrays under jit; a pytree).

    tokens, token_seq, token_pos: int [T] token id, sequence row and absolute position of each
      token (padding tokens: position -1);
    slot_mapping: int [T] cache slot (block * block_size + offset) each token's K/V is written
      to before attention (padding: -1, which writes only the reserved null block 0);
    block_tables, context_lens: int [S, max_blocks] and [S] (this step's tokens included;
      padding sequence rows: context 0);
    logit_rows: optional int [R]: only these token rows go through the LM head (None: all T).
    """

    tokens: jax.Array
    token_seq: jax.Array
    token_pos: jax.Array
    slot_mapping: jax.Array
    block_tables: jax.Array
    context_lens: jax.Array
    logit_rows: jax.Array | None = None

    @classmethod
    def padding(
        cls, num_seqs: int, num_tokens: int, max_blocks: int, *, logit_rows: bool = True
    ) -> PagedBatch:
        """A (num_seqs, num_tokens) bucket that is all padding: it writes only the null block and
        reads nothing. Fill it in place (its arrays are fresh numpy arrays)."""
        return cls(
            tokens=np.zeros(num_tokens, np.int32),
            token_seq=np.zeros(num_tokens, np.int32),
            token_pos=np.full(num_tokens, -1, np.int32),
            slot_mapping=np.full(num_tokens, -1, np.int32),
            block_tables=np.zeros((num_seqs, max_blocks), np.int32),
            context_lens=np.zeros(num_seqs, np.int32),
            logit_rows=np.zeros(num_seqs, np.int32) if logit_rows else None,
        )

    @property
    def num_tokens(self) -> int:
        return self.tokens.shape[0]

    def replace(self, **changes) -> PagedBatch:
        return dataclasses.replace(self, **changes)


def init_kv_cache(config: LlamaConfig, num_blocks: int, block_size: int, dtype, sharding=None) -> KVCache:
    """Zeroed paged KV cache: per layer (k, v) [num_blocks, block_size, Hkv, D]. Block 0 is the
    reserved null block that padding tokens write to; allocate sequences from block 1.
    ``sharding``: a ``jax.sharding.Sharding`` to create each array in directly (tensor
    parallelism: each device allocates only its KV heads, never the whole cache)."""
    if num_blocks < 2:
        raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
    shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
    if sharding is None:
        return [(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(config.num_layers)]
    zeros = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
    return [(zeros(), zeros()) for _ in range(config.num_layers)]


# A packed row's sequences are laid out in pages of this many tokens: one page per KV tile of
# the GPU attention kernel (``attention_math.kv_tile`` of any block size <= 64 is 64), so each
# tile is one contiguous load. A token's bits are the same for any block size <= 64.
PACKED_BLOCK = 64


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedLayout:
    """Packed rows (``Llama.forward_packed``) as paged sequences: one sequence per (row, segment).

    token_seq, token_pos: int [T] (T = B * L, row-major) the token's sequence and its position
      counted from its segment's first token (padding: sequence 0, position -1);
    slots: int [T] where the token's K/V goes in the pages (padding: past the end, dropped);
    block_tables, context_lens: int [B * max_segments, ceil(L / PACKED_BLOCK)] and [B * max_segments].
    Pages are allocated segment after segment from page 1 (page 0 is the zeroed null page that
    unused table entries point to).
    """

    token_seq: jax.Array
    token_pos: jax.Array
    slots: jax.Array
    block_tables: jax.Array
    context_lens: jax.Array

    @classmethod
    def create(cls, segment_ids: jax.Array, max_segments: int) -> PackedLayout:
        """From ``segment_ids`` int [B, L] (each segment one contiguous run of its row; -1: padding)."""
        b, length = segment_ids.shape
        s, pb = max_segments, PACKED_BLOCK
        seg = segment_ids.reshape(-1).astype(jnp.int32)
        idx = jnp.tile(jnp.arange(length, dtype=jnp.int32), b)
        valid = seg >= 0
        n = b * s  # sequences; padding tokens go to entry n, which the scatters drop
        sid = jnp.where(valid, jnp.repeat(jnp.arange(b, dtype=jnp.int32), length) * s + seg, n)
        start = jnp.full((n,), length, jnp.int32).at[sid].min(idx, mode="drop")
        count = jnp.zeros((n,), jnp.int32).at[sid].add(1, mode="drop")
        pos = jnp.where(valid, idx - start[jnp.minimum(sid, n - 1)], -1)
        pages = (count + pb - 1) // pb
        first = 1 + jnp.cumsum(pages) - pages  # each sequence's first page
        slots = jnp.where(valid, first[jnp.minimum(sid, n - 1)] * pb + pos, cls.num_pages(b * length, n) * pb)
        j = jnp.arange(-(-length // pb), dtype=jnp.int32)
        tables = jnp.where(j[None, :] < pages[:, None], first[:, None] + j[None, :], 0)
        return cls(jnp.where(valid, sid, 0), pos, slots, tables, count)

    @staticmethod
    def num_pages(num_tokens: int, num_seqs: int) -> int:
        """Pages for any packing of ``num_tokens`` into ``num_seqs`` sequences (with the null page):
        the sum over sequences of ceil(count / 64) is at most ceil(num_tokens / 64) + num_seqs."""
        return 1 + -(-num_tokens // PACKED_BLOCK) + num_seqs

    def pages(self, x: jax.Array) -> jax.Array:
        """The tokens' rows x [T, Hkv, D] -> pages [num_pages, PACKED_BLOCK, Hkv, D] (zeros where
        no token is)."""
        n = self.num_pages(x.shape[0], self.block_tables.shape[0])
        flat = jnp.zeros((n * PACKED_BLOCK,) + x.shape[1:], x.dtype).at[self.slots].set(x, mode="drop")
        return flat.reshape((n, PACKED_BLOCK) + x.shape[1:])
