"""`bijax serve` through the official `openai` client against real server processes.

Two servers for the whole module: `tiny` (random weights, token-id prompts, 4 seqs x 64 tokens
per step) for invariance, streaming, the 200-request burst and SIGTERM; and the embedded
SmolLM2 (a tokenizer and a chat template; with --api-key; slower steps) for chat, text prompts,
stop strings, tokenize, disconnects and the error cases. The in-process references are
test_engine's shared LLMs (the tiny one with other limits: 8 seqs), so equal bits also show
that the server's batching changed nothing.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import numpy as np
import openai
import pytest

from bijax import SamplingParams as SP
from tests.bijax.test_engine import shared_llm
from tests.conftest import bits

KEY = "test-key"
ENGINE = ["--max-model-len", "256", "--block-size", "16"]
TINY = ["--model", "tiny", "--dtype", "float32", "--max-num-seqs", "4", "--max-num-batched-tokens", "64"]
SMOL = ["--model", "smollm2-135m", "--max-num-seqs", "8", "--max-num-batched-tokens", "64",
        "--num-kv-blocks", "160", "--model-seed", "1", "--api-key", KEY,
        "--served-model-name", "smol", "smollm2-135m", "--max-request-bytes", "16000000"]  # fmt: skip
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Server:
    def __init__(self, argv):
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
        cmd = [sys.executable, "-m", "bijax.cli", "serve", "--port", "0", *ENGINE, *argv]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        self.url = None

    def wait(self, timeout=300) -> Server:
        t0 = time.time()
        while self.url is None:
            text = open(self.log.name).read()
            for line in text.splitlines():
                if "bijax serve:" in line and " on http://" in line:
                    self.url = line.split(" on ")[1].split()[0].removesuffix("/v1")
            assert self.proc.poll() is None, f"server exited:\n{text[-3000:]}"
            assert time.time() - t0 < timeout, f"server did not start:\n{text[-3000:]}"
            time.sleep(0.2)
        return self

    def client(self, key=KEY, cls=openai.OpenAI, timeout=300.0):
        return cls(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=timeout)

    def get(self, path, key=None) -> tuple[int, str]:
        req = urllib.request.Request(self.url + path, headers=_auth(key))
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def post(self, path, body: bytes | dict, key=KEY) -> tuple[int, dict]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers=_auth(key), method="POST")
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def metric(self, name, **labels) -> float:
        """The sum of metric ``name`` over the series that have ``labels``."""
        _, text = self.get("/metrics")
        want = [f'{k}="{v}"' for k, v in labels.items()]
        lines = [x for x in text.splitlines() if x.startswith(name + "{") and all(w in x for w in want)]
        assert lines, f"no metric {name} {labels}"
        return sum(float(x.split()[-1]) for x in lines)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        os.unlink(self.log.name)


def _auth(key):
    return {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}


@pytest.fixture(scope="module")
def servers():
    started = {"tiny": Server(TINY), "smol": Server(SMOL)}  # both start at once
    try:
        yield {k: s.wait() for k, s in started.items()}
    finally:
        for s in started.values():
            s.stop()


@pytest.fixture(scope="module")
def tiny(servers):
    return servers["tiny"]


@pytest.fixture(scope="module")
def smol(servers):
    return servers["smol"]


def lp_bits(values) -> np.ndarray:
    return bits(np.asarray(values, np.float32))


NEEDLE = list(map(int, np.random.default_rng(5).integers(3, 512, 23)))
NEEDLE_KW = dict(temperature=0.8, top_p=0.9, seed=11, max_tokens=8, logprobs=0, ignore_eos=True)


def _others(count):
    """31 other requests of mixed lengths, parameters, n, top logprobs (another step program)
    and streaming."""
    rng = np.random.default_rng(7)
    out = []
    for i in range(count):
        prompt = list(map(int, rng.integers(3, 512, int(rng.integers(1, 60)))))
        kw = [dict(temperature=0), dict(temperature=1.0, top_k=20, seed=i), dict(temperature=0.6, n=2)][i % 3]
        if i % 5 == 0:
            kw["logprobs"] = 3
        out.append((prompt, dict(max_tokens=int(rng.integers(2, 9)), stream=i % 2 == 0, **kw)))
    return out


async def _complete(client, prompt, kw, stream_needle=False):
    """(token ids, logprobs) of one completion; streamed ones are reassembled from the chunks."""
    if not kw.get("stream") and not stream_needle:
        r = await client.completions.create(model="tiny", prompt=prompt, extra_body=_extra(kw), **_std(kw))
        c = r.choices[0]
        return c.token_ids, (c.logprobs.token_logprobs if c.logprobs else None)
    kw = {**kw, "stream": True}
    ids, lps = [], []
    async for chunk in await client.completions.create(
        model="tiny", prompt=prompt, extra_body=_extra(kw), **_std(kw)
    ):
        for c in chunk.choices:
            if c.index == 0:
                ids += c.token_ids
                lps += c.logprobs.token_logprobs if c.logprobs else []
    return ids, lps


def _complete_sync(client, prompt, kw):
    r = client.completions.create(model="tiny", prompt=prompt, extra_body=_extra(kw), **_std(kw))
    return r.choices[0].token_ids, r.choices[0].logprobs.token_logprobs


_STD = ("temperature", "top_p", "seed", "max_tokens", "logprobs", "n", "stream", "stop")


def _std(kw):
    return {k: v for k, v in kw.items() if k in _STD}


def _extra(kw):
    return {"return_token_ids": True, **{k: v for k, v in kw.items() if k not in _STD}}


def test_same_bits_alone_with_31_concurrent_and_as_llm_generate(tiny):
    async def batch(client, stream_needle):
        jobs = [_complete(client, p, kw) for p, kw in _others(31)]
        jobs.insert(13, _complete(client, NEEDLE, NEEDLE_KW, stream_needle))
        return (await asyncio.gather(*jobs))[13]

    async def run():
        async with tiny.client(cls=openai.AsyncOpenAI) as client:
            alone = await _complete(client, NEEDLE, NEEDLE_KW)
            return alone, await batch(client, False), await batch(client, True)

    alone, crowded, streamed = asyncio.run(run())
    ref = shared_llm("tiny").generate(NEEDLE, SP(**{k: v for k, v in NEEDLE_KW.items()}), use_tqdm=False)[0]
    assert len(ref.token_ids) == 8
    for ids, lps in (alone, crowded, streamed):
        assert ids == ref.token_ids
        np.testing.assert_array_equal(lp_bits(lps), bits(ref.logprobs))
    # Negative control: the same check tells another seed's bits apart.
    other = _complete_sync(tiny.client(), NEEDLE, {**NEEDLE_KW, "seed": 12})
    assert other[0] != ref.token_ids or not np.array_equal(lp_bits(other[1]), bits(ref.logprobs))


def test_json_floats_round_trip_the_float32_bits():
    x = np.random.default_rng(0).standard_normal(1000).astype(np.float32) * 10
    back = np.asarray(json.loads(json.dumps([float(v) for v in x])), np.float32)
    np.testing.assert_array_equal(bits(back), bits(x))
    # Control: one ulp off is caught by the same comparison.
    bumped = back.copy()
    bumped[500] = np.nextafter(bumped[500], np.float32(np.inf))
    assert not np.array_equal(bits(bumped), bits(x))


def test_streaming_every_token_once_in_order_with_usage_and_n(tiny):
    client = tiny.client()
    kw = dict(model="tiny", prompt=[NEEDLE, NEEDLE[:5]], temperature=1.0, seed=3, max_tokens=6, n=2)
    whole = client.completions.create(**kw, logprobs=1, extra_body={"return_token_ids": True})
    assert [c.index for c in whole.choices] == [0, 1, 2, 3]
    ids, lps, reasons, usage = {}, {}, {}, None
    for chunk in client.completions.create(
        **kw,
        logprobs=1,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"return_token_ids": True},
    ):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            assert c.index not in reasons, "a chunk after the choice finished"
            ids.setdefault(c.index, []).extend(c.token_ids)
            lps.setdefault(c.index, []).extend(c.logprobs.token_logprobs)
            if c.finish_reason is not None:
                reasons[c.index] = c.finish_reason
    for c in whole.choices:
        assert ids[c.index] == c.token_ids and reasons[c.index] == c.finish_reason
        np.testing.assert_array_equal(lp_bits(lps[c.index]), lp_bits(c.logprobs.token_logprobs))
        assert len(c.logprobs.top_logprobs[0]) == 1
    assert whole.choices[0].token_ids != whole.choices[1].token_ids  # n samples differ
    n_out = sum(len(c.token_ids) for c in whole.choices)
    assert whole.usage.prompt_tokens == len(NEEDLE) + 5 and whole.usage.completion_tokens == n_out
    assert usage.model_dump() == whole.usage.model_dump()


def test_the_seed_used_is_returned_and_reproduces(tiny):
    client = tiny.client()
    raw = client.completions.with_raw_response.create(
        model="tiny", prompt=NEEDLE, temperature=1.0, max_tokens=5, logprobs=0
    )
    r = raw.parse()
    seed = r.choices[0].seed
    assert raw.headers["x-bijax-seed"] == str(seed)
    again = client.completions.create(
        model="tiny", prompt=NEEDLE, temperature=1.0, max_tokens=5, logprobs=0, seed=seed
    )
    np.testing.assert_array_equal(
        lp_bits(again.choices[0].logprobs.token_logprobs), lp_bits(r.choices[0].logprobs.token_logprobs)
    )


def test_burst_of_200_concurrent_requests_loses_nothing(tiny):
    done_before = tiny.metric("bijax_requests_finished_total")
    tokens_before = tiny.metric("bijax_generation_tokens_total")
    steps_before = tiny.metric("bijax_step_seconds_count")
    rng = np.random.default_rng(1)
    prompts = [list(map(int, rng.integers(3, 512, int(rng.integers(1, 40))))) for _ in range(200)]

    async def one(client, i):
        kw = dict(temperature=0.5, seed=i, max_tokens=1 + i % 4, ignore_eos=True, stream=i % 3 == 0)
        return await _complete(client, prompts[i], kw)

    async def run():
        async with tiny.client(cls=openai.AsyncOpenAI) as client:
            return await asyncio.gather(*(one(client, i) for i in range(200)))

    t0 = time.time()
    results = asyncio.run(run())
    assert time.time() - t0 < 120
    assert [len(ids) for ids, _ in results] == [1 + i % 4 for i in range(200)]
    assert tiny.metric("bijax_requests_finished_total") - done_before == 200
    tokens = sum(1 + i % 4 for i in range(200))
    assert tiny.metric("bijax_generation_tokens_total") - tokens_before == tokens
    # Requests shared steps (continuous batching): one at a time would take a step per token.
    assert tiny.metric("bijax_step_seconds_count") - steps_before < 0.6 * tokens
    assert tiny.metric("bijax_kv_blocks_in_use") == 0 and tiny.metric("bijax_num_unfinished_requests") == 0


# ---------------------------------------------------------------------- SmolLM2 (with --api-key)

MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]


def test_chat_equals_llm_chat_whole_and_streamed(smol):
    client = smol.client()
    kw = dict(model="smol", messages=MSGS, temperature=0.7, seed=5, max_tokens=8)
    r = client.chat.completions.create(
        **kw, logprobs=True, top_logprobs=2, extra_body={"return_token_ids": True}
    )
    ref = shared_llm("smollm2").chat(
        MSGS, SP(temperature=0.7, seed=5, max_tokens=8, logprobs=2), use_tqdm=False
    )[0]
    c = r.choices[0]
    assert c.token_ids == ref.token_ids and c.message.content == ref.text and c.message.role == "assistant"
    assert r.prompt_token_ids == ref.prompt_token_ids
    np.testing.assert_array_equal(lp_bits([t.logprob for t in c.logprobs.content]), bits(ref.logprobs))
    tops = [[(t.logprob) for t in e.top_logprobs] for e in c.logprobs.content]
    np.testing.assert_array_equal(
        lp_bits(tops), lp_bits([[v for _, v in s] for s in ref.outputs[0].top_logprobs])
    )
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids) and r.usage.completion_tokens == len(
        ref.token_ids
    )
    # Negative control: another seed's reply fails the same comparison.
    other = client.chat.completions.create(
        **{**kw, "seed": 6}, logprobs=True, extra_body={"return_token_ids": True}
    ).choices[0]
    other_bits = lp_bits([t.logprob for t in other.logprobs.content])
    assert other.token_ids != ref.token_ids or not np.array_equal(other_bits, bits(ref.logprobs))
    text, ids = "", []
    for chunk in client.chat.completions.create(**kw, stream=True, extra_body={"return_token_ids": True}):
        for ch in chunk.choices:
            text += ch.delta.content or ""
            ids += getattr(ch, "token_ids", None) or []
    assert text == ref.text and ids == ref.token_ids


def test_text_completion_equals_llm_generate_and_stop_strings(smol):
    client = smol.client()
    prompt = "The capital of France is"
    r = client.completions.create(
        model="smollm2-135m", prompt=prompt, temperature=0, max_tokens=12, logprobs=0
    )
    ref = shared_llm("smollm2").generate(prompt, SP(temperature=0, max_tokens=12), use_tqdm=False)[0]
    assert r.choices[0].text == ref.text
    np.testing.assert_array_equal(lp_bits(r.choices[0].logprobs.token_logprobs), bits(ref.logprobs))
    words = ref.text.split()
    word = words[1] if len(words) > 1 else ref.text.strip()[:3]
    cut = ref.text[: ref.text.find(word)]
    kw = dict(model="smol", prompt=prompt, temperature=0, max_tokens=12, stop=[word])
    s = client.completions.create(**kw)
    assert s.choices[0].finish_reason == "stop" and s.choices[0].text == cut
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True) if c.choices)
    assert streamed == cut  # the stop string was held back, never sent


def test_tokenize_and_detokenize(smol):
    tok = shared_llm("smollm2").tokenizer
    status, r = smol.post("/tokenize", {"prompt": "Hello there, world"})
    assert (
        status == 200 and r["tokens"] == tok.encode("Hello there, world") and r["count"] == len(r["tokens"])
    )
    status, r2 = smol.post("/detokenize", {"tokens": r["tokens"]})
    assert status == 200 and r2["prompt"] == tok.decode(r["tokens"])
    status, r3 = smol.post("/tokenize", {"messages": MSGS})
    assert r3["tokens"] == tok.encode_chat(MSGS) and r3["max_model_len"] == 256


@pytest.mark.parametrize(
    "body, status, param, text",
    [
        ({"prompt": "x", "temperature": -1}, 400, "temperature", ">= 0"),
        ({"prompt": "x", "top_p": 2}, 400, "top_p", "(0, 1]"),
        ({"prompt": "x", "n": 0}, 400, "n", "[1, 4096]"),
        ({"prompt": "x", "n": 10**9}, 400, "n", "[1, 4096]"),  # never a billion sequences
        ({"prompt": "x", "max_tokens": "5"}, 400, "max_tokens", "integer"),
        ({"prompt": "x", "logprobs": 50}, 400, "logprobs", "[0, 20]"),
        ({"prompt": "x", "seed": -3}, 400, "seed", "2**32"),
        ({"prompt": "x", "stop": 5}, 400, "stop", "string"),
        ({"prompt": 5}, 400, "prompt", "token ids"),
        ({"prompt": [[1, 2], 3]}, 400, "prompt", "token ids"),
        ({"prompt": [70000]}, 400, "prompt", "vocabulary"),
        ({"prompt": ["Hi", ""]}, 400, "prompt", "prompt[1]: prompt is empty"),  # which of them
        ({"prompt": [[1, 2], []]}, 400, "prompt", "prompt[1] is an empty list of token ids"),
        ({"prompt": "x", "frequency_penalty": 0.5}, 400, "frequency_penalty", "not supported"),
        ({"prompt": "x", "logit_bias": {"1": 0, "2": 5}}, 400, "logit_bias", "not supported"),
        # vLLM's fields bijax does not implement: refused, never silently ignored
        ({"prompt": "x", "min_tokens": 5}, 400, "min_tokens", "not supported"),
        ({"prompt": "x", "guided_choice": ["a", "b"]}, 400, "guided_choice", "not supported"),
        ({"prompt": "x", "skip_special_tokens": False}, 400, "skip_special_tokens", "not supported"),
        ({"prompt": "x", "stop": ["s"] * 65}, 400, "stop", "at most 64 stop strings"),
        ({"prompt": "x", "stop": "s" * 1001}, 400, "stop", "at most 1000"),
        ({"prompt": "x", "stop_token_ids": [70000]}, 400, "stop_token_ids", "vocabulary"),
        ({"prompt": ["x", "y"], "n": 4096}, 400, "n", "8192 sequences"),  # (--max-request-seqs)
        ({"prompt": "x", "model": "m" * 5000}, 404, "model", "(5000 characters)"),
        (
            {"prompt": "x", "stream": True, "stream_options": {"continuous_usage_stats": True}},
            400,
            "stream_options",
            "not supported",
        ),
        ({"prompt": " x" * 300, "max_tokens": 4}, 400, "prompt", "max_model_len"),
        ({"prompt": "x", "max_tokens": 256}, 400, "prompt", "max_model_len"),
        ({"prompt": "x", "model": "gpt-4"}, 404, "model", "does not exist"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options", "stream"),
        ({"prompt": "x", "temperature": "t" * 100_000}, 400, "temperature", "characters)"),  # cut short
        ({"prompt": "x", "temperature": 1e300}, 400, "temperature", "float32"),
        # chat's fields, which this endpoint would ignore
        ({"prompt": "x", "max_completion_tokens": 40}, 400, "max_completion_tokens", "use max_tokens"),
        ({"prompt": "x", "logprobs": 1, "top_logprobs": 3}, 400, "top_logprobs", "use logprobs"),
        (
            {"prompt": "x", "stream": True, "stream_options": {"k" * 5000: 1}},
            400,
            "stream_options",
            "(5002 characters)",
        ),
    ],
)
def test_bad_completion_requests_name_the_field(smol, body, status, param, text):
    got, r = smol.post("/v1/completions", body)
    assert got == status and r["error"]["param"] == param and text in r["error"]["message"], r


def test_bad_chat_requests_bad_json_and_the_official_clients_errors(smol):
    got, r = smol.post("/v1/chat/completions", {"messages": "hi"})
    assert got == 400 and r["error"]["param"] == "messages"
    got, r = smol.post("/v1/chat/completions", {"messages": MSGS, "top_logprobs": 3})
    assert got == 400 and r["error"]["param"] == "top_logprobs"
    got, r = smol.post("/v1/chat/completions", {"messages": MSGS, "logprobs": True, "top_logprobs": 99})
    assert got == 400 and r["error"]["param"] == "top_logprobs"
    got, r = smol.post("/v1/completions", b"{not json")
    assert got == 400 and "JSON" in r["error"]["message"]
    got, r = smol.post("/v1/completions", json.dumps({"prompt": "cut \ud83c"}).encode())  # (half an emoji)
    assert got == 400 and "not valid Unicode" in r["error"]["message"], r
    got, r = smol.post("/v1/chat/completions", {"messages": [*MSGS, {"role": "assistant", "tool_calls": 5}]})
    assert got == 400 and "messages[2].tool_calls must be a list of objects" in r["error"]["message"], r
    req = urllib.request.Request(smol.url + "/v1/completions", headers=_auth(KEY), method="PUT")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=60)
    assert e.value.code == 405 and e.value.headers["Allow"] == "POST", e.value.headers  # (RFC 9110)
    assert "PUT '/v1/completions'" in json.loads(e.value.read())["error"]["message"]
    got, text = smol.get("/v2/completions")
    assert got == 404 and "GET '/v2/completions'" in text, text
    big = [{"role": "user", "content": "word " * 300}]
    got, r = smol.post("/v1/chat/completions", {"messages": big})
    assert got == 400 and r["error"]["code"] == "context_length_exceeded"
    assert "leaves no room for a reply" in r["error"]["message"], r  # (no max_tokens it was not sent)
    got, r = smol.post("/v1/chat/completions", {"messages": MSGS, "max_completion_tokens": 10**6})
    assert got == 400 and r["error"]["code"] == "context_length_exceeded", r
    assert "max_completion_tokens (1000000)" in r["error"]["message"], r  # (the name it was sent as)
    got, r = smol.post("/v1/chat/completions", {"messages": MSGS, "max_tokens": 10**6})
    assert got == 400 and r["error"]["code"] == "context_length_exceeded", r
    assert (
        r["error"]["message"].startswith("the templated messages (")
        and "max_tokens (1000000)" in r["error"]["message"]
    ), r
    got, r = smol.post("/v1/chat/completions", {"messages": MSGS, "functions": [{"name": "f"}]})
    assert got == 400 and r["error"]["param"] == "functions", r
    with pytest.raises(openai.NotFoundError):
        smol.client().completions.create(model="nope", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError) as e:
        smol.client().completions.create(model="smol", prompt="x", max_tokens=1, temperature=-2)
    assert e.value.body["param"] == "temperature"


def _sse_chunks(text: str) -> list:
    """The JSON chunks of a server-sent event stream (without the closing [DONE])."""
    lines = [ln[len("data: ") :] for ln in text.splitlines() if ln.startswith("data: ")]
    return [json.loads(ln) for ln in lines if ln != "[DONE]"]


def test_nulls_mean_defaults_and_malformed_bodies_name_the_problem(smol, tiny):
    """OpenAI's schema allows null for its optional fields: null is the field's default. A body
    that is JSON but no object, a 0 under the name the client used, text parts that are not
    strings, and stop strings on a model without a tokenizer are 400s naming the right thing."""
    nulls = {"n": None, "stream": None, "ignore_eos": None, "return_token_ids": None, "logprobs": None}
    got, r = smol.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2, **nulls, "min_tokens": None})
    assert got == 200 and len(r["choices"]) == 1, r
    opts = {"stream": True, "stream_options": {"include_usage": None}}  # (a null inside it too)
    body = json.dumps({"prompt": "Hi", "max_tokens": 2, **opts}).encode()
    req = urllib.request.Request(smol.url + "/v1/completions", data=body, headers=_auth(KEY), method="POST")
    with urllib.request.urlopen(req, timeout=120) as r:
        text = r.read().decode()
        assert r.status == 200 and text.rstrip().endswith("data: [DONE]")
    assert all("usage" not in c for c in _sse_chunks(text))  # (no usage asked for: no key)
    # with include_usage every chunk has "usage" (OpenAI's): null but in the last, which has it
    for path, extra in (("/v1/completions", {"prompt": "Hi"}), ("/v1/chat/completions", {"messages": MSGS})):
        body = {**extra, "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}}
        req = urllib.request.Request(smol.url + path, data=json.dumps(body).encode(), headers=_auth(KEY))
        with urllib.request.urlopen(req, timeout=120) as r:
            chunks = _sse_chunks(r.read().decode())
        assert len(chunks) >= 3 and all(c["usage"] is None for c in chunks[:-1]), (path, chunks)
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 2
    chat_nulls = {"n": None, "stream": None, "logprobs": None, "add_generation_prompt": None}
    got, r = smol.post("/v1/chat/completions", {"messages": MSGS, "max_tokens": 2, **chat_nulls})
    assert got == 200 and r["choices"][0]["logprobs"] is None, r
    got, r = smol.post("/v1/completions", {"prompt": "Hi", "max_tokens": 1, "logit_bias": {"1": 0, "7": 0.0}})
    assert got == 200, r  # (biases of 0: neutral, as {})
    got, r = smol.post("/detokenize", {"tokens": None})
    assert got == 400 and r["error"]["param"] == "tokens" and "required" in r["error"]["message"]
    for body in (b"[1, 2]", b"null", b'"text"'):
        got, r = smol.post("/v1/completions", body)
        assert got == 400 and r["error"]["message"].startswith("the body must be a JSON object"), r
    got, r = smol.post("/v1/chat/completions", {"messages": MSGS, "max_completion_tokens": 0})
    assert got == 400 and r["error"]["param"] == "max_completion_tokens", r
    for content in ([{"type": "text", "text": 12345}], [{"type": "text"}], []):
        got, r = smol.post("/v1/chat/completions", {"messages": [{"role": "user", "content": content}]})
        assert got == 400 and r["error"]["param"] == "messages" and "content" in r["error"]["message"], r
    got, r = tiny.post("/v1/completions", {"prompt": [1, 2], "max_tokens": 2, "stop": ["a"]})
    assert got == 400 and r["error"]["param"] == "stop" and "tokenizer" in r["error"]["message"], r


def test_a_huge_prompt_is_tokenized_off_the_event_loop(smol):
    """A 12 MB prompt takes seconds to tokenize (then a 400: too long). It is tokenized in a
    worker thread that releases Python's lock, so a /health sent while it runs is answered first."""
    done = []

    async def big():
        body = json.dumps({"prompt": "hello world " * 1_000_000, "max_tokens": 1}).encode()
        got, r = await asyncio.to_thread(smol.post, "/v1/completions", body)
        done.append(("big", got, r["error"]["code"]))

    async def health():
        await asyncio.sleep(0.5)
        got, _ = await asyncio.to_thread(smol.get, "/health")
        done.append(("health", got))

    async def run():
        await asyncio.gather(big(), health())

    asyncio.run(run())
    assert done == [("health", 200), ("big", 400, "context_length_exceeded")], done


def test_body_limit_heavy_pool_and_template_errors(smol):
    """A body over --max-request-bytes is a 413 before it is read (Content-Length) or as it
    arrives (chunked); large bodies are parsed and tokenized in their own two-thread pool, so
    a few of them never hold the pool every other request's tokenization uses (eight 4 MB
    prompts held a small request 14 s); a chat template's own Python error is a 400 naming it."""
    import socket
    import threading
    import types

    from bijax.server import app as server_app

    host, port = smol.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        sock.sendall((head + "Content-Type: application/json\r\nContent-Length: 16000001\r\n\r\n").encode())
        reply = b""
        while b"--max-request-bytes" not in reply:  # (the headers and the body may come apart)
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
        reply = reply.decode()
    assert reply.startswith("HTTP/1.1 413") and "--max-request-bytes" in reply, reply[:300]

    class Chunked:  # what Server.body reads: headers, and the body as it arrives
        headers = {}

        async def stream(self):
            for _ in range(5):
                yield b"x" * 1000

    limits = types.SimpleNamespace(max_request_bytes=4000)
    with pytest.raises(server_app.ApiError, match="over 4000 bytes") as e:
        asyncio.run(server_app.Server.body(limits, Chunked()))
    assert e.value.status == 413
    limits.max_request_bytes = 5000
    assert asyncio.run(server_app.Server.body(limits, Chunked())) == b"x" * 5000

    pool = types.SimpleNamespace(heavy=server_app.concurrent.futures.ThreadPoolExecutor(1, "heavy-test"))
    where = [
        asyncio.run(server_app.Server.off_loop(pool, size, lambda: threading.current_thread().name))
        for size in (server_app.HEAVY_BYTES, server_app.HEAVY_BYTES + 1)
    ]
    pool.heavy.shutdown()
    assert not where[0].startswith("heavy-test") and where[1].startswith("heavy-test"), where

    tool_call = [{"role": "assistant", "content": None,
                  "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]  # fmt: skip
    got, r = smol.post("/v1/chat/completions", {"messages": tool_call, "max_tokens": 2})
    assert got == 400 and r["error"]["message"].startswith("chat template failed"), r


def test_api_key(smol):
    for key in (None, "wrong"):
        got, r = smol.post("/v1/completions", {"prompt": "x", "max_tokens": 1}, key=key)
        assert got == 401 and r["error"]["code"] == "invalid_api_key"
        assert smol.get("/v1/models", key=key)[0] == 401
    with pytest.raises(openai.AuthenticationError):
        smol.client(key="wrong").models.list()
    assert smol.get("/health")[0] == 200 and smol.get("/metrics")[0] == 200  # open without the key
    head = urllib.request.Request(smol.url + "/health", method="HEAD")  # (load balancers' probe)
    with urllib.request.urlopen(head, timeout=60) as r:
        assert r.status == 200
    assert [m.id for m in smol.client().models.list().data] == ["smol", "smollm2-135m"]


def test_bad_requests_do_not_harm_a_concurrent_good_one(smol):
    kw = dict(model="smol", prompt="Once upon a time", temperature=0.9, seed=2, max_tokens=6, logprobs=0)

    async def bad(client, i):
        try:
            await client.completions.create(
                model="smol", prompt="x", max_tokens=1, extra_body={"top_k": -5 - i}
            )
        except openai.BadRequestError as e:
            return e.status_code

    async def run():
        async with smol.client(cls=openai.AsyncOpenAI) as client:
            alone = await client.completions.create(**kw)
            bads = (bad(client, i) for i in range(8))
            return alone, await asyncio.gather(client.completions.create(**kw), *bads)

    alone, (good, *codes) = asyncio.run(run())
    assert codes == [400] * 8
    assert good.choices[0].text == alone.choices[0].text
    np.testing.assert_array_equal(
        lp_bits(good.choices[0].logprobs.token_logprobs), lp_bits(alone.choices[0].logprobs.token_logprobs)
    )


def _wait_until_no_blocks_in_use(server):
    deadline = time.time() + 30
    while server.metric("bijax_kv_blocks_in_use") > 0 and time.time() < deadline:
        time.sleep(0.1)
    assert server.metric("bijax_kv_blocks_in_use") == 0


def test_a_disconnect_aborts_and_frees_blocks(smol):
    """On SmolLM2 (a step takes tens of ms): 200 tokens take seconds, so the client surely
    leaves before the end."""
    aborted = smol.metric("bijax_requests_finished_total", finished_reason="abort")
    kw = dict(model="smol", prompt="Once upon a time", max_tokens=200, extra_body={"ignore_eos": True})
    stream = smol.client().completions.create(**kw, stream=True)
    next(iter(stream))
    assert smol.metric("bijax_kv_blocks_in_use") > 0  # control: while it streams, it holds blocks
    stream.close()
    _wait_until_no_blocks_in_use(smol)
    assert smol.metric("bijax_requests_finished_total", finished_reason="abort") == aborted + 1
    # Not streamed: a client that gives up waiting aborts its request too.
    with pytest.raises(openai.APITimeoutError):
        smol.client(timeout=1.0).completions.create(**kw)
    _wait_until_no_blocks_in_use(smol)
    assert smol.metric("bijax_requests_finished_total", finished_reason="abort") == aborted + 2


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--port", "70000"], "--port"),
        (["--api-key", ""], "--api-key"),
        (["--max-request-seqs", "0"], "--max-request-seqs"),
        (["--port", "IN_USE"], "cannot listen there"),
        (["--host", "nosuch.invalid", "--port", "0"], "cannot listen there"),  # (port 0: checked too)
    ],
)
def test_bad_serve_flags_exit_2_before_loading(capsys, argv, message):
    import socket

    from bijax import cli

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        argv = [str(taken.getsockname()[1]) if a == "IN_USE" else a for a in argv]
        assert cli.main(["serve", "--model", "tiny", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "loaded in" not in err


def test_logprobs_of_tokens_that_hold_part_of_a_character():
    """An emoji is several byte tokens, each decoding to U+FFFD alone: chat's ``bytes`` are the
    token's own bytes (they join to the text), completions name such tokens "bytes:\\xNN..."
    (distinct top_logprobs keys) and count text_offset in characters of the text."""
    from bijax.outputs import CompletionOutput
    from bijax.server.render import TextOffsets, chat_logprobs, completion_logprobs
    from models.loading import embedded_model_path
    from models.tokenizer import load_tokenizer

    tok = load_tokenizer(embedded_model_path("smollm2-135m"))
    text = "🌟👎 é!"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > 4 and sum(tok.decode([i]) == "\ufffd" for i in ids) >= 2
    steps = [[(i, -1.0), (j, -2.0)] for i, j in zip(ids, ids[1:] + ids[:1], strict=True)]
    o = CompletionOutput(0, ids, np.full(len(ids), -1.0, np.float32), text, None, top_logprobs=steps)
    chat = chat_logprobs(tok, o, 0, len(ids), True)["content"]
    assert b"".join(bytes(e["bytes"]) for e in chat).decode() == text
    legacy = completion_logprobs(tok, o, 0, len(ids), TextOffsets(tok))
    assert all(len(step) == 2 for step in legacy["top_logprobs"])  # no two keys collide
    assert any(t.startswith("bytes:\\x") for t in legacy["tokens"])
    assert legacy["text_offset"][-1] == text.index("!") and max(legacy["text_offset"]) < len(text)
    # streamed in two chunks: the offsets continue across them
    offsets = TextOffsets(tok)
    a = completion_logprobs(tok, o, 0, 3, offsets)["text_offset"]
    assert a + completion_logprobs(tok, o, 3, len(ids), offsets)["text_offset"] == legacy["text_offset"]


def test_text_offset_without_a_tokenizer_indexes_the_empty_text():
    """A model without a tokenizer (a preset) answers text "": every text_offset is 0, not one
    counted in the characters of the "token_id:N" names its logprobs give the tokens."""
    from bijax.outputs import CompletionOutput
    from bijax.server.render import TextOffsets, completion_logprobs

    o = CompletionOutput(0, [438, 224, 196], np.full(3, -1.0, np.float32), "", None)
    lp = completion_logprobs(None, o, 0, 3, TextOffsets(None))
    assert lp["tokens"] == ["token_id:438", "token_id:224", "token_id:196"]
    assert lp["text_offset"] == [0, 0, 0]


# ---------------------------------------------------------------------- last: it stops the tiny server


def test_sigterm_stops_cleanly_during_a_stream(tiny):
    client = tiny.client()
    stream = client.completions.create(
        model="tiny", prompt=NEEDLE, max_tokens=230, extra_body={"ignore_eos": True}, stream=True
    )
    next(iter(stream))
    t0 = time.time()
    tiny.proc.send_signal(signal.SIGTERM)
    rest = list(stream)  # the stream ends properly (the client sees data: [DONE])
    assert tiny.proc.wait(60) == 0 and time.time() - t0 < 5  # not the 5 s grace period
    assert rest[-1].choices[0].finish_reason == "abort"
    assert "bijax serve: stopped (SIGTERM)" in open(tiny.log.name).read()
