"""The invariance audit: no reduction runs outside pallas_kernels on the invariant path.

Walks the jaxprs of the engine step (model + sampler) and of the scoring step, recursing into
every sub-jaxpr, and fails on any reduction primitive that is not inside a pallas_kernels
entry point (pjit named ``bijax_op_*``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jcore

import bijax
from bijax.sampler import SamplingRows
from bijax.step_programs import forward_program, sample_program, score_program
from models.configs import preset
from models.llama import Llama
from models.paged import PagedBatch
from pallas_kernels.runtime import KERNEL_PREFIX

REDUCTIONS = {
    "dot_general",
    "reduce_sum",
    "reduce_max",
    "reduce_min",
    "reduce_prod",
    "reduce_and",
    "reduce_or",
    "reduce_xor",
    "argmax",
    "argmin",
    "cumsum",
    "cumprod",
    "cummax",
    "cummin",
    "cumlogsumexp",
    "sort",
    "top_k",
    "psum",
    "psum_scatter",
    "all_reduce",
    "reduce_scatter",
    "conv_general_dilated",
    "reduce_precision_sum",
}


def _sub_jaxprs(value):
    if isinstance(value, jcore.ClosedJaxpr):
        yield value.jaxpr
    elif isinstance(value, jcore.Jaxpr):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _sub_jaxprs(v)


def _exact(eqn) -> bool:
    """Integer and boolean reductions are exact in any order (two's complement addition is
    associative): only floating-point operands make a reduction's bits order dependent."""
    dtypes = [getattr(v.aval, "dtype", None) for v in eqn.invars]
    return all(d is not None and not jnp.issubdtype(d, jnp.inexact) for d in dtypes)


def reductions_outside_kernels(jaxpr) -> list[str]:
    found = []
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in ("pjit", "jit") and str(eqn.params.get("name", "")).startswith(KERNEL_PREFIX):
            continue
        if name in REDUCTIONS and not _exact(eqn):
            found.append(name)
        for v in eqn.params.values():
            for sub in _sub_jaxprs(v):
                found += reductions_outside_kernels(sub)
    return found


@pytest.fixture(scope="module")
def runner_inputs():
    llm = bijax.LLM(
        Llama(preset("tiny"), dtype=jnp.bfloat16, seed=0),
        max_model_len=128,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        num_kv_blocks=16,
    )
    r = llm.engine.runner
    batch = PagedBatch.padding(4, 32, llm.config.max_blocks_per_seq)
    sampling = SamplingRows.greedy(4)
    sampling.temperature[:] = 1.0  # sampled rows: the filters' code is in the step
    return r, batch, sampling


def forward_jaxprs(r, s: int, t: int, invariant: bool) -> list:
    """The jaxprs of one bucket's forward programs as the engine runs them (the chain: the
    embedding, each group of layers' program, the LM head), and of the whole forward in one
    program (``score``'s) - ``invariant`` as given."""
    jaxprs = []
    for key in r.forward_keys(s, t, s):
        fn, args, kw, _, _ = r._spec(key)
        jaxprs.append(jax.make_jaxpr(functools.partial(fn, **dict(kw, invariant=invariant)))(*args).jaxpr)
    batch = r.padding_batch(s, t)
    fwd = lambda p, c, b: forward_program(p, c, b, graphdef=r.graphdef, invariant=invariant)  # noqa: E731
    return jaxprs + [jax.make_jaxpr(fwd)(r.params, r.cache, batch).jaxpr]


def _step_reductions(r, batch, sampling, invariant, num_logprobs=0):
    """Reductions outside the kernels in the programs of an engine step: the forward's, then
    sampling (both variants: without and with the top-k / top-p masks)."""
    jaxprs = forward_jaxprs(r, len(batch.context_lens), batch.num_tokens, invariant)
    for filters in (False, True):
        fn = lambda lg, s, f=filters: sample_program(  # noqa: E731
            lg, s, invariant=invariant, num_logprobs=num_logprobs, filters=f
        )
        jaxprs.append(jax.make_jaxpr(fn)(r._logits_spec(len(batch.logit_rows)), sampling).jaxpr)
    return [x for j in jaxprs for x in reductions_outside_kernels(j)]


def _score_jaxpr(r, batch, invariant):
    batch = batch.replace(logit_rows=None)
    t = batch.num_tokens
    fn = lambda p, c, b: score_program(
        p, c, b, np.zeros(t, np.int32), np.ones(t, np.float32), graphdef=r.graphdef, invariant=invariant
    )
    return jax.make_jaxpr(fn)(r.params, r.cache, batch).jaxpr


@pytest.mark.parametrize("num_logprobs", [0, 5])
def test_engine_step_has_no_reduction_outside_the_kernels(runner_inputs, num_logprobs):
    assert _step_reductions(*runner_inputs, invariant=True, num_logprobs=num_logprobs) == []


def test_score_step_has_no_reduction_outside_the_kernels(runner_inputs):
    r, batch, _ = runner_inputs
    assert reductions_outside_kernels(_score_jaxpr(r, batch, invariant=True)) == []


def test_negative_control_the_audit_finds_xla_reductions(runner_inputs):
    """The XLA path is full of them: dots, reductions, sorts and cumsums."""
    found = set(_step_reductions(*runner_inputs, invariant=False, num_logprobs=5))
    assert {"dot_general", "reduce_max", "cumsum", "sort"} <= found
    r, batch, _ = runner_inputs
    assert "dot_general" in reductions_outside_kernels(_score_jaxpr(r, batch, invariant=False))


def test_only_floating_point_reductions_count():
    """Integer reductions (the trainer's page offsets are an int cumsum) are exact in any order."""
    jaxpr = lambda x: jax.make_jaxpr(lambda a: (jnp.cumsum(a), jnp.sum(a)))(x).jaxpr
    assert reductions_outside_kernels(jaxpr(np.ones(8, np.int32))) == []
    assert reductions_outside_kernels(jaxpr(np.ones(8, np.float32))) == ["cumsum", "reduce_sum"]
