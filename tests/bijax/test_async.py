"""Async scheduling: the host enqueues step N + 1 (its decode tokens taken on the device from
step N's samples) before it reads step N back. Same token ids, float32 logprob bits, top
logprobs and finish reasons as the synchronous engine - with stop tokens ending sequences while
their next step is already on the device, max_tokens, n > 1, preemption in a small pool,
prefix-cache hits and an abort mid-flight."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

import bijax
from bijax import SamplingParams as SP
from tests.bijax.test_engine import shared_model
from tests.conftest import bits


def _llm(async_scheduling, **kw):
    """test_robustness's tiny engine settings (the compiled steps are shared)."""
    args = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=160, seed=1)
    return bijax.LLM(shared_model("tiny")[0], async_scheduling=async_scheduling, **(args | kw))


def _workload():
    rng = np.random.default_rng(5)
    system = list(map(int, rng.integers(3, 500, 40)))  # a shared prefix: prefix-cache hits
    prompts = [system + list(map(int, rng.integers(3, 500, n))) for n in (3, 9, 17, 30)]
    prompts += [list(map(int, rng.integers(3, 500, n))) for n in (5, 12, 22, 2)]
    stop = list(range(3, 60))  # common enough that sampled sequences stop early
    params = [
        SP(temperature=0.0, max_tokens=8, ignore_eos=True),
        SP(temperature=0.7, max_tokens=12, seed=3, n=2, logprobs=3, ignore_eos=True),
        SP(temperature=1.0, max_tokens=20, seed=4, stop_token_ids=stop, ignore_eos=True),
        SP(temperature=0.9, max_tokens=1, seed=5, ignore_eos=True),
        SP(temperature=1.3, max_tokens=25, seed=6, stop_token_ids=stop, ignore_eos=True),
        SP(temperature=0.5, max_tokens=6, seed=7, logprobs=2, ignore_eos=True),
        SP(temperature=1.2, max_tokens=30, seed=8, stop_token_ids=stop[:20], ignore_eos=True),
        SP(temperature=0.0, max_tokens=16, n=3, ignore_eos=True),
    ]
    return prompts, params


def _flat(outs):
    return [(c.token_ids, bits(c.logprobs), c.finish_reason, c.top_logprobs) for o in outs for c in o.outputs]


def _equal(a, b) -> bool:
    return all(
        x[0] == y[0] and np.array_equal(x[1], y[1]) and x[2:] == y[2:] for x, y in zip(a, b, strict=True)
    )


def test_async_gives_the_synchronous_bits():
    prompts, params = _workload()
    sync = _flat(_llm(False).generate(prompts, params, use_tqdm=False))
    reasons = [r for _, _, r, _ in sync]
    assert "stop" in reasons and "length" in reasons  # both ways of ending are exercised
    roomy = _llm(True)
    assert roomy.engine.async_scheduling
    roomy.generate(prompts[:1], params[:1], use_tqdm=False)  # its prefix is cached now
    hits = roomy.engine.stats().prefix_cache_hit_blocks
    assert _equal(_flat(roomy.generate(prompts, params, use_tqdm=False)), sync)
    assert roomy.engine.stats().prefix_cache_hit_blocks - hits >= 4 * 2
    small = _llm(True, num_kv_blocks=12)  # 11 usable blocks for 8 requests (12 sequences)
    assert _equal(_flat(small.generate(prompts, params, use_tqdm=False)), sync)
    stats = small.engine.stats()
    assert stats.num_preemptions > 0 and stats.num_kv_blocks_in_use == 0
    # control: the comparison sees a change in one request's sampling
    other = [dataclasses.replace(p, seed=99) if i == 2 else p for i, p in enumerate(params)]
    assert not _equal(_flat(_llm(True).generate(prompts, other, use_tqdm=False)), sync)


def test_abort_while_a_step_is_in_flight():
    prompts, params = _workload()
    prompts, params = prompts[4:7], [dataclasses.replace(p, stop_token_ids=[]) for p in params[4:7]]
    sync = _flat(_llm(False).generate(prompts, params, use_tqdm=False))
    llm = _llm(True)
    engine = llm.engine
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{i}", p, sp)
    done = {}
    for _ in range(3):
        for out in engine.step():
            done[out.request_id] = out
    engine.abort("r1")
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out
    assert done["r1"].finished and done["r1"].outputs[0].finish_reason == "abort"
    got = _flat([done["r0"], done["r2"]])
    assert _equal(got, [sync[0], sync[2]])
    assert engine.stats().num_kv_blocks_in_use == 0


def test_an_interrupted_read_back_loses_nothing():
    """An interrupt (or device error) while the host waits for a step's tokens leaves that step
    queued: stepping on reads it again and gives the synchronous bits."""
    prompts, params = _workload()
    prompts, params = prompts[4:7], [dataclasses.replace(p, stop_token_ids=[]) for p in params[4:7]]
    sync = _flat(_llm(False).generate(prompts, params, use_tqdm=False))
    engine = _llm(True).engine
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{i}", p, sp)
    real, calls = engine.runner.collect, []

    def flaky(launched):
        calls.append(1)
        if len(calls) in (3, 4):  # twice in a row: the second retry finds two steps queued
            raise KeyboardInterrupt
        return real(launched)

    engine.runner.collect = flaky
    done, interrupts = {}, 0
    for _ in range(500):  # bounded: a lost step would leave the engine spinning
        if not engine.has_unfinished_requests():
            break
        try:
            outs = engine.step()
        except KeyboardInterrupt:
            interrupts += 1
            continue
        for out in outs:
            done[out.request_id] = out
    assert interrupts == 2 and not engine.has_unfinished_requests()
    assert _equal(_flat([done[f"r{i}"] for i in range(3)]), sync)
    assert engine.stats().num_kv_blocks_in_use == 0


def test_a_second_interrupt_inside_release_leaves_the_llm_usable():
    """Two quick Ctrl-Cs: the first ends ``generate``, whose ``release`` steps the engine to
    free its requests; the second lands while that waits for a step's tokens. The steps left
    queued belong to no request: the next ``generate`` reads them back first and runs as
    before, with the same bits. Control: until then the engine counts them as unfinished."""
    prompts, params = _workload()
    prompts, params = prompts[4:7], [dataclasses.replace(p, stop_token_ids=[]) for p in params[4:7]]
    llm = _llm(True)
    ref = _flat(llm.generate(prompts, params, use_tqdm=False))
    real, calls = llm.engine.runner.collect, []

    def flaky(launched):
        calls.append(1)
        if len(calls) in (2, 3):  # generate's second read-back, then release's first
            raise KeyboardInterrupt
        return real(launched)

    llm.engine.runner.collect = flaky
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, params, use_tqdm=False)
    llm.engine.runner.collect = real
    assert len(calls) == 3 and llm.engine.has_unfinished_requests() and not llm.engine._requests
    assert _equal(_flat(llm.generate(prompts, params, use_tqdm=False)), ref)
    assert not llm.engine.has_unfinished_requests() and llm.engine.stats().num_kv_blocks_in_use == 0


def _forward_input_addresses(llm) -> dict:
    """Wraps the runner's forwards: per step bucket, the set of device addresses of the batch
    arrays each forward was given."""
    runner, seen = llm.engine.runner, {}
    for name in ("_forward_whole", "_forward_layers"):
        real = getattr(runner, name)

        def wrapped(batch, s, t, r, real=real):
            ptrs = tuple(a.unsafe_buffer_pointer() for a in jax.tree_util.tree_leaves(batch))
            seen.setdefault((s, t, r), set()).add(ptrs)
            return real(batch, s, t, r)

        setattr(runner, name, wrapped)
    return seen


def test_staged_inputs_keep_their_addresses_and_the_bits(monkeypatch):
    """A step's inputs reach its programs in the same device buffers every step (XLA would
    re-record a program's CUDA graph for inputs that moved: ``ModelRunner._staged``), and the
    tokens and logprob bits are those of inputs passed as new buffers every step."""
    prompts, params = _workload()
    monkeypatch.setenv("BIJAX_STAGED_INPUTS", "1")  # (off by default)
    llm = _llm(True)
    seen = _forward_input_addresses(llm)
    staged = _flat(llm.generate(prompts, params, use_tqdm=False))
    assert sum(len(s) for s in seen.values()) == len(seen) >= 2  # one address set per bucket
    monkeypatch.setenv("BIJAX_STAGED_INPUTS", "0")
    assert _equal(_flat(_llm(True).generate(prompts, params, use_tqdm=False)), staged)
    monkeypatch.setenv("BIJAX_STAGED_INPUTS", "1")
    # control: copies that do not land in the old buffers (no donation) move every step
    llm = _llm(True)
    llm.engine.runner._copy_into = jax.jit(lambda old, new: jax.lax.optimization_barrier(new))
    seen = _forward_input_addresses(llm)
    assert _equal(_flat(llm.generate(prompts, params, use_tqdm=False)), staged)
    assert max(len(s) for s in seen.values()) > 1
