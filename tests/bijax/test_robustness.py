"""Prefix cache hit vs miss, preemption vs none, restart, cross-commit golden bits, soak."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import numpy as np
import pytest

import bijax
from bijax import SamplingParams as SP
from bijax.digest import device_class
from tests.bijax import golden
from tests.conftest import bits

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _llm(**kw):
    """tests/bijax/test_engine.py's `tiny` engine settings (so the compiled steps are shared)."""
    from tests.bijax.test_engine import shared_model as _model

    args = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=160, seed=1)
    return bijax.LLM(_model("tiny")[0], **(args | kw))


def _same(a, b):
    return all(
        x.token_ids == y.token_ids and np.array_equal(bits(x.logprobs), bits(y.logprobs))
        for p, q in zip(a, b, strict=True)
        for x, y in zip(p.outputs, q.outputs, strict=True)
    )


def _shared_prefix_requests():
    rng = np.random.default_rng(21)
    system = list(map(int, rng.integers(3, 500, 53)))  # 3 full blocks + 5 tokens
    prompts = [system + list(map(int, rng.integers(3, 500, n))) for n in (4, 11, 30)]
    params = [SP(temperature=0.8, max_tokens=6, seed=i, ignore_eos=True) for i in range(3)]
    return prompts, params


def test_prefix_cache_hit_equals_miss():
    prompts, params = _shared_prefix_requests()
    miss = _llm(enable_prefix_caching=False).generate(prompts, params, use_tqdm=False)
    llm = _llm()
    first = llm.generate(prompts[:1], params[:1], use_tqdm=False)
    hits_before = llm.engine.blocks.hit_blocks
    again = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.blocks.hit_blocks - hits_before >= 3 * 3  # every prompt reused the system prefix
    assert _same(again, miss) and _same(first, miss[:1])
    # score over a cached prefix too
    o = again[1]
    lp = llm.score([o.prompt_token_ids + o.token_ids], [len(o.prompt_token_ids)], temperature=0.8)[0]
    np.testing.assert_array_equal(bits(lp), bits(o.logprobs))
    # the counters are since the engine was built: a smaller pool does not zero them
    hits = llm.engine.stats().prefix_cache_hit_blocks
    llm.engine.limit_kv_pool(40)
    assert llm.engine.stats().prefix_cache_hit_blocks == hits > 0


def test_preemption_equals_no_preemption():
    rng = np.random.default_rng(22)
    prompts = [list(map(int, rng.integers(3, 500, int(rng.integers(20, 40))))) for _ in range(6)]
    params = [SP(temperature=0.9, max_tokens=20, seed=i, ignore_eos=True) for i in range(6)]
    roomy = _llm().generate(prompts, params, use_tqdm=False)
    small = _llm(num_kv_blocks=12)  # 11 usable blocks of 16 tokens for 6 requests of up to 60
    tight = small.generate(prompts, params, use_tqdm=False)
    assert small.engine.scheduler.num_preemptions > 0
    assert _same(tight, roomy)
    assert small.engine.blocks.num_free == 11  # every block back
    with pytest.raises(ValueError, match="KV blocks"):
        small.generate([list(range(3, 200))], SP(max_tokens=8), use_tqdm=False)


def test_restart_gives_the_same_bits():
    code = (
        "from tests.bijax import golden; import bijax; "
        "llm = bijax.LLM('tiny', **golden.ENGINE); "
        "p, s = golden._requests(); print(golden.digest(llm.generate(p, s, use_tqdm=False)))"
    )
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True, cwd=REPO
    )
    prompts, params = golden._requests()
    assert out.stdout.strip().splitlines()[-1] == golden.digest(
        _llm().generate(prompts, params, use_tqdm=False)
    )


# JAX settings a caller may set globally that change what JAX computes (or refuse code that is
# correct under JAX's defaults): bijax pins its own (``pallas_kernels.runtime.pinned_config``).
_HOSTILE = (
    ("jax_disable_jit", True),
    ("jax_threefry_partitionable", False),
    ("jax_default_prng_impl", "unsafe_rbg"),
    ("jax_legacy_prng_key", "error"),
    ("jax_default_matmul_precision", "bfloat16"),
    ("jax_numpy_rank_promotion", "raise"),
    ("jax_numpy_dtype_promotion", "strict"),
)
_NOISE = "import jax; print(jax.numpy.asarray(jax.random.uniform(jax.random.key(0), (8,))).view('uint32').tolist())"


def test_a_callers_jax_settings_change_no_bits(tmp_path):
    """A trainer's global JAX settings changed bijax's bits silently (``threefry_partitionable=
    False``: other sampled tokens and other preset weights; ``disable_jit``: other logprobs, and
    generate failed inside JAX) or broke it deep in a kernel (``numpy_rank_promotion="raise"``).
    Under all of them at once, set before bijax is imported, a fresh process (no exported
    programs to read back: it traces everything) gives the suite's digest of this process, and
    ``bijax.logprobs`` equals its own generate. The control: the same settings give JAX's own
    random numbers other bits in that process."""
    code = "\n".join(
        [
            "import json, jax, numpy as np",
            *(f"jax.config.update({k!r}, {v!r})" for k, v in _HOSTILE),
            "from tests.bijax import golden; import bijax",
            "llm = bijax.LLM('tiny', **golden.ENGINE)",
            "p, s = golden._requests(); outs = llm.generate(p, s, use_tqdm=False)",
            "o = outs[1].outputs[0]; toks = np.array([p[1] + list(o.token_ids)], np.int32)",
            "lp = np.asarray(bijax.logprobs(llm.model, toks, temperature=0.8))[0, len(p[1]):]",
            "same = np.array_equal(lp.view(np.uint32), np.asarray(o.logprobs, np.float32).view(np.uint32))",
            _NOISE.replace("print(", "noise = ("),
            "print(json.dumps([golden.digest(outs), bool(same), noise]))",
        ]
    )
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu", BIJAX_CACHE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    digest, logprobs_same, noise = __import__("json").loads(out.stdout.strip().splitlines()[-1])
    defaults = subprocess.run(
        [sys.executable, "-c", _NOISE], capture_output=True, text=True, env=env, check=True
    ).stdout.strip()
    assert str(noise).replace(" ", "") != defaults.replace(" ", "")  # the control: they took effect
    prompts, params = golden._requests()
    assert digest == golden.digest(_llm().generate(prompts, params, use_tqdm=False))
    assert logprobs_same


def test_golden_bits_unchanged_unless_numerics_version_bumped():
    record = golden.load()
    assert record["numerics_version"] == bijax.NUMERICS_VERSION, (
        f"NUMERICS_VERSION is {bijax.NUMERICS_VERSION} but golden.json is for {record['numerics_version']}: "
        "regenerate it with `python -m tests.bijax.golden --write`"
    )
    from tests.bijax.test_engine import shared_llm as engine_llm  # shares its compiled SmolLM2 steps

    now = golden.current_hashes({"tiny": _llm(), "smollm2-135m": engine_llm("smollm2")})
    golden.verify(now, record, device_class())


def test_golden_verify_recorded_and_unrecorded_classes():
    """The decision logic on fabricated records: a recorded class must match; an unrecorded one
    passes only when fresh processes agree, and says so with a GoldenNotRecorded warning."""
    now = {"tiny": "a", "smollm2-135m": "b"}
    record = {"numerics_version": bijax.NUMERICS_VERSION, "records": {"cpu:x:jaxlib-0": dict(now)}}
    assert golden.verify(now, record, "cpu:x:jaxlib-0") == "recorded"
    with pytest.raises(AssertionError, match="without a NUMERICS_VERSION bump"):
        golden.verify(now | {"tiny": "c"}, record, "cpu:x:jaxlib-0")
    with pytest.warns(golden.GoldenNotRecorded, match="no golden digest is recorded for device class 'gpu:y"):
        assert golden.verify(now, record, "gpu:y:jaxlib-0", fresh=lambda: dict(now)) == "unrecorded"
    answers = iter([dict(now), now | {"tiny": "d"}])
    with pytest.raises(AssertionError, match="two fresh processes disagree"):
        golden.verify(now, record, "gpu:y:jaxlib-0", fresh=lambda: next(answers))


def test_golden_digest_notices_one_bit():
    """Negative control: flipping one logprob bit changes the digest."""
    prompts, params = golden._requests()
    outs = _llm().generate(prompts[:1], params[:1], use_tqdm=False)
    before = golden.digest(outs)
    outs[0].outputs[0].logprobs.view(np.uint32)[0] ^= 1
    assert golden.digest(outs) != before


def test_soak_random_arrivals():
    """500 requests arriving at random steps with random lengths and sampling parameters,
    pushed through Engine.step; one bad request among them is rejected alone. Every request
    finishes, equals its run in other batches (all of them again in one generate call) bit for
    bit, and every KV block is free at the end."""
    rng = np.random.default_rng(23)
    n = 500
    llm = _llm()
    eng = llm.engine
    prompts = [list(map(int, rng.integers(3, 500, int(rng.integers(1, 40))))) for _ in range(n)]
    kinds = [
        lambda: SP(temperature=0, max_tokens=int(rng.integers(1, 6))),
        lambda: SP(
            temperature=0.9, top_p=0.9, max_tokens=int(rng.integers(1, 6)), seed=int(rng.integers(1000))
        ),
        lambda: SP(temperature=1.1, top_k=10, max_tokens=int(rng.integers(1, 6))),
        lambda: SP(temperature=0.7, min_p=0.05, n=2, max_tokens=int(rng.integers(1, 4))),
    ]
    params = [kinds[int(rng.integers(len(kinds)))]() for _ in range(n)]
    arrival = np.sort(rng.integers(0, 400, n))
    bad_at = 137
    done, seeds, step, i = {}, {}, 0, 0
    while i < n or eng.has_unfinished_requests():
        while i < n and arrival[i] <= step:
            if i == bad_at:
                with pytest.raises(ValueError, match="outside the vocabulary"):
                    eng.add_request(f"soak-{i}", [1, 2, 10**6], params[i])
            else:
                seeds[i] = eng.add_request(f"soak-{i}", prompts[i], params[i])
            i += 1
        for out in eng.step():
            if out.finished:
                done[int(out.request_id.split("-")[1])] = out
        step += 1
    assert sorted(done) == [k for k in range(n) if k != bad_at]
    assert eng.blocks.num_free == eng.config.num_kv_blocks - 1
    # The reference: every request again in one generate call (another schedule and other
    # batches entirely; one call, not 499: CI time), with the seed each one drew.
    keys = sorted(done)
    again = llm.generate(
        [prompts[k] for k in keys],
        [dataclasses.replace(params[k], seed=seeds[k]) for k in keys],
        use_tqdm=False,
    )
    for k, ref in zip(keys, again, strict=True):
        assert _same([done[k]], [ref]), k


def test_a_head_dim_the_kernels_do_not_take_is_named_when_the_engine_is_made():
    """A model with head_dim 32 built an invariant engine and failed at its first step, deep in
    the attention op; now the engine refuses it (the XLA path takes it)."""
    import dataclasses

    import jax.numpy as jnp

    from models.configs import preset
    from models.llama import Llama

    model = Llama(dataclasses.replace(preset("tiny"), head_dim=32), dtype=jnp.float32, seed=0)
    with pytest.raises(
        ValueError, match="the model's head_dim is 32: the invariant attention kernels take 64 or 128"
    ):
        bijax.LLM(model, max_model_len=64, num_kv_blocks=16)
    assert (
        bijax.LLM(model, invariant=False, max_model_len=64, num_kv_blocks=16).engine.config.invariant is False
    )


def test_a_failing_score_gives_its_blocks_back(monkeypatch):
    """``LLM.score`` interrupted midway (Ctrl-C, a device error) kept its sequences' KV blocks
    for good, and every later request failed ("the KV pool cannot hold the next request"). Now
    the pool is whole again and the next score has the same bits as before."""
    llm = _llm()
    rng = np.random.default_rng(4)
    seqs = [list(map(int, rng.integers(3, 500, 150))) for _ in range(4)]
    before = llm.score(seqs, [1] * 4)
    free = llm.engine.stats().num_free_blocks
    runner = llm.engine.runner
    real, calls = runner.score_step, []

    def fails_at_the_third_step(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(runner, "score_step", fails_at_the_third_step)
    with pytest.raises(KeyboardInterrupt):
        llm.score(seqs, [1] * 4)
    monkeypatch.setattr(runner, "score_step", real)
    assert llm.engine.stats().num_free_blocks == free and not llm.engine.has_unfinished_requests()
    again = llm.score(seqs, [1] * 4)
    assert all(np.array_equal(bits(x), bits(y)) for x, y in zip(again, before, strict=True))


def test_a_request_larger_than_a_limited_pool_is_refused():
    """After ``Engine.limit_kv_pool`` a request was still checked against the whole pool: one
    larger than the limited pool was accepted and preempted itself forever (a livelock). Now
    it is refused, also as a ValidPrompt checked before the limit."""
    llm = _llm(num_kv_blocks=64)
    eng = llm.engine
    params = SP(max_tokens=40)
    valid = eng.validate([5] * 10, params)  # 50 tokens: 4 blocks of 16, fine in the whole pool
    eng.limit_kv_pool(3)  # 2 usable blocks
    with pytest.raises(ValueError, match="needs 4 KV blocks; the pool has 2"):
        eng.validate([5] * 10, params)
    with pytest.raises(ValueError, match="needs 4 KV blocks; the pool has 2"):
        eng.add_request("r", valid)
    assert not eng.has_unfinished_requests()


def test_one_call_at_a_time_and_release_keeps_the_other_outputs():
    """A second generate on one LLM - from inside an ``on_output`` callback, or another thread -
    is refused at once with a clear RuntimeError, and the first call's outputs are intact.
    ``Engine.release`` of one request keeps the final outputs of the others (the next step
    returns them). A 1-D numpy array is one prompt of token ids; a non-iterable is named."""
    import threading

    llm = bijax.LLM("tiny", dtype=np.float32, max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32,
                    num_kv_blocks=20)  # fmt: skip
    sp = SP(temperature=0.8, seed=3, max_tokens=4, ignore_eos=True)
    solo = llm.generate([[5, 6, 7, 8]], sp, use_tqdm=False)[0]
    errors = []

    def reenter(i, out):
        try:
            llm.generate([[1, 2, 3]], sp, use_tqdm=False)
        except RuntimeError as e:
            errors.append(str(e))

    got = llm.generate([[5, 6, 7, 8]], sp, use_tqdm=False, on_output=reenter)[0]
    assert errors and all("already running" in e for e in errors)
    assert got.token_ids == solo.token_ids and np.array_equal(bits(got.logprobs), bits(solo.logprobs))
    started, release = threading.Event(), threading.Event()

    def slow(i, out):
        started.set()
        release.wait(30)

    t = threading.Thread(target=lambda: llm.generate([[5, 6, 7, 8]], sp, use_tqdm=False, on_output=slow))
    t.start()
    assert started.wait(60)
    with pytest.raises(RuntimeError, match="another thread"):
        llm.generate([[1, 2, 3]], sp, use_tqdm=False)
    with pytest.raises(RuntimeError, match="already running"):
        llm.score([[5, 6, 7, 8]], [2])
    release.set()
    t.join(60)
    # numpy prompts: 1-D is one prompt (== the list), and a bare int is named
    (arr,) = llm.generate(np.array([5, 6, 7, 8]), sp, use_tqdm=False)
    assert arr.token_ids == solo.token_ids
    with pytest.raises(TypeError, match="prompts must be a str"):
        llm.generate(5, sp, use_tqdm=False)
    # release one request: the other's final output still comes out of the next step
    e = llm.engine
    e.add_request("keep", e.validate([5, 6, 7, 8], sp))
    e.add_request("drop", e.validate([4, 5, 6], SP(max_tokens=20, ignore_eos=True)))
    e.step()
    e.release(["drop"])
    assert e.has_unfinished_requests()  # (the kept output is still to be returned)
    outs = []
    while e.has_unfinished_requests():
        outs += e.step()
    keep = [o for o in outs if o.request_id == "keep" and o.finished]
    assert len(keep) == 1 and keep[0].outputs[0].token_ids == solo.token_ids
    assert not [o for o in outs if o.request_id == "drop"]
    llm.close()


@pytest.mark.parametrize("form", ["layers", "whole"])
def test_ctrl_c_right_after_a_program_took_the_cache(monkeypatch, form):
    """A real SIGINT that arrives just after a forward program returned - the KV cache it was
    given already donated, the one it returned not yet stored - is held until the cache is
    stored: generate raises KeyboardInterrupt and the engine runs on with the same bits (the
    runner held deleted arrays, and every later step failed)."""
    import signal

    # Ctrl-C as an interactive session takes it (a job started in the background with "&"
    # inherits SIGINT ignored, and Python then installs no handler of its own)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _ctrl_c_after_a_program(monkeypatch, form)
    finally:
        signal.signal(signal.SIGINT, previous)


def _ctrl_c_after_a_program(monkeypatch, form):
    import signal

    monkeypatch.setenv("BIJAX_STEP_PROGRAMS", form)
    llm = _llm()
    sp = SP(temperature=0.8, seed=5, max_tokens=6, ignore_eos=True)
    ref = llm.generate([[5, 6, 7, 8, 9]], sp, use_tqdm=False)
    runner, armed = llm.engine.runner, [True]
    real = runner._layer if form == "layers" else runner._program

    def interrupted(*a):
        program = real(*a)
        if not (form == "layers" or a[0][0] == "forward"):
            return program

        def call(*args, **kw):
            out = program(*args, **kw)
            if armed[0]:
                armed[0] = False
                signal.raise_signal(signal.SIGINT)  # Ctrl-C now
            return out

        return call

    monkeypatch.setattr(runner, "_layer" if form == "layers" else "_program", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([[5, 6, 7, 8, 9]], sp, use_tqdm=False)
    assert not armed[0] and not llm.engine.has_unfinished_requests()
    monkeypatch.undo()
    assert _same(llm.generate([[5, 6, 7, 8, 9]], sp, use_tqdm=False), ref)
    llm.close()


def test_engine_level_requests_and_generate():
    """Requests added with ``engine.add_request`` are never lost: ``generate`` refuses to run
    (it would step them and drop their outputs); an id whose final output the next step is
    yet to return is not taken again; ``abort`` / ``release`` name a wrong argument's type (a
    str to release was read as a list of one-character ids); requests an ``on_output`` callback
    adds run to their end and their final outputs come out of the next ``step()``."""
    llm = _llm()
    e = llm.engine
    sp = SP(temperature=0.8, seed=2, max_tokens=3, ignore_eos=True)
    e.add_request("job-1", [5, 6, 7], sp)
    with pytest.raises(RuntimeError, match="requests this call did not add"):
        llm.generate([[1, 2, 3]], sp, use_tqdm=False)
    e.add_request("long", [4, 5, 6], SP(max_tokens=20, ignore_eos=True))
    e.step()
    with pytest.raises(TypeError, match="request_ids must be a list of str, got str"):
        e.release("long")
    with pytest.raises(TypeError, match="request_id must be a str, got list"):
        e.abort(["long"])
    e.release(["long"])  # job-1 runs to its end; its output waits for the next step()
    with pytest.raises(ValueError, match=r"'job-1' finished, but the next step\(\) has yet to return"):
        e.add_request("job-1", [9, 9, 9], sp)
    with pytest.raises(RuntimeError, match="requests this call did not add"):
        llm.generate([[1, 2, 3]], sp, use_tqdm=False)
    outs = []
    while e.has_unfinished_requests():
        outs += e.step()
    (job,) = [o for o in outs if o.finished]
    assert job.request_id == "job-1" and job.prompt_token_ids == [5, 6, 7]
    solo = llm.generate([[5, 6, 7]], sp, use_tqdm=False)[0]  # idle again: generate runs
    assert _same([job], [solo])
    # an on_output callback that adds an engine request: generate runs it too, and hands its
    # final output back to the engine (the next step() returns it) - it was dropped
    added = []

    def add_one(i, out):
        if not added:
            added.append(e.add_request("from-callback", [5, 6, 7], sp))

    (mine,) = llm.generate([[1, 2, 3]], sp, use_tqdm=False, on_output=add_one)
    assert added and mine.prompt_token_ids == [1, 2, 3]
    assert e.has_unfinished_requests()
    (theirs,) = e.step()
    assert theirs.request_id == "from-callback" and theirs.finished and _same([theirs], [solo])
    assert not e.has_unfinished_requests()
    with pytest.raises(TypeError, match="outputs must be a list of RequestOutput"):
        e.hand_back(theirs)
    llm.close()


def test_set_weights_checks_and_a_swap_holds_the_other_llms(monkeypatch):
    """``Engine.set_weights`` refuses a model its steps cannot run (config, dtype), naming the
    difference, before anything changes; ``update_weights`` holds the other LLMs on the model
    while it swaps (a generate starting meanwhile in another of them ran, and that LLM kept the
    old weights); deleted weights with requests in flight say what to do."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    import bijax.llm
    from models.configs import preset
    from models.llama import Llama, param_state

    a = _llm()
    b = bijax.LLM(
        a.model, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=160, seed=1
    )
    sp = SP(temperature=0.8, seed=4, max_tokens=4, ignore_eos=True)
    before = a.generate([[5, 6, 7]], sp, use_tqdm=False)
    tiny = preset("tiny")
    with pytest.raises(ValueError, match=r"the new model's weights\['embed'\] has shape \(300, "):
        a.engine.set_weights(Llama(dataclasses.replace(tiny, vocab_size=300), dtype=jnp.float32))
    with pytest.raises(
        ValueError, match=r"attention heads .* \(8, 4, 128\) differ from the engine's \(16, 8, 64\)"
    ):
        # (the same weight shapes, another KV cache)
        a.engine.set_weights(
            Llama(dataclasses.replace(tiny, num_heads=8, num_kv_heads=4, head_dim=128), dtype=jnp.float32)
        )
    with pytest.raises(ValueError, match="has dtype bfloat16, the engine's is float32"):
        a.engine.set_weights(Llama(tiny, dtype=jnp.bfloat16))
    with pytest.raises(TypeError, match="model must be a models.Llama"):
        a.engine.set_weights(param_state(a.model))
    assert _same(a.generate([[5, 6, 7]], sp, use_tqdm=False), before)  # nothing changed
    # during a's swap, b is held: its generate is refused (it ran before, on the old weights)
    seen, real = [], bijax.llm.non_finite

    def b_generates(tree):
        try:
            b.generate([[5, 6, 7]], sp, use_tqdm=False)
            seen.append("ran")
        except RuntimeError as e:
            seen.append(str(e))
        return real(tree)

    monkeypatch.setattr(bijax.llm, "non_finite", b_generates)
    new = param_state(Llama(tiny, dtype=jnp.float32, seed=9))
    a.update_weights(new)
    assert len(seen) == 1 and "already running" in seen[0], seen
    monkeypatch.undo()
    moved = a.generate([[5, 6, 7]], sp, use_tqdm=False)
    assert not _same(moved, before) and _same(b.generate([[5, 6, 7]], sp, use_tqdm=False), moved)
    # deleted weights (donated to a train step) with a request in flight: abort, then update
    b.close()
    a.engine.add_request("r", [5, 6, 7], sp)
    for leaf in jax.tree_util.tree_leaves(param_state(a.model)):
        leaf.delete()
    with pytest.raises(RuntimeError, match=r"after aborting the 1 request\(s\) in flight"):
        a.engine.step()
    a.engine.release(["r"])
    a.update_weights(param_state(Llama(tiny, dtype=jnp.float32, seed=9)))  # (``new``'s arrays are deleted)
    assert _same(a.generate([[5, 6, 7]], sp, use_tqdm=False), moved)
    a.close()
