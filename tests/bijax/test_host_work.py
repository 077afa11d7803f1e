"""Per-step host work that must not grow with a sequence's length or the KV pool: a step takes a
few tokens of a sequence without building its whole token list, copies block tables as arrays,
and a prefix hit takes blocks off the free list in O(1) - with the free list's order unchanged
(benchmarks/host_step.py times it)."""

from __future__ import annotations

import numpy as np
import pytest

from bijax.block_manager import BlockManager
from bijax.config import EngineConfig
from bijax.model_runner import Chunk, ModelRunner
from bijax.sampling_params import SamplingParams
from bijax.sequence import PENDING, BlockTable, Sequence


def _seq(prompt, out=(), in_flight=0, seq_id=0):
    s = Sequence(seq_id, str(seq_id), list(prompt), SamplingParams(), 0, 0, seq_id)
    s.output_token_ids = list(out)
    s.in_flight = in_flight
    return s


def test_token_slice_is_token_ids_slice():
    s = _seq(range(10), [100, 101, 102], in_flight=2)
    full = s.token_ids
    assert full[-2:] == [PENDING, PENDING]
    for a in range(len(full) + 2):
        for b in range(a, len(full) + 3):
            assert s.token_slice(a, b) == full[a:b], (a, b)


def test_block_table_behaves_as_the_list_it_replaced():
    t = BlockTable([5, 6, 7])
    t.append(8)
    assert list(t) == [5, 6, 7, 8] and t == [5, 6, 7, 8] and len(t) == 4 and t
    assert t[-1] == 8 and t[1:3] == [6, 7] and list(reversed(t)) == [8, 7, 6, 5]
    assert t.array.dtype == np.int32 and t.array.tolist() == [5, 6, 7, 8]
    del t[2:]
    assert t == [5, 6]
    for b in range(40):  # grows past its first capacity
        t.append(b)
    assert t == [5, 6, *range(40)]
    with pytest.raises(TypeError, match="cut from the end"):
        del t[1:3]
    with pytest.raises(IndexError):
        t[len(t)]
    assert not BlockTable()


def test_a_step_never_builds_a_whole_token_list(monkeypatch):
    """Chunks, step inputs and prefix-cache keys read slices only. Control: the same patch
    makes ``token_ids`` itself fail, so a path that used it would fail here."""

    def whole(self):
        raise AssertionError("built the whole token list")

    monkeypatch.setattr(Sequence, "token_ids", property(whole))
    with pytest.raises(AssertionError, match="whole token list"):
        _ = _seq(range(5)).token_ids
    cfg = EngineConfig(max_model_len=4096, max_num_seqs=4, max_num_batched_tokens=64)
    bm = BlockManager(1024, 16)
    seqs = []
    for i in range(3):
        s = _seq(range(1000 + i), seq_id=i)
        bm.allocate(s, len(s))
        s.num_computed = len(s) - 1
        bm.register(s)
        seqs.append(s)
    chunks = [Chunk.pending(s, 1) for s in seqs]
    assert [c.tokens for c in chunks] == [(999,), (1000,), (1001,)]

    class Runner:
        config = cfg
        _tiered = False  # (the step's own bucket: nothing compiled to pick a larger one from)

    batch = ModelRunner._batch(Runner(), chunks)
    assert batch.block_tables[1, : len(seqs[1].block_table)].tolist() == list(seqs[1].block_table)
    again = _seq(range(1000), seq_id=9)
    assert bm.match_prefix(again) == 62  # 999 tokens may come from the cache: 62 full blocks


def test_free_list_keeps_least_recently_freed_first():
    bm = BlockManager(8, 4)
    a, b = _seq(range(8), seq_id=0), _seq(range(100, 108), seq_id=1)
    bm.allocate(a, 8)
    bm.allocate(b, 8)
    assert list(a.block_table) == [1, 2] and list(b.block_table) == [3, 4]
    for s in (a, b):
        s.num_computed = 8
        bm.register(s)
    bm.release(b)  # freed first: 4, 3 (released in reverse)
    bm.release(a)  # then 2, 1
    assert list(bm.free) == [5, 6, 7, 4, 3, 2, 1]
    hit = _seq(range(100, 109), seq_id=2)  # b's prefix: takes 3 and 4 out of the middle
    assert bm.match_prefix(hit) == 2 and list(hit.block_table) == [3, 4]
    assert list(bm.free) == [5, 6, 7, 2, 1]
    c = _seq(range(200, 220), seq_id=3)
    bm.allocate(c, 20)
    assert list(c.block_table) == [5, 6, 7, 2, 1]


def test_a_long_cached_prefix_matches_without_deep_keys():
    """A 3,000-block prefix (block_size 1) is registered and matched: keys nested their parent's
    key, so a lookup compared 1,500-deep tuples and raised RecursionError (a cache hit on a
    24k-token prompt at block_size 16). The chain ids stay exact: the same tokens after a
    different first token match nothing, a prefix that stops early matches only its blocks."""
    bm = BlockManager(8000, 1)
    a = _seq(range(3001), seq_id=0)
    bm.allocate(a, len(a))
    a.num_computed = len(a)
    bm.register(a)
    hit = _seq(range(3001), seq_id=1)
    assert bm.match_prefix(hit) == 3000 and list(hit.block_table) == list(a.block_table)[:3000]
    assert bm.match_prefix(_seq([7, *range(1, 3001)], seq_id=2)) == 0  # all but the first token
    assert bm.match_prefix(_seq([*range(1500), 7, 7], seq_id=3)) == 1500
    # a second sequence computing the same prefix into its own blocks continues the same chain
    b = _seq([*range(3001), 5, 6], seq_id=4)
    bm.allocate(b, len(b))
    b.num_computed = len(b)
    bm.register(b)
    longer = _seq([*range(3001), 5, 6, 9], seq_id=5)
    assert bm.match_prefix(longer) == 3003


def test_prefix_hits_count_once_a_request_is_admitted():
    """A waiting request whose prefix is cached matches it at every step it waits for blocks:
    the hits were counted each try (22 for a 2-block prefix in a probe); now once, admitted."""
    from bijax.scheduler import Scheduler

    cfg = EngineConfig(
        max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64, block_size=4, num_kv_blocks=9
    )
    bm = BlockManager(9, 4)
    sched = Scheduler(cfg, bm)
    warm = _seq(range(9), seq_id=0)
    sched.add(warm)
    assert sched.schedule() == [(warm, 9)]
    warm.num_computed = 9
    bm.register(warm)
    sched.finish(warm, "stop")  # blocks 1, 2 stay cached, at the free list's end
    hog = _seq(range(100, 124), seq_id=1)  # 6 of the 8 blocks; the 2 cached ones stay free
    sched.add(hog)
    assert sched.schedule() == [(hog, 24)]
    waiter = _seq(range(9), seq_id=2)  # its 2-block prefix is cached, but it needs 3 blocks
    sched.add(waiter)
    for _ in range(5):
        assert sched.schedule() == [(hog, 24)] and waiter.block_table == [] and bm.hit_blocks == 0
    sched.finish(hog, "stop")
    assert [s for s, _ in sched.schedule()] == [waiter] and bm.hit_blocks == 2
