"""Trainer-side logprobs (``bijax.rl.logprobs``) against the engine, on `tiny` in float32.

(a) bits: equal to ``LLM.generate``'s reported logprobs (seeded T=0.7 and greedy T=0) for a
    batch of 1, a right-padded batch of 8 and packed rows; negative controls: the XLA path
    (invariant=False) differs, and the comparison fails on a one-ulp perturbation;
(b) gradients through the kernels' custom VJPs match jax.grad of the XLA path (<= 1e-4);
(c) jit: the jitted function gives the eager bits; inputs are validated.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import bijax.rl as rl
from bijax import SamplingParams as SP
from tests.bijax.test_engine import shared_llm as _llm
from tests.bijax.test_engine import shared_model as _model
from tests.conftest import bits, rel_err

PROMPT_LENS = (3, 9, 17, 30, 5, 12, 22, 40)
MAX_TOKENS = 5
TEMPERATURES = (0.7, 0.0)


def _tiny():
    return _model("tiny")[0]


@functools.cache
def _rollouts(temperature):
    """[(full token ids, prompt length, generate's logprobs)] for 8 prompts of different lengths."""
    rng = np.random.default_rng(21)
    prompts = [list(map(int, rng.integers(3, 512, n))) for n in PROMPT_LENS]
    sp = SP(temperature=temperature, seed=5, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = _llm("tiny").generate(prompts, sp, use_tqdm=False)
    return [
        (list(o.prompt_token_ids) + o.outputs[0].token_ids, len(o.prompt_token_ids), o.outputs[0].logprobs)
        for o in outs
    ]


def _layout(name, seqs):
    """-> (tokens [B, L], segment_ids [B, L] or None, [(row, start column, seq index)])."""
    if name == "batch1":
        s = seqs[3][0]
        return np.array([s], np.int32), None, [(0, 0, 3)]
    if name == "batch8":  # right padding, marked -1
        length = max(len(s) for s, _, _ in seqs) + 2
        tok = np.zeros((8, length), np.int32)
        seg = np.full((8, length), -1, np.int32)
        for i, (s, _, _) in enumerate(seqs):
            tok[i, : len(s)], seg[i, : len(s)] = s, 0
        return tok, seg, [(i, 0, i) for i in range(8)]
    # packed: 3 + 3 + 2 sequences in 3 rows, segment ids not in column order, some padding
    rows = [[0, 1, 2], [3, 4, 5], [6, 7]]
    length = max(sum(len(seqs[i][0]) for i in r) for r in rows) + 3
    tok = np.full((3, length), 7, np.int32)
    seg = np.full((3, length), -1, np.int32)
    where = []
    for r, members in enumerate(rows):
        col = 0
        for k, i in enumerate(members):
            s = seqs[i][0]
            tok[r, col : col + len(s)] = s
            seg[r, col : col + len(s)] = (k * 2 + r) % 3  # ids 0..2 in any order
            where.append((r, col, i))
            col += len(s)
    return tok, seg, where


def _generated(lp, where, seqs):
    """The entries of lp [B, L] at each sequence's generated tokens, in sequence order."""
    got = {}
    for r, col, i in where:
        full, plen, _ = seqs[i]
        got[i] = np.asarray(lp)[r, col + plen : col + len(full)]
    return [got[i] for i in sorted(got)]


def _wanted(where, seqs):
    """generate's logprobs of the same sequences, in sequence order."""
    return [seqs[i][2] for i in sorted(i for _, _, i in where)]


def _same_bits(a, b) -> bool:
    return all(np.array_equal(bits(x), bits(y)) for x, y in zip(a, b, strict=True))


# --------------------------------------------------------------------------- (a) bits


@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("layout", ["batch1", "batch8", "packed"])
def test_bits_equal_generate(layout, temperature):
    seqs = _rollouts(temperature)
    tok, seg, where = _layout(layout, seqs)
    lp, mask = rl.logprobs(_tiny(), tok, segment_ids=seg, temperature=temperature, return_mask=True)
    assert _same_bits(_generated(lp, where, seqs), _wanted(where, seqs))
    # mask: real tokens that are not their segment's first; 0 everywhere else
    lp, mask = np.asarray(lp), np.asarray(mask)
    expect = np.zeros_like(mask)
    for r, col, i in where:
        expect[r, col + 1 : col + len(seqs[i][0])] = True
    assert np.array_equal(mask, expect)
    assert (lp[~mask] == 0).all() and (lp[mask] < 0).all()


def test_score_and_trainer_agree_on_a_whole_sequence():
    """Every token after the first, not just the generated ones: equal to LLM.score."""
    full, _, _ = _rollouts(0.7)[4]
    want = _llm("tiny").score([full], [1], temperature=0.7)[0]
    got = np.asarray(rl.logprobs(_tiny(), np.array([full], np.int32), temperature=0.7))[0, 1:]
    assert np.array_equal(bits(got), bits(want))


def test_negative_control_xla_path_differs_and_perturbation_is_caught():
    seqs = _rollouts(0.7)
    want = [seqs[i][2] for i in range(8)]
    tok, seg, where = _layout("batch8", seqs)
    xla = rl.logprobs(_tiny(), tok, segment_ids=seg, temperature=0.7, invariant=False)
    got_xla = _generated(xla, where, seqs)
    assert not _same_bits(got_xla, want)
    # ... while agreeing to float32 rounding (the XLA path computes the same thing)
    assert max(np.abs(a - b).max() for a, b in zip(got_xla, want, strict=True)) < 1e-4
    # the comparison itself notices a one-ulp change
    got = _generated(rl.logprobs(_tiny(), tok, segment_ids=seg, temperature=0.7), where, seqs)
    assert _same_bits(got, want)
    bumped = [g.copy() for g in got]
    bumped[5][2] = np.nextafter(bumped[5][2], np.float32(0))
    assert not _same_bits(bumped, want)


def test_unmasked_right_padding_gives_the_same_bits():
    """Without segment_ids, right padding is harmless: the real tokens' values are unchanged."""
    seqs = _rollouts(0.7)
    tok, seg, where = _layout("batch8", seqs)
    plain = np.asarray(rl.logprobs(_tiny(), tok, temperature=0.7))
    masked = np.asarray(rl.logprobs(_tiny(), tok, segment_ids=seg, temperature=0.7))
    real = seg >= 0
    assert np.array_equal(bits(plain[real]), bits(masked[real]))


def test_per_row_temperature():
    seqs = _rollouts(0.7)
    tok, seg, where = _layout("batch8", seqs)
    temps = np.full(8, 0.7, np.float32)
    temps[3] = 1.3
    lp = np.asarray(rl.logprobs(_tiny(), tok, segment_ids=seg, temperature=temps))
    ref7 = np.asarray(rl.logprobs(_tiny(), tok, segment_ids=seg, temperature=0.7))
    ref13 = np.asarray(rl.logprobs(_tiny(), tok, segment_ids=seg, temperature=1.3))
    others = np.arange(8) != 3
    assert np.array_equal(bits(lp[others]), bits(ref7[others]))
    assert np.array_equal(bits(lp[3]), bits(ref13[3]))


# --------------------------------------------------------------------------- (b) gradients


def _grads(tok, seg, weights, temperature, invariant):
    graphdef, params, rest = nnx.split(_tiny(), nnx.Param, ...)

    def loss(params):
        model = nnx.merge(graphdef, params, rest)
        lp = rl.logprobs(model, tok, segment_ids=seg, temperature=temperature, invariant=invariant)
        return jnp.sum(lp * weights), lp

    (_, lp), g = jax.value_and_grad(loss, has_aux=True)(params)
    return lp, g


def test_gradients_match_the_xla_path():
    seqs = _rollouts(0.7)
    tok, seg, where = _layout("packed", seqs)
    weights = jnp.asarray(np.random.default_rng(3).standard_normal(tok.shape), jnp.float32)
    lp, g_inv = _grads(tok, seg, weights, 0.7, True)
    _, g_ref = _grads(tok, seg, weights, 0.7, False)
    # the value computed alongside the gradient keeps generate's bits
    want = [seqs[i][2] for i in range(8)]
    assert _same_bits(_generated(lp, where, seqs), want)
    leaves_inv = jax.tree_util.tree_leaves_with_path(g_inv)
    leaves_ref = jax.tree_util.tree_leaves(g_ref)
    assert len(leaves_inv) == len(leaves_ref) > 10
    for (path, a), b in zip(leaves_inv, leaves_ref, strict=True):
        assert np.abs(np.asarray(b)).max() > 0, path
        assert rel_err(a, b) <= 1e-4, (jax.tree_util.keystr(path), rel_err(a, b))


def test_gradient_wrt_temperature():
    full, _, _ = _rollouts(0.7)[1]
    tok = np.array([full], np.int32)

    def f(t, invariant):
        return rl.logprobs(_tiny(), tok, temperature=t, invariant=invariant).sum()

    a = jax.grad(f)(jnp.float32(0.7), True)
    b = jax.grad(f)(jnp.float32(0.7), False)
    assert abs(float(a) - float(b)) <= 1e-4 * abs(float(b))


# --------------------------------------------------------------------------- (c) jit, validation


def test_jit_gives_the_eager_bits():
    seqs = _rollouts(0.7)
    tok, seg, _ = _layout("packed", seqs)
    graphdef, state = nnx.split(_tiny())
    eager = rl.logprobs((graphdef, state), tok, segment_ids=seg, temperature=0.7)

    @jax.jit
    def step(state, tok, seg, temp):
        return rl.logprobs((graphdef, state), tok, segment_ids=seg, temperature=temp, max_segments=3)

    jitted = step(state, tok, seg, jnp.float32(0.7))
    assert np.array_equal(bits(jitted), bits(eager))


def test_traced_segment_ids_that_break_the_packing_rules_give_nan_not_wrong_values():
    """Under jit the ids cannot be checked with an error; ids that would put tokens into other
    sequences' pages poison the whole batch (NaN) on both paths. Control: valid traced ids give
    the eager bits (no NaN)."""
    tok = np.arange(10, 31, dtype=np.int32)[None]
    two = np.array([[0] * 12 + [1] * 9], np.int32)
    split = np.array([[0] * 6 + [1] * 9 + [0] * 6], np.int32)  # segment 0 in two runs
    graphdef, state = nnx.split(_tiny())

    @functools.partial(jax.jit, static_argnums=(2, 3))
    def f(state, seg, max_segments, invariant):
        return rl.logprobs(
            (graphdef, state), tok, segment_ids=seg, max_segments=max_segments, invariant=invariant
        )

    good = f(state, two, 2, True)
    assert np.array_equal(bits(good), bits(rl.logprobs((graphdef, state), tok, segment_ids=two)))
    for seg, max_segments in ((two, 1), (split, 2)):
        for invariant in (True, False):
            assert np.isnan(np.asarray(f(state, seg, max_segments, invariant))).all(), (seg, invariant)
    # the model's own packed forward too (its logits)
    logits = jax.jit(lambda seg: _tiny().forward_packed(tok, seg, max_segments=1))(two)
    assert np.isnan(np.asarray(logits)).all()


def test_traced_tokens_and_temperatures_out_of_range_give_nan_rows():
    """Eagerly a token outside the vocabulary or a bad temperature raises; under jit it cannot,
    and a row holding one came back finite and wrong (-3 wrapped to 509, 600 was clamped). Now
    that row is all NaN; the other rows keep their bits (the control: valid traced values
    give the eager bits)."""
    graphdef, state = nnx.split(_tiny())
    tok = np.array([[5, 9, 7, 11], [5, 9, 7, 11], [4, 8, 6, 2]], np.int32)
    seg = np.array([[0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, -1]], np.int32)

    @jax.jit
    def f(tok, temp):
        return rl.logprobs((graphdef, state), tok, segment_ids=seg, temperature=temp, max_segments=1)

    temps = jnp.array([0.7, 0.7, 1.0], jnp.float32)
    eager = np.asarray(rl.logprobs((graphdef, state), tok, segment_ids=seg, temperature=np.asarray(temps)))
    assert np.array_equal(bits(f(tok, temps)), bits(eager))
    assert np.array_equal(
        bits(f(np.where(seg < 0, -1, tok), temps)), bits(eager)
    )  # padding may hold anything
    for bad in (-3, 600):
        got = np.asarray(f(_with(tok, (1, 2), bad), temps))
        assert np.isnan(got[1]).all() and np.array_equal(bits(got[[0, 2]]), bits(eager[[0, 2]])), bad
    for bad in (-1.0, np.nan, np.inf, 1e-35):
        got = np.asarray(f(tok, temps.at[2].set(bad)))
        assert np.isnan(got[2]).all() and np.array_equal(bits(got[:2]), bits(eager[:2])), bad


def _with(a, index, value):
    a = np.array(a)
    a[index] = value
    return a


def test_jit_with_the_model_and_tokens_as_constants_keeps_the_bits():
    """A jit that closes over the model and the tokens (only the temperature traced): XLA
    folded the forward at compile time with other roundings until ``_logprobs``' barrier.
    Control: the XLA path's values differ from these bits, so the comparison can fail."""
    model, tok = _tiny(), np.arange(3, 19, dtype=np.int32)[None]
    eager = rl.logprobs(model, tok, temperature=0.7)
    const = jax.jit(lambda t: rl.logprobs(model, tok, temperature=t))(jnp.float32(0.7))
    assert np.array_equal(bits(const), bits(eager))
    xla = jax.jit(lambda t: rl.logprobs(model, tok, temperature=t, invariant=False))(jnp.float32(0.7))
    assert not np.array_equal(bits(xla), bits(eager))


def test_second_order_derivatives_are_a_clear_error():
    tok = np.arange(3, 11, dtype=np.int32)[None]

    def f(t):
        return rl.logprobs(_tiny(), tok, temperature=t).sum()

    with pytest.raises(NotImplementedError, match="second-order derivatives"):
        jax.grad(jax.grad(f))(jnp.float32(0.7))


def test_traced_segment_ids_need_max_segments():
    tok = np.ones((1, 8), np.int32)
    with pytest.raises(ValueError, match="max_segments"):
        jax.jit(lambda s: rl.logprobs(_tiny(), tok, segment_ids=s))(np.zeros((1, 8), np.int32))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(tokens=np.ones(8, np.int32)), ValueError, "2-D"),
        (dict(tokens=[[3, 4, 5], [3, 4]]), ValueError, "rows of different lengths.*right-pad"),
        (dict(tokens=np.ones((1, 8), np.float32)), TypeError, "integer"),
        (dict(tokens=np.full((1, 8), 512, np.int32)), ValueError, "vocabulary"),
        (dict(temperature=-0.5), ValueError, ">= 0"),
        (dict(temperature=np.ones(3, np.float32)), ValueError, "one per row"),
        (dict(temperature=True), TypeError, "bool"),
        (dict(segment_ids=np.zeros((1, 7), np.int32)), ValueError, "shape"),
        (dict(segment_ids=np.zeros((1, 8), np.float32)), TypeError, "integer"),
        (dict(segment_ids=np.array([[0, 0, 1, 1, 0, 0, -1, -1]])), ValueError, "contiguous"),
        (dict(segment_ids=np.array([[0, 0, 1, 1, 2, 2, 2, 2]]), max_segments=2), ValueError, "outside"),
        (dict(segment_ids=np.array([[0, 0, -2, 1, 1, 1, 1, 1]])), ValueError, "outside"),
        (dict(segment_ids=np.full((1, 8), -1)), ValueError, "padding"),
        (dict(segment_ids=np.zeros((1, 8), np.int32), max_segments=0), ValueError, "max_segments"),
        (dict(positions=np.array([[0, 1, 2, 3, 0, 1, 2, 3]])), ValueError, "positions"),
        (dict(positions=np.zeros((2, 8), np.int32)), ValueError, "shape"),
        (dict(model="tiny"), TypeError, "Llama"),
        (dict(invariant=1), TypeError, "bool"),
        (dict(return_mask="no"), TypeError, "return_mask must be a bool"),
    ],
)
def test_validation(kwargs, error, match):
    kwargs = dict(kwargs)
    model = kwargs.pop("model", _tiny())
    tok = kwargs.pop("tokens", np.ones((1, 8), np.int32))
    with pytest.raises(error, match=match):
        rl.logprobs(model, tok, **kwargs)


def test_a_deleted_parameter_is_named():
    """Weights donated to a train step: an error naming the parameter, not JAX's "Array has
    been deleted with shape=float32[256]"."""
    graphdef, state = nnx.split(_tiny())
    state = jax.tree.map(jnp.copy, state)  # (the shared model keeps its arrays)
    state["final_norm"][...].delete()
    with pytest.raises(RuntimeError, match=r"parameter \['final_norm'\]\.value has been deleted"):
        rl.logprobs((graphdef, state), np.ones((1, 8), np.int32))


def test_positions_that_match_segments_are_accepted():
    tok = np.arange(3, 11, dtype=np.int32)[None]
    seg = np.array([[0, 0, 0, 1, 1, 1, 1, -1]])
    pos = np.array([[0, 1, 2, 0, 1, 2, 3, 99]])
    a = rl.logprobs(_tiny(), tok, segment_ids=seg, positions=pos)
    b = rl.logprobs(_tiny(), tok, segment_ids=seg)
    assert np.array_equal(bits(a), bits(b))
    # a segment's values do not depend on its neighbour
    alone = rl.logprobs(_tiny(), tok[:, 3:7])
    assert np.array_equal(bits(np.asarray(a)[0, 3:7]), bits(np.asarray(alone)[0]))


def test_no_reduction_outside_the_kernels():
    """The invariance audit of test_audit.py, on the trainer's function (forward)."""
    from tests.bijax.test_audit import reductions_outside_kernels

    tok, seg = np.ones((2, 16), np.int32), np.array([[0] * 10 + [1] * 6, [0] * 12 + [-1] * 4])
    graphdef, state = nnx.split(_tiny())

    def jaxpr(invariant):
        fn = lambda st: rl.logprobs(
            (graphdef, st), tok, segment_ids=seg, temperature=0.7, invariant=invariant
        )
        return jax.make_jaxpr(fn)(state).jaxpr

    assert reductions_outside_kernels(jaxpr(True)) == []
    assert "dot_general" in reductions_outside_kernels(jaxpr(False))
