"""Engine configuration (vLLM's engine-argument names), checked once."""

from __future__ import annotations

import dataclasses

from pallas_kernels.checks import check_positive_int


def _pow2_upto(lo: int, hi: int) -> tuple[int, ...]:
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    out.append(hi)
    return tuple(sorted(set(out)))


def check_max_model_len(value) -> None:
    """A Python int >= 2: a request holds at least one prompt token and one generated (below
    that no request fits, and every one would be refused)."""
    check_positive_int("max_model_len", value, numpy=False)
    if value < 2:
        raise ValueError(f"max_model_len must be >= 2 (one prompt token and one generated), got {value}")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """max_model_len: longest prompt + output; max_num_seqs: sequences per step;
    max_num_batched_tokens: tokens per step (prefill chunks + decode tokens); block_size: KV
    block size; num_kv_blocks: KV pool size in blocks (block 0 is reserved); invariant: run the
    batch-invariant kernels (False: plain XLA, the baseline / negative control); seed: draws the
    seeds of requests that have none; enable_prefix_caching: reuse the KV blocks of prompts'
    cached prefixes; tensor_parallel_size: devices the model is split over (its k_shards must
    be a multiple); async_scheduling: enqueue the next step while the device runs the current
    one (the same bits; off with a draft model, on with n-gram speculation)."""

    max_model_len: int
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    block_size: int = 16
    num_kv_blocks: int = 1024
    invariant: bool = True
    seed: int = 0
    enable_prefix_caching: bool = True
    tensor_parallel_size: int = 1
    async_scheduling: bool = True

    def __post_init__(self):
        for f in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "block_size",
            "num_kv_blocks",
            "tensor_parallel_size",
        ):
            check_positive_int(f, getattr(self, f), numpy=False)
        check_max_model_len(self.max_model_len)
        if self.block_size & (self.block_size - 1) or self.block_size > 64:
            raise ValueError(f"block_size must be a power of two <= 64, got {self.block_size}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs ({self.max_num_seqs})"
            )
        if self.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks must be >= 2 (block 0 is reserved), got {self.num_kv_blocks}")

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)

    @property
    def token_buckets(self) -> tuple[int, ...]:
        return _pow2_upto(min(16, self.max_num_batched_tokens), self.max_num_batched_tokens)

    @property
    def seq_buckets(self) -> tuple[int, ...]:
        # From 16 (or max_num_seqs if smaller): the kernels pad rows to tiles of >= 16 anyway,
        # so smaller sequence buckets would only add compiled steps, not save work.
        return _pow2_upto(min(16, self.max_num_seqs), self.max_num_seqs)

    def step_bucket(self, num_seqs: int, num_tokens: int) -> tuple[int, int]:
        """The (sequences, tokens) bucket of a step: the token bucket that holds its tokens, and
        a sequence bucket that holds its sequences and at least a ``TOKENS_PER_SEQ_ROW``-th of
        the token bucket (or the largest): a step of many tokens gets its rows from one of
        the few largest sequence buckets, so fewer buckets exist to compile - the extra rows
        are padding (a block-table row, a logits row) next to that many tokens' forward. Which
        bucket a step lands in never changes its bits."""
        t = bucket(num_tokens, self.token_buckets)
        return bucket(max(num_seqs, min(t // TOKENS_PER_SEQ_ROW, self.seq_buckets[-1])), self.seq_buckets), t

    def bucket_pairs(self) -> list[tuple[int, int]]:
        """Every (sequences, tokens) bucket ``step_bucket`` gives."""
        return sorted(
            {self.step_bucket(s, t) for s in self.seq_buckets for t in self.token_buckets if t >= s}
        )


# A step's sequence bucket holds at least this fraction of its token bucket (``step_bucket``):
# for a 64-sequence, 2048-token engine 12 forward programs instead of 21 (2026-12-02).
TOKENS_PER_SEQ_ROW = 4


def bucket(n: int, buckets: tuple[int, ...]) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
