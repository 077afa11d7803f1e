"""Drives ``Llama.forward_paged`` over hand-made schedules (a minimal stand-in for the engine).

Each step packs chunks of several sequences into one flat, padded batch of ``bucket``
tokens and ``max_seqs`` sequence rows, with KV blocks taken from a shuffled free list
(so a sequence's KV lands in arbitrary physical blocks).
"""

from __future__ import annotations

import numpy as np
from flax import nnx

from models.llama import Llama
from models.paged import PagedBatch, init_kv_cache

_FWD = nnx.jit(Llama.forward_paged, static_argnames="invariant", donate_argnames="kv_cache")


class Paged:
    def __init__(self, model, *, num_blocks=64, block_size=16, max_seqs=8, max_blocks=8, seed=0):
        self.model = model
        self.block_size, self.max_seqs, self.max_blocks = block_size, max_seqs, max_blocks
        self.cache = init_kv_cache(model.config, num_blocks, block_size, model.dtype)
        self.rng = np.random.default_rng(seed)
        self.free = list(self.rng.permutation(np.arange(1, num_blocks)))

    def run(self, seqs, steps, *, bucket=40, invariant=True, slots=None):
        """seqs: token arrays; steps: lists of (seq index, number of tokens) chunks, in order.

        ``slots``: sequence row of each sequence in the step's batch (default: its index).
        Returns per sequence its float32 logits [len, V] (all positions).
        """
        n = len(seqs)
        slots = list(range(n)) if slots is None else slots
        tables = [[] for _ in range(n)]
        done = [0] * n
        out = [np.zeros((len(s), self.model.config.vocab_size), np.float32) for s in seqs]
        bs = self.block_size
        for step in steps:
            tok = np.zeros(bucket, np.int32)
            seq = np.zeros(bucket, np.int32)
            pos = np.full(bucket, -1, np.int32)
            slot = np.full(bucket, -1, np.int32)
            bt = np.zeros((self.max_seqs, self.max_blocks), np.int32)
            ctx = np.zeros(self.max_seqs, np.int32)
            rows, t = [], 0
            for i, count in step:
                start = done[i]
                while len(tables[i]) * bs < start + count:
                    tables[i].append(self.free.pop())
                for p in range(start, start + count):
                    tok[t], seq[t], pos[t] = seqs[i][p], slots[i], p
                    slot[t] = tables[i][p // bs] * bs + p % bs
                    rows.append((i, p, t))
                    t += 1
                done[i] += count
            for i in range(n):
                bt[slots[i], : len(tables[i])] = tables[i]
                ctx[slots[i]] = done[i]
            assert t <= bucket, "step does not fit the bucket"
            batch = PagedBatch(tok, seq, pos, slot, bt, ctx)
            logits, self.cache = _FWD(self.model, batch, self.cache, invariant=invariant)
            logits = np.asarray(logits)
            for i, p, r in rows:
                out[i][p] = logits[r]
        for i in range(n):
            assert done[i] == len(seqs[i]), "schedule does not cover every token"
            self.free.extend(tables[i])
        return out


def chunked(i: int, length: int, chunk: int):
    """Steps that run sequence i alone in chunks of ``chunk`` tokens (1 = token-by-token decode)."""
    return [[(i, min(chunk, length - s))] for s in range(0, length, chunk)]


def interleaved(lengths, chunks):
    """Steps that run all sequences together, sequence i advancing chunks[i] tokens per step."""
    done = [0] * len(lengths)
    steps = []
    while any(d < n for d, n in zip(done, lengths, strict=False)):
        step = []
        for i, (d, n) in enumerate(zip(done, lengths, strict=False)):
            if d < n:
                c = min(chunks[i], n - d)
                step.append((i, c))
                done[i] += c
        steps.append(step)
    return steps


def greedy(
    model, prompt, new_tokens: int, *, invariant=True, block_size=16, prefill_bucket=None, blocks=None
):
    """Greedy decoding through the paged forward: prefill the prompt in one step (padded to
    ``prefill_bucket`` tokens), then one token per step (padded to 16), on a cache of ``blocks``
    blocks (default: what the sequence needs; prompts of one size share the compiled steps).
    Returns (new token ids, float32 logits of each step's last token)."""
    prompt = [int(t) for t in prompt]
    total = len(prompt) + new_tokens
    blocks = max(blocks or 0, -(-total // block_size))
    cache = init_kv_cache(model.config, blocks + 1, block_size, model.dtype)
    table = np.zeros((1, blocks), np.int32)
    table[0] = np.arange(1, blocks + 1)
    out, logits_seen = [], []
    tokens = list(prompt)
    start, chunk = 0, len(prompt)
    while len(out) < new_tokens:
        pos = np.arange(start, start + chunk, dtype=np.int32)
        bucket = -(-chunk // 16) * 16 if start or prefill_bucket is None else prefill_bucket
        tok = np.zeros(bucket, np.int32)
        tok[:chunk] = tokens[start : start + chunk]
        p = np.full(bucket, -1, np.int32)
        p[:chunk] = pos
        slot = np.full(bucket, -1, np.int32)
        slot[:chunk] = table[0, pos // block_size] * block_size + pos % block_size
        ctx = np.array([start + chunk], np.int32)
        rows = np.array([chunk - 1], np.int32)
        logits, cache = _FWD_ROWS(
            model, tok, np.zeros(bucket, np.int32), p, slot, cache, table, ctx, rows, invariant=invariant
        )
        last = np.asarray(logits)[0]
        logits_seen.append(last)
        nxt = int(np.argmax(last))
        out.append(nxt)
        tokens.append(nxt)
        start, chunk = start + chunk, 1
    return out, np.stack(logits_seen)


def _fwd_rows(model, tok, seq, pos, slot, cache, table, ctx, rows, *, invariant):
    return model.forward_paged(PagedBatch(tok, seq, pos, slot, table, ctx, rows), cache, invariant=invariant)


_FWD_ROWS = nnx.jit(_fwd_rows, static_argnames="invariant", donate_argnames="cache")
