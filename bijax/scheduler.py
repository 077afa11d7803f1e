"""Waiting/running queues, chunked prefill under a token budget, preemption by recompute."""

from __future__ import annotations

from collections import deque

from bijax.block_manager import BlockManager
from bijax.config import EngineConfig
from bijax.sequence import Sequence, Status


class Scheduler:
    """Each step: running sequences first (a decode token, or the next prefill chunk), then
    waiting ones in arrival order while sequence slots, the token budget and KV blocks last.
    A running sequence that needs a block when none is free preempts the latest-arrived
    running sequence, which later recomputes its tokens (bit-identical: the kernels are
    batch invariant). With async scheduling a sequence's last token may still be on the
    device (``Sequence.in_flight``); one whose in-flight token ends it is not scheduled."""

    def __init__(self, config: EngineConfig, blocks: BlockManager):
        self.config = config
        self.blocks = blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, victim: Sequence) -> None:
        self.running.remove(victim)
        self.blocks.release(victim)
        victim.reset_for_recompute()
        self.waiting.appendleft(victim)
        self.num_preemptions += 1

    def schedule(self) -> list[tuple[Sequence, int]]:
        """The next step: (sequence, number of its pending tokens to compute) pairs."""
        budget = self.config.max_num_batched_tokens
        chunks: list[tuple[Sequence, int]] = []
        for seq in sorted(self.running, key=lambda s: s.arrival):
            if seq not in self.running or budget == 0 or seq.finishing:
                continue
            n = min(seq.num_pending, budget)
            while not self.blocks.can_allocate(seq, n):
                # (not one that its token on the device ends: its blocks come back at the next read)
                victim = max((s for s in self.running if not s.finishing), key=lambda s: s.arrival)
                self._preempt(victim)
                if victim is seq:
                    break
            if seq not in self.running:
                continue
            self.blocks.allocate(seq, n)
            chunks.append((seq, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if seq.finishing:  # preempted while its last token is on the device: it ends next step
                break
            reused = self.blocks.match_prefix(seq)  # reuse cached KV blocks of its prefix
            n = min(seq.num_pending, budget)
            if not self.blocks.can_allocate(seq, n):
                self.blocks.release(seq)
                seq.num_computed = 0
                break
            self.blocks.hit_blocks += reused  # (counted once it is admitted: not at every try)
            self.waiting.popleft()
            self.blocks.allocate(seq, n)
            seq.status = Status.RUNNING
            self.running.append(seq)
            chunks.append((seq, n))
            budget -= n
        in_flight = any(
            s.in_flight for s in (*self.running, *self.waiting)
        )  # progress comes back from the device
        if not chunks and self.has_unfinished() and not in_flight:
            raise RuntimeError("scheduler made no progress: the KV pool cannot hold the next request")
        return chunks

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        seq.in_flight, seq.finishing = 0, False  # an enqueued step's row for it is dropped
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.release(seq)
