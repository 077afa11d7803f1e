"""Tokenizers and chat templates against transformers (fixtures from make_gguf_fixtures.py)."""

from __future__ import annotations

import gzip
import json
import os
import shutil

import pytest

from models.loading import embedded_model_path
from models.tokenizer import Tokenizer, UnsupportedTokenizer, load_tokenizer

FIX = os.path.join(os.path.dirname(__file__), "fixtures", "smollm2_gguf")
REF = json.load(open(os.path.join(FIX, "tokenizer.json"), encoding="utf-8"))


@pytest.fixture(scope="module")
def gguf_tok():
    return load_tokenizer(embedded_model_path("smollm2-135m"))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A HF tokenizer directory as transformers saved it (tokenizer.json stored gzipped)."""
    d = tmp_path_factory.mktemp("hf_tok")
    with gzip.open(os.path.join(FIX, "hf_tokenizer.json.gz"), "rb") as f:
        (d / "tokenizer.json").write_bytes(f.read())
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(os.path.join(FIX, name), d / name)
    return d


@pytest.fixture(scope="module", params=["gguf", "hf_dir"])
def tok(request, gguf_tok, hf_dir):
    return gguf_tok if request.param == "gguf" else load_tokenizer(hf_dir)


@pytest.mark.parametrize("i", range(len(REF["strings"])))
def test_ids_equal_transformers(tok, i):
    case = REF["strings"][i]
    assert tok.encode(case["text"]) == case["ids"], repr(case["text"])
    assert tok.encode(case["text"], add_special_tokens=False) == case["ids_no_special"]
    assert tok.decode(case["ids"]) == case["decoded"]
    assert tok.decode(case["ids"], skip_special_tokens=True) == case["decoded_skip_special"]


def test_every_string_round_trips(tok):
    for case in REF["strings"]:
        assert tok.decode(tok.encode(case["text"])) == case["text"]


@pytest.mark.parametrize("i", range(len(REF["chats"])))
def test_chat_template_equals_transformers(tok, i):
    chat = REF["chats"][i]
    assert tok.apply_chat_template(chat["messages"]) == chat["rendered"]
    assert tok.apply_chat_template(chat["messages"], add_generation_prompt=False) == chat["rendered_no_gen"]
    assert tok.encode_chat(chat["messages"]) == chat["ids"]
    assert tok.encode_chat(chat["messages"], add_generation_prompt=False) == chat["ids_no_gen"]


def test_special_tokens(tok):
    s = REF["special"]
    assert tok.vocab_size == s["vocab_size"]
    assert tok.bos_token_id == s["bos_token_id"]
    assert s["eos_token_id"] in tok.eos_token_ids
    for t in s["added_tokens"]:
        assert tok.token_to_id(t["content"]) == t["id"]
        assert tok.encode(t["content"], add_special_tokens=False) == [t["id"]]


def test_end_ids_from_generation_config_else_model_config(hf_dir, tmp_path):
    """The ids that end a generation, besides the tokenizer's eos_token: generation_config.json's;
    without that file config.json's, as transformers reads them (they were ignored)."""
    d = tmp_path / "tok"
    shutil.copytree(hf_dir, d)
    eos = load_tokenizer(d).eos_token_ids[0]
    assert load_tokenizer(d).eos_token_ids == (eos,)
    (d / "config.json").write_text(json.dumps({"eos_token_id": [eos, 7]}))
    assert load_tokenizer(d).eos_token_ids == (eos, 7)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert load_tokenizer(d).eos_token_ids == (eos, 5)  # the generation config wins


def test_negative_control_plain_bpe_differs(gguf_tok):
    """Without the control tokens registered as special, '<|im_start|>' would be cut into
    pieces: the check above can fail."""
    backend = gguf_tok._tok
    assert len(backend.model.tokenize("<|im_start|>")) > 1


def test_bad_input(gguf_tok, tmp_path):
    with pytest.raises(TypeError, match="str"):
        gguf_tok.encode(b"bytes")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        gguf_tok.decode([49152])
    with pytest.raises(ValueError, match="messages"):
        gguf_tok.apply_chat_template([])
    with pytest.raises(ValueError, match="'role' and 'content'"):
        gguf_tok.apply_chat_template([{"text": "hi"}])
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(tmp_path)
    bad = Tokenizer(
        gguf_tok._tok, bos_token=None, eos_token=None, chat_template="{% raise_exception('no system role') %}"
    )
    with pytest.raises(ValueError):
        bad.apply_chat_template([{"role": "user", "content": "x"}])
    raising = Tokenizer(
        gguf_tok._tok, bos_token=None, eos_token=None, chat_template="{{ raise_exception('no system role') }}"
    )
    with pytest.raises(ValueError, match="no system role"):
        raising.apply_chat_template([{"role": "user", "content": "x"}])
    concat = Tokenizer(  # a template's own Python error (null content + '...'): named, a ValueError
        gguf_tok._tok, bos_token=None, eos_token=None, chat_template="{{ messages[0]['content'] + '!' }}"
    )
    with pytest.raises(
        ValueError, match=r"chat template failed on these messages: TypeError.*messages \[0\] are tool"
    ):
        concat.apply_chat_template([{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}])
    plus_one = Tokenizer(
        gguf_tok._tok, bos_token=None, eos_token=None, chat_template="{{ messages[0]['content'] + 1 }}"
    )
    with pytest.raises(ValueError, match=r"chat template failed on these messages: TypeError") as err:
        plus_one.apply_chat_template([{"role": "user", "content": "x"}])
    assert "tool" not in str(err.value)  # (no tool message: no hint)
    no_template = Tokenizer(gguf_tok._tok, bos_token=None, eos_token=None, chat_template=None)
    with pytest.raises(ValueError, match="no chat template"):
        no_template.apply_chat_template([{"role": "user", "content": "x"}])


def test_unsupported_gguf_tokenizer_named():
    class Fake:
        metadata = {
            "tokenizer.ggml.model": "llama",
            "tokenizer.ggml.tokens": ["a"],
            "tokenizer.ggml.merges": [],
        }

    with pytest.raises(UnsupportedTokenizer, match="'llama'"):  # (a ValueError: the model loads without)
        Tokenizer.from_gguf(Fake())
    Fake.metadata = dict(Fake.metadata, **{"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "mystery"})
    with pytest.raises(UnsupportedTokenizer, match="'mystery'"):
        Tokenizer.from_gguf(Fake())


def test_generation_blocks_render_their_body(gguf_tok):
    """transformers' ``{% generation %}`` marker (its assistant mask) renders its body as it is;
    an unclosed one is named."""
    marked = "{% for m in messages %}<{{ m['role'] }}>{% generation %}{{ m['content'] }}{% endgeneration %}{% endfor %}"
    plain = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    a, b = (
        Tokenizer(gguf_tok._tok, bos_token=None, eos_token=None, chat_template=t).apply_chat_template(msgs)
        for t in (marked, plain)
    )
    assert a == b == "<user>hi<assistant>yo"
    unclosed = Tokenizer(gguf_tok._tok, bos_token=None, eos_token=None, chat_template="{% generation %}x")
    with pytest.raises(ValueError, match="does not parse"):
        unclosed.apply_chat_template(msgs)


def test_hf_directory_files_as_transformers_reads_them(hf_dir, tmp_path):
    """chat_template.jinja overrides tokenizer_config.json's template (it was the other way
    round: a silently different prompt); a template list needs a "default"; a corrupt or
    non-object generation_config.json / tokenizer_config.json is named (a corrupt
    generation_config.json was skipped, and config.json's eos ids with it)."""
    d = tmp_path / "tok"
    shutil.copytree(hf_dir, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "chat_template.jinja").write_text("NEW {{ messages[0]['content'] }}")
    (d / "tokenizer_config.json").write_text(
        json.dumps({**cfg, "chat_template": "OLD {{ messages[0]['content'] }}"})
    )
    hi = [{"role": "user", "content": "hi"}]
    assert load_tokenizer(d).apply_chat_template(hi) == "NEW hi"
    os.remove(d / "chat_template.jinja")
    assert load_tokenizer(d).apply_chat_template(hi) == "OLD hi"  # the control: the config's alone
    listed = [{"name": "tool_use", "template": "TOOL"}, {"name": "default", "template": "DEF"}]
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": listed}))
    assert load_tokenizer(d).apply_chat_template(hi) == "DEF"
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": listed[:1]}))
    no_default = load_tokenizer(d)  # loads (text needs no template); chatting says why not
    assert no_default.encode("hi") == load_tokenizer(hf_dir).encode("hi")
    with pytest.raises(ValueError, match=r"chat templates \['tool_use'\] and none named 'default'"):
        no_default.apply_chat_template(hi)
    (d / "tokenizer_config.json").write_text("[]")
    with pytest.raises(ValueError, match="tokenizer_config.json must hold a JSON object, got list"):
        load_tokenizer(d)
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    (d / "generation_config.json").write_text('{"eos_token_id": [1, 2],}')
    with pytest.raises(ValueError, match="generation_config.json is not valid JSON"):
        load_tokenizer(d)


def test_token_bytes_of_byte_level_and_byte_fallback_tokenizers(tok):
    """``token_bytes``: what a token stands for, also where it holds part of a character (its
    ``decode`` is U+FFFD alone). Byte-level BPE (SmolLM2): the tokens of any text join to its
    bytes. SentencePiece byte fallback: ``<0xNN>`` is that byte, "▁" a space."""
    for text in ("🌟👎 é", "答案 x\n\t", "<|im_end|>ab"):
        ids = tok.encode(text, add_special_tokens=False)
        assert b"".join(tok.token_bytes(i) for i in ids) == text.encode(), text
    assert any(tok.decode([i]) == "\ufffd" for i in tok.encode("🌟", add_special_tokens=False))  # (control)
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models

    vocab = {"<unk>": 0, "<0xF0>": 1, "<0x9F>": 2, "<0x8C>": 3, "\u2581a": 4, "b": 5}
    backend = Backend(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    spm = Tokenizer(backend, bos_token=None, eos_token=None, chat_template=None)
    assert [spm.token_bytes(i) for i in (1, 2, 3, 4, 5)] == [b"\xf0", b"\x9f", b"\x8c", b" a", b"b"]
    assert spm.decode([1]) == "\ufffd"  # (what the bytes are for)
