"""Flat ragged steps padded to (num_seqs, num_tokens) buckets, one jitted step per bucket.

The weights are an argument of the step (not baked into it), so they can be swapped without
recompiling; the KV cache is donated. Padding tokens have position -1 and slot -1 (they write
the null block and read nothing); padding sequence rows have context length 0 and their
sampled tokens are dropped. The kernels are batch invariant, so padding cannot change a bit
of a real row.

With ``tensor_parallel_size`` P > 1 the whole step (forward and sampling) runs inside one
``jax.shard_map`` over a P-device mesh: weights and KV cache sharded (``models.sharding``),
inputs replicated, every rank sampling the same tokens from the same gathered logits.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import itertools
import os
import time

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import pallas_kernels as pk
from bijax import step_cache
from bijax.config import EngineConfig, bucket
from bijax.sampler import SamplingRows, sample_rows, target_logprobs
from bijax.sequence import Sequence
from models import sharding
from models.llama import Llama, TensorParallel
from models.paged import PagedBatch, init_kv_cache


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One sequence's tokens in a step: ``tokens`` at positions ``start``.. (KV written to the
    sequence's blocks), and logits sampled for the last ``num_rows`` of them (the row of the
    token at position p samples the token at p + 1, with the key of position p + 1)."""

    seq: Sequence
    start: int
    tokens: tuple[int, ...]
    num_rows: int = 1

    @classmethod
    def pending(cls, seq: Sequence, n: int, drafts=()) -> Chunk:
        """The next ``n`` pending tokens of ``seq`` and then ``drafts`` (speculative tokens after
        its last token), sampling the last row and every draft row."""
        nc = seq.num_computed
        ids = seq.token_ids
        return cls(seq, nc, tuple(ids[nc : nc + n]) + tuple(drafts), 1 + len(drafts))


def _chunk_arrays(chunks: list[Chunk]):
    """Per chunk: (token count, start position, sampled rows) as int32 arrays."""
    n = len(chunks)
    return (
        np.fromiter((len(c.tokens) for c in chunks), np.int32, n),
        np.fromiter((c.start for c in chunks), np.int32, n),
        np.fromiter((c.num_rows for c in chunks), np.int32, n),
    )


def _last_rows(ends, counts):
    """The last ``counts[i]`` integers before ``ends[i]``, for each i in order, concatenated."""
    offsets = np.cumsum(counts) - counts
    return (np.arange(int(counts.sum()), dtype=np.int32) + np.repeat(ends - counts - offsets, counts)).astype(
        np.int32
    )


def _forward(params, cache, batch: PagedBatch, *, graphdef, invariant, tp=None):
    """The model's paged forward over one padded batch."""
    return nnx.merge(graphdef, params).forward_paged(batch, cache, invariant=invariant, tp=tp)


def _over_mesh(body, mesh, params, cache, *args):
    """``body(params, cache, *args, tp)`` -> (out, cache): as is without a mesh, else inside one
    shard_map (sharded weights and cache, replicated inputs and outputs)."""
    if mesh is None:
        return body(params, cache, *args, None)
    tp = TensorParallel(sharding.AXIS, mesh.shape[sharding.AXIS])
    kv = sharding.cache_specs(cache)
    return jax.shard_map(
        lambda p, c, *a: body(p, c, *a, tp),
        mesh=mesh,
        in_specs=(sharding.state_specs(params), kv) + (P(),) * len(args),
        out_specs=(P(), kv),
        check_vma=False,
    )(params, cache, *args)


@functools.partial(
    jax.jit, static_argnames=("graphdef", "invariant", "num_logprobs", "mesh"), donate_argnames=("cache",)
)
def step_program(
    params, cache, batch: PagedBatch, sampling: SamplingRows, *, graphdef, invariant, num_logprobs, mesh=None
):
    """One engine step: the paged forward of ``batch`` (logits of its ``logit_rows``, one per
    sequence row) and a sampled token per row, with ``num_logprobs`` top logprobs (0: none)."""

    def body(params, cache, batch, sampling, tp):
        logits, cache = _forward(params, cache, batch, graphdef=graphdef, invariant=invariant, tp=tp)
        return sample_rows(logits, sampling, invariant=invariant, num_logprobs=num_logprobs), cache

    return _over_mesh(body, mesh, params, cache, batch, sampling)


@functools.partial(jax.jit, static_argnames=("graphdef", "invariant", "mesh"), donate_argnames=("cache",))
def score_program(params, cache, batch: PagedBatch, targets, temperature, *, graphdef, invariant, mesh=None):
    """The paged forward of ``batch`` (every token row) and each row's logprob of its target."""

    def body(params, cache, batch, targets, temperature, tp):
        logits, cache = _forward(params, cache, batch, graphdef=graphdef, invariant=invariant, tp=tp)
        return target_logprobs(logits, targets, temperature, invariant=invariant), cache

    return _over_mesh(body, mesh, params, cache, batch, targets, temperature)


def num_compiled_steps() -> int:
    """How many engine step programs this process has compiled (all engines together): a
    constant across calls shows that nothing recompiled."""
    return step_program._cache_size()


class ModelRunner:
    """Runs the jitted steps of one model. With ``config.tensor_parallel_size`` > 1 the model's
    weights are moved onto a mesh of that many devices (the model then holds the shards)."""

    def __init__(self, model: Llama, config: EngineConfig):
        self.config = config
        self.model_config = model.config
        self.compiled_buckets: set = set()  # (seqs, tokens) buckets whose step is compiled
        # Steps compiled ahead of time by ``warmup`` (in parallel), by (seqs, tokens, num_logprobs).
        self._aot: dict = {}
        if config.invariant and jax.default_backend() == "cpu":
            pk.require_consistent_cpu_math()  # CPU bits must not depend on the CPU model
        size = config.tensor_parallel_size
        self.mesh = None
        if size > 1:
            sharding.check_tensor_parallel(model.config, size, model.k_shards)
            self.mesh = sharding.make_mesh(size)
        self.set_model(model)
        kv = None if self.mesh is None else NamedSharding(self.mesh, sharding.kv_spec())
        self.cache = init_kv_cache(model.config, config.num_kv_blocks, config.block_size, model.dtype, kv)

    def set_model(self, model: Llama) -> None:
        """Takes the model's weights (placed on the mesh under tensor parallelism)."""
        graphdef, params = nnx.split(model)
        if getattr(self, "graphdef", graphdef) != graphdef:
            self._aot.clear()  # steps compiled for another structure or config
        self.graphdef = graphdef
        if self.mesh is not None:
            params = sharding.shard_state(params, self.mesh)
            nnx.update(model, params)  # the model keeps the shards, not a second whole copy
        elif any(
            isinstance(a, jax.Array) and len(a.sharding.device_set) > 1
            for a in jax.tree_util.tree_leaves(params)
        ):  # shards of an earlier tensor-parallel engine: back to one device, never a partitioned step
            params = jax.device_put(params, jax.devices()[0])
            nnx.update(model, params)
        self.params = params

    def _inputs(self, tree):
        """Host inputs as arrays every rank of the mesh sees whole (needed across processes)."""
        if self.mesh is None or jax.process_count() == 1:
            return tree
        rep = NamedSharding(self.mesh, P())
        return jax.tree_util.tree_map(lambda a: sharding.to_global(np.asarray(a), rep), tree)

    def _batch(self, chunks: list[Chunk], *, logit_rows: bool = True) -> PagedBatch:
        """Flat padded inputs for the chunks, in order; ``logit_rows``: the sampled rows of each
        chunk - one per sequence row when every chunk samples one (R = S), else bucketed like
        tokens - or, without, every token row goes through the LM head."""
        cfg = self.config
        lens, starts, nrows = _chunk_arrays(chunks)
        total = int(lens.sum())
        t = bucket(total, cfg.token_buckets)
        s = bucket(len(chunks), cfg.seq_buckets)
        bs = cfg.block_size
        b = PagedBatch.padding(s, t, cfg.max_blocks_per_seq, logit_rows=logit_rows)
        rows = int(nrows.sum())
        if logit_rows and rows > len(chunks):
            b = b.replace(logit_rows=np.zeros(bucket(rows, cfg.token_buckets), np.int32))
        # Whole arrays at once (no per-chunk slices): token r's sequence row, position and slot.
        first = np.cumsum(lens) - lens  # each chunk's first flat token
        seq = np.repeat(np.arange(len(chunks), dtype=np.int32), lens)
        pos = np.arange(total, dtype=np.int32) + np.repeat(starts - first, lens)
        for r, c in enumerate(chunks):
            b.block_tables[r, : len(c.seq.block_table)] = c.seq.block_table
        blocks = np.fromiter((len(c.seq.block_table) for c in chunks), np.int32, len(chunks))
        if total and (pos // bs >= blocks[seq]).any():  # an engine bug, never a silent null-block write
            raise RuntimeError("a scheduled token's position lies past its sequence's allocated blocks")
        b.tokens[:total] = np.fromiter(
            itertools.chain.from_iterable(c.tokens for c in chunks), np.int32, total
        )
        b.token_seq[:total] = seq
        b.token_pos[:total] = pos
        b.slot_mapping[:total] = b.block_tables[seq, pos // bs] * bs + pos % bs
        b.context_lens[: len(chunks)] = starts + lens
        if logit_rows:  # the last num_rows tokens of each chunk
            b.logit_rows[:rows] = _last_rows(first + lens, nrows)
        return b

    def step(self, chunks: list[Chunk], num_logprobs: int = 0):
        """Runs one step; returns per sampled row, in chunk order, (token, logprob, top).

        Rows of sequences that are still mid-prompt are sampled too; the caller ignores them.
        """
        batch = self._batch(chunks)
        self.compiled_buckets.add((len(batch.context_lens), batch.num_tokens))
        sampling = SamplingRows.greedy(len(batch.logit_rows))
        j = sum(c.num_rows for c in chunks)
        flat = batch.logit_rows[:j]  # each sampled row's token in the batch
        owner = batch.token_seq[flat]  # and the chunk it belongs to
        for name, dtype in (
            ("temperature", np.float32),
            ("top_k", np.int32),
            ("top_p", np.float32),
            ("min_p", np.float32),
        ):
            getattr(sampling, name)[:j] = np.fromiter((getattr(c.seq.params, name) for c in chunks), dtype)[
                owner
            ]
        sampling.seed[:j] = np.fromiter((c.seq.seed for c in chunks), np.uint32)[owner]
        sampling.sample_index[:j] = np.fromiter((c.seq.sample_index for c in chunks), np.int32)[owner]
        sampling.position[:j] = batch.token_pos[flat] + 1  # a row samples the token after its own
        tok, tok_lp, top = self._run(batch, sampling, num_logprobs)
        tok, tok_lp = sharding.host(tok), sharding.host(tok_lp)
        top = None if top is None else (sharding.host(top[0])[:j], sharding.host(top[1])[:j])
        return tok[:j], tok_lp[:j], top

    def _step_args(self, batch: PagedBatch, sampling: SamplingRows, num_logprobs: int):
        args = (self.params, self.cache, self._inputs(batch), self._inputs(sampling))
        kw = dict(
            graphdef=self.graphdef, invariant=self.config.invariant, num_logprobs=num_logprobs, mesh=self.mesh
        )
        return args, kw

    def _run(self, batch: PagedBatch, sampling: SamplingRows, num_logprobs: int):
        """One step (compiled ahead of time by ``warmup``, else jitted now); keeps the donated
        cache; returns (tokens, logprobs, top)."""
        args, kw = self._step_args(batch, sampling, num_logprobs)
        key = (len(batch.context_lens), batch.num_tokens, len(batch.logit_rows), num_logprobs)
        compiled = self._aot.get(key)
        out, self.cache = compiled(*args) if compiled is not None else step_program(*args, **kw)
        return out

    def score_step(self, chunks: list[Chunk], targets, temperature: float):
        """Logprobs of ``targets`` (one per computed token; -1: not wanted) for one step."""
        batch = self._batch(chunks, logit_rows=False)
        t = batch.num_tokens
        tg = np.zeros(t, np.int32)
        tg[: len(targets)] = np.maximum(targets, 0)
        temp = np.full(t, temperature, np.float32)
        lp, self.cache = score_program(
            self.params,
            self.cache,
            self._inputs(batch),
            *self._inputs((tg, temp)),
            graphdef=self.graphdef,
            invariant=self.config.invariant,
            mesh=self.mesh,
        )
        return sharding.host(lp)[: len(targets)]

    def bucket_pairs(self) -> list[tuple[int, int]]:
        """Every (sequences, tokens) bucket a step can use: token bucket >= sequence bucket."""
        cfg = self.config
        return [(s, t) for s in cfg.seq_buckets for t in cfg.token_buckets if t >= s]

    def padding_batch(self, s: int, t: int, r: int | None = None) -> PagedBatch:
        """A (sequences, tokens) bucket's inputs that are all padding: position -1, slot -1 (it
        writes only the reserved null block and reads nothing); ``r`` sampled rows (default s)."""
        b = PagedBatch.padding(s, t, self.config.max_blocks_per_seq)
        return b if r is None or r == s else b.replace(logit_rows=np.zeros(r, np.int32))

    def compiled_text(self, s: int, t: int, num_logprobs: int = 0) -> str:
        """The compiled step of one bucket as HLO text (what the device runs; for audits)."""
        lowered = step_program.lower(
            self.params,
            self.cache,
            self._inputs(self.padding_batch(s, t)),
            self._inputs(SamplingRows.greedy(s)),
            graphdef=self.graphdef,
            invariant=self.config.invariant,
            num_logprobs=num_logprobs,
            mesh=self.mesh,
        )
        return lowered.compile().as_text()

    def warmup(self, pairs, num_logprobs: int = 0, progress=None, workers: int | None = None) -> float:
        """Compiles the step for each (sequences, tokens) bucket - or (sequences, tokens,
        sampled rows) for steps that sample more rows than sequences (speculative decoding) -
        ahead of time, ``workers`` at once (default: one per CPU core, at most 8). Each bucket's
        program comes from ``step_cache`` (exported by an earlier start; CPU only) or is traced
        and lowered now, in this thread and in a fixed order - tracing holds Python's lock anyway,
        and a fixed order keeps the lowered text (Mosaic GPU numbers its kernels as it lowers
        them) and so JAX's persistent cache keys the same from start to start. XLA's compile,
        most of the time, releases the lock: it runs in worker threads while the next bucket
        lowers. ``progress(s, t)`` after each bucket, in the order they finish. Returns the
        seconds spent tracing and lowering (or reading exported programs), in this thread."""
        todo = []
        for b in pairs:
            s, t, r = b if len(b) == 3 else (*b, b[0])
            if (s, t, r, num_logprobs) not in self._aot:
                todo.append((s, t, r))
        if not todo:
            return 0.0
        workers = workers or min(8, os.cpu_count() or 1)
        tracing = 0.0
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(workers, len(todo))) as pool:
            futures = {}
            for s, t, r in todo:
                t0 = time.perf_counter()
                lowered = self._lowered_step(s, t, r, num_logprobs)
                tracing += time.perf_counter() - t0
                futures[pool.submit(lowered.compile)] = (s, t, r)
            for future in concurrent.futures.as_completed(futures):
                s, t, r = futures[future]
                self._aot[(s, t, r, num_logprobs)] = future.result()
                self.compiled_buckets.add((s, t))
                if progress is not None:
                    progress(s, t)
        return tracing

    def _lowered_step(self, s: int, t: int, r: int, num_logprobs: int):
        """One bucket's step lowered for inputs shaped as this runner's - through ``step_cache``
        (an exported program read back, or exported now) where it keeps programs, else from
        tracing. Its ``compile()`` gives what ``_run`` calls."""
        args, kw = self._step_args(self.padding_batch(s, t, r), SamplingRows.greedy(r), num_logprobs)
        if step_cache.directory() is None:
            return step_program.lower(*args, **kw)
        return step_cache.lower(step_program, args, kw, donate=1, label="step_program")

    def check_params(self) -> None:
        for leaf in jax.tree_util.tree_leaves(self.params):
            if isinstance(leaf, jax.Array) and leaf.is_deleted():
                raise RuntimeError(
                    "the engine's weights have been deleted (donated to a train step?): "
                    "call LLM.update_weights with the new weights first"
                )
