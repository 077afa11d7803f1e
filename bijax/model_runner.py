"""Flat ragged steps padded to (num_seqs, num_tokens) buckets, one jitted step per bucket.

The weights are an argument of the step (not baked into it), so they can be swapped without
recompiling; the KV cache is donated. Padding tokens have position -1 and slot -1 (they write
the null block and read nothing); padding sequence rows have context length 0 and their
sampled tokens are dropped. The kernels are batch invariant, so padding cannot change a bit
of a real row.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from flax import nnx

from bijax.config import EngineConfig, bucket
from bijax.sampler import sample_rows, target_logprobs
from models.llama import Llama, init_kv_cache


def _forward(params, cache, batch, *, graphdef, invariant, rows):
    """The model's paged forward over one padded batch; ``rows``: the token rows to take logits of."""
    model = nnx.merge(graphdef, params)
    return model.forward_paged(
        batch["tokens"], batch["seq"], batch["pos"], batch["slot"], cache, batch["tables"], batch["ctx"],
        logit_rows=rows, invariant=invariant,
    )  # fmt: skip


@functools.partial(jax.jit, static_argnames=("graphdef", "invariant", "num_top"), donate_argnames=("cache",))
def _step(params, cache, batch, sampling, *, graphdef, invariant, num_top):
    logits, cache = _forward(params, cache, batch, graphdef=graphdef, invariant=invariant, rows=batch["rows"])
    s = sampling
    out = sample_rows(
        logits, s["temperature"], s["top_k"], s["top_p"], s["min_p"], s["seed"], s["sample_index"], s["position"],
        invariant=invariant, num_top=num_top,
    )  # fmt: skip
    return out, cache


@functools.partial(jax.jit, static_argnames=("graphdef", "invariant"), donate_argnames=("cache",))
def _score_step(params, cache, batch, targets, temperature, *, graphdef, invariant):
    logits, cache = _forward(params, cache, batch, graphdef=graphdef, invariant=invariant, rows=None)
    return target_logprobs(logits, targets, temperature, invariant=invariant), cache


def _greedy_rows(s: int) -> dict:
    """Per-row sampling inputs for ``s`` rows, every filter off, greedy (padding rows keep these)."""
    return dict(
        temperature=np.zeros(s, np.float32),
        top_k=np.full(s, -1, np.int32),
        top_p=np.ones(s, np.float32),
        min_p=np.zeros(s, np.float32),
        seed=np.zeros(s, np.uint32),
        sample_index=np.zeros(s, np.int32),
        position=np.zeros(s, np.int32),
    )


class ModelRunner:
    def __init__(self, model: Llama, config: EngineConfig):
        self.config = config
        self.model_config = model.config
        self.graphdef, self.params = nnx.split(model)
        self.cache = init_kv_cache(model.config, config.num_kv_blocks, config.block_size, model.dtype)
        self.compiled_buckets: set = set()

    def _batch(self, chunks):
        """Flat padded inputs for [(sequence, tokens to compute)], in order."""
        cfg = self.config
        n_tok = sum(n for _, n in chunks)
        t = bucket(n_tok, cfg.token_buckets)
        s = bucket(len(chunks), cfg.seq_buckets)
        bs = cfg.block_size
        tokens = np.zeros(t, np.int32)
        seq = np.zeros(t, np.int32)
        pos = np.full(t, -1, np.int32)
        slot = np.full(t, -1, np.int32)
        tables = np.zeros((s, cfg.max_blocks_per_seq), np.int32)
        ctx = np.zeros(s, np.int32)
        rows = np.zeros(s, np.int32)
        i = 0
        for r, (sq, n) in enumerate(chunks):
            p = np.arange(sq.num_computed, sq.num_computed + n, dtype=np.int32)
            table = np.asarray(sq.block_table, np.int32)
            tokens[i : i + n] = sq.tokens[sq.num_computed : sq.num_computed + n]
            seq[i : i + n] = r
            pos[i : i + n] = p
            slot[i : i + n] = table[p // bs] * bs + p % bs
            tables[r, : len(table)] = table
            ctx[r] = sq.num_computed + n
            rows[r] = i + n - 1
            i += n
        self.compiled_buckets.add((s, t))
        return dict(tokens=tokens, seq=seq, pos=pos, slot=slot, tables=tables, ctx=ctx, rows=rows), s

    def step(self, chunks, num_top: int = 0):
        """Runs one step; returns per chunk (token, logprob, top) sampled from its last row.

        Rows of sequences that are still mid-prompt are sampled too; the caller ignores them.
        """
        batch, s = self._batch(chunks)
        sampling = _greedy_rows(s)
        for r, (sq, n) in enumerate(chunks):
            p = sq.params
            for key, value in (
                ("temperature", p.temperature),
                ("top_k", p.top_k),
                ("top_p", p.top_p),
                ("min_p", p.min_p),
                ("seed", sq.seed),
                ("sample_index", sq.sample_index),
                ("position", sq.num_computed + n),
            ):
                sampling[key][r] = value
        tok, tok_lp, top = self._run(batch, sampling, num_top)
        tok, tok_lp = np.asarray(tok), np.asarray(tok_lp)
        top = None if top is None else (np.asarray(top[0]), np.asarray(top[1]))
        return tok[: len(chunks)], tok_lp[: len(chunks)], top

    def _run(self, batch, sampling, num_top):
        """One jitted step; keeps the donated cache; returns (tokens, logprobs, top)."""
        out, self.cache = _step(
            self.params,
            self.cache,
            batch,
            sampling,
            graphdef=self.graphdef,
            invariant=self.config.invariant,
            num_top=num_top,
        )
        return out

    def score_step(self, chunks, targets, temperature: float):
        """Logprobs of ``targets`` (one per computed token; -1: not wanted) for one step."""
        batch, _ = self._batch(chunks)
        t = len(batch["tokens"])
        tg = np.zeros(t, np.int32)
        tg[: len(targets)] = np.maximum(targets, 0)
        temp = np.full(t, temperature, np.float32)
        lp, self.cache = _score_step(
            self.params, self.cache, batch, tg, temp, graphdef=self.graphdef, invariant=self.config.invariant
        )
        return np.asarray(lp)[: len(targets)]

    def bucket_pairs(self) -> list[tuple[int, int]]:
        """Every (sequences, tokens) bucket a step can use: token bucket >= sequence bucket."""
        cfg = self.config
        return [(s, t) for s in cfg.seq_buckets for t in cfg.token_buckets if t >= s]

    def warmup(self, pairs, num_top: int = 0, progress=None) -> None:
        """Compiles the step for each (sequences, tokens) bucket by running it on padding
        (position -1, slot -1: it writes only the reserved null block and reads nothing)."""
        cfg = self.config
        for s, t in pairs:
            batch = dict(
                tokens=np.zeros(t, np.int32),
                seq=np.zeros(t, np.int32),
                pos=np.full(t, -1, np.int32),
                slot=np.full(t, -1, np.int32),
                tables=np.zeros((s, cfg.max_blocks_per_seq), np.int32),
                ctx=np.zeros(s, np.int32),
                rows=np.zeros(s, np.int32),
            )
            jax.block_until_ready(self._run(batch, _greedy_rows(s), num_top))
            self.compiled_buckets.add((s, t))
            if progress is not None:
                progress(s, t)

    def check_params(self) -> None:
        for leaf in jax.tree_util.tree_leaves(self.params):
            if isinstance(leaf, jax.Array) and leaf.is_deleted():
                raise RuntimeError(
                    "the engine's weights have been deleted (donated to a train step?): "
                    "call LLM.update_weights with the new weights first"
                )
