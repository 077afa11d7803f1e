"""Host work of one decode step against the context length and the KV pool (no device work).

The engine's per-step host work - the scheduler's chunks (``Chunk.pending``), the runner's flat
inputs (``ModelRunner._batch``: token ids, positions, block tables, slots), the block manager's
allocation - must not grow with the context length or the pool size (decode issue). This times
those parts for 64 running sequences at contexts from 1k to 32k tokens, a prefix-cache hit of a
2048-token prompt against pools of 1k to 64k blocks, and the RequestOutput snapshots a step
returns (``LLM.generate`` without ``on_output`` asks the engine for finished ones only).

Run:  PYTHONPATH=. python benchmarks/host_step.py
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from bijax.block_manager import BlockManager
from bijax.config import EngineConfig
from bijax.llm_engine import Engine, _Request
from bijax.model_runner import Chunk, ModelRunner
from bijax.sampling_params import SamplingParams
from bijax.sequence import Sequence


class _Runner:
    """Just what ``ModelRunner._batch`` reads."""

    def __init__(self, config):
        self.config = config


def _median_ms(fn, reps=15):
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def decode_step(num_seqs: int, context: int, bs: int = 16):
    cfg = EngineConfig(max_model_len=context + 64, max_num_seqs=num_seqs, max_num_batched_tokens=num_seqs)
    blocks = num_seqs * (-(-(context + 1) // bs)) + 1
    bm = BlockManager(blocks, bs, enable_prefix_caching=False)
    rng = np.random.default_rng(0)
    seqs = []
    for i in range(num_seqs):
        s = Sequence(i, str(i), rng.integers(0, 50000, context).tolist(), SamplingParams(), 0, 0, i)
        bm.allocate(s, context)
        s.num_computed = context - 1
        seqs.append(s)
    runner = _Runner(cfg)

    def chunks():
        return [Chunk.pending(s, 1) for s in seqs]

    made = chunks()
    return {
        "chunks (Chunk.pending)": _median_ms(chunks),
        "inputs (ModelRunner._batch)": _median_ms(lambda: ModelRunner._batch(runner, made)),
    }


def prefix_hit(pool: int, prompt: int = 2048, bs: int = 16):
    """A second request with the same prompt takes the first one's cached blocks."""
    bm = BlockManager(pool, bs)
    ids = list(range(prompt))
    first = Sequence(0, "0", ids, SamplingParams(), 0, 0, 0)
    bm.allocate(first, prompt)
    first.num_computed = prompt
    bm.register(first)
    bm.release(first)  # cached, on the free list

    def hit():
        s = Sequence(1, "1", ids, SamplingParams(), 0, 0, 1)
        bm.match_prefix(s)
        bm.release(s)

    return _median_ms(hit)


class _Engine:
    """Just what ``Engine._output`` reads (no tokenizer: the presets' case)."""

    tokenizer = None
    speculator = None


def snapshots(num_reqs: int, prompt: int, output: int) -> float:
    """Building the RequestOutput snapshots of one step: every advanced request's prompt ids,
    output ids and logprobs so far (what ``Engine.step`` returns for streaming)."""
    reqs = []
    for i in range(num_reqs):
        s = Sequence(i, str(i), list(range(prompt)), SamplingParams(), 0, 0, i)
        for t in range(output):
            s.output_token_ids.append(t)
            s.logprobs.append(np.float32(-0.5))
        reqs.append(_Request(str(i), None, list(range(prompt)), SamplingParams(), 0, [s]))
    return _median_ms(lambda: [Engine._output(_Engine(), r) for r in reqs])


def main():
    print("| 64 sequences, context | chunks ms | inputs ms |")
    print("|---|---|---|")
    for ctx in (1024, 4096, 16384, 32768):
        r = decode_step(64, ctx)
        print(
            f"| {ctx} | {r['chunks (Chunk.pending)']:.3f} | {r['inputs (ModelRunner._batch)']:.3f} |",
            flush=True,
        )
    print("\n| KV pool blocks | prefix hit of 2048 tokens, ms |")
    print("|---|---|")
    for pool in (1024, 8192, 65536):
        print(f"| {pool} | {prefix_hit(pool):.3f} |", flush=True)
    print("\n| 64 requests: prompt, output tokens | snapshots of one step, ms |")
    print("|---|---|")
    for prompt, output in ((1024, 1024), (1024, 8192), (32768, 1024)):
        print(f"| {prompt}, {output} | {snapshots(64, prompt, output):.3f} |", flush=True)


if __name__ == "__main__":
    main()
