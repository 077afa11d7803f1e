"""Paged KV blocks: a free list with reference counts and a prefix cache.

Block 0 is the reserved null block (padding tokens write there). A full block whose tokens
are all computed is registered under a key of (its parent's chain id, its token ids), so a
later sequence with the same prefix reuses it instead of recomputing it. A chain id names one
registered prefix exactly (a counter, never reused: when a block is evicted its id dies with
it, and blocks registered under it can no longer be reached), so keys stay flat - a key that
nested its parent's key made a 1,500-block prefix a 1,500-deep tuple, whose hash and
comparison recursed past Python's limit. A block whose
reference count drops to zero goes to the back of the free list but keeps its content and
key until it is handed out again (least recently freed first): the cache evicts lazily.
Reused KV has the same bits as recomputed KV (the kernels are batch invariant), so a cache
hit cannot change an output.
"""

from __future__ import annotations

from collections import OrderedDict


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True):
        if num_blocks < 2:
            raise ValueError(f"the KV pool needs at least 2 blocks (block 0 is reserved), got {num_blocks}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Free blocks, least recently freed first; ordered dict: a prefix hit takes a block out
        # of the middle in O(1) (a deque's remove was O(pool) per block).
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self.ref = [0] * num_blocks
        self.key_of: list[tuple | None] = [None] * num_blocks
        self.chain_of: list[int | None] = [None] * num_blocks  # the chain id of a registered block
        self.cached: dict[tuple, int] = {}
        self._chains = 0  # chain ids handed out (0: the empty prefix)
        self.hit_blocks = 0

    @property
    def num_free(self) -> int:
        return len(self.free)

    def _take_free(self) -> int:
        b, _ = self.free.popitem(last=False)
        key = self.key_of[b]
        if key is not None:  # evict its cached content
            del self.cached[key]
            self.key_of[b] = self.chain_of[b] = None
        return b

    def blocks_needed(self, seq, new_tokens: int) -> int:
        """Blocks to add to ``seq`` so it holds num_computed + new_tokens tokens."""
        need = -(-(seq.num_computed + new_tokens) // self.block_size)
        return max(0, need - len(seq.block_table))

    def can_allocate(self, seq, new_tokens: int) -> bool:
        return self.blocks_needed(seq, new_tokens) <= self.num_free

    def allocate(self, seq, new_tokens: int) -> None:
        n = self.blocks_needed(seq, new_tokens)
        if n > self.num_free:
            raise RuntimeError("out of KV blocks (the scheduler should have preempted)")
        for _ in range(n):
            b = self._take_free()
            self.ref[b] = 1
            seq.block_table.append(b)

    def trim(self, seq) -> None:
        """Returns the blocks past the sequence's computed tokens (allocated for speculative
        drafts that were rejected: their KV is never read and they were never registered)."""
        keep = -(-seq.num_computed // self.block_size)
        for b in reversed(seq.block_table[keep:]):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free[b] = None
        del seq.block_table[keep:]

    def release(self, seq) -> None:
        for b in reversed(seq.block_table):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free[b] = None
        seq.block_table = []
        seq.block_keys = []

    # ------------------------------------------------------------------ prefix cache

    def _key(self, seq, i: int, parent: int):
        bs = self.block_size
        return (parent, tuple(seq.token_slice(i * bs, (i + 1) * bs)))

    def _new_chain(self) -> int:
        self._chains += 1
        return self._chains

    def match_prefix(self, seq) -> int:
        """For a sequence with no blocks: takes the cached blocks of its longest cached prefix
        (leaving at least one token to compute) and marks their tokens computed. Returns the
        number of blocks reused (the caller counts them as hits if it keeps them)."""
        if not self.enable_prefix_caching or seq.block_table:
            return 0
        parent, n = 0, 0
        limit = len(seq) - 1 if seq.prefix_limit is None else min(len(seq) - 1, seq.prefix_limit)
        for i in range(limit // self.block_size):
            b = self.cached.get(self._key(seq, i, parent))
            if b is None:
                break
            if self.ref[b] == 0:
                del self.free[b]
            self.ref[b] += 1
            seq.block_table.append(b)
            parent, n = self.chain_of[b], n + 1
            seq.block_keys.append(parent)
        seq.num_computed = n * self.block_size
        return n

    def register(self, seq) -> None:
        """Registers the sequence's newly completed full blocks in the cache (``seq.block_keys``:
        each full block's chain id)."""
        if not self.enable_prefix_caching:
            return
        full = min(seq.num_computed // self.block_size, len(seq.block_table))
        for i in range(len(seq.block_keys), full):
            key = self._key(seq, i, seq.block_keys[-1] if seq.block_keys else 0)
            b = seq.block_table[i]
            have = self.cached.get(key)
            if have is not None:  # another block holds this prefix: its chain goes on
                chain = self.chain_of[have]
            else:
                chain = self._new_chain()  # (one no block holds if b is taken: unreachable)
                if self.key_of[b] is None:
                    self.cached[key] = b
                    self.key_of[b], self.chain_of[b] = key, chain
            seq.block_keys.append(chain)

    def reset_prefix_cache(self) -> None:
        """Forgets every cached block (their KV was computed with weights that changed)."""
        self.cached.clear()
        self.key_of = [None] * self.num_blocks
        self.chain_of = [None] * self.num_blocks
