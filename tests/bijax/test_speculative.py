"""Speculative decoding gives the bits of plain decoding (token ids, float32 logprobs, top
logprobs), for prompt-lookup drafts and draft models, under sampling, n > 1, stop conditions,
chunked prefill, other requests in the batch, preemption, prefix-cache hits and tensor
parallelism; drafts are accepted where the output repeats, and the steps are fewer. Negative
control: on the XLA path (invariant=False) speculation changes the bits.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np
import pytest

import bijax
from benchmarks.speculative import cycle_prompt, looping_weights
from bijax import SamplingParams as SP
from bijax.sequence import PENDING
from bijax.speculative import (
    ADAPT_BACKOFF,
    PROBE_EVERY,
    PROBE_MAX,
    PROBE_TRIES,
    PROMPT_LOOKUP_LIMIT,
    NgramIndex,
    SpeculativeConfig,
    Speculator,
    ngram_propose,
)
from models.configs import preset
from models.llama import Llama
from tests.bijax.test_engine import shared_model
from tests.conftest import bits

KW = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=96, seed=1)
# adaptive off: drafts whenever possible (what the assertions on drafts and steps need; the
# adaptive rules change only which steps draft, never an output - tested on their own below)
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 1,
    "adaptive": False,
}


@functools.cache
def unrelated_draft():
    return Llama(preset("tiny"), dtype=jnp.float32, seed=123)


def spec_config(kind):
    model = shared_model("tiny")[0]
    return {
        "plain": None,
        "ngram": NGRAM,
        "ngram-adaptive": {**NGRAM, "adaptive": True},
        "draft-same": {
            "method": "draft_model",
            "model": model,
            "num_speculative_tokens": 3,
            "adaptive": False,
        },
        "draft-other": {"method": "draft_model", "model": unrelated_draft(), "num_speculative_tokens": 3},
    }[kind]


@functools.cache
def llm(kind, invariant=True, tp=1):
    model = shared_model("tiny-tp2" if tp > 1 else "tiny")[0]
    return bijax.LLM(
        model, invariant=invariant, tensor_parallel_size=tp, speculative_config=spec_config(kind), **KW
    )


def workload():
    """A mixed batch: a prompt that repeats (drafts accepted), random prompts, one longer than
    the token budget (chunked prefill), greedy and seeded top-k / top-p / min-p sampling, n = 2,
    top logprobs, a stop token."""
    rng = np.random.default_rng(3)
    loop = [int(t) for t in rng.integers(3, 512, 6)] * 5
    prompts = [loop, [int(t) for t in rng.integers(3, 512, 90)], [int(t) for t in rng.integers(3, 512, 11)]]
    params = [
        SP(temperature=0, max_tokens=40, logprobs=3),
        SP(temperature=0.9, top_k=30, top_p=0.9, max_tokens=24, seed=5, n=2),
        SP(temperature=1.1, min_p=0.05, max_tokens=30, seed=9, stop_token_ids=[7, 11]),
    ]
    return prompts, params


@functools.cache
def plain_outputs(invariant=True):
    prompts, params = workload()
    return llm("plain", invariant).generate(prompts, params, use_tqdm=False)


def same(a, b) -> bool:
    return all(
        x.token_ids == y.token_ids
        and np.array_equal(bits(x.logprobs), bits(y.logprobs))
        and x.top_logprobs == y.top_logprobs
        and x.finish_reason == y.finish_reason
        for ra, rb in zip(a, b, strict=True)
        for x, y in zip(ra.outputs, rb.outputs, strict=True)
    )


def totals(outs):
    return sum(o.metrics.num_draft_tokens for o in outs), sum(o.metrics.num_accepted_tokens for o in outs)


@pytest.mark.parametrize("kind", ["ngram", "ngram-adaptive", "draft-same", "draft-other"])
def test_speculative_equals_plain(kind, monkeypatch):
    eng = llm(kind).engine
    propose = eng.speculator.propose

    def on_host_tokens_only(chunks, blocks, budget):  # drafts never see a token still on the device
        assert all(seq.in_flight == 0 and PENDING not in seq.token_ids for seq, _ in chunks)
        return propose(chunks, blocks, budget)

    monkeypatch.setattr(eng.speculator, "propose", on_host_tokens_only)
    free = eng.stats().num_free_blocks
    prompts, params = workload()
    outs = llm(kind).generate(prompts, params, use_tqdm=False)
    assert same(outs, plain_outputs())
    # idle again: nothing in flight, no drafting decision or timing carried over, blocks back
    assert not eng._in_flight and not eng._drain and not eng._restart and eng._last_event is None
    assert eng.stats().num_free_blocks == free
    if kind == "ngram-adaptive":
        return  # (which steps draft follows measured times here)
    drafted, accepted = totals(outs)
    assert drafted > 0
    if kind == "draft-same":  # the target drafting for itself with the same keys: all accepted
        assert accepted == drafted
    if kind == "draft-other":
        assert accepted < drafted / 2
    # the needle: the repeating prompt alone == in the batch, and the prefix cache (hit now) too
    hits = llm(kind).engine.stats().prefix_cache_hit_blocks
    alone = llm(kind).generate(prompts[:1], params[:1], use_tqdm=False)
    assert same(alone, plain_outputs()[:1])
    assert llm(kind).engine.stats().prefix_cache_hit_blocks > hits


@functools.cache
def looping_llm(spec: bool, async_scheduling: bool = True):
    """tiny with looping weights (benchmarks/speculative.py): every layer's output projections
    zeroed, so greedy decoding walks a cycle of token -> next token, and a prompt made of that
    cycle is continued exactly - outputs that repeat their prompts. Its own model object
    (``update_weights`` writes into it); the step programs are shared with ``llm``'s."""
    model = Llama(preset("tiny"), dtype=jnp.float32, seed=0)
    own = bijax.LLM(
        model, speculative_config=NGRAM if spec else None, async_scheduling=async_scheduling, **KW
    )
    own.update_weights(looping_weights(model))
    return own


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_output_that_repeats_its_prompt_accepts_drafts_in_fewer_steps(async_scheduling):
    plain = looping_llm(False)
    prompt = cycle_prompt(plain, 11, 40, search=64)
    sp = SP(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)
    eng = looping_llm(True, async_scheduling).engine
    assert eng.async_scheduling == async_scheduling  # n-gram drafts run with async scheduling
    eng.add_request("loop", prompt, sp)
    steps = 0
    while eng.has_unfinished_requests():
        out = eng.step()
        steps += 1
    (out,) = out
    assert same([out], plain.generate([prompt], sp, use_tqdm=False))
    period = next(p for p in range(1, len(prompt)) if prompt[p:] == prompt[:-p])
    assert out.outputs[0].token_ids == [prompt[(len(prompt) + i) % period] for i in range(40)]  # its cycle
    assert out.metrics.acceptance_rate > 0.9
    # 40 tokens at up to 5 a step (1 + 4 drafts), plus the prompt's step (and, async, the steps
    # enqueued before the first drafted one): far fewer than plain decoding's 40
    assert steps <= 40 // 5 + (4 if async_scheduling else 2)
    st = eng.stats()  # the counters of the speculator's work (``benchmarks/speculative.py``)
    assert 0 < st.num_drafted_steps == out.metrics.num_verify_steps  # one request: a verify row a step
    assert st.num_drafted_steps + st.num_drained_steps_without_drafts == st.num_drained_steps or (
        not async_scheduling and st.num_drained_steps == 0
    )
    assert st.speculation_host_seconds > 0
    st = plain.engine.stats()  # control: an engine without speculation counts nothing
    assert st.speculation_host_seconds == 0 and st.num_drained_steps == st.num_drafted_steps == 0


def test_has_candidates_guesses_from_host_tokens_of_decoding_sequences():
    from bijax.sequence import Sequence

    sp = Speculator(SpeculativeConfig.create(NGRAM), llm("plain").config)

    ids = iter(range(100))

    def seq(prompt, out, *, in_flight=1, max_tokens=40, computed=None, finishing=False):
        s = Sequence(next(ids), "r", prompt, SP(max_tokens=max_tokens), 0, 0, 0)
        s.output_token_ids, s.in_flight, s.finishing = list(out), in_flight, finishing
        s.num_computed = len(s) - 1 if computed is None else computed  # in decode
        return s

    loop = [5, 6, 7, 8] * 4
    assert sp.has_candidates([seq(loop, [5, 6])])  # "5 6" was followed by "7 8": 2 > 1 in flight
    assert sp.has_candidates([seq(loop, [5, 6], in_flight=2)])  # ... more than 2 follow too
    assert not sp.has_candidates([seq([1, 2, 3, 4], [9])])  # no earlier match
    assert not sp.has_candidates([seq(loop, [5, 6], finishing=True)])  # ends on the device
    assert not sp.has_candidates([seq(loop, [], in_flight=1)])  # nothing generated on the host yet
    assert not sp.has_candidates([seq(loop, [5, 6], computed=3)])  # recomputing its prompt
    assert not sp.has_candidates([seq(loop, [5, 6], max_tokens=4)])  # 2 + 1 in flight + 1 = 4: no room
    assert not sp.has_candidates([seq([1, 2, 1, 2], [3])])  # the tail "3" never came before
    # "5" came before, followed by one token only: not more than the one in flight
    assert not sp.has_candidates([seq([4, 5], [5])]) and sp.has_candidates([seq([4, 5], [5], in_flight=0)])
    assert sp.has_candidates([seq([1, 2], [9]), seq(loop, [5, 6])])  # any sequence


def test_nothing_to_draft_keeps_steps_enqueued_ahead():
    """With n-gram drafts and async scheduling, a sequence that has nothing to draft decodes
    with the next step enqueued before the current one is read back."""
    own = bijax.LLM(shared_model("tiny")[0], speculative_config={**NGRAM, "prompt_lookup_min": 3}, **KW)
    eng = own.engine
    prompts, params = workload()
    sp = SP(temperature=1.1, max_tokens=24, seed=9, ignore_eos=True)
    eng.add_request("r", prompts[2], sp)
    ahead, outs = 0, []  # steps after which the next one is already on the device
    while eng.has_unfinished_requests():
        outs += eng.step()
        ahead += len(eng._in_flight) > 0
    assert outs[-1].metrics.num_draft_tokens == 0 and ahead >= 20
    st = eng.stats()
    assert st.num_drafted_steps == st.num_drained_steps == 0  # never emptied the queue
    assert same(outs[-1:], llm("plain").generate(prompts[2:3], sp, use_tqdm=False))


@pytest.mark.parametrize("kind", ["draft-same", "ngram"])  # synchronous / async scheduling
def test_preemption_with_a_small_pool(kind):
    # its own LLM (limit_kv_pool turns prefix caching off); the step programs are shared
    own = bijax.LLM(shared_model("tiny")[0], speculative_config=spec_config(kind), **KW)
    own.engine.limit_kv_pool(12)  # 11 usable blocks: the batch cannot fit at once
    prompts, params = workload()
    outs = own.generate(prompts, params, use_tqdm=False)
    assert own.engine.stats().num_preemptions > 0
    assert same(outs, plain_outputs())
    assert own.engine.stats().num_free_blocks == 11  # rejected drafts' blocks came back


def test_tensor_parallel():
    """At tensor_parallel_size 2 (k_shards=8, whose bits TP 1 shares: test_tp.py) too."""
    prompts, params = workload()
    outs = llm("ngram", tp=2).generate(prompts, params, use_tqdm=False)
    assert totals(outs)[0] > 0
    assert same(outs, llm("plain", tp=2).generate(prompts, params, use_tqdm=False))


def test_negative_control_xla_path_differs():
    """Without the invariant kernels a row computed in a verify chunk is not its decode row."""
    prompts, params = workload()
    outs = llm("draft-same", invariant=False).generate(prompts, params, use_tqdm=False)
    assert not same(outs, plain_outputs(invariant=False))


def test_abort_mid_generation_frees_every_block():
    eng = llm("ngram").engine
    prompts, params = workload()
    free = eng.stats().num_free_blocks
    eng.add_request("a", prompts[0], params[0])
    eng.add_request("b", prompts[1], params[1])
    for _ in range(4):
        eng.step()
    assert eng.stats().num_draft_tokens > 0
    eng.abort("a")
    eng.abort("b")
    outs = {o.request_id: o for o in eng.step()}
    assert outs["a"].finish_reason == "abort" and not eng.has_unfinished_requests()
    assert eng.stats().num_free_blocks == free


def test_ngram_propose():
    assert ngram_propose([1, 2, 3, 9, 1, 2, 3], 2, 3, 1) == [9, 1]
    assert ngram_propose([1, 2, 5, 1, 2, 6, 1, 2], 3, 2, 1) == [6, 1, 2]  # latest match
    assert ngram_propose([4, 5, 6], 2, 3, 1) == []
    assert ngram_propose([1, 2, 3, 1], 4, 3, 2) == []  # min_n 2: a single token is no match


def test_config_errors():
    with pytest.raises(ValueError, match="unknown key 'lookahead'"):
        SpeculativeConfig.create({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1})
    with pytest.raises(ValueError, match="method"):
        SpeculativeConfig.create({"method": "medusa", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig.create({"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeculativeConfig.create({**NGRAM, "prompt_lookup_min": 5})
    with pytest.raises(ValueError, match="needs 'model'"):
        SpeculativeConfig.create({"method": "draft_model", "num_speculative_tokens": 2})
    for limit in (PROMPT_LOOKUP_LIMIT, PROMPT_LOOKUP_LIMIT + 1):  # the bound and one past it
        spec = {**NGRAM, "prompt_lookup_max": limit}
        if limit == PROMPT_LOOKUP_LIMIT:
            assert SpeculativeConfig.create(spec).prompt_lookup_max == limit
        else:
            with pytest.raises(ValueError, match=rf"prompt_lookup_max \({limit}\) is over"):
                SpeculativeConfig.create(spec)
    with pytest.raises(TypeError, match=r"'model'\] must be a preset name.*got int"):
        SpeculativeConfig.create({"method": "draft_model", "num_speculative_tokens": 2, "model": 5})
    assert SpeculativeConfig.create({"method": "draft_model", "num_speculative_tokens": 2, "model": "tiny"})
    with pytest.raises(TypeError, match="dict"):
        SpeculativeConfig.create("ngram")
    made = SpeculativeConfig.create(
        {"method": "ngram", "num_speculative_tokens": np.int64(3)}
    )  # (numpy ints)
    assert made.num_speculative_tokens == 3 and type(made.num_speculative_tokens) is int
    with pytest.raises(ValueError, match="num_speculative_tokens.*got 2.0"):
        SpeculativeConfig.create({"method": "ngram", "num_speculative_tokens": 2.0})
    small = Llama(dataclasses.replace(preset("tiny"), vocab_size=300), dtype=jnp.float32, seed=0)
    with pytest.raises(
        ValueError,
        match=r"draft model's vocabulary \(300\) is not the model's \(512\), and without both tokenizers",
    ):
        bijax.LLM(
            shared_model("tiny")[0],
            speculative_config={"method": "draft_model", "model": small, "num_speculative_tokens": 2},
            **KW,
        )


def word_tokenizer(path, words):
    """A tokenizer.json in ``path`` whose ids are ``words``' positions."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))


def test_draft_with_fewer_rows_and_the_same_tokenizer(tmp_path):
    """A draft whose embedding has fewer rows than the model's (checkpoints pad their vocabulary
    differently) drafts when both tokenizers are known and equal - with plain decoding's bits,
    also where the model's tokens have no row in the draft (ids 300-511 here). More rows than
    the model's, or another tokenizer, are refused."""
    from models.loading import save_orbax
    from models.tokenizer import load_tokenizer

    words = [f"w{i}" for i in range(256)]
    model = shared_model("tiny")[0]

    def draft_dir(name, rows, words):
        path = tmp_path / name
        save_orbax(
            Llama(dataclasses.replace(preset("tiny"), vocab_size=rows), dtype=jnp.float32, seed=7), path
        )
        word_tokenizer(path, words)
        return path

    word_tokenizer(tmp_path, words)
    tok = load_tokenizer(tmp_path)

    def make(path, **kw):
        spec = {"method": "draft_model", "model": path, "num_speculative_tokens": 3, "adaptive": False}
        return bijax.LLM(model, tokenizer=tok, speculative_config=spec, **KW, **kw)

    llm_small = make(draft_dir("small", 300, words))
    prompts, params = workload()
    outs = llm_small.generate(prompts, params, use_tqdm=False)
    assert same(outs, plain_outputs())
    assert totals(outs)[0] > 0  # it drafted
    with pytest.raises(
        ValueError, match=r"draft model's vocabulary \(600\) is larger than the model's \(512\)"
    ):
        make(draft_dir("large", 600, words))
    with pytest.raises(ValueError, match="draft model's tokenizer is not the model's"):
        make(draft_dir("other", 300, words[::-1]))  # other ids
    # equal rows: the tokenizers are not compared (nor the draft's loaded: a draft that cannot
    # change an output is not refused for its tokenizer files)
    assert make(draft_dir("same-rows", 512, words[::-1])).engine.speculator is not None


def test_smollm2_text_and_stop_strings():
    """The embedded SmolLM2 (a real model and tokenizer): a prompt that asks for a repeat, and
    stop strings, greedy and seeded."""
    model, tok = shared_model("smollm2")
    prompts = [
        "Repeat after me: the cat sat on the mat. the cat sat on the mat. the cat sat on the mat. the cat",
        "The capital of France is",
    ]
    params = [
        SP(temperature=0, max_tokens=24),
        SP(temperature=0.7, top_p=0.9, seed=4, max_tokens=24, stop=[".", "\n"]),
    ]
    kw = dict(KW, num_kv_blocks=48)
    plain = bijax.LLM(model, tokenizer=tok, **kw).generate(prompts, params, use_tqdm=False)
    outs = bijax.LLM(model, tokenizer=tok, speculative_config=NGRAM, **kw).generate(
        prompts, params, use_tqdm=False
    )
    assert same(outs, plain) and [o.text for o in outs] == [o.text for o in plain]
    assert outs[0].metrics.num_accepted_tokens > 0  # (this small model copies little; tiny's loop: > 0.5)


def test_ngram_index_equals_the_search():
    rng = np.random.default_rng(0)
    for _ in range(20):
        ids = [int(t) for t in rng.integers(0, 4, 40)]
        index = NgramIndex(3, 1)
        for size in range(1, len(ids) + 1):  # grown a token at a time, as a sequence decodes
            assert index.propose(ids[:size], 3) == ngram_propose(ids[:size], 3, 3, 1)


def test_adaptive_rules():
    """Drafting stops where the measured intervals say it does not pay: each regime measured
    first, then the faster one runs and the other is probed after PROBE_EVERY decisions, twice
    as far apart while the choice stands, until it is measured (at most PROBE_TRIES decisions);
    per sequence, drafting backs off after a window of low acceptance."""
    sp = Speculator(SpeculativeConfig.create({**NGRAM, "adaptive": True}), llm("plain").config)
    n = 4
    rates = {False: (0.010, 4), True: (0.030, 8)}  # plain: 4 tokens in 10 ms; drafted: 8 in 30

    def decide(k, measured=True):  # k decisions, each step's interval measured as it ran
        out = []
        for _ in range(k):
            out.append(sp.worth_it(n))
            if measured:
                sp.timed(n, True, out[-1], *rates[out[-1]])
        return out

    assert decide(2) == [True, False]  # drafting measured first, then plain
    decisions = decide(PROBE_EVERY * 7)
    # drafting does not pay: it runs only as probes, PROBE_EVERY decisions apart, then twice as far
    assert [i + 1 for i, d in enumerate(decisions) if d] == [
        PROBE_EVERY,
        3 * PROBE_EVERY,
        7 * PROBE_EVERY,
    ]
    sp.timed(n, False, True, 0.001, 100)  # a step with a prefill chunk: not comparable, ignored
    assert not decide(1)[0]
    # a probe that gets no measurement (no sequence had drafts) goes on, at most PROBE_TRIES decisions
    unmeasured = decide(PROBE_MAX + PROBE_TRIES, measured=False)
    runs = [i for i, d in enumerate(unmeasured) if d]
    assert runs == list(range(runs[0], runs[0] + PROBE_TRIES)) and not unmeasured[-1]  # then plain again
    rates[True] = (0.030, 24)  # drafting now emits 24 tokens per 30 ms: worth it
    for _ in range(20):
        sp.timed(n, True, True, *rates[True])
    decisions = decide(2 * PROBE_EVERY)
    assert (
        decisions.count(False) == 1 and not decisions[PROBE_EVERY - 1]
    )  # the choice changed: probes restart
    assert sp.worth_it(1)  # another batch-size bucket: nothing measured there

    class Seq:  # the counters of bijax.sequence.Sequence
        num_draft_tokens = num_accepted_tokens = num_verify_steps = 0
        window_drafted = window_accepted = spec_resume_at = spec_misses = 0

        def __len__(self):
            return 100

    seq = Seq()
    sp.record(seq, 4, 0)
    sp.record(seq, 4, 1)  # 1 of 8 accepted: back off
    assert seq.spec_resume_at == 100 + ADAPT_BACKOFF
    sp.record(seq, 4, 0)
    sp.record(seq, 4, 0)
    assert seq.spec_resume_at == 100 + 2 * ADAPT_BACKOFF  # twice as long after a second miss


def test_adaptive_rule_probes_plain_with_async_scheduling(monkeypatch):
    """With async scheduling, drafting the faster way and a sequence that could always draft,
    the probes of plain decoding are measured: a plain interval needs a few plain decisions in a
    row, and a probe lasts until it is measured. Control: a one-decision probe (PROBE_TRIES = 1)
    measures plain only once, before drafting is chosen. Outputs stay plain decoding's."""
    import bijax.speculative as speculative

    eng = llm("ngram-adaptive").engine
    assert eng.async_scheduling and eng.speculator.spec.adaptive
    monkeypatch.setattr(eng.speculator, "has_candidates", lambda seqs: True)
    timed = eng.speculator.timed
    rng = np.random.default_rng(3)
    loop = [int(t) for t in rng.integers(3, 512, 6)] * 5
    sp = SP(max_tokens=120, ignore_eos=True, temperature=0)
    plain = llm("plain").generate([loop] * 2, sp, use_tqdm=False)

    def plain_intervals(tries):
        monkeypatch.setattr(speculative, "PROBE_TRIES", tries)
        eng.speculator.times.clear()
        eng.speculator.probes.clear()
        seen = []

        # Drafting made to look far faster: a drafted interval counts as 1 us, so no pause of
        # a loaded machine (a CI run once saw one flip a 4x margin) makes plain look faster.
        def record(n, decode_only, drafted, seconds, emitted):
            seen.append(drafted) if decode_only else None
            timed(n, decode_only, drafted, 1e-6 if drafted else seconds, emitted)

        monkeypatch.setattr(eng.speculator, "timed", record)
        assert same(llm("ngram-adaptive").generate([loop] * 2, sp, use_tqdm=False), plain)
        return seen.count(False)

    assert plain_intervals(speculative.PROBE_TRIES) >= 2
    assert plain_intervals(1) == 1  # control


def test_warmup_compiles_the_verify_steps():
    """After LLM.warmup every step - verify steps sample every token row: programs with more
    sampled rows than sequences - runs a program compiled ahead of time (with ``logprobs=True``,
    the top-logprobs variants too). Control: warming
    only the plain buckets leaves verify steps to compile at run time."""

    def aot_misses(warm, logprobs=False):
        own = bijax.LLM(shared_model("tiny")[0], speculative_config=NGRAM, **KW)
        warm(own)
        runner, misses = own.engine.runner, []

        class Recording(dict):
            def get(self, key, default=None):
                if key not in self:
                    misses.append(key)
                return super().get(key, default)

        runner._aot = Recording(runner._aot)
        prompts, params = workload()
        params = [dataclasses.replace(p, logprobs=3 if logprobs else None) for p in params]
        outs = own.generate(prompts, params, use_tqdm=False)
        assert totals(outs)[0] > 0
        return misses

    assert aot_misses(lambda llm: llm.warmup(progress=False)) == []
    # with top logprobs too: verify steps' sampling programs with them (2026-12-05)
    assert aot_misses(lambda llm: llm.warmup(progress=False, logprobs=True), logprobs=True) == []
    plain_only = lambda llm: llm.engine.runner.warmup(llm.engine.runner.bucket_pairs())  # noqa: E731
    assert aot_misses(plain_only)
