"""Paged KV blocks: a free list with reference counts. Block 0 is the reserved null block."""

from __future__ import annotations

from collections import deque


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 2:
            raise ValueError(f"the KV pool needs at least 2 blocks (block 0 is reserved), got {num_blocks}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free = deque(range(1, num_blocks))
        self.ref = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self.free)

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
            b = self.free.popleft()
            self.ref[b] = 1
            seq.block_table.append(b)

    def release(self, seq) -> None:
        for b in reversed(seq.block_table):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free.append(b)
        seq.block_table = []
