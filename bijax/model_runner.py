"""Flat ragged steps padded to (num_seqs, num_tokens) buckets; a step is its forward - one
compiled program, or a chain of them (the embedding, one program per layer: the same compiled
layer for every layer of the same shapes, the LM head of its sampled rows), per token bucket
as ``bijax.step_programs`` says - then sampling.

The weights are an argument of every program (not baked into it), so they can be swapped
without recompiling; the KV cache is donated, a layer's at a time. Padding tokens have
position -1 and slot -1 (they write the null block and read nothing); padding sequence rows
have context length 0 and their sampled tokens are dropped. The kernels are batch invariant, so
padding cannot change a bit of a real row. Sampling runs with or without the top-k / top-p
masks, as the host decides from the rows' parameters (``sample_program``); a row that uses
neither gets the same bits either way.

With ``tensor_parallel_size`` P > 1 every program runs inside ``jax.shard_map`` over a P-device
mesh: weights and KV cache sharded (``models.sharding``), inputs replicated, every rank sampling
the same tokens from the same gathered logits.
"""

from __future__ import annotations

import concurrent.futures
import concurrent.futures.thread  # its exit hook registered before ``_stopping``'s (see there)
import contextlib
import dataclasses
import functools
import itertools
import os
import signal
import threading
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax._src import config as jax_config  # trace_context: the settings tracing reads
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import pallas_kernels as pk
from bijax import parallel_lowering, step_cache
from bijax.config import EngineConfig, bucket
from bijax.sampler import SamplingRows, uses_filters
from bijax.sequence import PENDING, Sequence
from bijax.step_programs import (
    BASELINE_XLA_OPTIONS,
    Layout,
    block_inputs,
    block_program,
    chain_from,
    embed_program,
    forward_program,
    head_program,
    layer_switches,
    layers_per_program,
    placed,
    sample_program,
    score_program,
    staged_inputs,
    tiered,
)
from models import sharding
from models.checkpoint import check_same_layout
from models.llama import Llama
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
        return cls(seq, nc, tuple(seq.token_slice(nc, nc + n)) + tuple(drafts), 1 + len(drafts))


@dataclasses.dataclass(frozen=True)
class Launched:
    """A step on the device: its sampled rows (device arrays, not read back), how many are
    real (``num_rows``), and each sequence's last sampled row (``rows``, by seq_id)."""

    tok: jax.Array
    lp: jax.Array
    top: tuple | None
    num_rows: int
    rows: dict


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


_LEAF = jax.tree_util.tree_structure(0)


def _tuple(*trees):
    return jax.tree_util.treedef_tuple(trees)


_compiles = [0]  # step programs compiled by every runner of this process
# The counters' increments (a runner's background threads - whole forwards, buckets filled in -
# and the engine's thread keep programs at the same time)
_counting = threading.Lock()
# Compiled programs by ``ModelRunner._shared_name``: runners of the same model and shapes (an
# engine rebuilt, a draft model equal to the target, tests) share them, as jit's cache would.
_shared: dict = {}


# Tiered runners' background compiles stop starting new programs when the interpreter exits,
# before the thread pools are joined: threading runs its exit hooks last registered first, and
# ``concurrent.futures.thread`` (imported above) registers the pools' join on import.
_stopping = threading.Event()
getattr(threading, "_register_atexit", lambda fn: None)(_stopping.set)


def num_compiled_steps() -> int:
    """How many engine step programs (forward and sampling) this process has compiled (all
    engines together, ahead of time or when a step first needed them): a constant across calls
    shows that nothing recompiled."""
    return _compiles[0]


@contextlib.contextmanager
def ctrl_c_held():
    """Ctrl-C (SIGINT) held back until the block ends, then delivered: a KeyboardInterrupt
    between a program that took the KV cache (donated) and the store of the cache it returned
    would leave the runner holding deleted arrays, and every later step failing. Only in the
    main thread (the one Python delivers signals to) and under a handler set from Python."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.getsignal(signal.SIGINT)
    if old is None:  # (a handler not set from Python cannot be put back)
        yield
        return
    frames = []
    signal.signal(signal.SIGINT, lambda _num, frame: frames.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
    if frames:  # (the block ended normally: the held Ctrl-C now, as its handler takes it)
        if callable(old):
            old(signal.SIGINT, frames[0])
        elif old == signal.SIG_DFL:
            signal.raise_signal(signal.SIGINT)


def _sampled_rows(config: EngineConfig, s: int, rows: int, num_chunks: int) -> int:
    """The sampled (logit) rows of a step of sequence bucket ``s`` whose ``num_chunks`` chunks
    sample ``rows`` rows: one per sequence row when each chunk samples one, else bucketed like
    tokens (speculative verify steps)."""
    return bucket(rows, config.token_buckets) if rows > num_chunks else s


class ModelRunner:
    """Runs the jitted steps of one model. With ``config.tensor_parallel_size`` > 1 the model's
    weights are moved onto a mesh of that many devices (the model then holds the shards)."""

    def __init__(self, model: Llama, config: EngineConfig):
        self._start(config, model.config)
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

    @classmethod
    def abstract(
        cls, graphdef, params, cache, config: EngineConfig, model_config, switches: tuple
    ) -> ModelRunner:
        """A runner of ``graphdef`` whose weights and KV cache are ``params`` and ``cache`` as
        given - ShapeDtypeStructs in ``parallel_lowering``'s helpers, which only lower its
        programs (no tensor parallelism) - with another runner's ``switches()``."""
        self = cls.__new__(cls)
        self._start(config, model_config)
        self.chain_from, self._layer_copies, self._layer_buffers, self._per_program = switches
        self.mesh, self.graphdef, self.params, self.cache = None, graphdef, params, cache
        self._param_leaves, self._param_tree = jax.tree_util.tree_flatten(params)
        return self

    def _start(self, config: EngineConfig, model_config) -> None:
        """What every runner starts with: its configs and no programs yet."""
        self.config = config
        self.model_config = model_config
        self._layout, self._layout_lock = None, threading.Lock()  # (``layout``)
        # token buckets from this one run the forward as a chain of programs, the others as one
        # (None: all as one; step_programs)
        self.chain_from = chain_from()
        self._layer_copies, self._layer_buffers = layer_switches()
        self._per_program = layers_per_program()  # layers a block program of the chain runs
        self._copies: dict = {}  # (block key, layer) -> that layer's loaded copy (BIJAX_LAYER_COPIES)
        self.copy_seconds = 0.0  # spent making them (a measurement)
        if self._layer_copies and jax.default_backend() == "cpu":
            # (XLA:CPU could not run a copy of an executable read back from the persistent cache)
            raise ValueError("BIJAX_LAYER_COPIES is a GPU measurement switch; unset it on CPU")
        self.compiled_buckets: set = set()  # (seqs, tokens) buckets whose step is compiled
        # Programs compiled ahead of time by ``warmup`` (in parallel), by ``_lowered``'s keys.
        self._aot: dict = {}
        self._names: dict = {}  # ``step_cache.step_key`` by program key (``_shared_name``)
        self.programs_made = 0  # by ``warmup``, all calls together
        self.programs_lowered_elsewhere = 0  # of them, lowered by ``parallel_lowering``'s helpers
        # Tiered (``step_programs.tiered``): the chain first, each bucket's whole forward compiled
        # in a background thread and run from when it is kept.
        self._tiered = tiered()
        self._upgrader = None  # that thread (a one-worker pool), made when first needed
        # ... and one for the chains of buckets whose steps run in a larger bucket meanwhile
        # (``_batch``: not queued behind whole forwards, which take longer to compile)
        self._filler = None
        self.larger_bucket_steps = 0  # steps run in a larger bucket than their own, so far
        self._upgrading: set = set()  # whole-forward keys given to it
        self._kept_chain: set = set()  # ... of them, not compiled there (``_upgrade``)
        self._upgrades: list = []  # its pending batches (futures)
        self._generation = 0  # the weights' structure: a background program of another is dropped
        self.programs_upgraded = 0  # programs the background threads kept
        self.steps_by_form = {"chain": 0, "whole": 0}  # steps run by each form of the forward
        self._staging: dict = {}  # the step inputs' device buffers, by structure and shapes (``_staged``)
        self._stage = staged_inputs()

    def check_model(self, model, what: str = "set_weights") -> None:
        """Raises (naming the difference) unless ``model`` is a ``Llama`` the engine can run: the
        same attention heads (the KV cache's shape) and k_shards, its arrays of the same shapes
        and dtypes, none deleted. Another config otherwise (an epsilon, RoPE's base) is taken:
        ``set_model`` drops the steps compiled for the old one."""
        if not isinstance(model, Llama):
            raise TypeError(f"{what}: model must be a models.Llama, got {type(model).__name__}")
        heads = lambda c: (c.num_heads, c.num_kv_heads, c.head_dim)  # noqa: E731
        if heads(model.config) != heads(self.model_config):
            raise ValueError(
                f"{what}: the model's attention heads (num_heads, num_kv_heads, head_dim) "
                f"{heads(model.config)} differ from the engine's {heads(self.model_config)}: its KV "
                "cache was made for those"
            )
        if (model.k_shards, model.tp_parts) != (self.k_shards, self.tp_parts):
            raise ValueError(
                f"{what}: the model has k_shards={model.k_shards} (tp_parts={model.tp_parts}), the engine's "
                f"{self.k_shards} ({self.tp_parts}): other bits"
            )
        leaves = lambda state: dict(jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(state)))  # noqa: E731
        check_same_layout(
            leaves(self.params),
            leaves(nnx.split(model)[1]),
            what=f"{what}: the new model's weights",
            ref="the engine's",
        )

    def set_model(self, model: Llama) -> None:
        """Takes the model's weights (placed on the mesh under tensor parallelism)."""
        graphdef, params = nnx.split(model)
        if getattr(self, "graphdef", graphdef) != graphdef:
            self._aot.clear()  # steps compiled for another structure or config
            self._names.clear()
            self._copies.clear()
            self._upgrading.clear()
            self._generation += 1
        self.graphdef = graphdef
        self.k_shards, self.tp_parts = model.k_shards, model.tp_parts
        model_state = params  # (split from the model: its variables)
        if self.mesh is not None:
            params = sharding.shard_state(params, self.mesh)
            nnx.update(model, params)  # the model keeps the shards, not a second whole copy
        elif any(
            isinstance(a, jax.Array) and a.sharding.device_set != {jax.devices()[0]}
            for a in jax.tree_util.tree_leaves(params)
        ):  # shards of an earlier tensor-parallel engine, or another device: to the one the steps run on
            params = jax.device_put(params, jax.devices()[0])
            nnx.update(model, params)
        with self._layout_lock:  # (a background compile's ``layout`` keeps no Layout of the old weights)
            # Flattened once (an nnx State flattens in Python: ~1 ms per step for llama3-8b's 291
            # arrays): ``check_params`` and the warmed-up steps' flat calls use these. The state
            # every other program takes (scoring, the chain's layout) is made from the same
            # arrays: a state split from the model shares its variables, so an in-place change
            # of the model (an optimizer step on it, ``nnx.update``) would reach scoring and not
            # generation (``follows`` tells the LLM, which takes such a change as update_weights)
            self._param_leaves, self._param_tree = jax.tree_util.tree_flatten(params)
            self.params = jax.tree_util.tree_unflatten(self._param_tree, self._param_leaves)
            self._layout = None  # made again from these weights when the chain needs it
            # the model's variables and the arrays they hold now (``follows``)
            if model_state is not params:  # (the model took new arrays: its variables again)
                model_state = nnx.split(model)[1]
            self._watched = [(var, var.get_value()) for _, var in nnx.to_flat_state(model_state)]

    def follows(self) -> bool:
        """Whether the model this runner took (``set_model``) still holds the arrays it took:
        False once they were changed in place (an optimizer step on it, ``nnx.update``). Reads
        each variable the model had then (~0.8 ms for 273, where splitting the model again took
        ~8 ms); a variable object replaced by another is not seen."""
        return all(var.get_value() is value for var, value in self._watched)

    def _inputs(self, tree):
        """Host inputs as arrays every rank of the mesh sees whole (needed across processes);
        leaves already on the devices stay as they are."""
        if self.mesh is None or jax.process_count() == 1:
            return tree
        rep = NamedSharding(self.mesh, P())
        return jax.tree_util.tree_map(
            lambda a: a if isinstance(a, jax.Array) else sharding.to_global(np.asarray(a), rep), tree
        )

    def _staged(self, tree):
        """``tree`` (a step's inputs: host arrays, or device arrays made for this step) in device
        buffers that keep their addresses from step to step: copied into the buffers that the
        last call of the same structure and shapes returned, which it donates (the copy lands
        where they are). XLA runs a warmed-up program as a CUDA graph and re-records the graph
        (~1 ms of host time for a llama3-8b forward, every step) whenever one of the program's
        buffers moved since its last run: inputs placed anew every step moved every step
        (benchmarks/RESULTS.md, session 36). Values only move: no bit can change."""
        if not self._stage:
            return tree
        leaves, treedef = jax.tree_util.tree_flatten(self._inputs(tree))
        key = (treedef, tuple((a.shape, np.dtype(a.dtype)) for a in leaves))
        old = self._staging.pop(key, None)
        new = self._copy(leaves) if old is None else self._copy_into(old, leaves)
        self._staging[key] = new
        return jax.tree_util.tree_unflatten(treedef, new)

    @functools.cached_property
    def _copy(self):
        """New values -> a copy in buffers of XLA's own (a host array placed on the CPU may
        share the array's memory, which a later copy could not be donated into)."""
        out = None if self.mesh is None else NamedSharding(self.mesh, P())
        # (the barrier keeps jit from handing ``new`` back as it is instead of copying it)
        return jax.jit(jax.lax.optimization_barrier, out_shardings=out)

    @functools.cached_property
    def _copy_into(self):
        """(old buffers, new values) -> the new values in the old buffers (donated)."""
        out = None if self.mesh is None else NamedSharding(self.mesh, P())
        return jax.jit(
            lambda old, new: jax.lax.optimization_barrier(new),
            donate_argnums=0,
            keep_unused=True,  # (else jit drops the unused ``old``, and its donation with it)
            out_shardings=out,
        )

    def _batch(self, chunks: list[Chunk], *, logit_rows: bool = True, num_logprobs: int = 0) -> PagedBatch:
        """Flat padded inputs for the chunks, in order; ``logit_rows``: the sampled rows of each
        chunk - one per sequence row when every chunk samples one (R = S), else bucketed like
        tokens - or, without, every token row goes through the LM head."""
        cfg = self.config
        lens, starts, nrows = _chunk_arrays(chunks)
        total = int(lens.sum())
        rows = int(nrows.sum())
        s, t = cfg.step_bucket(len(chunks), total)
        if logit_rows and self._tiered and self.config.invariant:  # (the baseline's bits follow its bucket)
            s, t = self._ready_bucket(s, t, rows, len(chunks), num_logprobs)
        bs = cfg.block_size
        b = PagedBatch.padding(s, t, cfg.max_blocks_per_seq, logit_rows=logit_rows)
        if logit_rows and rows > len(chunks):
            b = b.replace(logit_rows=np.zeros(_sampled_rows(cfg, s, rows, len(chunks)), np.int32))
        # Whole arrays at once (no per-chunk slices): token r's sequence row, position and slot.
        first = np.cumsum(lens) - lens  # each chunk's first flat token
        seq = np.repeat(np.arange(len(chunks), dtype=np.int32), lens)
        pos = np.arange(total, dtype=np.int32) + np.repeat(starts - first, lens)
        for r, c in enumerate(chunks):
            table = c.seq.block_table.array
            b.block_tables[r, : len(table)] = table
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

    def _ready_bucket(
        self, s: int, t: int, rows: int, num_chunks: int, num_logprobs: int = 0
    ) -> tuple[int, int]:
        """Tiered: the bucket a step of bucket (s, t) runs in - its own, or, while its own
        forward is not compiled, the smallest larger bucket (fewest tokens, then sequences)
        whose forward is, its own then compiling in the background; a step's bits do not
        depend on its bucket (the extra rows are padding). Its own where none is ready, or
        where its chain cannot be compiled in the background (``_kept_chain``): compiled now.
        The background compile takes its own sampled rows' sampling programs too (both
        variants, as ``warmup``): its first step in its own bucket compiles nothing."""

        def rows_of(s):
            return _sampled_rows(self.config, s, rows, num_chunks)

        def ready(s, t) -> bool:
            r = rows_of(s)
            whole = ("forward", s, t, r)
            if whole in self._aot:  # (every step: this first, no program names hashed)
                return True
            chain = self.forward_keys(s, t, r)
            return all(k in self._aot for k in chain) or self._reuse(whole) or all(map(self._reuse, chain))

        if ready(s, t):
            return s, t
        own = self.forward_keys(s, t, rows_of(s))
        if any(k in self._kept_chain for k in own):
            return s, t
        larger = sorted(
            (t2, s2) for s2, t2 in self.bucket_pairs() if s2 >= s and t2 >= t and (s2, t2) != (s, t)
        )
        for t2, s2 in larger:
            if ready(s2, t2):
                samples = [("sample", rows_of(s), num_logprobs, f) for f in (False, True)]
                self._upgrade(own + samples, fill=True)
                self._upgrade([("forward", s, t, rows_of(s))])  # (as its chain's first step would)
                self.larger_bucket_steps += 1
                return s2, t2
        return s, t

    def step(self, chunks: list[Chunk], num_logprobs: int = 0):
        """Runs one step; returns per sampled row, in chunk order, (token, logprob, top).

        Rows of sequences that are still mid-prompt are sampled too; the caller ignores them.
        """
        return self.collect(self.dispatch(chunks, num_logprobs))

    def dispatch(self, chunks: list[Chunk], num_logprobs: int = 0, prev: Launched | None = None) -> Launched:
        """Enqueues one step on the device and returns without waiting for it. A chunk token
        that is ``PENDING`` (async scheduling: sampled by ``prev``, not read back) is taken on
        the device from ``prev``'s sampled row of its sequence."""
        batch = self._batch(chunks, num_logprobs=num_logprobs)
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
        pending = np.flatnonzero(batch.tokens == PENDING)
        if len(pending):
            if prev is None:
                raise RuntimeError("a step's token is still on the device, but no step is in flight")
            src = np.full(batch.num_tokens, -1, np.int32)
            src[pending] = [prev.rows[chunks[r].seq.seq_id] for r in batch.token_seq[pending]]
            batch = batch.replace(tokens=self._fill_pending(batch.tokens, prev.tok, src))
        tok, tok_lp, top = self._run(batch, sampling, num_logprobs)
        ends = np.cumsum(_chunk_arrays(chunks)[2])
        rows = {c.seq.seq_id: int(e) - 1 for c, e in zip(chunks, ends, strict=True)}
        return Launched(tok, tok_lp, top, j, rows)

    def collect(self, launched: Launched):
        """Waits for a dispatched step; its sampled rows on the host: (tokens, logprobs, top)."""
        j, top = launched.num_rows, launched.top
        tok, tok_lp = sharding.host(launched.tok), sharding.host(launched.lp)
        top = None if top is None else (sharding.host(top[0])[:j], sharding.host(top[1])[:j])
        return tok[:j], tok_lp[:j], top

    @functools.cached_property
    def _fill_pending(self):
        """tokens [T] (host) with each ``src >= 0`` entry replaced by ``prev[src]`` (device)."""
        out = None if self.mesh is None else NamedSharding(self.mesh, P())
        return jax.jit(
            lambda t, prev, src: jnp.where(src >= 0, prev[jnp.maximum(src, 0)], t), out_shardings=out
        )

    def _forward_args(self, batch: PagedBatch):
        args = (self.params, self.cache, self._inputs(batch))
        return args, dict(graphdef=self.graphdef, invariant=self.config.invariant, mesh=self.mesh)

    def _sample_args(self, logits, sampling: SamplingRows, num_logprobs: int, filters: bool):
        args = (logits, self._inputs(sampling))
        kw = dict(invariant=self.config.invariant, num_logprobs=num_logprobs, filters=filters, mesh=self.mesh)
        return args, kw

    def _logits_spec(self, r: int) -> jax.ShapeDtypeStruct:
        """What ``forward_program`` returns as logits for ``r`` sampled rows."""
        rep = None if self.mesh is None else NamedSharding(self.mesh, P())
        return jax.ShapeDtypeStruct((r, self.model_config.vocab_size), np.float32, sharding=rep)

    def _run(self, batch: PagedBatch, sampling: SamplingRows, num_logprobs: int):
        """One step - the forward, then sampling, each through its programs compiled ahead of
        time by ``warmup`` or now, the first time a step needs them (the same path either
        way); keeps the donated cache; returns (tokens, logprobs, top)."""
        s, t, r = len(batch.context_lens), batch.num_tokens, len(batch.logit_rows)
        filters = uses_filters(sampling)  # (read on the host, before staging)
        batch, sampling = self._staged((batch, sampling))
        whole = ("forward", s, t, r)
        if self._chained(t) and not (self._tiered and whole in self._aot):
            logits = self._forward_layers(batch, s, t, r)
            self.steps_by_form["chain"] += 1
            if self._tiered:
                self._upgrade([whole])  # (a no-op once it is queued)
        else:
            logits = self._forward_whole(batch, s, t, r)
            self.steps_by_form["whole"] += 1
        self.compiled_buckets.add((s, t))
        args, _ = self._sample_args(logits, sampling, num_logprobs, filters)
        return self._program(("sample", r, num_logprobs, filters))(*args)

    def _forward_whole(self, batch: PagedBatch, s: int, t: int, r: int):
        args, _ = self._forward_args(batch)
        compiled = self._program(("forward", s, t, r))
        rest, rest_tree = jax.tree_util.tree_flatten(args[1:])  # the weights' leaves as flattened once
        tree = jax.tree_util.treedef_tuple([self._param_tree, *rest_tree.children()])
        with ctrl_c_held():
            logits, self.cache = compiled(*args, flat=(self._param_leaves + rest, tree))
        return logits

    def _forward_layers(self, batch: PagedBatch, s: int, t: int, r: int):
        """The chain: the embedding, each layer's program (its weights flattened once, by
        ``Layout``), the LM head; the step's inputs placed on the device once."""
        lay = self.layout
        tokens, inputs, rows = placed((batch.tokens, block_inputs(batch), batch.logit_rows), self.mesh)
        _, embed, embed_tree = lay.embed
        h, residual = self._program(("embed", t))(flat=(embed + [tokens], _tuple(embed_tree, _LEAF)))
        in_leaves, in_tree = jax.tree_util.tree_flatten(inputs)
        _, rope, rope_tree = lay.rope
        trees = {}  # by group: the layers of a group share their arguments' tree
        # (every program first - a compile here is never inside ``ctrl_c_held``)
        programs = [self._layer(("block", s, t, g), j) for j, g in enumerate(lay.groups)]
        head_program = self._program(("head", t, r))
        with ctrl_c_held():
            for j, (run, g) in enumerate(zip(lay.runs, lay.groups, strict=True)):
                _, weights, weights_tree = lay.blocks[j]
                kv = tuple(self.cache[i] for i in run)
                tree = trees.get(g)
                if tree is None:
                    kv_tree = jax.tree_util.tree_structure(kv)
                    tree = trees[g] = _tuple(weights_tree, kv_tree, rope_tree, _LEAF, _LEAF, in_tree)
                leaves = weights + [x for layer_kv in kv for x in layer_kv] + rope + [h, residual] + in_leaves
                (h, residual), kv = programs[j](flat=(leaves, tree))
                for i, layer_kv in zip(run, kv, strict=True):
                    self.cache[i] = layer_kv
        _, head, head_tree = lay.head
        return head_program(flat=(head + [h, rows], _tuple(head_tree, _LEAF, _LEAF)))

    def _program(self, key):
        """The compiled program of ``_lowered``'s ``key``, compiled now if ``warmup`` did not."""
        compiled = self._aot.get(key)
        if compiled is None:
            if not self._reuse(key):
                self._keep(key, self._lowered(key).compile(self._compiler_options(key)))
            compiled = self._aot[key]
        return compiled

    def _layer(self, key, i: int):
        """Run ``i``'s block program (``Layout.runs``): its group's (``key``), or with
        ``BIJAX_LAYER_COPIES`` a loaded copy of it for this run alone (made the first time)."""
        if not self._layer_copies or i == key[3]:
            return self._program(key)
        copy = self._copies.get((key, i))
        if copy is None:
            t0 = time.perf_counter()
            copy = self._copies[(key, i)] = self._program(key).copy()
            self.copy_seconds += time.perf_counter() - t0
        return copy

    def _compiler_options(self, key) -> dict | None:
        """XLA options a program compiles with: none on the invariant path (its matmuls are
        Pallas kernels), but the layer programs' command buffers off under
        ``BIJAX_LAYER_COMMAND_BUFFERS=0`` (a measurement switch); the baseline's
        (``invariant=False``) programs with ``step_programs.BASELINE_XLA_OPTIONS``."""
        opts = {}
        if key[0] == "block" and not self._layer_buffers:
            opts["xla_gpu_enable_command_buffer"] = ""
        if not self.config.invariant:
            opts.update(BASELINE_XLA_OPTIONS)
        return opts or None

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
        """Every (sequences, tokens) bucket a step can use (``EngineConfig.step_bucket``)."""
        return self.config.bucket_pairs()

    def padding_batch(self, s: int, t: int, r: int | None = None) -> PagedBatch:
        """A (sequences, tokens) bucket's inputs that are all padding: position -1, slot -1 (it
        writes only the reserved null block and reads nothing); ``r`` sampled rows (default s)."""
        b = PagedBatch.padding(s, t, self.config.max_blocks_per_seq)
        return b if r is None or r == s else b.replace(logit_rows=np.zeros(r, np.int32))

    def compiled_text(self, s: int, t: int, num_logprobs: int = 0) -> str:
        """The compiled programs of one bucket's step - its forward's (the chain's embedding,
        layer and LM head programs, or the whole forward), then its sampling (both variants:
        without and with the top-k / top-p masks) - as HLO text (what the device runs; for
        audits)."""
        texts = []
        keys = [*self.forward_keys(s, t, s)] + [("sample", s, num_logprobs, f) for f in (False, True)]
        for key in keys:  # compiled as the engine compiles them (its XLA options included)
            fn, args, kw, _, _ = self._spec(key)
            options = self._compiler_options(key)
            with pk.runtime.pinned_config():
                lowered = fn.lower(*args, **kw)
            texts.append((lowered.compile(options) if options else lowered.compile()).as_text())
        return "\n".join(texts)

    @property
    def layout(self) -> Layout | None:
        """The weights as the chain's arguments (None where no bucket runs the chain)."""
        if self.chain_from is None:
            return None
        lay = self._layout
        if lay is None:
            params = self.params
            lay = Layout.of(self.graphdef, params, self.cache, self._per_program)
            with self._layout_lock:
                # kept only if the weights are still those (a background thread lowering a
                # chain while ``set_model`` swapped them: its Layout serves that lowering only)
                if self.params is params:
                    self._layout = lay
        return lay

    def switches(self) -> tuple:
        """The measurement switches this runner was made with (``step_programs``): which token
        buckets run the chain, the layer copies, the layer programs' command buffers, the layers
        a block program runs."""
        return self.chain_from, self._layer_copies, self._layer_buffers, self._per_program

    def _chained(self, t: int) -> bool:
        """Whether a step of token bucket ``t`` runs its forward as the chain."""
        return self.chain_from is not None and t >= self.chain_from

    def forward_keys(self, s: int, t: int, r: int) -> list:
        """The programs of one bucket's forward (``_lowered``'s keys): the chain's ("embed",
        t), a ("block", s, t, group) per group of runs of layers that share a program and ("head", t,
        r); or ("forward", s, t, r), the whole forward as one program (``chain_from``)."""
        if not self._chained(t):
            return [("forward", s, t, r)]
        groups = sorted(set(self.layout.groups))
        return [("embed", t), *(("block", s, t, g) for g in groups), ("head", t, r)]

    def warmup(
        self,
        pairs,
        num_logprobs: int = 0,
        progress=None,
        workers: int | None = None,
        processes: int | None = None,
    ) -> float:
        """Compiles the step for each (sequences, tokens) bucket - or (sequences, tokens,
        sampled rows) for steps that sample more rows than sequences (speculative decoding) -
        ahead of time, ``workers`` at once (default: one per CPU core, at most 8): its forward's
        programs (``forward_keys``; buckets share the embedding and LM-head programs of their
        token count), and the sampling programs (without and with top-k / top-p masks) of its
        sampled rows. Each program comes from ``step_cache`` (exported by an earlier start) or
        is traced and lowered now, in this thread and in a fixed order - tracing holds Python's
        lock anyway, and a fixed order keeps the lowered text (Mosaic GPU numbers its kernels as
        it lowers them) and so JAX's persistent cache keys the same from start to start. XLA's
        compile, most of the time, releases the lock: it runs in worker threads while the next
        program lowers. Forward programs the step cache lacks are first lowered in up to
        ``processes`` helper processes at once (``parallel_lowering``; default
        ``default_processes()``), then read back here. ``progress(s, t)`` after each bucket's
        forward is ready, in the order they finish. Returns the seconds spent tracing and
        lowering (or reading exported programs, or waiting for the helpers), in this thread;
        ``programs_made`` counts the programs made ready. Tiered (``step_programs.tiered``):
        a bucket whose whole forward is ready or exported by an earlier start (then most
        likely in the persistent cache: a load) warms that up; the others warm up the chain
        and leave their whole forwards to the background thread (``_upgrade``)."""
        forwards, samples, waiting = [], [], {}  # waiting: bucket -> its forward keys not ready
        upgrades = []  # tiered: whole forwards to compile after these, in the background
        for b in pairs:
            s, t, r = b if len(b) == 3 else (*b, b[0])
            keys = self.forward_keys(s, t, r)
            if self._tiered:
                whole = ("forward", s, t, r)
                if self._reuse(whole) or self._exported(whole):
                    keys = [whole]  # ready, or read back from the caches: no chain for it
                else:
                    upgrades.append(whole)
            todo = [k for k in keys if not self._reuse(k)]
            waiting.setdefault((s, t), set()).update(todo)
            forwards += [k for k in todo if k not in forwards]
            for filters in (False, True):
                key = ("sample", r, num_logprobs, filters)
                if not self._reuse(key) and key not in samples:
                    samples.append(key)
        for (s, t), todo in waiting.items():
            if not todo:
                self._bucket_ready(s, t, progress)
        tracing = 0.0
        if forwards or samples:
            tracing = self._make(forwards, samples, waiting, progress, workers, processes)
        self._upgrade(upgrades)
        return tracing

    def _make(
        self, forwards, samples, waiting, progress, workers, processes, stop=None, generation=None
    ) -> float:
        """Lowers and compiles ``forwards`` and ``samples`` (``warmup``; in helper processes
        and worker threads); ``waiting``: bucket -> its keys not ready (``progress`` when a
        bucket's are all kept). ``stop`` (an Event, set: no more compiles start) and
        ``generation`` (programs kept only while the runner's weights' structure is that one)
        for the background upgrades. Returns the seconds spent tracing (see ``warmup``)."""
        if stop is not None and stop.is_set():
            return 0.0
        workers = workers or min(8, os.cpu_count() or 1)
        t0 = time.perf_counter()
        helpers = parallel_lowering.start(self, forwards, processes)
        own = (forwards if helpers is None else [k for k in forwards if k not in helpers.keys]) + samples
        try:
            with concurrent.futures.ThreadPoolExecutor(
                max_workers=min(workers, len(forwards) + len(samples))
            ) as pool:
                futures = {}
                # This process's own programs first, then each helper's as it is saved (compiled
                # in the pool while the helpers lower the next ones), and what they left.
                for key in itertools.chain(own, () if helpers is None else helpers.as_ready()):
                    if stop is not None and stop.is_set():
                        break
                    futures[pool.submit(self._lowered(key).compile, self._compiler_options(key))] = key
                tracing = time.perf_counter() - t0
                for future in concurrent.futures.as_completed(futures):
                    if stop is not None and stop.is_set():
                        for f in futures:
                            f.cancel()
                        break
                    key = futures[future]
                    if generation is not None and generation != self._generation:
                        continue  # compiled for weights of another structure: dropped
                    self._keep(key, future.result())
                    with _counting:
                        if generation is None:
                            self.programs_made += 1
                        else:
                            self.programs_upgraded += 1
                    for (s, t), todo in waiting.items():
                        if key in todo:
                            todo.discard(key)
                            if not todo:
                                self._bucket_ready(s, t, progress)
        finally:
            if helpers is not None:
                helpers.close()
                with _counting:
                    self.programs_lowered_elsewhere += helpers.exported
        return tracing

    def _exported(self, key) -> bool:
        """Whether an earlier start exported ``key``'s program to the step cache (then its
        compile is most likely in the persistent cache too: a load, not a compile)."""
        where = step_cache.directory()
        return where is not None and os.path.exists(os.path.join(where, self._shared_name(key)[0]))

    def _upgrade(self, keys, *, fill: bool = False) -> None:
        """Tiered: compiles the whole forwards ``keys`` in a background thread (one batch of
        keys after another, each like ``warmup``'s); a step runs its bucket's whole forward
        from when it is kept. ``fill``: ``keys`` are the chain of a bucket whose steps run in a
        larger one meanwhile (``_ready_bucket``), compiled in a thread of their own."""
        todo = [k for k in keys if k not in self._upgrading and not self._reuse(k)]
        if not todo:
            return
        self._upgrading.update(todo)
        if fill and self._filler is None:
            self._filler = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="bijax-fill")
        if not fill and self._upgrader is None:
            self._upgrader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="bijax-upgrade")
        pool = self._filler if fill else self._upgrader
        gen = self._generation
        # JAX settings made for this thread only (``with jax.default_matmul_precision(...)``)
        # are not the background thread's: a whole forward traced there would not be the
        # program this thread's chain runs (nor the one its name says). Then no upgrade.
        context = jax_config.trace_context()

        def compile_in_background():
            if jax_config.trace_context() != context:
                self._kept_chain.update(todo)
                warnings.warn(
                    "bijax: JAX settings made in this thread only (a `with jax...` block) are "
                    "not the background thread's, so these step programs are not compiled there: "
                    "their buckets keep running the chain of programs, or compile what they miss "
                    "when a step needs it (the same bits, slower steps)",
                    RuntimeWarning,
                    stacklevel=1,
                )
                return 0.0
            try:
                samples = [k for k in todo if k[0] == "sample"]
                forwards = [k for k in todo if k[0] != "sample"]
                return self._make(forwards, samples, {}, None, None, None, _stopping, gen)
            except Exception as e:
                if _stopping.is_set():
                    return 0.0  # the interpreter is exiting: nothing more is compiled
                # (a bucket filled in: its steps compile what is missing now)
                self._kept_chain.update(k for k in todo if k not in self._aot)
                warnings.warn(
                    f"bijax: compiling step programs in the background failed ({type(e).__name__}: "
                    f"{e}); their buckets keep running the chain of programs, or compile what they "
                    "miss when a step needs it (the same bits, slower steps)",
                    RuntimeWarning,
                    stacklevel=1,
                )
                raise

        self._upgrades.append(pool.submit(compile_in_background))

    def pending_upgrades(self) -> int:
        """Programs given to the background threads and not ready yet (tiered: whole forwards,
        and chains of buckets whose steps run in a larger one meanwhile)."""
        return sum(1 for k in list(self._upgrading) if k not in self._aot and k not in self._kept_chain)

    def wait_upgrades(self, timeout: float | None = None) -> float:
        """Waits for the background compiles that ``_upgrade`` started (tiered); returns the
        seconds waited (0 when none is pending); re-raises a failed compile's error."""
        if not self._upgrades:
            return 0.0
        t0 = time.perf_counter()
        for f in concurrent.futures.as_completed(self._upgrades, timeout=timeout):
            f.result()
        self._upgrades = [f for f in self._upgrades if not f.done()]
        return time.perf_counter() - t0

    def close(self) -> None:
        """Frees the device memory this runner holds besides the model's weights: drops the
        background compiles not started (waits for the one running: a compile cannot be
        stopped; a failed one has warned already), then deletes the KV cache and the staged
        input buffers now (not whenever the collector gets to them) and drops this runner's
        references to its programs. The runner runs nothing afterwards (``Engine.close``)."""
        try:
            pools = [p for p in (self._upgrader, self._filler) if p is not None]
            for pool in pools:  # none starts another batch ...
                pool.shutdown(wait=False, cancel_futures=True)
            for pool in pools:  # ... then the ones running end
                pool.shutdown(wait=True)
        finally:
            buffers = jax.tree_util.tree_leaves(self.cache) + [
                a for leaves in self._staging.values() for a in leaves
            ]
            for a in buffers:
                if isinstance(a, jax.Array) and not a.is_deleted():
                    a.delete()
            self.cache = None
            self._upgrader = self._filler = None
            for kept in (self._staging, self._aot, self._copies, self._upgrading, self._kept_chain):
                kept.clear()
            self._upgrades = []

    def _bucket_ready(self, s: int, t: int, progress) -> None:
        self.compiled_buckets.add((s, t))
        if progress is not None:
            progress(s, t)

    def _reuse(self, key) -> bool:
        """Whether ``key``'s program is ready: this runner's, or another runner's of the same
        model and shapes (then this runner takes it)."""
        if key in self._aot:
            return True
        compiled = _shared.get(self._shared_name(key))
        if compiled is None:
            return False
        self._aot[key] = compiled
        return True

    def _keep(self, key, compiled) -> None:
        """A program this runner compiled: kept, shared with other runners, counted."""
        self._aot[key] = _shared[self._shared_name(key)] = compiled
        with _counting:
            _compiles[0] += 1

    def _spec(self, key):
        """(jitted function, args, static kw, donated argument, label) of ``_lowered``'s key."""
        kind = key[0]
        if kind == "forward":
            _, s, t, r = key
            args, kw = self._forward_args(self.padding_batch(s, t, r))
            return forward_program, args, kw, 1, "forward_program"
        if kind == "sample":
            _, r, num_logprobs, filters = key
            args, kw = self._sample_args(self._logits_spec(r), SamplingRows.greedy(r), num_logprobs, filters)
            return sample_program, args, kw, None, "sample_program"
        lay = self.layout
        kw = dict(decoder=lay.decoder, invariant=self.config.invariant, mesh=self.mesh)
        if kind == "embed":
            (_, t) = key
            return (
                embed_program,
                (lay.embed[0], self._host_spec(np.zeros(t, np.int32))),
                kw,
                None,
                "embed_program",
            )
        if kind == "head":
            _, t, r = key
            args = (lay.head[0], self._hidden_spec(t), self._host_spec(np.zeros(r, np.int32)))
            return head_program, args, kw, None, "head_program"
        _, s, t, g = key  # "block"
        batch = self._host_spec(block_inputs(self.padding_batch(s, t)))
        h = self._hidden_spec(t)
        args = (lay.blocks[g][0], tuple(self.cache[i] for i in lay.runs[g]), lay.rope[0], h, h, batch)
        return block_program, args, dict(kw, graphdef=lay.graphdefs[g]), 1, "block_program"

    def _host_spec(self, tree):
        """What the programs are lowered for where a step passes its host inputs: the numpy
        arrays themselves on one device (placed there at run time), replicated ShapeDtypeStructs
        over a mesh."""
        if self.mesh is None:
            return tree
        rep = NamedSharding(self.mesh, P())
        return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep), tree)

    def _hidden_spec(self, t: int) -> jax.ShapeDtypeStruct:
        """The hidden states [T, H] passed between the chain's programs."""
        dtype = self.layout.embed[1][0].dtype
        rep = None if self.mesh is None else NamedSharding(self.mesh, P())
        return jax.ShapeDtypeStruct((t, self.model_config.hidden_size), dtype, sharding=rep)

    def _shared_name(self, key):
        """What a program is shared under between runners: its inputs' shapes, dtypes and
        shardings, its static arguments (the model's structure among them), and how it was
        lowered (exported or not)."""
        name = self._names.get(key)
        if name is None:  # hashing the inputs' avals and the static arguments: once per key
            _, args, kw, _, label = self._spec(key)
            name = self._names[key] = step_cache.step_key(label, args, kw)
        return name, step_cache.directory(), repr(self._compiler_options(key))

    def _lowered(self, key):
        """One program lowered for inputs shaped as this runner's - ``forward_keys``' keys, or
        ("sample", rows, num_logprobs, filters) - through ``step_cache`` (an exported program
        read back, or exported now) where it keeps programs, else traced now; a
        ``step_cache.FlatStep`` either way. Its ``compile()`` gives what ``_run`` calls."""
        fn, args, kw, donate, _ = self._spec(key)
        if step_cache.directory() is None:
            return step_cache.lower_flat(fn, args, kw, donate=donate)
        return step_cache.lower(fn, args, kw, donate=donate, name=self._shared_name(key)[0])

    def check_params(self, message: str | None = None) -> None:
        for leaf in self._param_leaves:
            if isinstance(leaf, jax.Array) and leaf.is_deleted():
                raise RuntimeError(
                    message
                    or "the engine's weights have been deleted (donated to a train step?): "
                    "call LLM.update_weights with the new weights first"
                )
