"""Engine invariance (bit-exact token ids and float32 logprobs), on `tiny` and on SmolLM2, and on
`tiny` (k_shards=8) at tensor_parallel_size 2 and 4 over the 8 fake CPU devices of conftest.py.

1. needle in a batch; 2. batch of 1 vs N (greedy, seeded, n > 1); 3. prefill vs decode
(`score` equals generate's logprobs); 4. chunked prefill under several token budgets;
5. negative control: with invariant=False at least one of 1-4 differs.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest

import bijax
from bijax import SamplingParams as SP
from models.configs import preset
from models.llama import Llama
from models.loading import embedded_model_path, load_model
from models.tokenizer import load_tokenizer
from tests.conftest import bits

MAX_LEN = 256


# name -> tensor_parallel_size (those models are built with k_shards=8)
TP_NAMES = {"tiny-tp2": 2, "tiny-tp4": 4}


@functools.cache
def shared_model(name):
    if name in TP_NAMES:
        return Llama(preset("tiny"), dtype=jnp.float32, seed=0, k_shards=8), None
    if name == "tiny":
        return Llama(preset("tiny"), dtype=jnp.float32, seed=0), None
    return load_model("smollm2-135m"), load_tokenizer(embedded_model_path("smollm2-135m"))


@functools.cache
def shared_llm(name, invariant=True, budget=64):
    model, tok = shared_model(name)
    return bijax.LLM(
        model,
        tensor_parallel_size=TP_NAMES.get(name, 1),
        tokenizer=tok,
        invariant=invariant,
        max_model_len=MAX_LEN,
        max_num_seqs=8,
        max_num_batched_tokens=budget,
        num_kv_blocks=160,
        seed=1,
    )


def _same(a, b) -> bool:
    return len(a.outputs) == len(b.outputs) and all(
        x.token_ids == y.token_ids and np.array_equal(bits(x.logprobs), bits(y.logprobs))
        for x, y in zip(a.outputs, b.outputs, strict=True)
    )


def _gen(llm, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


def _others(rng, vocab, count):
    prompts = [list(map(int, rng.integers(3, vocab, int(rng.integers(1, 60))))) for _ in range(count)]
    kinds = [
        SP(temperature=0, max_tokens=5),
        SP(temperature=1.0, top_k=20, max_tokens=7, seed=int(rng.integers(99))),
        SP(temperature=0.6, top_p=0.8, max_tokens=4),
        SP(temperature=1.2, min_p=0.05, max_tokens=6, n=2),
    ]
    return prompts, [kinds[int(rng.integers(len(kinds)))] for _ in range(count)]


def _needle(name):
    if name.startswith("tiny"):
        return list(map(int, np.random.default_rng(5).integers(3, 512, 23)))
    return "The three primary colors are"


def check_needle(name, invariant):
    llm = shared_llm(name, invariant)
    rng = np.random.default_rng(11)
    needle, sp = _needle(name), SP(temperature=0.8, top_p=0.9, max_tokens=6, seed=7)
    solo = _gen(llm, [needle], sp)[0]
    same = []
    for _ in range(2 if name == "tiny" else 1):
        prompts, params = _others(rng, llm.model.config.vocab_size, int(rng.integers(3, 8)))
        slot = int(rng.integers(len(prompts) + 1))
        outs = _gen(llm, prompts[:slot] + [needle] + prompts[slot:], params[:slot] + [sp] + params[slot:])
        same.append(_same(outs[slot], solo))
    return all(same)


def check_batch_1_vs_n(name, invariant):
    llm = shared_llm(name, invariant)
    rng = np.random.default_rng(12)
    p = _needle(name)
    reqs = [SP(temperature=0, max_tokens=6), SP(temperature=0.9, max_tokens=5, seed=3, n=3)]
    solos = [_gen(llm, [p], sp)[0] for sp in reqs]
    prompts, params = _others(rng, llm.model.config.vocab_size, 5)
    outs = _gen(llm, [p] + prompts + [p], [reqs[0]] + params + [reqs[1]])
    return _same(outs[0], solos[0]) and _same(outs[-1], solos[1]) and len(outs[-1].outputs) == 3


def check_prefill_vs_decode(name, invariant):
    llm = shared_llm(name, invariant)
    p = _needle(name)
    ok = []
    for sp in (SP(temperature=0, max_tokens=6), SP(temperature=0.8, max_tokens=6, seed=9, ignore_eos=True)):
        o = _gen(llm, [p], sp)[0]
        full = list(o.prompt_token_ids) + o.token_ids
        lp = llm.score([full], [len(o.prompt_token_ids)], temperature=sp.temperature)[0]
        ok.append(np.array_equal(bits(lp), bits(o.logprobs)))
    return all(ok)


def check_chunked_prefill(name, invariant):
    rng = np.random.default_rng(13)
    long = list(map(int, rng.integers(3, shared_model(name)[0].config.vocab_size, 150)))
    sp = [SP(temperature=0, max_tokens=4), SP(temperature=0.7, max_tokens=4, seed=5)]
    runs = [_gen(shared_llm(name, invariant, budget), [long, long], sp) for budget in (16, 32, 64)]
    return all(_same(r[i], runs[-1][i]) for r in runs[:-1] for i in range(2))


CHECKS = {
    "needle in a batch": check_needle,
    "batch 1 vs N": check_batch_1_vs_n,
    "prefill vs decode": check_prefill_vs_decode,
    "chunked prefill": check_chunked_prefill,
}


@pytest.mark.parametrize("check", list(CHECKS))
@pytest.mark.parametrize("name", ["tiny", "smollm2", *TP_NAMES])
def test_invariance(name, check):
    assert CHECKS[check](name, True)


@pytest.mark.parametrize("name", ["tiny", "smollm2", "tiny-tp2"])
def test_negative_control_xla_path_differs(name):
    """The same checks with invariant=False: at least one must fail (cheapest first; stops at
    the first failure)."""
    order = ["prefill vs decode", "batch 1 vs N", "chunked prefill", "needle in a batch"]
    passed = []
    for check in order:
        if not CHECKS[check](name, False):
            return
        passed.append(check)
    pytest.fail(f"the XLA path passed every check: {passed}")


def test_step_inputs_name_a_position_past_the_allocated_blocks():
    """The step's inputs are built as whole arrays; a token whose position lies past its
    sequence's blocks (an engine bug) is an error, never a write to the null block."""
    from bijax.model_runner import Chunk
    from bijax.sequence import Sequence

    runner = shared_llm("tiny").engine.runner
    seq = Sequence(0, "r", list(range(1, 40)), SP(max_tokens=1), 0, 0, 0)
    seq.block_table = [3, 4]  # 32 positions with 16-token blocks
    ok = runner._batch([Chunk(seq, 0, tuple(seq.prompt_token_ids[:32]))])
    assert list(ok.slot_mapping[:32]) == [3 * 16 + p for p in range(16)] + [4 * 16 + p for p in range(16)]
    with pytest.raises(RuntimeError, match="past its sequence's allocated blocks"):
        runner._batch([Chunk(seq, 0, tuple(seq.prompt_token_ids))])


def test_step_buckets_give_many_token_steps_the_larger_sequence_buckets():
    """A step's sequence bucket holds at least a quarter of its token bucket (``step_bucket``):
    a 64-sequence, 2048-token engine has 12 (sequences, tokens) buckets, not 21."""
    from bijax.config import EngineConfig

    cfg = EngineConfig(max_model_len=8192, max_num_seqs=64, max_num_batched_tokens=2048)
    pairs = cfg.bucket_pairs()
    assert len(pairs) == 12 and (64, 2048) in pairs and (16, 2048) not in pairs
    assert all(t >= s >= min(t // 4, 64) for s, t in pairs)
    assert cfg.step_bucket(1, 2000) == (64, 2048)
    assert cfg.step_bucket(1, 1) == (16, 16) and cfg.step_bucket(3, 100) == (32, 128)
    assert all(cfg.step_bucket(s, t) in pairs for s in range(1, 65) for t in range(s, 2049, 37))
    small = EngineConfig(max_model_len=256, max_num_seqs=2, max_num_batched_tokens=64)
    assert small.bucket_pairs() == [(2, 16), (2, 32), (2, 64)]  # one sequence bucket: as before


def test_a_step_in_a_larger_sequence_bucket_gives_the_same_bits(monkeypatch):
    """One 100-token prompt's prefill step runs in the (32, 128) bucket (a quarter of 128
    tokens), not (16, 128): the same tokens and logprob bits as with the rule off. Control:
    the rule off compiles the other bucket."""
    from bijax import config

    model, _ = shared_model("tiny")
    prompt = list(map(int, np.random.default_rng(3).integers(3, 500, 100)))
    sp = SP(temperature=0.9, max_tokens=3, seed=4)
    runs = {}
    for rule in (True, False):
        monkeypatch.setattr(config, "TOKENS_PER_SEQ_ROW", 4 if rule else 10**9)
        llm = bijax.LLM(
            model, max_model_len=MAX_LEN, max_num_seqs=32, max_num_batched_tokens=128, num_kv_blocks=40
        )
        runs[rule] = (_gen(llm, [prompt], sp)[0], set(llm.engine.runner.compiled_buckets))
    assert (32, 128) in runs[True][1] and (16, 128) not in runs[True][1]
    assert (16, 128) in runs[False][1]  # control: the rule is what moved the step
    assert _same(runs[True][0], runs[False][0])
