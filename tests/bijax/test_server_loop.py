"""The server's engine loop and the engine statistics /metrics reads, in process (no HTTP)."""

from __future__ import annotations

import asyncio

import numpy as np

from bijax import SamplingParams as SP
from bijax.server.engine_loop import EngineError, EngineLoop, _Sink, next_item
from tests.bijax.test_engine import shared_llm
from tests.conftest import bits

PROMPTS = [list(range(3 + i, 23 + i)) for i in range(10)]  # 20 tokens each: 2 KV blocks of 16


def test_engine_stats_count_running_waiting_and_blocks_in_use():
    engine = shared_llm("tiny").engine
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"stats-{i}", p, SP(max_tokens=3))
    s = engine.stats()
    assert (s.num_running_seqs, s.num_waiting_seqs, s.num_kv_blocks_in_use) == (0, 10, 0)
    engine.step()  # 64 tokens: three whole prompts and a chunk of the fourth
    s = engine.stats()
    assert (s.num_running_seqs, s.num_waiting_seqs, s.num_kv_blocks_in_use) == (4, 6, 7)
    for i in range(len(PROMPTS)):
        engine.abort(f"stats-{i}")
    engine.step()
    s = engine.stats()
    assert (s.num_running_seqs, s.num_waiting_seqs, s.num_kv_blocks_in_use) == (0, 0, 0)
    assert s.num_unfinished_requests == 0


class _FailsOnce:
    """The engine, except that its first step raises."""

    def __init__(self, engine):
        self._engine, self.failed = engine, False

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def step(self):
        if not self.failed:
            self.failed = True
            raise RuntimeError("device lost")
        return self._engine.step()


class _CountsAtStep:
    """The engine, noting how many sequences it holds as each step starts."""

    def __init__(self, engine):
        self._engine, self.seqs = engine, []

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def step(self):
        s = self._engine.stats()
        self.seqs.append(s.num_running_seqs + s.num_waiting_seqs)
        return self._engine.step()


async def _run(loop: EngineLoop, rid: str, prompt, params):
    q: asyncio.Queue = asyncio.Queue()
    (seed,) = await loop.add([(rid, loop.validate(prompt, params))], q)
    while True:
        item = await next_item(q)
        if isinstance(item, EngineError) or item.finished:
            return seed, item


def test_a_failing_step_fails_the_requests_in_flight_and_the_loop_serves_on():
    llm = shared_llm("tiny")
    params = SP(temperature=0.9, seed=4, max_tokens=5)
    flaky = _FailsOnce(llm.engine)
    loop = EngineLoop(flaky)
    loop.start()
    try:

        async def both():
            first = await _run(loop, "loop-0", PROMPTS[0], params)
            second = await _run(loop, "loop-1", PROMPTS[0], params)
            return first, second

        (_, first), (seed, second) = asyncio.run(both())
    finally:
        loop.stop()
    assert flaky.failed and isinstance(first, EngineError) and "device lost" in str(first)
    assert loop.metrics.engine_errors == 1 and loop.stats.num_kv_blocks_in_use == 0
    ref = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0]
    assert seed == 4 and second.token_ids == ref.token_ids
    np.testing.assert_array_equal(bits(second.logprobs), bits(ref.logprobs))
    assert not loop.alive and not llm.engine.has_unfinished_requests()


def test_requests_added_together_join_one_step_and_a_drain_refuses_adds():
    """One command adds a request's prompts: they all join the next step (added one by one, a
    32-prompt request took 33 steps to be queued); a failing one leaves none of them running.
    After ``abort_all`` (shutting down) an add is refused; after ``stop``, too."""
    engine = shared_llm("tiny").engine
    counting = _CountsAtStep(engine)
    loop = EngineLoop(counting)
    params = SP(temperature=0, max_tokens=1)
    valid = [loop.validate(p, params) for p in PROMPTS[:3]]
    loop.start()
    try:

        async def go():
            q: asyncio.Queue = asyncio.Queue()
            seeds = await loop.add([(f"many-{i}", v) for i, v in enumerate(valid)], q)
            finals = set()
            while len(finals) < 3:
                item = await next_item(q)
                finals.add(item.request_id) if item.finished else None
            bad = [("twice", valid[0]), ("twice", valid[1])]  # (the second's id is taken)
            try:
                await loop.add(bad, asyncio.Queue())
            except ValueError as e:
                return seeds, str(e)

        seeds, error = asyncio.run(go())
        assert len(seeds) == 3 and "request_id must be a new str" in error
        assert counting.seqs[0] == 3  # the first step had all three (added one by one: 1)
        loop.abort_all()
        assert "shutting down" in _refused(loop, valid[0])
    finally:
        loop.stop()
    assert "not running" in _refused(loop, valid[0])
    # (the first 'twice', added before the second failed, was aborted)
    assert not engine.has_unfinished_requests()


def _refused(loop: EngineLoop, valid) -> str:
    """The EngineError's message when ``loop`` refuses to add a request."""

    async def add():
        try:
            await loop.add([("late", valid)], asyncio.Queue())
        except EngineError as e:
            return str(e)

    return asyncio.run(add())


def test_a_slow_reader_holds_one_snapshot_per_request():
    """Outputs are cumulative: snapshots the reader has not taken are replaced, not queued."""

    async def go():
        q: asyncio.Queue = asyncio.Queue()
        sink = _Sink(asyncio.get_running_loop(), q)
        for step in range(5):  # five steps' outputs before the reader looks
            sink.put(("snapshot", step))
        sink.put(EngineError("late failure"))
        await asyncio.sleep(0)
        assert q.qsize() == 2  # one marker for the snapshots, then the error
        first, second = await next_item(q), await next_item(q)
        sink.put(("snapshot", 5))
        await asyncio.sleep(0)
        return first, second, await next_item(q)

    first, second, third = asyncio.run(go())
    assert first == ("snapshot", 4) and isinstance(second, EngineError) and third == ("snapshot", 5)
