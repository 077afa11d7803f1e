"""``Engine.score``'s steps: teacher-forced logprobs of given tokens through the same paged
steps as generation (so they are bit-equal to generate's logprobs)."""

from __future__ import annotations

import numpy as np

from bijax.model_runner import Chunk
from bijax.scheduler import Scheduler


def score_sequences(runner, blocks, config, seqs, prompt_lens, temperature: float) -> list[np.ndarray]:
    """float32 logprob of each token of ``seqs[i]`` at index >= ``prompt_lens[i]`` given the
    tokens before it. ``seqs[i]`` has seq_id -1 - i and ``prefix_limit`` prompt_lens[i] - 1 (the
    positions whose logits are needed are never served from the prefix cache)."""
    results = [np.zeros(len(s) - pl, np.float32) for s, pl in zip(seqs, prompt_lens, strict=True)]
    sched = Scheduler(config, blocks)
    for s in seqs:
        sched.add(s)
    try:
        _run(runner, sched, seqs, prompt_lens, temperature, results)
    finally:  # a failure or Ctrl-C midway: every sequence's blocks go back to the pool
        for s in (*sched.running, *sched.waiting):
            sched.finish(s, "abort")
    return results


def _run(runner, sched, seqs, prompt_lens, temperature, results) -> None:
    while sched.has_unfinished():
        chunks = sched.schedule()
        targets, where = [], []
        for seq, n in chunks:
            i = -1 - seq.seq_id
            nxt = seq.token_slice(seq.num_computed + 1, seq.num_computed + n + 1)  # each row's target
            for j, p in enumerate(range(seq.num_computed, seq.num_computed + n)):
                want = prompt_lens[i] <= p + 1 < len(seq)
                targets.append(nxt[j] if want else -1)
                where.append((i, p + 1 - prompt_lens[i]) if want else None)
        lp = runner.score_step(
            [Chunk.pending(s, n) for s, n in chunks], np.asarray(targets, np.int32), float(temperature)
        )
        for v, w in zip(lp, where, strict=True):
            if w is not None:
                results[w[0]][w[1]] = v
        for seq, n in chunks:
            seq.num_computed += n
            if seq.num_computed == len(seq):
                sched.finish(seq, "stop")
