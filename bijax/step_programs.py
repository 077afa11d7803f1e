"""The jitted programs of an engine step, and how a model's weights are laid out as their
arguments.

A step's forward runs as one of two equivalent forms, chosen per token bucket (``chain_from``):

* the chain: ``embed_program`` (the embedding and the first layer's input norm),
  ``block_program`` once per run of ``layers_per_program()`` consecutive layers (default one) -
  one compiled program for every run of the same shapes, so a step bucket compiles one layer
  (or run), not 32 - and ``head_program`` (the LM head of the sampled rows);
* ``forward_program``: the same forward as one program.

Both run ``models.llama``'s ``paged_embed`` / ``paged_block`` / ``paged_head`` in the same order,
so they give the same bits (``score_program``, which ``LLM.score`` runs, is the whole forward:
every score-vs-generate bits test compares the two; the H200 digests MATCH with the chain, and
the whole forward's jaxpr is the one whose digests matched before the chain existed). Then
``sample_program`` samples the rows.

Which form (measured 2026-12-02 session 28, RESULTS.md): on CPU the chain for every bucket
(compiling SmolLM2's step 7.1 -> 2.5 s, the same step time). On the H200 the chain starts in
half the time (llama3-8b, 64 x 2048 engine, empty cache: warm-up 21.4 s vs 39.4 s) but runs a
decode step 1.7-2x slower: the host takes ~0.2-0.3 ms to launch each of a step's 34 programs.
(Session 28 blamed re-recorded CUDA graphs; session 29 measured that it is not: each call
costs the host ~0.1 ms beyond the whole forward's.) So the GPU default was the whole
forward (until ``tiered``, below), and ``BIJAX_STEP_PROGRAMS`` sets it (a measurement switch, read when an engine is made):
``layers`` (the chain everywhere), ``whole`` (nowhere), or an integer N (the chain for token
buckets of N or more: long steps, where the device time dominates), or ``tiered``. Since
(2026-12-03 session 30): the chain's prefill step takes the whole forward's device time; 4 layers a program (11 calls a step, under PJRT's 32 executions in
flight) start fast but still run engine decode steps 35-40% slower, and from 256 tokens they
save 4-9 s of a 29-33 s warm-up at ~1% of a 64-sequence step (noise) and, unexplained, 4% of
one stream's in three pairs of four (RESULTS.md). ``tiered`` takes both: every bucket warms
up the chain (fast to compile) and its whole forward then compiles in a background thread,
which the bucket's steps run from when it is ready (``ModelRunner._upgrade``; the same bits,
so a request may switch forms between steps); a bucket whose whole forward an earlier start
exported warms that up directly. ``LLM.wait_for_upgrades`` waits for the background.

Since 2026-12-04 (session 32) ``tiered`` with 4 layers a program is the GPUs' default: on the
H200 (llama3-8b) its steps, once upgraded, take the whole forward's time (A/B, two pairs: 5.24 /
5.21 vs 5.21 / 5.55 ms at one sequence, 7.44 / 7.57 vs 7.34 / 7.99 ms at 64), and a 64 x 2048
engine warms up in 17.6 s against the whole forward's 24.9 s (same run, empty caches; one
request: 6.3 s). A process that exits while whole forwards compile waits for the compiles in
flight (no new one starts): their programs are then in the caches for the next start.

Every program takes the weights as an argument (swapped without recompiling) and donates the
KV cache it writes (the whole cache, or its layers'). With tensor parallelism each runs inside
one ``jax.shard_map``: weights and KV cache sharded (``models.sharding``), inputs and outputs
replicated.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from bijax.sampler import SamplingRows, sample_rows, target_logprobs
from models import sharding
from models.llama import (
    FIRST_NORM_PATH,
    Decoder,
    Llama,
    TensorParallel,
    head_path,
    next_norm_path,
    paged_block,
    paged_embed,
    paged_head,
    weight_at,
)
from models.paged import PagedBatch
from pallas_kernels.runtime import pinned

LAYERS, WHOLE, TIERED = "layers", "whole", "tiered"


def _setting() -> str:
    """``BIJAX_STEP_PROGRAMS``, or its default: ``layers`` on CPU, ``tiered`` on GPUs (see top) -
    in one process: across processes every process must run the same programs at every step
    (their collectives meet), and each would switch a bucket to its whole forward when its own
    background compile ended, so there the default is ``whole`` and ``tiered`` an error."""
    raw = os.environ.get("BIJAX_STEP_PROGRAMS", "").strip()
    several = jax.process_count() > 1
    if raw == TIERED and several:
        raise ValueError(
            f"BIJAX_STEP_PROGRAMS={TIERED} runs in one process only ({jax.process_count()} processes "
            "here: they would switch programs at different steps); use 'whole' or 'layers'"
        )
    if raw:
        return raw
    if jax.default_backend() == "cpu":
        return LAYERS
    return WHOLE if several else TIERED


def chain_from() -> int | None:
    """The smallest token bucket whose forward runs as the chain (None: none, every forward is
    one program): ``BIJAX_STEP_PROGRAMS`` (see top), by default every bucket (on GPUs first:
    ``tiered``); a value it does not take is an error naming the variable."""
    raw = _setting()
    if raw in (LAYERS, TIERED):
        return 0
    if raw == WHOLE:
        return None
    try:
        n = int(raw)
    except ValueError:
        n = -1
    if n < 0:
        raise ValueError(
            f"BIJAX_STEP_PROGRAMS must be {LAYERS!r}, {WHOLE!r}, {TIERED!r} or a token count >= 0, "
            f"got {raw!r}"
        )
    return n


def tiered() -> bool:
    """``BIJAX_STEP_PROGRAMS=tiered``: the chain for every bucket first (fast to compile), and
    each bucket's whole forward compiled in the background after ``warmup`` (or after the
    bucket's first step), which that bucket's steps run from when it is ready - the same bits
    (the two forms are the same operations), the whole forward's step time after the switch.
    (``chain_from`` is then 0.) The GPUs' default."""
    return _setting() == TIERED


def _switch(name: str, default: bool) -> bool:
    """A 0/1 environment variable; unset or empty: ``default``; anything else is an error."""
    raw = os.environ.get(name, "").strip()
    if raw not in ("", "0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {raw!r}")
    return default if not raw else raw == "1"


def layer_switches() -> tuple[bool, bool]:
    """Measurement switches of the layer programs (read when an engine is made):
    ``BIJAX_LAYER_COPIES=1`` gives every layer a loaded copy of its own of its group's compiled
    program; ``BIJAX_LAYER_COMMAND_BUFFERS=0`` compiles the layer programs without XLA's command
    buffers (CUDA graphs). Returns (copies, command buffers)."""
    return _switch("BIJAX_LAYER_COPIES", False), _switch("BIJAX_LAYER_COMMAND_BUFFERS", True)


def staged_inputs() -> bool:
    """Whether a step's inputs are copied into the same device buffers every step
    (``ModelRunner._staged``: XLA's CUDA graphs then keep their recording). Off by default
    everywhere since 2026-12-05 (session 41): the copy into donated buffers waits for the step
    in flight that reads them - on the GPU 0.8-1.9 ms of host time a step (H100, llama3-8b,
    ``benchmarks/staged_ab.py``) for no faster step (ITL p50 6.26 vs 6.25 ms at one sequence,
    8.55 vs 8.38 ms at 64; session 39's H200: 0.5-0.9 ms a step slower staged), and on CPU
    ~0.5 ms a step slower (tiny, 2 cores). The same bits either way (values only move).
    ``BIJAX_STAGED_INPUTS=0|1`` (read when an engine is made, and when bijax is imported: only
    with 1 then does bijax ask XLA for ``GPU_GRAPH_UPDATE_MODE``) says otherwise."""
    return _switch("BIJAX_STAGED_INPUTS", False)


def layers_per_program() -> int:
    """How many consecutive layers one ``block_program`` of the chain runs:
    ``BIJAX_LAYERS_PER_PROGRAM`` (read when an engine is made), by default 1 on CPU and 4 on
    GPUs. More layers a program: fewer calls a step (PJRT lets the host enqueue at most 32
    programs ahead of the device; a chain of one layer a program is 35 a step for 32 layers)
    and a longer compile."""
    raw = os.environ.get("BIJAX_LAYERS_PER_PROGRAM", "").strip()
    if not raw:
        return 1 if jax.default_backend() == "cpu" else 4
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"BIJAX_LAYERS_PER_PROGRAM must be an integer >= 1, got {raw!r}")
    return n


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


def _replicated(fn, mesh, *args):
    """``fn(*args)`` as is without a mesh, else inside one shard_map with every input and output
    replicated (each rank computes the same)."""
    if mesh is None:
        return fn(*args)
    return jax.shard_map(fn, mesh=mesh, in_specs=(P(),) * len(args), out_specs=P(), check_vma=False)(*args)


def _forward(params, cache, batch: PagedBatch, *, graphdef, invariant, tp=None):
    """The model's paged forward over one padded batch."""
    return nnx.merge(graphdef, params).forward_paged(batch, cache, invariant=invariant, tp=tp)


@functools.partial(jax.jit, static_argnames=("graphdef", "invariant", "mesh"), donate_argnames=("cache",))
def forward_program(params, cache, batch: PagedBatch, *, graphdef, invariant, mesh=None):
    """A step's whole forward as one program (``WHOLE``): the paged forward of ``batch`` ->
    (logits of its ``logit_rows`` [R, V], replicated under tensor parallelism; the cache)."""

    def body(params, cache, batch, tp):
        return _forward(params, cache, batch, graphdef=graphdef, invariant=invariant, tp=tp)

    return _over_mesh(body, mesh, params, cache, batch)


@functools.partial(jax.jit, static_argnames=("decoder", "invariant", "mesh"))
def embed_program(weights, tokens, *, decoder: Decoder, invariant, mesh=None):
    """The chain's first program: ``weights`` = (embedding, first layer's attn_norm) variables,
    tokens [T] -> (normed input of the first layer, residual stream) [T, H]."""

    def body(weights, _, tokens, tp):
        embed, first_norm = weights
        return paged_embed(decoder, embed[...], first_norm[...], tokens, invariant=invariant), ()

    return _over_mesh(body, mesh, weights, (), tokens)[0]


@functools.partial(
    jax.jit, static_argnames=("graphdef", "decoder", "invariant", "mesh"), donate_argnames=("kv",)
)
def block_program(
    weights, kv, rope_table, h, residual, batch, *, graphdef, decoder: Decoder, invariant, mesh=None
):
    """A run of consecutive layers (``paged_block`` each, in order): ``weights`` = per layer (its
    state, the variable of the norm it ends with), ``kv`` = per layer its (k, v) cache
    (donated), ``graphdef`` per layer its block graphdef, ``batch`` the step's ``PagedBatch``
    without tokens and logit rows -> ((normed, residual), kv)."""

    def body(weights, kv, rope_table, h, residual, batch, tp):
        out = []
        for block_def, (state, next_norm), layer_kv in zip(graphdef, weights, kv, strict=True):
            blk = nnx.merge(block_def, state)
            (h, residual), layer_kv = paged_block(
                decoder,
                blk,
                next_norm[...],
                rope_table[...],
                h,
                residual,
                batch,
                layer_kv,
                invariant=invariant,
                tp=tp,
            )
            out.append(layer_kv)
        return (h, residual), tuple(out)

    return _over_mesh(body, mesh, weights, kv, rope_table, h, residual, batch)


@functools.partial(jax.jit, static_argnames=("decoder", "invariant", "mesh"))
def head_program(weight, h, logit_rows, *, decoder: Decoder, invariant, mesh=None):
    """The chain's last program: float32 logits [R, V] of the rows ``logit_rows`` of the last
    block's output; ``weight`` the LM head's variable (the embedding's when tied)."""

    def body(weight, _, h, logit_rows, tp):
        return paged_head(decoder, weight[...], h, logit_rows, invariant=invariant, tp=tp), ()

    return _over_mesh(body, mesh, weight, (), h, logit_rows)[0]


@functools.partial(jax.jit, static_argnames=("invariant", "num_logprobs", "filters", "mesh"))
def sample_program(logits, sampling: SamplingRows, *, invariant, num_logprobs, filters, mesh=None):
    """An engine step's last program: a sampled token per row of ``logits`` with
    ``num_logprobs`` top logprobs (0: none); ``filters``: ``uses_filters`` of the rows.

    Sampling is a program of its own so that whether a step needs the top-k / top-p masks is
    decided on the host, from the rows' parameters, as the choice of program: inside the
    forward's program it was a ``lax.cond`` on device values, and on a GPU XLA runs a cond by
    copying its predicate to the host - the host then waited for the whole forward before it
    launched the rest, every step (H200, llama3-8b, one sequence: 2.8 ms of a 9 ms step idle)."""

    def body(logits, sampling):
        return sample_rows(logits, sampling, invariant=invariant, num_logprobs=num_logprobs, filters=filters)

    return _replicated(body, mesh, logits, sampling)


# XLA options of the baseline's (``invariant=False``) model programs: without the dot merger. It
# merged each layer's gate and up dots into one Triton GEMM fusion that took 7.8 ms a layer of a
# 2048-token prefill step on the H200 (308 ms a step; 68 ms without it: RESULTS.md, session 36).
# The invariant path's matmuls are Pallas kernels: its programs compile with XLA's defaults.
BASELINE_XLA_OPTIONS = {"xla_gpu_dot_merger_threshold_mb": 0}


def baseline_jit(fn, **jit_kw):
    """``fn`` jitted twice - the invariant path's program and the baseline's, compiled with
    ``BASELINE_XLA_OPTIONS`` - called by its static ``invariant`` keyword. Traced inside the
    caller's own jit or grad (a trainer's step), the baseline's runs as the plain one: it is
    inlined into the caller's program, which compiles with the caller's options (JAX refuses
    compiler options on a nested jit)."""
    jitted = {
        True: jax.jit(fn, **jit_kw),
        False: jax.jit(fn, compiler_options=BASELINE_XLA_OPTIONS, **jit_kw),
    }

    @functools.wraps(fn)
    @pinned
    def call(*args, invariant, **kw):
        traced = any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves((args, kw)))
        return jitted[invariant or traced](*args, invariant=invariant, **kw)

    call.jitted = jitted  # by ``invariant`` (to lower one, for audits)
    return call


def _score(params, cache, batch: PagedBatch, targets, temperature, *, graphdef, invariant, mesh=None):
    """The paged forward of ``batch`` (every token row) and each row's logprob of its target."""

    def body(params, cache, batch, targets, temperature, tp):
        logits, cache = _forward(params, cache, batch, graphdef=graphdef, invariant=invariant, tp=tp)
        return target_logprobs(logits, targets, temperature, invariant=invariant), cache

    return _over_mesh(body, mesh, params, cache, batch, targets, temperature)


score_program = baseline_jit(
    _score, static_argnames=("graphdef", "invariant", "mesh"), donate_argnames=("cache",)
)


def block_inputs(batch: PagedBatch) -> PagedBatch:
    """What ``block_program`` reads of a step's batch (its tokens and logit rows go to the
    chain's first and last programs)."""
    return batch.replace(tokens=None, logit_rows=None)


@dataclasses.dataclass(frozen=True)
class Layout:
    """A model's weights as the chain's arguments, flattened once (an nnx State flattens in
    Python; a step calls ``block_program`` once per run of layers).

    decoder: the model's arithmetic (a static argument of every program of the chain).
    embed, head, rope: the weights of ``embed_program`` ((embedding, first norm)), of
      ``head_program`` and the RoPE table, as (leaves, treedef) and the tree itself.
    runs: the layers of each ``block_program`` call - consecutive, ``per_program`` of them (the
      last run may be shorter).
    blocks: per run, its ``block_program`` weights (per layer: its state, the next norm)
      flattened.
    groups: per run, the first run whose block program it shares (same structures, shapes,
      dtypes and placements: one program); ``graphdefs``: the block graphdefs (one per layer of
      the run) of each group.
    """

    decoder: Decoder
    embed: tuple
    head: tuple
    rope: tuple
    runs: tuple[tuple[int, ...], ...]
    blocks: tuple
    groups: tuple[int, ...]
    graphdefs: dict

    @classmethod
    def of(cls, graphdef, params, cache, per_program: int = 1) -> Layout:
        """From ``nnx.split(model)`` and the KV cache - real arrays, or ShapeDtypeStructs
        (helpers) - with ``per_program`` layers a block program."""
        # The block graphdefs from a state rebuilt from its pytree (shapes only): a Variable's
        # metadata then has one order, however the state was made - the graphdefs are static
        # arguments, named by their repr (``step_cache.step_key``) in this process and helpers.
        rebuilt = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
        model: Llama = nnx.merge(graphdef, rebuilt)
        n = len(model.layers)

        def flat(tree):
            leaves, treedef = jax.tree_util.tree_flatten(tree)
            return tree, leaves, treedef

        runs = tuple(tuple(range(i, min(i + per_program, n))) for i in range(0, n, per_program))
        blocks, groups, graphdefs, seen = [], [], {}, {}
        for j, run in enumerate(runs):
            weights = tuple(
                (weight_at(params, ("layers", i)), weight_at(params, next_norm_path(i, n))) for i in run
            )
            tree, leaves, treedef = flat(weights)
            block_defs = tuple(nnx.split(model.layers[i])[0] for i in run)
            kv = jax.tree_util.tree_leaves(tuple(cache[i] for i in run))
            sig = (block_defs, treedef, tuple(_aval(x) for x in leaves + kv))
            first = seen.setdefault(sig, j)
            graphdefs.setdefault(first, block_defs)
            groups.append(first)
            blocks.append((tree, leaves, treedef))
        return cls(
            decoder=model.decoder,
            embed=flat((params["embed"], weight_at(params, FIRST_NORM_PATH))),
            head=flat(weight_at(params, head_path(model.config))),
            rope=flat(params["rope"]),
            runs=runs,
            blocks=tuple(blocks),
            groups=tuple(groups),
            graphdefs=graphdefs,
        )


def _aval(x):
    return (tuple(x.shape), str(x.dtype), getattr(x, "sharding", None))


def placed(tree, mesh):
    """Host inputs on the device (replicated over ``mesh``) once per step: every program of the
    chain reads them. Leaves already on a device stay as they are."""
    if mesh is None:
        return jax.device_put(tree)
    rep = NamedSharding(mesh, P())
    return jax.tree_util.tree_map(
        lambda a: a if isinstance(a, jax.Array) else sharding.to_global(np.asarray(a), rep), tree
    )


__all__ = [
    "LAYERS",
    "WHOLE",
    "Layout",
    "block_inputs",
    "block_program",
    "embed_program",
    "chain_from",
    "layer_switches",
    "layers_per_program",
    "staged_inputs",
    "forward_program",
    "head_program",
    "placed",
    "sample_program",
    "score_program",
    "BASELINE_XLA_OPTIONS",
    "baseline_jit",
]
