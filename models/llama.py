"""Flax NNX Llama-family decoder (Llama 2/3, SmolLM2, Qwen2, Qwen3, Qwen3-MoE) on the batch-invariant kernels.

Two entry points, both running the same decoder stack (``_layers``) and differing only in
where attention finds its keys:

* ``Llama.forward_packed(tokens[B, L], segment_ids[B, L])`` - causal forward over packed rows
  (several sequences per row, padding anywhere): the trainer's layout (``bijax.rl``). Its
  shorthand ``Llama.forward(tokens[B, L])`` is one sequence per row, positions 0..L-1;
* ``Llama.forward_paged(PagedBatch, kv_cache)`` - the engine's forward over a flat, ragged
  batch of tokens (prefill chunks and decode tokens mixed) against a paged KV cache
  (``models.paged``). It is three pieces, which the engine also runs as programs of their
  own - ``paged_embed`` (the embedding and the first norm), ``paged_block`` once per layer
  (the same program for every layer of the same shape: a step compiles one layer, not 32),
  ``paged_head`` (the LM head) - so the two give the same bits by construction.

The layers' arithmetic lives in ``Decoder`` (the model's config and reduction choices, no
weights; hashable): both entry points and the engine's per-layer programs run its methods.

With ``invariant=True`` (the default) every matmul (the LM head included), norm and
attention goes through ``pallas_kernels``; the rest is per-token gathers and elementwise
math in float32, so a token's logits depend only on its sequence, never on the batch. The
packed forward runs the same attention kernel over a paged view of its own KV, so it gives
the same bits as the paged forward. ``invariant=False`` uses plain XLA ops (the kernels'
``*_reference`` functions; the paged forward's attention is ``attention_xla``: cuDNN flash
attention for first chunks, a bounded paged loop for cached keys) - the negative control and
the speed baseline, never a fallback.

Weights are stored [in, out] (HF's [out, in] is transposed once at load). Row-parallel
weights (o, down) use the model's ``k_shards`` (docs/design.md); column-parallel ones (q, k, v,
gate, up, the LM head) go through in ``k_shards`` column blocks. Logits are float32.

Tensor parallelism (``forward_paged(..., tp=TensorParallel(axis, size))``, inside
``jax.shard_map``, weights sharded by ``models.sharding``): q/k/v and gate/up are
column-parallel, o and down row-parallel (each rank's float32 partial covers its k_shards/P
shards; ``pallas_kernels.tree_psum`` adds the ranks in the k_shards tree's order), heads and
the KV cache are split by KV head, and the LM head is vocabulary-parallel, its logits
gathered (no reduction) before any softmax. Every degree dividing ``k_shards`` gives the
bits of one device.

Mixture-of-experts layers (Qwen3-MoE, ``config.is_moe_layer``) replace the MLP by a router
and stacked SwiGLU experts (``models.ops.moe``): a token's output does not depend on which or
how many other tokens chose its experts. They run on one device only (no tensor parallelism).
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import dataclasses
import functools
import os
import zlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

import pallas_kernels as pk
from models.configs import LlamaConfig
from models.ops import (
    TensorParallel,
    col_mm,
    col_mm_shared,
    col_mm_swiglu,
    moe,
    norm,
    qkv_rope_write_kv,
    row_mm_norm,
)
from models.paged import KVCache, PackedLayout, PagedBatch, init_kv_cache
from pallas_kernels import K_SHARDS
from pallas_kernels.checks import check_positive_int

__all__ = [
    "FIRST_NORM_PATH",
    "Decoder",
    "Llama",
    "TensorParallel",
    "check_tokens",
    "head_path",
    "init_kv_cache",
    "next_norm_path",
    "paged_block",
    "paged_embed",
    "paged_head",
    "param_state",
    "rope_table",
    "weight_at",
]


class RopeTable(nnx.Variable):
    """cos/sin of every position: a constant, not a parameter (never saved or trained)."""


def rope_table(config: LlamaConfig, length: int | None = None) -> np.ndarray:
    """[length, 2, head_dim // 2] float32 (cos, sin), computed on the host.

    The angle is rounded to float32 as HF/vLLM do (position * inv_freq in float32); cos
    and sin are then taken in float64 and rounded once, so the table is the same on
    every machine and backend.
    """
    length = config.max_position_embeddings if length is None else length
    inv = config.inv_freq().astype(np.float32)
    ang = np.arange(length, dtype=np.float32)[:, None] * inv[None, :]
    ang = ang.astype(np.float64)
    return np.stack([np.cos(ang), np.sin(ang)], axis=1).astype(np.float32)


def _seed_key(seed: int, name: str) -> jax.Array:
    # One key per tensor name: the draw is the same in every process and does not
    # depend on the order tensors are built in.
    return jax.random.fold_in(jax.random.PRNGKey(seed), zlib.crc32(name.encode()) & 0x7FFFFFFF)


@functools.partial(jax.jit, static_argnames=("shape", "std", "dtype"))
def _normal_values(key, *, shape, std: float, dtype) -> jax.Array:
    # One program per (shape, std, dtype): a preset builds with a handful of compiles, not
    # four eager ones per shape. The barrier keeps the scaling a separate multiply (here and
    # inside one jitted build, ``models.sharding.build_sharded``): XLA would otherwise fold
    # ``std`` into the normal's own constant factor and round differently.
    x = lax.optimization_barrier(jax.random.normal(key, shape, jnp.float32))
    return (x * np.float32(std)).astype(dtype)


# While ``compile_draws`` traces a build: the draw programs it asks for.
_draws_seen: contextvars.ContextVar[list | None] = contextvars.ContextVar("_draws_seen", default=None)


@pk.runtime.pinned  # (the draws are JAX's default PRNG's, whatever a caller set)
def _normal(seed: int, name: str, shape, std: float, dtype) -> nnx.Param:
    spec = dict(shape=tuple(shape), std=float(std), dtype=jnp.dtype(dtype))
    seen = _draws_seen.get()
    if seen is not None and spec not in seen:
        seen.append(spec)
    return nnx.Param(_normal_values(_seed_key(seed, name), **spec))


@pk.runtime.pinned
def compile_draws(make: Callable[[], nnx.Module], workers: int | None = None) -> int:
    """Compiles the random-weight programs that ``make()`` (a constructor of random weights)
    will run - one per (shape, scale, dtype) - ``workers`` at once (default: one per CPU core,
    at most 8), so that the build after it only draws. The same programs as the build would
    compile one after another (same bits): a cold start's build is mostly these compiles.
    Returns how many it compiled."""
    seen: list = []
    token = _draws_seen.set(seen)
    try:
        nnx.eval_shape(make)  # records the draws, computes nothing
        key = jax.eval_shape(lambda: _seed_key(0, ""))
    finally:
        _draws_seen.reset(token)
    if not seen:
        return 0
    workers = workers or min(8, os.cpu_count() or 1)
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(workers, len(seen))) as pool:
        # Tracing holds Python's lock; XLA's compiles run side by side.
        list(pool.map(pk.runtime.pinned(lambda spec: _normal_values.lower(key, **spec).compile()), seen))
    return len(seen)


def _ones(shape, dtype) -> nnx.Param:
    return nnx.Param(jnp.ones(shape, dtype))


def _zeros(shape, dtype) -> nnx.Param:
    return nnx.Param(jnp.zeros(shape, dtype))


# --------------------------------------------------------------------------- the arithmetic


@dataclasses.dataclass(frozen=True)
class Decoder:
    """A Llama-family decoder's arithmetic without its weights: what every forward runs, layer
    by layer. Hashable (a static argument of the engine's programs).

    A layer is cut after the NEXT layer's input norm (``block``): the stack is
    ``first_norm``, then ``block`` per layer - each ending with the norm of the layer after it,
    or the final norm - then ``head``. Every layer's ``block`` has the same inputs and outputs,
    so one compiled program serves them all; the operations and their order are those of a
    plain loop over the layers.
    """

    config: LlamaConfig
    k_shards: int = 1
    tp_parts: int = 1

    @property
    def padded_vocab(self) -> int:
        """The LM head's columns: the vocabulary rounded up to whole ``k_shards`` column blocks
        (the extra columns are zero and their logits dropped)."""
        return -(-self.config.vocab_size // self.k_shards) * self.k_shards

    def first_norm(self, x, weight, *, invariant: bool):
        """The first layer's input norm of x [T, H] -> (normed, residual stream x)."""
        return norm(x, weight, self.config.rms_norm_eps, invariant=invariant), x

    def block(
        self,
        blk: Block,
        next_norm,
        rope_table,
        h,
        residual,
        pos,
        attend,
        *,
        invariant: bool,
        tp: TensorParallel | None = None,
    ):
        """One layer on its normed input ``h`` [T, H] and the residual stream, then the norm of
        the layer after it (``next_norm``: its attn_norm weight, or the final norm's) ->
        (normed, residual). ``attend(layer, h, cos_sin)`` -> [T, Hq, D] is this layer's attention
        of its normed input: the projections (``qkv``, or fused with RoPE and the KV write:
        ``qkv_rope_write_kv``), RoPE with ``cos_sin`` [T, 2, D/2] (the tokens' rows of
        ``rope_table``) and attention."""
        eps = self.config.rms_norm_eps
        cos_sin = rope_table[jnp.clip(pos, 0, self.config.max_position_embeddings - 1)]  # [T, 2, D/2]
        o = attend(blk.attn, h, cos_sin).reshape(h.shape[0], -1)
        h, residual = self.row_norm(
            o, blk.attn.wo[...], blk.mlp_norm[...], residual, invariant=invariant, tp=tp
        )
        if isinstance(blk.mlp, MoE):
            x = self.moe(blk.mlp, h, invariant=invariant, tp=tp)
            return norm(x, next_norm, eps, invariant=invariant, residual=residual)
        x = self.swiglu(blk.mlp, h, invariant=invariant, tp=tp)
        return self.row_norm(x, blk.mlp.w_down[...], next_norm, residual, invariant=invariant, tp=tp)

    def head(self, w, x, *, invariant: bool, tp: TensorParallel | None = None):
        """float32 logits [T, V] of x [T, H]; ``w`` is the LM head [H, V], or the embedding
        [V, H] for tied embeddings. Under ``tp`` each rank computes its 1/P of the (padded)
        vocabulary from the replicated weight and the ranks' columns are gathered."""
        c = self.config
        v, vp = c.vocab_size, self.padded_vocab
        tied = c.tie_word_embeddings
        axis = 0 if tied else 1
        if vp != v:
            w = jnp.pad(w, [(0, vp - v), (0, 0)] if tied else [(0, 0), (0, vp - v)])
        if tp is not None:
            part = vp // tp.size
            w = lax.dynamic_slice_in_dim(w, lax.axis_index(tp.axis) * part, part, axis=axis)
        if tied:
            w = w.T
        y = col_mm(x, w, invariant=invariant, col_blocks=self.k_shards, tp=tp, out_dtype=jnp.float32)
        if tp is not None:
            y = pk.gather_last(y, tp.axis)
        return y[:, :v] if vp != v else y

    def qkv(self, layer: Attention, x, *, invariant: bool, tp: TensorParallel | None = None):
        """Projections of x [T, H] -> q [T, Hq, D], k, v [T, Hkv, D] (under ``tp``: this rank's
        heads), q and k normed per head where the model does (Qwen3), before RoPE."""
        c = self.config
        bias = c.attention_bias
        ws = [layer.wq[...], layer.wk[...], layer.wv[...]]
        out_dtype = jnp.float32 if bias else None
        ys = col_mm_shared(x, ws, invariant=invariant, col_blocks=self.k_shards, tp=tp, out_dtype=out_dtype)
        if bias:
            biases = (layer.bq, layer.bk, layer.bv)
            ys = [(y + b[...].astype(jnp.float32)).astype(x.dtype) for y, b in zip(ys, biases, strict=True)]
        q, k, v = (y.reshape(x.shape[0], -1, c.head_dim) for y in ys)
        if c.qk_norm:  # each head's vector through the (invariant) rms_norm: rows are tokens x heads
            head_norm = lambda y, w: norm(  # noqa: E731
                y.reshape(-1, c.head_dim), w[...], c.rms_norm_eps, invariant=invariant
            ).reshape(y.shape)
            q, k = head_norm(q, layer.q_norm), head_norm(k, layer.k_norm)
        return q, k, v

    def qkv_rope_write_kv(
        self, layer: Attention, x, cos_sin, k_cache, v_cache, slots, *, tp: TensorParallel | None = None
    ):
        """The invariant path's projections of x [T, H], RoPE and the KV write -> (q rotated
        [T, Hq, D], k_cache, v_cache): one op (``pk.qkv_rope_write_kv``: no XLA combine of the
        projections' leaf partials on the GPU) where nothing comes between the projections and
        RoPE, else ``qkv`` then ``pk.rope_write_kv`` - the same bits either way."""
        c = self.config
        if c.attention_bias or c.qk_norm:
            q, k, v = self.qkv(layer, x, invariant=True, tp=tp)
            return pk.rope_write_kv(q, k, v, cos_sin, k_cache, v_cache, slots)
        ws = [layer.wq[...], layer.wk[...], layer.wv[...]]
        return qkv_rope_write_kv(x, ws, cos_sin, k_cache, v_cache, slots, col_blocks=self.k_shards, tp=tp)

    def row_norm(self, x, w, norm_weight, residual, *, invariant: bool, tp: TensorParallel | None):
        """A row-parallel projection (o, down) of x, the residual add and the norm after it ->
        (normed, residual stream)."""
        kw = dict(invariant=invariant, k_shards=self.k_shards, tp_parts=self.tp_parts, tp=tp)
        return row_mm_norm(x, w, norm_weight, residual, self.config.rms_norm_eps, **kw)

    def moe(self, mlp: MoE, x, *, invariant: bool, tp: TensorParallel | None = None):
        if tp is not None:
            raise ValueError("tensor parallelism is not supported for mixture-of-experts layers")
        c = self.config
        return moe(
            x,
            mlp.router[...],
            mlp.experts_gate[...],
            mlp.experts_up[...],
            mlp.experts_down[...],
            top_k=c.num_experts_per_tok,
            norm_topk_prob=c.norm_topk_prob,
            invariant=invariant,
            k_shards=self.k_shards,
        )

    def swiglu(self, mlp: MLP, x, *, invariant: bool, tp: TensorParallel | None = None):
        """A dense MLP's hidden activation SiLU(x @ gate) * (x @ up), before down."""
        cb = self.k_shards
        ws = (mlp.w_gate[...], mlp.w_up[...])
        # up to mlp.FUSED_MAX_ROWS rows one launch with SwiGLU in its epilogue (gate_up_swiglu,
        # on the GPU where mlp.FUSED); above, one shared launch of gate and up from
        # GATE_UP_SHARED_MIN_ROWS rows on (matmul_triton's measurements), else a launch each; the
        # same bits every way
        m = x.shape[0]
        fused = pk.mlp.FUSED and m <= pk.mlp.FUSED_MAX_ROWS  # (off: the route of before, for A/Bs)
        if invariant and (fused or m < pk.matmul_triton.GATE_UP_SHARED_MIN_ROWS):
            return col_mm_swiglu(x, *ws, col_blocks=cb, tp=tp)
        if m >= pk.matmul_triton.GATE_UP_SHARED_MIN_ROWS:
            g, u = col_mm_shared(x, ws, invariant=invariant, col_blocks=cb, tp=tp)
        else:
            g, u = (col_mm(x, w, invariant=False, col_blocks=cb, tp=tp) for w in ws)
        return pk.swiglu(g.astype(jnp.float32), u.astype(jnp.float32)).astype(x.dtype)  # rounded once


# --------------------------------------------------------------------------- the paged forward's pieces
#
# ``Llama.forward_paged`` is these three in a row; the engine runs each as a program of its own
# (``bijax.model_runner``): the embedding, one layer (called once per layer), the LM head.


def paged_embed(decoder: Decoder, embed, first_norm, tokens, *, invariant: bool):
    """The step's tokens [T] -> (normed input of the first layer, residual stream) [T, H]."""
    return decoder.first_norm(embed[tokens], first_norm, invariant=invariant)


def paged_block(
    decoder: Decoder,
    blk: Block,
    next_norm,
    rope_table,
    h,
    residual,
    batch: PagedBatch,
    kv,
    *,
    invariant: bool,
    tp: TensorParallel | None = None,
):
    """One layer of the paged forward (``Decoder.block``): its K/V written at the batch's slots
    into ``kv`` = (k, v) cache of this layer, then attention over the cache. ``batch``'s tokens
    and logit rows are not read (they may be None). Returns ((normed, residual), updated kv)."""
    b, out = batch, []

    def attend(layer, h, cos_sin):
        kc, vc = kv
        index = (b.block_tables, b.context_lens, b.token_seq, b.token_pos)
        if invariant:  # projections, RoPE and the KV write: one kernel after the matmul on the GPU
            q, kc, vc = decoder.qkv_rope_write_kv(layer, h, cos_sin, kc, vc, b.slot_mapping, tp=tp)
            out.append((kc, vc))
            return pk.attention(q, kc, vc, *index)
        q, k, v = decoder.qkv(layer, h, invariant=False, tp=tp)
        q, k = pk.rope(q, cos_sin), pk.rope(k, cos_sin)
        kc, vc = pk.write_kv(kc, vc, k.astype(kc.dtype), v.astype(vc.dtype), b.slot_mapping)
        out.append((kc, vc))
        return pk.attention_xla(q, k, v, kc, vc, *index)

    h, residual = decoder.block(
        blk, next_norm, rope_table, h, residual, b.token_pos, attend, invariant=invariant, tp=tp
    )
    return (h, residual), out[0]


def paged_head(decoder: Decoder, w, h, logit_rows, *, invariant: bool, tp: TensorParallel | None = None):
    """float32 logits of the rows ``logit_rows`` of the last block's output (None: all rows)."""
    if logit_rows is not None:
        h = h[logit_rows]
    return decoder.head(w, h, invariant=invariant, tp=tp)


# Where the pieces' weights are: key paths into a ``Llama`` or its state (``nnx.split``'s), the one
# home of which norm a block ends with and what the LM head multiplies by.
FIRST_NORM_PATH = ("layers", 0, "attn_norm")


def next_norm_path(i: int, num_layers: int) -> tuple:
    """Layer ``i``'s block ends with layer i + 1's attn_norm, the last one with the final norm."""
    return ("layers", i + 1, "attn_norm") if i + 1 < num_layers else ("final_norm",)


def head_path(config: LlamaConfig) -> tuple:
    """The LM head's weight: ``lm_head`` [H, V], or ``embed`` [V, H] for tied embeddings."""
    return ("embed",) if config.tie_word_embeddings else ("lm_head",)


def weight_at(tree, path: tuple):
    """The variable at ``path`` in a ``Llama`` (attributes and list indices) or its state (keys)."""
    for key in path:
        tree = tree[key] if isinstance(tree, nnx.State) or isinstance(key, int) else getattr(tree, key)
    return tree


# --------------------------------------------------------------------------- modules


class Attention(nnx.Module):
    def __init__(self, config: LlamaConfig, *, dtype, seed: int, prefix: str):
        c = config
        h, std = c.hidden_size, c.hidden_size**-0.5
        self.wq = _normal(seed, prefix + "wq", (h, c.q_dim), std, dtype)  # [H, Hq*D]
        self.wk = _normal(seed, prefix + "wk", (h, c.kv_dim), std, dtype)  # [H, Hkv*D]
        self.wv = _normal(seed, prefix + "wv", (h, c.kv_dim), std, dtype)  # [H, Hkv*D]
        self.wo = _normal(seed, prefix + "wo", (c.q_dim, h), c.q_dim**-0.5, dtype)  # [Hq*D, H]
        if c.attention_bias:
            self.bq = _zeros((c.q_dim,), dtype)
            self.bk = _zeros((c.kv_dim,), dtype)
            self.bv = _zeros((c.kv_dim,), dtype)
        if c.qk_norm:  # Qwen3: RMSNorm over each head's q and k before RoPE
            self.q_norm = _ones((c.head_dim,), dtype)
            self.k_norm = _ones((c.head_dim,), dtype)


class MLP(nnx.Module):
    def __init__(self, config: LlamaConfig, *, dtype, seed: int, prefix: str):
        h, i = config.hidden_size, config.intermediate_size
        self.w_gate = _normal(seed, prefix + "w_gate", (h, i), h**-0.5, dtype)  # [H, I]
        self.w_up = _normal(seed, prefix + "w_up", (h, i), h**-0.5, dtype)  # [H, I]
        self.w_down = _normal(seed, prefix + "w_down", (i, h), i**-0.5, dtype)  # [I, H]


class MoE(nnx.Module):
    """Qwen3-MoE's sparse block: a router and ``num_experts`` SwiGLU experts stacked on axis 0."""

    def __init__(self, config: LlamaConfig, *, dtype, seed: int, prefix: str):
        h, i, e = config.hidden_size, config.moe_intermediate_size, config.num_experts
        self.router = _normal(seed, prefix + "router", (h, e), h**-0.5, dtype)  # [H, E]
        self.experts_gate = _normal(seed, prefix + "experts_gate", (e, h, i), h**-0.5, dtype)  # [E, H, I]
        self.experts_up = _normal(seed, prefix + "experts_up", (e, h, i), h**-0.5, dtype)  # [E, H, I]
        self.experts_down = _normal(seed, prefix + "experts_down", (e, i, h), i**-0.5, dtype)  # [E, I, H]


class Block(nnx.Module):
    def __init__(self, config: LlamaConfig, *, dtype, seed: int, index: int):
        prefix = f"layers.{index}."
        self.attn_norm = _ones((config.hidden_size,), dtype)
        self.attn = Attention(config, dtype=dtype, seed=seed, prefix=prefix + "attn.")
        self.mlp_norm = _ones((config.hidden_size,), dtype)
        if config.is_moe_layer(index):
            self.mlp = MoE(config, dtype=dtype, seed=seed, prefix=prefix + "mlp.")
        else:
            self.mlp = MLP(config, dtype=dtype, seed=seed, prefix=prefix + "mlp.")


WEIGHT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def weight_dtype(dtype) -> jnp.dtype:
    """``dtype`` as the weights' dtype (bfloat16, float16 or float32, by object or name), or a
    TypeError naming it."""
    try:
        dt = jnp.dtype(dtype)
    except TypeError:
        dt = None
    if dt not in WEIGHT_DTYPES:
        shown = repr(dtype) if dt is None else str(dt)
        raise TypeError(f"dtype must be bfloat16, float16 or float32, got {shown}")
    return dt


class Llama(nnx.Module):
    """A Llama-family decoder.

    Args:
      config: the model's ``LlamaConfig``.
      dtype: parameter and activation dtype (bfloat16, float16 or float32).
      k_shards: virtual K shards of the row-parallel weights (o, down): 1, 2, 4 or 8; the
        same value gives the same bits at every tensor-parallel degree dividing it.
      seed: random weights are drawn from it (presets without a checkpoint), the same in
        every process. A checkpoint loader overwrites them (``models.loading``).
      tp_parts: run o/down as this many separate shard partials combined by the tree
        (what a tensor-parallel rank does); for checking k_shards on one device.
    """

    def __init__(
        self,
        config: LlamaConfig,
        *,
        dtype=jnp.bfloat16,
        k_shards: int = 1,
        seed: int = 0,
        tp_parts: int = 1,
    ):
        if not isinstance(config, LlamaConfig):
            raise TypeError(f"config must be a LlamaConfig, got {type(config).__name__}")
        dtype = weight_dtype(dtype)
        if k_shards not in K_SHARDS:
            raise ValueError(f"k_shards must be one of {K_SHARDS}, got {k_shards!r}")
        if tp_parts < 1 or k_shards % tp_parts:
            raise ValueError(f"tp_parts ({tp_parts}) must divide k_shards ({k_shards})")
        c = config
        if k_shards > 1:  # column-parallel weights go through in k_shards column blocks
            for name, width in (
                ("num_heads * head_dim", c.q_dim),
                ("num_kv_heads * head_dim", c.kv_dim),
                ("intermediate_size", c.intermediate_size),
            ):
                if width % k_shards:
                    raise ValueError(
                        f"k_shards={k_shards} must divide {name} ({width}); use a smaller k_shards"
                    )
        self.config = c
        self.dtype = dtype
        self.k_shards = k_shards
        self.tp_parts = tp_parts
        self.embed = _normal(seed, "embed", (c.vocab_size, c.hidden_size), 1.0, dtype)  # [V, H]
        self.layers = nnx.List([Block(c, dtype=dtype, seed=seed, index=i) for i in range(c.num_layers)])
        self.final_norm = _ones((c.hidden_size,), dtype)
        if not c.tie_word_embeddings:
            self.lm_head = _normal(seed, "lm_head", (c.hidden_size, c.vocab_size), c.hidden_size**-0.5, dtype)
        self.rope = RopeTable(jnp.asarray(rope_table(c)))

    # ------------------------------------------------------------------ shared pieces

    @property
    def decoder(self) -> Decoder:
        """The layers' arithmetic (everything but the weights)."""
        return Decoder(self.config, self.k_shards, self.tp_parts)

    @property
    def padded_vocab(self) -> int:
        return self.decoder.padded_vocab

    @property
    def head_weight(self):
        """What the LM head multiplies by: ``lm_head`` [H, V], or ``embed`` [V, H] when tied."""
        return weight_at(self, head_path(self.config))

    def next_norm(self, i: int):
        """The norm weight that layer ``i``'s block ends with (``next_norm_path``)."""
        return weight_at(self, next_norm_path(i, len(self.layers)))

    def _layers(self, x, pos, attend, *, invariant: bool, tp: TensorParallel | None = None):
        """The decoder stack over flat tokens x [T, H]; ``attend(i, layer, h, cos_sin)`` -> [T, Hq, D]
        (``Decoder.block``'s ``attend`` of layer i)."""
        d, rope_table = self.decoder, self.rope[...]
        h, residual = d.first_norm(x, weight_at(self, FIRST_NORM_PATH)[...], invariant=invariant)
        for i, blk in enumerate(self.layers):
            h, residual = d.block(
                blk,
                self.next_norm(i)[...],
                rope_table,
                h,
                residual,
                pos,
                functools.partial(attend, i),
                invariant=invariant,
                tp=tp,
            )
        return h

    # ------------------------------------------------------------------ entry points

    def forward(self, tokens: jax.Array, *, invariant: bool = True) -> jax.Array:
        """Full-sequence causal forward: tokens int [B, L] at positions 0..L-1 -> float32 logits
        [B, L, V]. ``forward_packed`` with one sequence per row (the same bits).

        Right padding is harmless (causal: a token never sees later ones).
        """
        return self.forward_packed(tokens, None, max_segments=1, invariant=invariant)

    @pk.runtime.pinned
    def forward_packed(
        self,
        tokens: jax.Array,
        segment_ids: jax.Array | None,
        *,
        max_segments: int | None = None,
        invariant: bool = True,
    ) -> jax.Array:
        """Causal forward over packed rows: tokens int [B, L] -> float32 logits [B, L, V].

        ``segment_ids`` int [B, L]: the segment of each token within its row, in
        [0, max_segments), each segment one contiguous run of its row; -1 marks padding
        (anywhere in the row; its logits are meaningless). A token attends to the earlier
        tokens of its own segment only, at positions counted from the segment's first token.
        ``segment_ids`` None: one sequence a row. Inputs are checked by ``check_packed`` (the
        values where they are concrete, as ``bijax.logprobs`` does); traced ``segment_ids``
        that break those rules make every logit NaN (``poison_bad_packing``), never a silently
        wrong one.

        With ``invariant=True`` every (row, segment) is one sequence of the paged attention
        kernel (``models.paged.PackedLayout``): each layer's K/V rows are placed in pages of 64
        tokens, one page per KV tile of the kernel, so a token's logits are bit-identical to the
        engine's for the same sequence (the kernel's bits are the same for any block size <= 64).
        ``invariant=False``: plain XLA, dense attention under a same-segment causal mask.
        """
        logits = self._packed_logits(tokens, segment_ids, max_segments=max_segments, invariant=invariant)
        return poison_bad_packing(logits, segment_ids, max_segments, self.config)

    def _packed_logits(self, tokens, segment_ids, *, max_segments, invariant: bool) -> jax.Array:
        """``forward_packed`` without ``poison_bad_packing`` (``bijax.logprobs`` applies it to
        its own result, after the last arithmetic)."""
        c = self.config
        tokens, segment_ids, max_segments, _ = check_packed(tokens, segment_ids, max_segments, c)
        b, length = tokens.shape
        flat = tokens.reshape(-1)
        layout = PackedLayout.create(segment_ids, max_segments)
        pos = layout.token_pos

        def attend(i, layer, h, cos_sin):
            q, k, v = self.decoder.qkv(layer, h, invariant=invariant)
            q, k = pk.rope(q, cos_sin), pk.rope(k, cos_sin)
            if invariant:
                index = (layout.block_tables, layout.context_lens, layout.token_seq, pos)
                return pk.attention(q, layout.pages(k), layout.pages(v), *index)
            return pk.segment_attention_reference(q, k, v, segment_ids.reshape(b, length).astype(jnp.int32))

        x = self.embed[...][flat]
        h = self._layers(x, pos, attend, invariant=invariant)
        return self.decoder.head(self.head_weight[...], h, invariant=invariant).reshape(
            b, length, c.vocab_size
        )

    def forward_paged(
        self,
        batch: PagedBatch,
        kv_cache: KVCache,
        *,
        invariant: bool = True,
        tp: TensorParallel | None = None,
    ) -> tuple[jax.Array, KVCache]:
        """The engine's forward over a flat, ragged batch of T tokens against a paged KV cache.

        Args:
          batch: the step's tokens, positions, cache slots and block tables (``models.paged``);
            each token's K/V is written at its slot before attention.
          kv_cache: from ``init_kv_cache``; returned updated (donate it under jit).
          tp: inside ``jax.shard_map`` with sharded weights and cache (``models.sharding``);
            the inputs are replicated, the logits come out whole on every rank.
        Returns (float32 logits [T, V], or [R, V] for ``batch.logit_rows``; updated kv_cache).
        """
        c = self.config
        if not isinstance(batch, PagedBatch):
            raise TypeError(f"batch must be a models.paged.PagedBatch, got {type(batch).__name__}")
        tokens = check_tokens(batch.tokens, c, ndim=1)
        if len(kv_cache) != c.num_layers:
            raise ValueError(f"kv_cache has {len(kv_cache)} layers, the model {c.num_layers}")
        d, rope_table, cache = self.decoder, self.rope[...], list(kv_cache)
        h, residual = paged_embed(
            d, self.embed[...], weight_at(self, FIRST_NORM_PATH)[...], tokens, invariant=invariant
        )
        for i, blk in enumerate(self.layers):
            (h, residual), cache[i] = paged_block(
                d,
                blk,
                self.next_norm(i)[...],
                rope_table,
                h,
                residual,
                batch,
                cache[i],
                invariant=invariant,
                tp=tp,
            )
        return paged_head(d, self.head_weight[...], h, batch.logit_rows, invariant=invariant, tp=tp), cache


def int_array_like_tokens(name, a, shape):
    if not hasattr(a, "shape") or not hasattr(a, "dtype"):
        a = np.asarray(a)
    if not jnp.issubdtype(a.dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array, got dtype {a.dtype}")
    if tuple(a.shape) != tuple(shape):
        raise ValueError(f"{name} must have the shape of tokens {tuple(shape)}, got {tuple(a.shape)}")
    return a


def _segment_positions(seg: np.ndarray) -> np.ndarray:
    """Host-side: each token's index within its segment (-1 for padding). Raises if a segment
    of a row is not one contiguous run."""
    b, length = seg.shape
    pos = np.full((b, length), -1, np.int64)
    for r in range(b):
        row = seg[r]
        valid = row >= 0
        # a run starts where the id changes (padding in between also ends a run)
        starts = valid & np.concatenate([[True], row[1:] != row[:-1]])
        ids = row[starts]
        if len(np.unique(ids)) != len(ids):
            dup = next(i for i in ids if (ids == i).sum() > 1)
            raise ValueError(
                f"segment_ids: segment {int(dup)} of row {r} is not one contiguous run "
                "(each packed sequence must occupy consecutive columns)"
            )
        run_start = np.maximum.accumulate(np.where(starts, np.arange(length), 0))
        pos[r] = np.where(valid, np.arange(length) - run_start, -1)
    return pos


def check_packed(tokens, segment_ids, max_segments, config: LlamaConfig):
    """The packed layout's checks (``Llama.forward_packed``, ``bijax.logprobs``): tokens int
    [B, L] in the vocabulary; ``segment_ids`` None (one sequence a row) or int [B, L] in
    [-1, max_segments), each segment one contiguous run no longer than the model's context;
    ``max_segments`` a positive int (None: inferred from concrete ids). The value checks run
    where the arrays are concrete. Returns (tokens int32, segment_ids int32, max_segments,
    each token's index in its segment [B, L] or None when traced)."""
    tokens = check_tokens(tokens, config, ndim=2)
    b, length = tokens.shape
    if segment_ids is None:
        if max_segments not in (None, 1):
            raise ValueError("max_segments needs segment_ids (without them every row is one sequence)")
        max_segments = 1
        segment_ids = jnp.zeros((b, length), jnp.int32)
        if length > config.max_position_embeddings:  # (positions 0..L-1 in every row)
            raise ValueError(
                f"a segment is {length} tokens long; the model's context is {config.max_position_embeddings}"
            )
        return tokens, segment_ids, max_segments, np.broadcast_to(np.arange(length), (b, length))
    segment_ids = int_array_like_tokens("segment_ids", segment_ids, (b, length))
    seg_np = pk.runtime.concrete(segment_ids)
    if max_segments is None:
        if seg_np is None:
            raise ValueError(
                "segment_ids is traced: pass max_segments= (a static int bound on the segment ids)"
            )
        max_segments = max(1, int(seg_np.max()) + 1)
    check_positive_int("max_segments", max_segments)
    max_segments = int(max_segments)
    seg_pos = None
    if seg_np is not None:
        if (seg_np < -1).any() or (seg_np >= max_segments).any():
            bad = seg_np[(seg_np < -1) | (seg_np >= max_segments)][0]
            raise ValueError(f"segment id {int(bad)} is outside [-1, {max_segments}) (-1 marks padding)")
        if not (seg_np >= 0).any():
            raise ValueError("every token is padding (segment_ids are all -1)")
        seg_pos = _segment_positions(seg_np)
        if seg_pos.max() >= config.max_position_embeddings:
            raise ValueError(
                f"a segment is {int(seg_pos.max()) + 1} tokens long; the model's context is "
                f"{config.max_position_embeddings}"
            )
    return tokens, jnp.asarray(segment_ids, jnp.int32), max_segments, seg_pos


def poison_bad_packing(out: jax.Array, segment_ids, max_segments, config: LlamaConfig) -> jax.Array:
    """``out`` as it is, or all NaN where traced ``segment_ids`` break ``check_packed``'s value
    rules (under ``jax.jit`` they cannot raise): an id outside [-1, max_segments), a segment in
    more than one run of its row, a segment longer than the model's context. Such ids would
    place tokens in other sequences' pages (other rows included), so the whole batch is
    poisoned. Concrete ids were checked with an error already: ``out`` comes back untouched.
    A select after the last arithmetic, so it changes no other bit."""
    if segment_ids is None or pk.runtime.concrete(segment_ids) is not None:
        return out
    seg = jnp.asarray(segment_ids, jnp.int32)
    b = seg.shape[0]
    in_range = ((seg >= -1) & (seg < max_segments)).all()
    one_hot = seg[:, :, None] == jnp.arange(max_segments, dtype=jnp.int32)  # [B, L, S]
    counts = one_hot.sum(axis=1)  # tokens of each (row, segment)
    starts = (seg >= 0) & jnp.concatenate([jnp.ones((b, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    one_run = starts.sum(axis=1) == (counts > 0).sum(axis=1)  # runs == segments present, per row
    fits = counts.max() <= config.max_position_embeddings
    ok = in_range & one_run.all() & fits
    return jnp.where(ok, out, jnp.float32(jnp.nan).astype(out.dtype))


def check_tokens(tokens, config: LlamaConfig, *, ndim: int):
    if not hasattr(tokens, "shape") or not hasattr(tokens, "dtype"):
        try:
            tokens = np.asarray(tokens)
        except ValueError:  # (numpy's "inhomogeneous shape")
            raise ValueError(
                f"tokens must be a {ndim}-D array of token ids; rows of different lengths are not one "
                "(right-pad them and mark the padding with segment_ids -1)"
            ) from None
    if tokens.ndim != ndim:
        raise ValueError(f"tokens must be {ndim}-D, got shape {tuple(tokens.shape)}")
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise TypeError(f"tokens must be integer token ids, got {tokens.dtype}")
    if tokens.size == 0:
        raise ValueError("tokens is empty")
    concrete = pk.runtime.concrete(tokens)
    if concrete is not None and ((concrete < 0) | (concrete >= config.vocab_size)).any():
        bad = concrete[(concrete < 0) | (concrete >= config.vocab_size)][0]
        raise ValueError(f"token id {int(bad)} is outside the vocabulary [0, {config.vocab_size})")
    return jnp.asarray(tokens, jnp.int32)


def param_state(model: Llama) -> nnx.State:
    """The model's parameters (what checkpoints hold; the RoPE table is not among them)."""
    return nnx.state(model, nnx.Param)
