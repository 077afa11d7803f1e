"""A step's forward as a chain of programs (the embedding, one layer program per layer, the LM
head) and as one program: the same bits, whichever runs which token bucket
(``bijax.step_programs``; the GPU's default is tiered - the chain, then the whole forward -
the CPU's the chain)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import bijax
from bijax import compile_cache, step_cache, step_programs
from models.configs import preset
from models.llama import Llama
from tests.conftest import bits

# Greedy and seeded sampling, a prompt longer than a step (chunked prefill), a short one.
PROMPTS = [[5 + i % 40 for i in range(50)], [7, 8, 9]]
SPS = [
    bijax.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
    bijax.SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=6, ignore_eos=True),
]


def _model():
    """``tiny`` with norm weights that differ from norm to norm (the preset's are all ones, which
    would hide a layer program given the wrong norm)."""
    model = Llama(preset("tiny"), dtype=jnp.float32, seed=0)
    rng = np.random.default_rng(0)
    for norm in [model.final_norm] + [n for blk in model.layers for n in (blk.attn_norm, blk.mlp_norm)]:
        norm[...] = jnp.asarray(1 + 0.2 * rng.standard_normal(norm[...].shape), jnp.float32)
    return model


def _run(monkeypatch, setting: str, model=None, per_program: int = 1):
    """(outputs, the LLM) of an engine whose forwards run as ``BIJAX_STEP_PROGRAMS=setting``,
    ``per_program`` layers a block program."""
    monkeypatch.setenv("BIJAX_STEP_PROGRAMS", setting)
    monkeypatch.setenv("BIJAX_LAYERS_PER_PROGRAM", str(per_program))
    model = _model() if model is None else model
    llm = bijax.LLM(model, max_model_len=128, max_num_seqs=2, max_num_batched_tokens=32, num_kv_blocks=24)
    outs = [o.outputs[0] for o in llm.generate(PROMPTS, SPS, use_tqdm=False)]
    return outs, llm


def _same(a, b) -> bool:
    return all(
        x.token_ids == y.token_ids and np.array_equal(bits(x.logprobs), bits(y.logprobs))
        for x, y in zip(a, b, strict=True)
    )


@pytest.fixture(scope="module")
def runs():
    """The chain everywhere, the whole forward everywhere, the chain from 32 tokens only, the
    chain with both layers in one block program."""
    mp = pytest.MonkeyPatch()
    try:
        out = {s: _run(mp, s) for s in ("layers", "whole", "32")}
        out["layers x2"] = _run(mp, "layers", per_program=2)
        return out
    finally:
        mp.undo()


def test_chain_and_whole_forward_give_the_same_bits(runs):
    (chain, llm_chain), (whole, llm_whole) = runs["layers"], runs["whole"]
    assert _same(chain, whole)
    # each ran what it says: the chain's programs, or only whole forwards
    assert {k[0] for k in llm_chain.engine.runner._aot} == {"embed", "block", "head", "sample"}
    assert {k[0] for k in llm_whole.engine.runner._aot} == {"forward", "sample"}


def test_the_bits_check_sees_a_tiny_weight_change(runs, monkeypatch):
    """Control: the same comparison fails when the last layer's down projection is scaled by
    1 + 2**-12 (the check can fail on a change far below any tolerance)."""
    chain, _ = runs["layers"]
    model = _model()
    w = model.layers[-1].mlp.w_down
    w[...] = w[...] * jnp.float32(1 + 2**-12)
    changed, _ = _run(monkeypatch, "whole", model)
    assert not _same(chain, changed)


def test_chain_from_a_token_bucket(runs):
    """``BIJAX_STEP_PROGRAMS=32``: 16-token steps run the whole forward, longer ones the chain -
    and the bits are the chain's."""
    outs, llm = runs["32"]
    assert _same(outs, runs["layers"][0])
    keys = set(llm.engine.runner._aot)
    assert any(k[0] == "forward" and k[2] == 16 for k in keys)
    assert any(k[0] == "block" and k[2] == 32 for k in keys)
    assert not any(k[0] == "forward" and k[2] == 32 for k in keys)
    assert not any(k[0] == "block" and k[2] == 16 for k in keys)


def test_two_layers_a_block_program(runs):
    """``BIJAX_LAYERS_PER_PROGRAM=2``: one block program runs both layers of ``tiny`` (one call
    a step) - the chain's bits."""
    outs, llm = runs["layers x2"]
    assert _same(outs, runs["layers"][0])
    runner = llm.engine.runner
    assert runner.layout.runs == ((0, 1),) and runner.layout.groups == (0,)
    assert {k[0] for k in runner._aot} == {"embed", "block", "head", "sample"}


def test_runs_of_layers_and_their_programs():
    """Three layers, two a program: runs (0, 1) and (2,), each its own program (other
    arguments); one a program: one program for all three."""
    import dataclasses

    import jax
    from flax import nnx

    from models.paged import init_kv_cache

    cfg = dataclasses.replace(preset("tiny"), num_layers=3)
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Llama(cfg, dtype=jnp.float32, seed=0)))
    cache = jax.eval_shape(lambda: init_kv_cache(cfg, 8, 16, jnp.float32))
    two = step_programs.Layout.of(graphdef, params, cache, 2)
    assert two.runs == ((0, 1), (2,)) and two.groups == (0, 1)
    assert [len(two.graphdefs[g]) for g in (0, 1)] == [2, 1]
    one = step_programs.Layout.of(graphdef, params, cache)
    assert one.runs == ((0,), (1,), (2,)) and one.groups == (0, 0, 0)


def test_layers_per_program_is_checked(monkeypatch):
    monkeypatch.delenv("BIJAX_LAYERS_PER_PROGRAM", raising=False)
    for platform, want in (("cpu", 1), ("gpu", 4)):
        monkeypatch.setattr(step_programs.jax, "default_backend", lambda p=platform: p)
        assert step_programs.layers_per_program() == want
    monkeypatch.setenv("BIJAX_LAYERS_PER_PROGRAM", "4")
    assert step_programs.layers_per_program() == 4
    for bad in ("0", "two", "-2"):
        monkeypatch.setenv("BIJAX_LAYERS_PER_PROGRAM", bad)
        with pytest.raises(ValueError, match="BIJAX_LAYERS_PER_PROGRAM"):
            step_programs.layers_per_program()


def test_the_setting_is_checked_and_defaults_by_platform(monkeypatch):
    monkeypatch.delenv("BIJAX_STEP_PROGRAMS", raising=False)
    # CPU: every bucket as the chain; GPU: tiered (the chain first, then the whole forward)
    for platform, tiered in (("cpu", False), ("gpu", True)):
        monkeypatch.setattr(step_programs.jax, "default_backend", lambda p=platform: p)
        assert step_programs.chain_from() == 0 and step_programs.tiered() == tiered
    for value, want in (("layers", 0), ("whole", None), ("256", 256), ("tiered", 0)):
        monkeypatch.setenv("BIJAX_STEP_PROGRAMS", value)
        assert step_programs.chain_from() == want
        assert step_programs.tiered() == (value == "tiered")
    for bad in ("wholes", "-1", "1.5"):
        monkeypatch.setenv("BIJAX_STEP_PROGRAMS", bad)
        with pytest.raises(ValueError, match="BIJAX_STEP_PROGRAMS"):
            step_programs.chain_from()


def test_layer_switches_take_0_or_1(monkeypatch):
    monkeypatch.delenv("BIJAX_LAYER_COPIES", raising=False)
    monkeypatch.setenv("BIJAX_LAYER_COMMAND_BUFFERS", "")  # empty: the default
    assert step_programs.layer_switches() == (False, True)
    monkeypatch.setenv("BIJAX_LAYER_COPIES", "1")
    monkeypatch.setenv("BIJAX_LAYER_COMMAND_BUFFERS", "0")
    assert step_programs.layer_switches() == (True, False)
    for name in ("BIJAX_LAYER_COPIES", "BIJAX_LAYER_COMMAND_BUFFERS"):
        monkeypatch.setenv(name, "off")
        with pytest.raises(ValueError, match=name):
            step_programs.layer_switches()
        monkeypatch.setenv(name, "0")


def test_warmup_reports_each_bucket_once_when_its_programs_are_ready(monkeypatch):
    """Buckets share the chain's embedding and head programs (by token count): each bucket's
    ``progress`` comes once, after all of its programs; a second warm-up compiles nothing and
    reports them all again (as ready)."""
    from bijax import model_runner

    monkeypatch.setattr(model_runner, "_shared", {})  # nothing from the other engines here
    monkeypatch.setenv("BIJAX_STEP_PROGRAMS", "layers")
    llm = bijax.LLM(_model(), max_model_len=64, max_num_seqs=32, max_num_batched_tokens=32, num_kv_blocks=12)
    runner = llm.engine.runner
    pairs = runner.bucket_pairs()
    assert len({t for _, t in pairs}) < len(pairs)  # two buckets share a token count
    seen, ready = [], set()

    def progress(s, t):
        seen.append((s, t))
        keys = runner.forward_keys(s, t, s)
        assert all(k in runner._aot for k in keys)  # every program of the bucket is there
        ready.update(keys)

    runner.warmup(pairs, progress=progress)
    assert sorted(seen) == sorted(pairs)  # each once
    made = runner.programs_made
    seen.clear()
    runner.warmup(pairs, progress=progress)
    assert sorted(seen) == sorted(pairs) and runner.programs_made == made


def test_tiered_runs_the_chain_then_the_whole_forward_with_the_same_bits(runs, monkeypatch):
    """``BIJAX_STEP_PROGRAMS=tiered``: each bucket's first step runs the chain and queues the
    bucket's whole forward, compiled in the background; a step whose bucket has no compiled
    forward yet runs in a larger bucket that has one (here: decoding in the prefill's 32-token
    bucket) while its own chain compiles in another background thread. Once all are ready the
    same requests run whole forwards of their own buckets only - the chain's bits throughout,
    in any bucket. A later engine whose whole forwards an earlier start exported (the step
    cache) warms them up directly, no chain and nothing left for the background."""
    from bijax import model_runner

    monkeypatch.setattr(model_runner, "_shared", {})  # compiled here, not taken from the other engines
    first, llm = _run(monkeypatch, "tiered")
    before = llm.engine.stats()
    assert before.num_chain_steps > 0  # no whole forward was ready for a bucket's first step
    assert before.num_larger_bucket_steps > 0  # decode steps ran in the 32-token bucket meanwhile
    llm.wait_for_upgrades()
    runner = llm.engine.runner
    queued = {k for k in runner._upgrading}
    assert all(k in runner._aot for k in queued)
    wholes = {k for k in queued if k[0] == "forward"}
    assert wholes and ("embed", 16) in queued  # whole forwards, and the decode bucket's chain
    assert runner.programs_upgraded == len(queued) == llm.engine.stats().num_upgraded_programs
    compiled = model_runner.num_compiled_steps()
    llm.reset_prefix_cache()  # the same steps, so the same buckets, again
    again = [o.outputs[0] for o in llm.generate(PROMPTS, SPS, use_tqdm=False)]
    after = llm.engine.stats()
    assert model_runner.num_compiled_steps() == compiled  # nothing compiled in the second run
    assert after.num_chain_steps == before.num_chain_steps  # every step of the second run: whole
    assert after.num_larger_bucket_steps == before.num_larger_bucket_steps  # ... in its own bucket
    assert after.num_whole_steps > before.num_whole_steps
    assert _same(first, runs["layers"][0]) and _same(again, runs["layers"][0])

    monkeypatch.setattr(model_runner, "_shared", {})
    other = bijax.LLM(
        _model(), max_model_len=128, max_num_seqs=2, max_num_batched_tokens=32, num_kv_blocks=24
    )
    pairs = sorted({(k[1], k[2]) for k in wholes})
    hits, misses = compile_cache.counts()
    other.engine.runner.warmup(pairs)
    kinds = {k[0] for k in other.engine.runner._aot}
    assert kinds == {"forward", "sample"} and not other.engine.runner._upgrading
    # ... and loads them from the persistent cache: the whole forwards lowered after steps (the
    # KV cache committed to its device by then) have the text of ones lowered before any step.
    assert compile_cache.counts()[1] == misses and compile_cache.counts()[0] >= hits + len(wholes)
    # (Control: lowered for the arrays themselves, the two caches give different texts.)
    fresh, used = other.engine.runner.cache[0][0], llm.engine.runner.cache[0][0]
    texts = [jax.jit(lambda c: c + 1).lower(*leaves).as_text() for leaves in ([fresh], [used])]
    assert texts[0] != texts[1]
    specs = [jax.jit(lambda c: c + 1).lower(*step_cache._specs(x)).as_text() for x in ([fresh], [used])]
    assert specs[0] == specs[1]


def test_a_bucket_filled_in_the_background_gets_its_sampling_programs_too(monkeypatch):
    """Tiered: a step of a smaller bucket (16 sequences) runs in a larger compiled one (32)
    while its own chain compiles in the background - and its own sampled rows' sampling programs
    with it: once the background compiles are done, the same request again compiles nothing
    (before, its first step in its own bucket compiled them: a compile inside a timed run)."""
    from bijax import model_runner

    monkeypatch.setattr(model_runner, "_shared", {})  # (the other engines' programs: not here)
    monkeypatch.setenv("BIJAX_STEP_PROGRAMS", "tiered")
    llm = bijax.LLM(_model(), max_model_len=64, max_num_seqs=32, max_num_batched_tokens=128, num_kv_blocks=24)
    runner = llm.engine.runner
    runner.warmup([(32, 128)])  # (the largest bucket only)
    prompts, sps = PROMPTS[:1], SPS[:1]
    llm.generate(prompts, sps, use_tqdm=False)
    assert llm.engine.stats().num_larger_bucket_steps > 0
    llm.wait_for_upgrades()
    assert ("sample", 16, 0, False) in runner._upgrading
    compiled = model_runner.num_compiled_steps()
    llm.reset_prefix_cache()
    llm.generate(prompts, sps, use_tqdm=False)
    assert model_runner.num_compiled_steps() == compiled
    llm.close()


def test_a_bucket_whose_background_compile_failed_compiles_when_its_steps_come(runs, monkeypatch):
    """Tiered, only the prompt's bucket warmed up (as ``bijax generate`` does): decoding runs in
    it while the decode bucket's chain (and whole forward) compile in the background. Where
    those compiles fail (a warning; ``wait_for_upgrades`` raises it), the bucket's later steps
    compile its chain themselves - not stuck in the larger bucket - with the same bits either
    way."""
    import threading

    from bijax import model_runner

    monkeypatch.setattr(model_runner, "_shared", {})  # (the other engines' decode programs: not here)
    monkeypatch.setenv("BIJAX_STEP_PROGRAMS", "tiered")
    monkeypatch.setenv("BIJAX_LAYERS_PER_PROGRAM", "1")
    kw = dict(max_model_len=128, max_num_seqs=2, max_num_batched_tokens=32, num_kv_blocks=24)
    llm = bijax.LLM(_model(), **kw)
    # (not the baseline's: its bits follow its bucket, so its steps wait for their own)
    assert (
        llm.engine.compiles_in_background
        and not bijax.LLM(_model(), invariant=False, **kw).engine.compiles_in_background
    )
    runner = llm.engine.runner
    llm.warmup(progress=False, step_tokens=[32])
    llm.wait_for_upgrades()  # (the prompt's whole forward, compiled before the failures begin)
    make = runner._make

    def failing(*a, **k):
        if threading.current_thread().name.startswith(("bijax-fill", "bijax-upgrade")):
            raise RuntimeError("no memory for this compile")
        return make(*a, **k)

    monkeypatch.setattr(runner, "_make", failing)
    prompts, sps = PROMPTS[:1], SPS[:1]
    with pytest.warns(RuntimeWarning, match="in the background failed .*no memory for this compile"):
        first = [o.outputs[0] for o in llm.generate(prompts, sps, use_tqdm=False)]
        with pytest.raises(RuntimeError, match="no memory for this compile"):
            llm.wait_for_upgrades()
    assert llm.engine.stats().num_larger_bucket_steps > 0
    before = llm.engine.stats().num_larger_bucket_steps
    llm.reset_prefix_cache()
    again = [o.outputs[0] for o in llm.generate(prompts, sps, use_tqdm=False)]
    # every step in its own bucket now: the decode bucket's chain compiled here, in this thread
    # (in the first run already, once the failure was seen, or in this one)
    assert llm.engine.stats().num_larger_bucket_steps == before and ("embed", 16) in runner._aot
    assert ("forward", 2, 16, 2) not in runner._aot  # (its background compile failed too)
    assert _same(first, runs["layers"][0][:1]) and _same(again, runs["layers"][0][:1])
    llm.close()  # (no compile of this engine's outlives the test)


def test_no_upgrade_traced_under_settings_the_background_thread_lacks(runs):
    """A whole forward queued inside a ``with jax.default_matmul_precision(...)`` block (a
    setting of that thread only) is not compiled in the background thread, which would trace it
    without the setting: its bucket keeps the chain. Control: queued outside, it compiles."""
    import warnings

    runner = runs["layers"][1].engine.runner
    inside, outside = ("forward", 1, 16, 1), ("forward", 2, 16, 2)
    assert inside not in runner._aot and outside not in runner._aot
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the background's note that it kept the chain
        with jax.default_matmul_precision("highest"):
            runner._upgrade([inside])
        runner.wait_upgrades()
    assert inside in runner._kept_chain and inside not in runner._aot
    runner._upgrade([outside])
    runner.wait_upgrades()
    assert outside in runner._aot and runner.pending_upgrades() == 0


def test_tiered_is_one_process_only_and_stops_before_the_pools_join(monkeypatch):
    """Across processes every process must run the same programs each step: the default is
    then the whole forward and ``tiered`` an error. At exit the background stops starting
    compiles before the thread pools are joined (threading runs its exit hooks last registered
    first)."""
    import concurrent.futures.thread
    import threading

    from bijax import model_runner

    monkeypatch.setattr(step_programs.jax, "default_backend", lambda: "gpu")
    monkeypatch.delenv("BIJAX_STEP_PROGRAMS", raising=False)
    assert step_programs.tiered()
    monkeypatch.setattr(step_programs.jax, "process_count", lambda: 2)
    assert not step_programs.tiered() and step_programs.chain_from() is None
    monkeypatch.setenv("BIJAX_STEP_PROGRAMS", "tiered")
    with pytest.raises(ValueError, match="one process only"):
        step_programs.tiered()
    hooks = [getattr(h, "func", h) for h in threading._threading_atexits]  # (functools.partials)
    assert hooks.index(model_runner._stopping.set) > hooks.index(concurrent.futures.thread._python_exit)
