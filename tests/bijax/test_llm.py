"""LLM / Engine behaviour: finish reasons, stop conditions, seeds, n, top logprobs, abort,
and bad input rejected alone with a clear error."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bijax import SamplingParams as SP
from tests.bijax.test_engine import shared_llm as _llm
from tests.conftest import bits

PROMPT = [5, 17, 42, 99, 123, 7, 8]


@pytest.fixture(scope="module")
def llm():
    return _llm("tiny")


def test_max_tokens_and_finish_reason(llm):
    o = llm.generate(PROMPT, SP(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)[0]
    assert len(o.token_ids) == 5 and o.finish_reason == "length" and o.logprobs.dtype == np.float32
    assert o.prompt_token_ids == PROMPT and o.logprobs.shape == (5,)


def test_stop_token_ids_end_the_output(llm):
    ref = llm.generate(PROMPT, SP(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
    stop = ref.token_ids[2]
    o = llm.generate(
        PROMPT, SP(temperature=0, max_tokens=6, ignore_eos=True, stop_token_ids=[stop]), use_tqdm=False
    )[0]
    first = ref.token_ids.index(stop)
    assert o.token_ids == ref.token_ids[: first + 1] and o.finish_reason == "stop"


def test_seed_reported_and_reproducible(llm):
    sp = SP(temperature=1.0, max_tokens=6)
    a = llm.generate(PROMPT, sp, use_tqdm=False)[0]
    again = llm.generate(PROMPT, SP(temperature=1.0, max_tokens=6, seed=a.seed), use_tqdm=False)[0]
    assert again.seed == a.seed and again.token_ids == a.token_ids
    np.testing.assert_array_equal(bits(again.logprobs), bits(a.logprobs))


def test_n_samples_differ_and_each_is_reproducible(llm):
    o = llm.generate(PROMPT, SP(temperature=1.5, max_tokens=8, n=3, seed=4), use_tqdm=False)[0]
    assert [c.index for c in o.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in o.outputs}) > 1  # sample_index is in the key


def test_top_logprobs(llm):
    o = llm.generate(PROMPT, SP(temperature=0, max_tokens=4, logprobs=3), use_tqdm=False)[0]
    top = o.outputs[0].top_logprobs
    assert len(top) == len(o.token_ids) and all(len(t) == 3 for t in top)
    for step, tok, lp in zip(top, o.token_ids, o.logprobs, strict=True):
        assert step[0][0] == tok and np.float32(step[0][1]) == lp  # greedy: the top-1 is the sample
        assert step[0][1] >= step[1][1] >= step[2][1]


def test_abort_engine_level(llm):
    eng = llm.engine
    eng.add_request("abort-me", PROMPT, SP(max_tokens=50, ignore_eos=True))
    eng.step()
    eng.abort("abort-me")
    eng.abort("abort-me")  # twice before a step: still one output
    outs = eng.step()
    assert [o.finish_reason for o in outs if o.request_id == "abort-me" and o.finished] == ["abort"]
    assert not eng.has_unfinished_requests()
    assert eng.blocks.num_free == eng.config.num_kv_blocks - 1  # every block back


def test_step_without_partial_outputs_returns_finished_ones_only(llm):
    """``step(partial=False)`` (what ``generate`` uses without ``on_output``) builds no snapshot
    of unfinished requests, and the finished outputs have the same ids and logprob bits."""
    eng = llm.engine
    sps = [SP(max_tokens=3, ignore_eos=True, seed=4), SP(max_tokens=9, ignore_eos=True, seed=5)]
    got, returned = {}, []
    for i, sp in enumerate(sps):
        eng.add_request(f"quiet-{i}", PROMPT, sp)
    while eng.has_unfinished_requests():
        outs = eng.step(partial=False)
        returned += outs
        got.update({o.request_id: o for o in outs})
    assert all(o.finished for o in returned) and len(returned) == 2
    streamed = {}
    llm.generate(
        [PROMPT, PROMPT], sps, use_tqdm=False, on_output=lambda i, o: streamed.setdefault(i, []).append(o)
    )
    assert any(not o.finished for o in streamed[1])  # the control: partial outputs do come with on_output
    for i in range(2):
        a, b = got[f"quiet-{i}"].outputs[0], streamed[i][-1].outputs[0]
        assert a.token_ids == b.token_ids and np.array_equal(bits(a.logprobs), bits(b.logprobs))
        assert a.logprobs.dtype == np.float32 and len(a.logprobs) == len(a.token_ids)


@pytest.mark.parametrize(
    "prompt, sp, err, match",
    [
        ([], SP(), ValueError, "empty"),
        ([1, 2, 10**6], SP(), ValueError, "outside the vocabulary"),
        ([1, 2], SP(stop_token_ids=[3, 10**12]), ValueError, r"stop_token_ids: 1000000000000 is outside"),
        ([1] * 250, SP(max_tokens=10), ValueError, "max_model_len"),
        ("text prompt", SP(), ValueError, "no tokenizer"),
        ([1.5, 2], SP(), TypeError, "token ids"),
        ([1, 2], "not params", TypeError, "SamplingParams"),
        (b"hello", SP(), TypeError, "got bytes"),
    ],
)
def test_bad_requests_are_rejected_alone(llm, prompt, sp, err, match):
    with pytest.raises(err, match=match):
        llm.generate([PROMPT, prompt], [SP(max_tokens=2), sp], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()  # nothing half-added
    ok = llm.generate([PROMPT], SP(max_tokens=2), use_tqdm=False)[0]
    assert len(ok.token_ids) == 2 or ok.finish_reason == "stop"


def test_jax_scalar_token_ids_and_calls_inside_jit(llm):
    """A list of JAX's 0-d int arrays is a prompt, as a list of numpy's ints is (same bits; it was
    refused); 0-d float or bool arrays are not. Inside ``jax.jit``, generate and score say they
    cannot run there (they failed naming lists or ``__array__``), and nothing is half-added."""
    sp = SP(max_tokens=3, ignore_eos=True, seed=2)
    want = llm.generate([PROMPT], sp, use_tqdm=False)[0].outputs[0]
    got = llm.generate([[jnp.int32(t) for t in PROMPT]], sp, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == want.token_ids and np.array_equal(bits(got.logprobs), bits(want.logprobs))
    for bad in (jnp.float32(1.0), jnp.bool_(True)):
        with pytest.raises(TypeError, match="must be ints"):
            llm.generate([[bad, 2]], sp, use_tqdm=False)
    calls = (lambda t: llm.generate([list(t)], sp, use_tqdm=False), lambda t: llm.score([list(t)], [1]))
    for call in calls:
        with pytest.raises(TypeError, match="traced by jax.jit"):
            jax.jit(call)(jnp.asarray(PROMPT))
    assert not llm.engine.has_unfinished_requests()


def test_an_empty_batch_gives_an_empty_list(llm):
    """No prompts (a list, a 0-row array) give no outputs, as ``score([], [])`` does; an empty
    prompt inside a batch is still refused (above)."""
    assert llm.generate([], use_tqdm=False) == []
    assert llm.generate(np.zeros((0, 3), np.int32), use_tqdm=False) == []
    assert llm.score([], []) == []
    assert not llm.engine.has_unfinished_requests()


def test_a_failing_generate_leaves_the_engine_idle_and_usable(llm):
    """A callback that raises (as Ctrl-C would) ends ``generate`` with the error; its requests are
    aborted and released, so the next ``generate`` runs as on a fresh engine (same bits)."""
    sp = SP(max_tokens=6, ignore_eos=True, seed=3)
    want = llm.generate([PROMPT], sp, use_tqdm=False)[0]

    def boom(i, out):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        llm.generate([PROMPT, PROMPT[:3]], [sp, sp], use_tqdm=False, on_output=boom)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.blocks.num_free == llm.engine.config.num_kv_blocks - 1  # every block back
    got = llm.generate([PROMPT], sp, use_tqdm=False)[0]
    assert got.token_ids == want.token_ids and np.array_equal(bits(got.logprobs), bits(want.logprobs))


def test_score_bad_input(llm):
    vocab = llm.model.config.vocab_size
    for bad in (vocab, 10**9, -1):  # a completion token outside the vocabulary, not just the prompt's
        with pytest.raises(ValueError, match=f"token_ids\\[0\\]: token id {bad} is outside the vocabulary"):
            llm.score([PROMPT + [bad]], [len(PROMPT)])
        # ... and in the prompt's part, in the second sequence: it is named
        with pytest.raises(
            ValueError, match=f"token_ids\\[1\\]: prompt token id {bad} is outside the vocabulary"
        ):
            llm.score([PROMPT + [1], [bad] + PROMPT], [len(PROMPT), 2])
    with pytest.raises(ValueError, match=r"token_ids\[1\] is empty"):
        llm.score([PROMPT, []], [1, 1])
    ok = llm.score([PROMPT + [1]], [np.int64(len(PROMPT))])  # numpy prompt lengths are ints too
    assert ok[0].shape == (1,) and ok[0].dtype == np.float32
    with pytest.raises(ValueError, match="prompt_lens"):
        llm.score([PROMPT], [0])
    with pytest.raises(ValueError, match="prompt_lens"):
        llm.score([PROMPT], [1, 2])
    with pytest.raises(ValueError, match="temperature"):
        llm.score([PROMPT], [2], temperature=-1.0)


def test_stop_strings_with_a_real_tokenizer():
    smol = _llm("smollm2")
    ref = smol.generate("The capital of France is", SP(temperature=0, max_tokens=12), use_tqdm=False)[0]
    word = ref.text.split()[1] if len(ref.text.split()) > 1 else ref.text.strip()[:3]
    o = smol.generate(
        "The capital of France is", SP(temperature=0, max_tokens=12, stop=[word]), use_tqdm=False
    )[0]
    assert o.finish_reason == "stop" and word not in o.text and ref.text.startswith(o.text)
    # vLLM's text dict prompt is the same prompt
    d = smol.generate(
        {"prompt": "The capital of France is"}, SP(temperature=0, max_tokens=12), use_tqdm=False
    )[0]
    assert d.token_ids == ref.token_ids and np.array_equal(bits(d.logprobs), bits(ref.logprobs))
    # a stop string the output starts with: the text is empty, not the whole output
    first = ref.text[:2]
    o = smol.generate(
        "The capital of France is", SP(temperature=0, max_tokens=12, stop=[first]), use_tqdm=False
    )[0]
    assert o.finish_reason == "stop" and o.text == "" and o.token_ids
    # a stop string across three tokens late in the output (each step searches only the new
    # end of the text, reaching back len(stop) - 1 characters)
    dec = smol.tokenizer.decode
    span = ref.text[len(dec(ref.token_ids[:6])) - 2 : len(dec(ref.token_ids[:8])) - 1]
    o = smol.generate(
        "The capital of France is", SP(temperature=0, max_tokens=12, stop=[span]), use_tqdm=False
    )[0]
    assert o.finish_reason == "stop" and o.text == ref.text[: ref.text.find(span)], (span, o.text)
    # ids past the tokenizer's vocabulary (a model's padded rows) have no text, and no error
    ids, v = list(ref.token_ids), smol.tokenizer.vocab_size
    assert smol.engine._text(ids[:3] + [v, v + 7] + ids[3:]) == ref.text
    with pytest.raises(ValueError, match="outside the vocabulary"):  # what a plain decode does
        smol.tokenizer.decode(ids + [v])


def test_streamed_text_never_shows_what_a_stop_string_cuts():
    """With ``on_output``, a partial text could end with the start of a stop string that the
    final text then cut (stop " 7": ' 5, 6, ' streamed, ' 5, 6,' final). A partial output now
    holds back what could begin a stop string: every partial text is a prefix of the final."""
    smol = _llm("smollm2")
    parts = []
    out = smol.generate(
        "Count from 1 to 10: 1, 2, 3, 4,",
        SP(temperature=0, max_tokens=20, stop=[" 7", "eleven"]),
        use_tqdm=False,
        on_output=lambda i, o: parts.append(o.outputs[0].text),
    )[0]
    assert out.finish_reason == "stop" and out.text == " 5, 6," and len(parts) > 3
    assert all(out.text.startswith(p) for p in parts), parts


@pytest.mark.parametrize(
    "kw, err, match",
    [
        ({"seed": -1}, ValueError, "seed must be an int"),
        ({"seed": 2**64}, ValueError, "seed must be an int"),
        ({"seed": 1.5}, ValueError, "seed must be an int"),
        ({"max_num_seqs": "2"}, ValueError, "max_num_seqs must be a positive int"),
        ({"max_num_batched_tokens": 0}, ValueError, "max_num_batched_tokens must be a positive int"),
        ({"block_size": 2.0}, ValueError, "block_size must be a positive int"),
        ({"num_kv_blocks": -4}, ValueError, "num_kv_blocks must be a positive int"),
        ({"max_model_len": "64"}, ValueError, "max_model_len must be a positive int"),
        ({"max_model_len": 1}, ValueError, r"max_model_len must be >= 2 \(one prompt token"),
        ({"gpu_memory_utilization": "0.5"}, ValueError, "gpu_memory_utilization"),
        ({"dtype": "foo"}, TypeError, "dtype must be a floating-point dtype"),
        ({"dtype": "int32"}, TypeError, "dtype must be a floating-point dtype"),
        ({"enable_prefix_caching": "no"}, TypeError, "enable_prefix_caching must be a bool"),
        ({"max_num_seqs": np.int64(4)}, ValueError, r"max_num_seqs must be a positive Python int \(int"),
    ],
)
def test_bad_llm_arguments_are_named_before_loading(kw, err, match, monkeypatch):
    """Each bad ``LLM`` argument is refused by name before anything loads (the loader is
    replaced by one that fails, so an argument that got past the checks would show)."""
    import bijax.llm

    monkeypatch.setattr(bijax.llm, "_load", lambda *a, **k: pytest.fail("loaded before checking"))
    with pytest.raises(err, match=match):
        bijax.llm.LLM("tiny", **kw)


def test_loading_options_for_a_given_model_are_refused_not_ignored(llm):
    """dtype and k_shards say how bijax loads a model: for a model given as is, a different value
    is an error (it was silently ignored); the model's own values are accepted."""
    import bijax

    m = llm.model
    other = "bfloat16" if m.dtype != jnp.bfloat16 else "float32"
    with pytest.raises(ValueError, match="dtype applies to models bijax loads"):
        bijax.LLM(m, dtype=other)
    with pytest.raises(ValueError, match="k_shards applies to models bijax loads"):
        bijax.LLM(m, k_shards=8 if m.k_shards != 8 else 2)
    draft = {"method": "draft_model", "model": m, "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match=f"dtype={jnp.dtype(other)} but the given draft model is"):
        bijax.LLM("tiny", dtype=other, speculative_config=draft, max_model_len=64, num_kv_blocks=8)
    same = bijax.LLM(m, dtype=m.dtype, k_shards=m.k_shards, max_model_len=64, max_num_seqs=2,
                     max_num_batched_tokens=32, num_kv_blocks=8)  # fmt: skip
    assert same.model is m


def test_unknown_model_name_or_path():
    import bijax

    with pytest.raises(FileNotFoundError, match="not a known model name"):
        bijax.LLM("no-such-model")
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        bijax.LLM("tiny", tensor_parallel_size=2)


def test_a_gguf_file_brings_its_tokenizer_whatever_its_name(tmp_path):
    """A GGUF file is one by its header (as ``load_model`` reads it), so a copy named smol.bin
    brings its tokenizer too (it was dropped: text prompts refused); a GGUF whose tokenizer
    bijax cannot build (none, or SentencePiece) loads without one, as a HF directory without
    tokenizer.json does, and says why (it refused the whole model)."""
    import bijax
    from models.loading import embedded_model_path
    from models.tokenizer import load_tokenizer
    from tests.models.test_gguf import write_gguf

    kw = dict(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32, num_kv_blocks=8)
    link = tmp_path / "smol.bin"
    link.symlink_to(embedded_model_path("smollm2-135m"))
    llm = bijax.LLM(str(link), **kw)
    want = load_tokenizer(embedded_model_path("smollm2-135m"))
    assert llm.tokenizer is not None and llm.tokenizer.encode("Hello there") == want.encode("Hello there")
    llm.close()
    write_gguf(tmp_path / "bare.gguf")  # (no tokenizer metadata)
    with pytest.warns(UserWarning, match="no tokenizer loaded.*no tokenizer metadata.*token ids"):
        bare = bijax.LLM(str(tmp_path / "bare.gguf"), **kw)
    assert bare.tokenizer is None
    with pytest.raises(ValueError, match="no tokenizer"):
        bare.generate("text", SP(max_tokens=1), use_tqdm=False)
    bare.close()


def test_engine_public_door(llm):
    """validate -> ValidPrompt -> add_request (no second check), on_output streaming, stats,
    and the idle-only operations refused mid-flight."""
    import bijax

    eng = llm.engine
    sp = SP(temperature=0, max_tokens=4, ignore_eos=True)
    v = eng.validate(PROMPT, sp)
    assert v.token_ids == tuple(PROMPT) and v.params is sp and v.text is None
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.validate([1, 10**6], sp)
    with pytest.raises(ValueError, match="carries its SamplingParams"):
        eng.add_request("door-bad", v, SP(max_tokens=2))
    other = _llm("tiny", budget=32).engine  # a ValidPrompt of another engine is checked again
    other.add_request("door-other", v)
    while other.has_unfinished_requests():
        other.step()
    seen = []
    ref = llm.generate(PROMPT, sp, use_tqdm=False)[0]
    before = eng.stats()
    out = llm.generate(
        [PROMPT, PROMPT], sp, use_tqdm=False, on_output=lambda i, o: seen.append((i, o.finished))
    )
    assert out[0].token_ids == ref.token_ids and {i for i, _ in seen} == {0, 1}
    assert [f for i, f in seen if i == 0][-1] and len([1 for i, _ in seen if i == 0]) == 4  # 4 steps streamed
    after = eng.stats()
    assert isinstance(after, bijax.EngineStats) and after.num_unfinished_requests == 0
    assert after.prefix_cache_hit_blocks >= before.prefix_cache_hit_blocks
    assert after.num_compiled_buckets == eng.num_compiled_buckets > 0
    # reset_prefix_cache: the same prompt again hits nothing, and gives the same bits
    long = PROMPT * 5  # two full KV blocks: cacheable
    first = llm.generate(long, sp, use_tqdm=False)[0]
    hits = eng.stats().prefix_cache_hit_blocks
    llm.generate(long, sp, use_tqdm=False)
    assert eng.stats().prefix_cache_hit_blocks > hits  # control: without a reset it hits
    llm.reset_prefix_cache()
    hits = eng.stats().prefix_cache_hit_blocks
    again = llm.generate(long, sp, use_tqdm=False)[0]
    assert eng.stats().prefix_cache_hit_blocks == hits
    assert again.token_ids == first.token_ids and np.array_equal(bits(again.logprobs), bits(first.logprobs))
    eng.add_request("door-busy", v)
    with pytest.raises(RuntimeError, match="no generation is in flight"):
        eng.limit_kv_pool(8)
    with pytest.raises(RuntimeError, match="no generation is in flight"):
        eng.reset_prefix_cache()
    with pytest.raises(RuntimeError, match="no generation is in flight"):
        eng.set_weights(llm.model)
    eng.abort("door-busy")
    while eng.has_unfinished_requests():
        eng.step()
    with pytest.raises(ValueError, match="num_blocks must be an int"):
        eng.limit_kv_pool(1)


def test_stop_strings_without_a_tokenizer_are_an_error():
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        _llm("tiny").generate([[5, 6, 7]], SP(max_tokens=3, stop=["x"]), use_tqdm=False)
    assert _llm("tiny").generate([[5, 6, 7]], SP(max_tokens=3, stop_token_ids=[9]), use_tqdm=False)


class _FakeGpu:
    """A GPU device as ``bijax.llm`` reads it: its allocator statistics and CUDA ordinal."""

    platform, local_hardware_id = "gpu", 3

    def __init__(self, stats):
        self.stats = stats

    def memory_stats(self):
        return self.stats


def test_kv_pool_sizing_reads_xla_statistics_or_else_the_driver(monkeypatch):
    """The KV pool takes utilization x the process's memory limit, less what is in use: from
    XLA's allocator statistics, or - under the VMM allocator, which keeps none - from the CUDA
    driver, with the client's memory fraction of the device as the limit."""
    from bijax import llm as L

    assert L._device_memory(_FakeGpu({"bytes_limit": 100, "bytes_in_use": 30})) == (100, 30)
    asked = []
    monkeypatch.setattr(L, "_driver_memory", lambda ordinal: asked.append(ordinal) or (600, 1000))
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    assert L._device_memory(_FakeGpu({})) == (750, 400) and asked == [3]
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", ".5")
    assert L._device_memory(_FakeGpu({"bytes_limit": 0})) == (500, 400)
    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", ".25")  # the new name wins
    assert L._device_memory(_FakeGpu({})) == (250, 400)
    for bad in ("most", "1.5"):
        monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", bad)
        with pytest.raises(ValueError, match="XLA_CLIENT_MEM_FRACTION must be a number in"):
            L._device_memory(_FakeGpu({}))
    monkeypatch.delenv("XLA_CLIENT_MEM_FRACTION")
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION")
    cfg = _llm("tiny").model.config
    monkeypatch.setattr(L.jax, "local_devices", lambda: [_FakeGpu({})])
    per_block = 2 * cfg.num_layers * 16 * cfg.num_kv_heads * cfg.head_dim * 4
    monkeypatch.setattr(L, "_driver_memory", lambda ordinal: (900 * per_block, 1000 * per_block))
    # 0.5 x 750 - 100 blocks' bytes: 275 blocks, or fewer if the engine wants fewer
    assert (
        L._kv_blocks(cfg, np.float32, 16, 8, 4, 0.5) == 33
        and L._kv_blocks(cfg, np.float32, 16, 100, 4, 0.5) == 275
    )
    with pytest.raises(ValueError, match="leaves no room for the KV cache"):
        L._kv_blocks(cfg, np.float32, 16, 8, 4, 0.1)


def test_the_gpu_graph_update_mode_is_asked_for_only_with_staged_inputs_and_a_users_setting_wins():
    """Importing bijax asks XLA to keep its scratch buffer in place for CUDA graphs only when
    ``BIJAX_STAGED_INPUTS=1`` is set by then (without staging SKIP_TEMP made no step faster and
    its VMM allocator keeps no memory statistics); a flag the user set, or a backend already
    running, leaves XLA_FLAGS as is."""
    import os
    import subprocess
    import sys

    import jax

    import bijax
    from pallas_kernels.runtime import request_xla_flag

    def flags_after_import(**env):
        code = "import os, bijax; print(os.environ.get('XLA_FLAGS', ''))"
        base = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "BIJAX_STAGED_INPUTS")}
        out = subprocess.run(
            [sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True
        )
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout.split()

    assert bijax.GPU_GRAPH_UPDATE_MODE in flags_after_import(BIJAX_STAGED_INPUTS="1")
    assert bijax.GPU_GRAPH_UPDATE_MODE not in flags_after_import()  # (the control: the default)
    users = "--xla_gpu_command_buffer_update_mode=ALWAYS_UPDATE"
    assert flags_after_import(BIJAX_STAGED_INPUTS="1", XLA_FLAGS=users).count(users) == 1
    assert bijax.GPU_GRAPH_UPDATE_MODE not in flags_after_import(BIJAX_STAGED_INPUTS="1", XLA_FLAGS=users)

    before = os.environ["XLA_FLAGS"]
    jax.devices()
    assert not request_xla_flag("--xla_gpu_dot_merger_threshold_mb=0")  # XLA read its flags
    assert os.environ["XLA_FLAGS"] == before


def test_a_gpu_process_that_started_jax_before_bijax_is_told_why_steps_are_slower(monkeypatch):
    """The request for the graph update mode is refused once a backend runs (or not made: staging
    switched on after the import); on a GPU with
    staged step inputs the engine then says so (a warning naming the fix), on CPU or without
    staging (the default: new input buffers every step update the graph anyway) nothing; a flag
    named in XLA_FLAGS (bijax's or the user's own value) is a choice made: no note."""
    import bijax
    from bijax.llm import graph_update_note

    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_platform_dependent_math=false")
    note = graph_update_note("gpu", staged=True)
    assert note is not None and "before importing bijax" in note and bijax.GPU_GRAPH_UPDATE_MODE in note
    assert graph_update_note("gpu", staged=False) is None
    assert graph_update_note("cpu", staged=True) is None
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_command_buffer_update_mode=ALWAYS_UPDATE")
    assert graph_update_note("gpu", staged=True) is None
    monkeypatch.setenv("XLA_FLAGS", bijax.GPU_GRAPH_UPDATE_MODE)
    assert graph_update_note("gpu", staged=True) is None


def test_the_baseline_compiles_its_forward_without_the_dot_merger():
    """The XLA path's programs compile without XLA's dot merger (it made a layer's gate and up
    one slow Triton GEMM on the H200); the invariant path's as they are."""
    inv, xla = _llm("tiny").engine.runner, _llm("tiny", invariant=False).engine.runner
    merger_off = {"xla_gpu_dot_merger_threshold_mb": 0}
    keys = (
        ("forward", 8, 64, 8),
        ("embed", 64),
        ("head", 64, 8),
        ("block", 8, 64, 0),
        ("sample", 8, 0, False),
    )
    for key in keys:
        switch = {} if key[0] != "block" or inv._layer_buffers else {"xla_gpu_enable_command_buffer": ""}
        assert inv._compiler_options(key) == (switch or None)
        assert xla._compiler_options(key) == merger_off | switch


def test_baseline_jit_compiles_only_the_baselines_program_with_its_options(monkeypatch):
    """``score_program`` and ``bijax.logprobs`` are ``baseline_jit`` programs: an option that XLA
    rejects is seen by the invariant=False call alone (the options reach that compile, and only it)."""
    import jax
    import jax.numpy as jnp

    from bijax import rl, step_programs

    assert set(step_programs.score_program.jitted) == set(rl._logprobs.jitted) == {True, False}
    monkeypatch.setattr(step_programs, "BASELINE_XLA_OPTIONS", {"xla_no_such_option": 1})
    f = step_programs.baseline_jit(lambda x, *, invariant: x * 2, static_argnames=("invariant",))
    assert f(jnp.ones(3), invariant=True).tolist() == [2, 2, 2]
    with pytest.raises(jax.errors.JaxRuntimeError, match="xla_no_such_option"):
        f(jnp.ones(3), invariant=False)
    # inside a caller's jit or grad it is part of the caller's program (nested options: refused)
    assert jax.jit(lambda x: f(x, invariant=False))(jnp.ones(3)).tolist() == [2, 2, 2]
    assert jax.grad(lambda x: f(x, invariant=False).sum())(jnp.ones(3)).tolist() == [2, 2, 2]


def test_tokenizer_argument_is_a_tokenizer_or_where_one_is():
    """``tokenizer=`` a path loads it (vLLM's convention); anything else is refused by name
    before the model loads (a str was an AttributeError from deep in the engine)."""
    import bijax
    from models.loading import embedded_model_path
    from models.tokenizer import Tokenizer

    with pytest.raises(TypeError, match="tokenizer must be a bijax Tokenizer.*got int"):
        bijax.LLM("tiny", tokenizer=123)
    with pytest.raises(FileNotFoundError, match="tokenizer: no tokenizer at"):
        bijax.LLM("tiny", tokenizer="/nonexistent/tokenizer")
    llm = bijax.LLM("tiny", tokenizer=embedded_model_path("smollm2-135m"), max_model_len=64, num_kv_blocks=8)
    assert isinstance(llm.tokenizer, Tokenizer) and llm.tokenizer.encode("Paris", add_special_tokens=False)
    llm.close()


def test_top_logprobs_of_a_vocabulary_under_twenty():
    """A step asks for min(20, vocabulary) top logprobs: with 5 tokens any logprobs request
    failed inside the sampling program; more than the vocabulary is refused up front."""
    import dataclasses

    import bijax
    from models.configs import preset
    from models.llama import Llama

    model = Llama(dataclasses.replace(preset("tiny"), vocab_size=5), dtype=jnp.float32, seed=0)
    llm = bijax.LLM(model, max_model_len=32, max_num_seqs=2, max_num_batched_tokens=16, num_kv_blocks=8)
    o = llm.generate([1, 2, 3], SP(temperature=0, max_tokens=2, logprobs=5), use_tqdm=False)[0]
    top = o.outputs[0].top_logprobs
    assert [len(t) for t in top] == [5, 5] and [t[0][0] for t in top] == o.token_ids
    assert sorted(i for i, _ in top[0]) == list(range(5))
    with pytest.raises(ValueError, match=r"logprobs \(6\) exceeds the vocabulary size \(5\)"):
        llm.generate([1, 2, 3], SP(max_tokens=2, logprobs=6), use_tqdm=False)
    llm.close()


def test_misshapen_calls_are_named(llm):
    """Arguments of the wrong kind get an error naming them (a dict of sampling settings was
    read as its keys; a str to score was split into characters; a str of ids in a dict prompt
    was tokenized as text; a too-long sequence to score named max_tokens)."""
    import bijax

    with pytest.raises(TypeError, match="sampling_params must be a SamplingParams or a list.*got dict"):
        llm.generate(PROMPT, {"temperature": 0, "max_tokens": 2}, use_tqdm=False)
    with pytest.raises(TypeError, match=r"token_ids\[0\] must be a list of int token ids, got str"):
        llm.score(["Hello world"], [1])
    with pytest.raises(TypeError, match="prompt_lens must be a list .*got int"):
        llm.score([PROMPT], 2)
    with pytest.raises(ValueError, match=r"token_ids\[0\]: \d+ tokens exceed max_model_len"):
        llm.score([PROMPT * llm.config.max_model_len], [1])
    full = (PROMPT * llm.config.max_model_len)[: llm.config.max_model_len]  # exactly max_model_len
    assert llm.score([full], [len(full)])[0].shape == (0,)  # nothing to score: "exceeds" was wrong
    assert llm.score([full], [len(full) - 1])[0].shape == (1,)
    with pytest.raises(TypeError, match="'prompt_token_ids' must be a list of int token ids, got str"):
        llm.generate({"prompt_token_ids": "5 17 42"}, SP(max_tokens=1), use_tqdm=False)
    with pytest.raises(ValueError, match="exactly one key"):
        llm.generate({"prompt_token_ids": PROMPT, "multi_modal_data": {}}, SP(max_tokens=1), use_tqdm=False)
    with pytest.raises(TypeError, match="model must be a preset"):
        bijax.LLM(None)
    # token ids as JAX arrays, as numpy's: one prompt, one a row, or a list of them
    want = llm.generate([PROMPT, PROMPT], SP(max_tokens=1, temperature=0), use_tqdm=False)[0].token_ids
    for prompts in (jnp.asarray(PROMPT), jnp.asarray([PROMPT, PROMPT]), [jnp.asarray(PROMPT)]):
        got = llm.generate(prompts, SP(max_tokens=1, temperature=0), use_tqdm=False)
        assert got[0].prompt_token_ids == PROMPT and got[0].token_ids == want, prompts
    assert llm.score(jnp.asarray([PROMPT + [1]]), [len(PROMPT)])[0].shape == (1,)
    with pytest.raises(TypeError, match=r"token_ids\[0\]: a prompt array must be 1-D int token ids"):
        llm.score([np.asarray(PROMPT, np.float32)], [1])
    seeds = llm.engine._seeds.bit_generator.state
    with pytest.raises(TypeError, match="on_output must be a callable fn\\(i, out\\) or None, got int"):
        llm.generate(PROMPT, SP(max_tokens=1), use_tqdm=False, on_output=5)  # refused before it runs
    assert llm.engine._seeds.bit_generator.state == seeds  # (no request was added: no seed drawn)
