"""Trainer-side logprobs that are bit-identical to the engine's (RL rollouts inside JAX trainers).

An RL trainer scores its rollouts with the policy it is training and differentiates through
that score; importance ratios and KL terms need the trainer's logprobs to be the SAME numbers
the sampler reported. ``logprobs`` runs the model through the same batch-invariant kernels as
``bijax.LLM`` (matmul, rms_norm, paged attention, tempered log_softmax), so for the same
weights, tokens and temperature its float32 values equal ``LLM.generate``'s reported logprobs
(and ``LLM.score``'s) bit for bit, whatever the trainer's layout: one sequence, a right-padded
batch, or several sequences packed into one row.

It is a pure function of (model, tokens, ...): jit-able (no data-dependent shapes) and
differentiable - every kernel carries a ``jax.custom_vjp`` whose backward is plain XLA in
float32, so ``jax.grad`` / ``nnx.grad`` of a loss over its output matches the gradient of the
XLA (``invariant=False``) path to float32 rounding.

    import bijax.rl
    lp, mask = bijax.rl.logprobs(model, tokens, segment_ids=seg, temperature=0.7, return_mask=True)
    loss = -(lp * advantages * mask).sum() / mask.sum()
"""

from __future__ import annotations

import functools
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import pallas_kernels as pk
from bijax.sampler import tempered_logprobs
from bijax.sampling_params import check_temperature, temperature_ok
from bijax.step_programs import baseline_jit
from models.llama import Llama, check_packed, int_array_like_tokens, poison_bad_packing

__all__ = ["logprobs"]


def _as_model(model) -> Llama:
    if isinstance(model, Llama):
        return model
    if isinstance(model, (tuple, list)) and len(model) >= 2 and isinstance(model[0], nnx.GraphDef):
        merged = nnx.merge(*model)
        if isinstance(merged, Llama):
            return merged
    raise TypeError(
        "model must be a models.Llama or a (graphdef, state, ...) tuple from nnx.split of one, "
        f"got {type(model).__name__}"
    )


def _temperature(temperature, b: int):
    if isinstance(temperature, bool):
        raise TypeError("temperature must be a real number or array, got a bool")
    t = temperature if hasattr(temperature, "dtype") else np.asarray(temperature)
    if not (jnp.issubdtype(t.dtype, jnp.floating) or jnp.issubdtype(t.dtype, jnp.integer)):
        raise TypeError(f"temperature must be a real number or array, got dtype {t.dtype}")
    concrete = pk.runtime.concrete(t)
    if concrete is not None:
        check_temperature(concrete)
    if t.ndim == 0:
        t = jnp.broadcast_to(jnp.asarray(t, jnp.float32), (b,))
    elif tuple(t.shape) != (b,):
        raise ValueError(
            f"temperature must be a scalar or have shape ({b},) (one per row), got {tuple(t.shape)}"
        )
    return jnp.asarray(t, jnp.float32)


@pk.runtime.pinned
def logprobs(
    model,
    tokens,
    *,
    positions=None,
    segment_ids=None,
    temperature=1.0,
    max_segments: int | None = None,
    invariant: bool = True,
    return_mask: bool = False,
):
    """Per-token float32 logprobs of ``tokens`` under ``model``: bit-identical to ``LLM.generate``.

    ``out[b, i] = log softmax(logits / T)[tokens[b, i]]``, the logits being the model's at
    the previous token of the same segment, i.e. log p(tokens[b, i] | the earlier tokens of its
    segment) under the tempered distribution (raw log_softmax for T = 0, as the engine
    reports for greedy requests). It is 0 at each segment's first token and at padding.
    With ``invariant=True`` each value equals, bit for bit, the logprob ``bijax.LLM.generate``
    reports (and ``LLM.score`` returns) for that token after the same earlier tokens at the
    same temperature, with the same weights - whatever B, L, padding or packing.

    Args:
      model: a ``models.Llama`` (e.g. ``nnx.merge(graphdef, params, rest)`` inside ``jax.grad``),
        or a ``(graphdef, state, ...)`` tuple from ``nnx.split`` of one.
      tokens: int [B, L] token ids (each in [0, vocab_size); checked when concrete).
      positions: optional int [B, L]; only CHECKED (when concrete): each token's position
        must be its index within its segment (0, 1, 2, ... restarting at every segment;
        anything at padding). Positions are always derived from ``segment_ids``, so traced
        positions are ignored.
      segment_ids: optional int [B, L] packing: the sequence each token belongs to within its
        row, in [0, max_segments); each sequence one contiguous run of columns (ids need not be
        ordered); -1 marks padding, anywhere in the row. Default: every row is one sequence
        (right padding then needs no mask - causal tokens never see later ones - but its
        logprobs are those of the pad tokens: mask them yourself, or pass -1 there).
      temperature: a scalar or float [B] (one per row), 0 or in [1e-30, 1e30] (checked when concrete).
      max_segments: static bound on the segment ids (sequences per row). Default: 1 without
        ``segment_ids``, else ``max(segment_ids) + 1`` when they are concrete; required when
        ``segment_ids`` is traced (under ``jax.jit``). It sets the size of the block tables
        (B * max_segments * L int32), never the numerics. Traced ``segment_ids`` that break
        the rules above (an id >= max_segments, a segment in two runs, one longer than the
        model's context) cannot raise: every logprob comes back NaN instead of a wrong one.
      invariant: True: the batch-invariant kernels (bits equal the engine's). False: plain
        XLA (dense masked attention, XLA dots and log_softmax) - the baseline and negative
        control; the same values up to float32 rounding.
      return_mask: also return the bool [B, L] mask of the entries that are logprobs
        (a real token that is not its segment's first).

    Returns:
      float32 [B, L] logprobs, or ``(logprobs, mask)`` with ``return_mask=True``.

    Differentiable in the model's parameters (and the temperature) through the kernels'
    ``jax.custom_vjp`` rules; the attention backward is XLA over each token's densely gathered
    keys, O(B * L * L * kv_heads * head_dim) memory.
    """
    m = _as_model(model)
    c = m.config
    if not isinstance(invariant, bool):
        raise TypeError(f"invariant must be a bool, got {invariant!r}")
    if not isinstance(return_mask, bool):  # (a truthy "no" returned a tuple)
        raise TypeError(f"return_mask must be a bool, got {return_mask!r}")
    if invariant and jax.default_backend() == "cpu":
        pk.require_consistent_cpu_math()  # the engine's CPU bits need the same setting
    tokens, segment_ids, max_segments, seg_pos = check_packed(tokens, segment_ids, max_segments, c)
    b, length = tokens.shape
    if positions is not None:
        positions = int_array_like_tokens("positions", positions, (b, length))
        pos_np = pk.runtime.concrete(positions)
        if pos_np is not None and seg_pos is not None:
            real = seg_pos >= 0
            if (pos_np[real] != seg_pos[real]).any():
                r, i = np.argwhere(real & (pos_np != seg_pos))[0]
                raise ValueError(
                    f"positions[{r}, {i}] is {int(pos_np[r, i])} but the token is at index "
                    f"{int(seg_pos[r, i])} of its segment (positions restart at 0 in every segment; "
                    "pass segment_ids for packed rows)"
                )
    temp = _temperature(temperature, b)

    graphdef, state = nnx.split(m)
    for path, x in jax.tree_util.tree_leaves_with_path(state):  # (JAX's error named no parameter)
        if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and x.is_deleted():
            raise RuntimeError(
                f"bijax.logprobs: the model's parameter {jax.tree_util.keystr(path)} has been deleted "
                "(donated to a train step?): pass the model with the step's new weights"
            )
    try:
        out, mask = _logprobs(
            graphdef,
            state,
            tokens,
            jnp.asarray(segment_ids, jnp.int32),
            temp,
            max_segments=max_segments,
            invariant=invariant,
            traced_ids=seg_pos is None,  # (concrete ids were checked above, with an error)
            traced_tokens=pk.runtime.concrete(tokens) is None,  # (so were concrete tokens ...)
            traced_temp=pk.runtime.concrete(temp) is None,  # (... and a concrete temperature)
        )
    except (AssertionError, ValueError) as e:
        # a derivative of the gradient differentiates the kernels' forward rules, which have no
        # derivative rule: Pallas fails an internal assertion, or linearizing the CPU forms
        # (``runtime.unbatched``'s custom_vmap) fails
        pallas = any("jax/_src/pallas" in f.filename for f in traceback.extract_tb(e.__traceback__)[-3:])
        linearize = isinstance(e, ValueError) and str(e).startswith("Linearization failed")
        if invariant and ((isinstance(e, AssertionError) and pallas) or linearize):
            raise NotImplementedError(
                "bijax.logprobs: second-order derivatives (a derivative of the gradient) are not supported "
                "by the invariant kernels (their backward rules are first order); invariant=False has them"
            ) from e
        raise
    return (out, mask) if return_mask else out


# Always one jitted program (inlined into the caller's when it is traced): XLA compiles the
# elementwise math between the kernels (RoPE, SwiGLU, ...) as it does in the engine's jitted
# step. Run op by op instead, XLA CPU rounds RoPE's ``x1 * cos - x2 * sin`` differently
# (measured: eager and jitted RoPE differ in the last bit), and the bits would not match.
# (the baseline's program compiles with step_programs.BASELINE_XLA_OPTIONS when called directly)
@functools.partial(
    baseline_jit,
    static_argnums=(0,),
    static_argnames=("max_segments", "invariant", "traced_ids", "traced_tokens", "traced_temp"),
)
def _logprobs(
    graphdef,
    state,
    tokens,
    segment_ids,
    temp,
    *,
    max_segments,
    invariant,
    traced_ids,
    traced_tokens,
    traced_temp,
):
    # A caller's jit that closes over the model and the tokens makes them constants of its
    # program, and XLA would fold the forward at compile time with other roundings: the
    # barrier keeps them inputs of the computation, as in the engine's steps.
    state, tokens, segment_ids = jax.lax.optimization_barrier((state, tokens, segment_ids))
    m = nnx.merge(graphdef, state)
    c = m.config
    b, length = tokens.shape
    logits = m._packed_logits(tokens, segment_ids, max_segments=max_segments, invariant=invariant)
    lp = tempered_logprobs(
        logits.reshape(b * length, c.vocab_size), jnp.repeat(temp, length), invariant=invariant
    )
    # Row i's distribution scores the next token, i + 1.
    targets = jnp.concatenate([tokens[:, 1:], jnp.zeros((b, 1), jnp.int32)], axis=1).reshape(-1)
    nxt = jnp.take_along_axis(lp, targets[:, None], axis=1).reshape(b, length)
    shifted = jnp.concatenate([jnp.zeros((b, 1), jnp.float32), nxt[:, :-1]], axis=1)
    valid = segment_ids >= 0
    prev_same = jnp.concatenate([jnp.zeros((b, 1), bool), segment_ids[:, 1:] == segment_ids[:, :-1]], axis=1)
    mask = valid & prev_same
    out = jnp.where(mask, shifted, jnp.float32(0))
    # Traced values that the checks would refuse cannot raise here: a row with a real token
    # outside the vocabulary (the embedding lookup would wrap or clamp it) or a bad temperature
    # comes back all NaN, never finite and wrong (a select after the last arithmetic).
    bad_rows = jnp.zeros((b,), bool)
    if traced_tokens:
        bad_rows |= (((tokens < 0) | (tokens >= c.vocab_size)) & valid).any(axis=1)
    if traced_temp:
        bad_rows |= ~temperature_ok(temp)
    if traced_tokens or traced_temp:
        out = jnp.where(bad_rows[:, None], jnp.float32(jnp.nan), out)
    return poison_bad_packing(out, segment_ids, max_segments, c) if traced_ids else out, mask
