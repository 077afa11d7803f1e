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

import functools

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import pallas_kernels as pk
from bijax.config import EngineConfig, bucket
from bijax.sampler import sample_rows, target_logprobs
from models import sharding
from models.llama import Llama, TensorParallel, init_kv_cache


def _forward(params, cache, batch, *, graphdef, invariant, rows, tp=None):
    """The model's paged forward over one padded batch; ``rows``: the token rows to take logits of."""
    model = nnx.merge(graphdef, params)
    return model.forward_paged(
        batch["tokens"], batch["seq"], batch["pos"], batch["slot"], cache, batch["tables"], batch["ctx"],
        logit_rows=rows, invariant=invariant, tp=tp,
    )  # fmt: skip


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
    jax.jit, static_argnames=("graphdef", "invariant", "num_top", "mesh"), donate_argnames=("cache",)
)
def step_program(params, cache, batch, sampling, *, graphdef, invariant, num_top, mesh=None):
    def body(params, cache, batch, s, tp):
        logits, cache = _forward(
            params, cache, batch, graphdef=graphdef, invariant=invariant, rows=batch["rows"], tp=tp
        )
        out = sample_rows(
            logits, s["temperature"], s["top_k"], s["top_p"], s["min_p"], s["seed"], s["sample_index"],
            s["position"], invariant=invariant, num_top=num_top,
        )  # fmt: skip
        return out, cache

    return _over_mesh(body, mesh, params, cache, batch, sampling)


@functools.partial(jax.jit, static_argnames=("graphdef", "invariant", "mesh"), donate_argnames=("cache",))
def score_program(params, cache, batch, targets, temperature, *, graphdef, invariant, mesh=None):
    def body(params, cache, batch, targets, temperature, tp):
        logits, cache = _forward(
            params, cache, batch, graphdef=graphdef, invariant=invariant, rows=None, tp=tp
        )
        return target_logprobs(logits, targets, temperature, invariant=invariant), cache

    return _over_mesh(body, mesh, params, cache, batch, targets, temperature)


def num_compiled_steps() -> int:
    """How many engine step programs this process has compiled (all engines together): a
    constant across calls shows that nothing recompiled."""
    return step_program._cache_size()


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
    """Runs the jitted steps of one model. With ``config.tensor_parallel_size`` > 1 the model's
    weights are moved onto a mesh of that many devices (the model then holds the shards)."""

    def __init__(self, model: Llama, config: EngineConfig):
        self.config = config
        self.model_config = model.config
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
        self.compiled_buckets: set = set()

    def set_model(self, model: Llama) -> None:
        """Takes the model's weights (placed on the mesh under tensor parallelism)."""
        self.graphdef, params = nnx.split(model)
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
        tok, tok_lp = sharding.host(tok), sharding.host(tok_lp)
        top = None if top is None else (sharding.host(top[0]), sharding.host(top[1]))
        return tok[: len(chunks)], tok_lp[: len(chunks)], top

    def _run(self, batch, sampling, num_top):
        """One jitted step; keeps the donated cache; returns (tokens, logprobs, top)."""
        out, self.cache = step_program(
            self.params,
            self.cache,
            self._inputs(batch),
            self._inputs(sampling),
            graphdef=self.graphdef,
            invariant=self.config.invariant,
            num_top=num_top,
            mesh=self.mesh,
        )
        return out

    def score_step(self, chunks, targets, temperature: float):
        """Logprobs of ``targets`` (one per computed token; -1: not wanted) for one step."""
        batch, _ = self._batch(chunks)
        t = len(batch["tokens"])
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

    def padding_batch(self, s: int, t: int) -> dict:
        """A (sequences, tokens) bucket's inputs that are all padding: position -1, slot -1 (it
        writes only the reserved null block and reads nothing)."""
        return dict(
            tokens=np.zeros(t, np.int32),
            seq=np.zeros(t, np.int32),
            pos=np.full(t, -1, np.int32),
            slot=np.full(t, -1, np.int32),
            tables=np.zeros((s, self.config.max_blocks_per_seq), np.int32),
            ctx=np.zeros(s, np.int32),
            rows=np.zeros(s, np.int32),
        )

    def compiled_text(self, s: int, t: int, num_top: int = 0) -> str:
        """The compiled step of one bucket as HLO text (what the device runs; for audits)."""
        lowered = step_program.lower(
            self.params,
            self.cache,
            self._inputs(self.padding_batch(s, t)),
            self._inputs(_greedy_rows(s)),
            graphdef=self.graphdef,
            invariant=self.config.invariant,
            num_top=num_top,
            mesh=self.mesh,
        )
        return lowered.compile().as_text()

    def warmup(self, pairs, num_top: int = 0, progress=None) -> None:
        """Compiles the step for each (sequences, tokens) bucket by running it on padding
        (position -1, slot -1: it writes only the reserved null block and reads nothing)."""
        for s, t in pairs:
            jax.block_until_ready(self._run(self.padding_batch(s, t), _greedy_rows(s), num_top))
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
