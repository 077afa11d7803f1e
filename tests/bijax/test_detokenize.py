"""bijax.detokenize: the incremental text equals the whole decode at every token."""

import itertools

import numpy as np
import pytest

from bijax.detokenize import current_text, partial_text, stop_prefix_len
from models.loading import embedded_model_path
from models.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(embedded_model_path("smollm2-135m"))


def _texts(decode, ids):
    """The incremental text after each token, as the engine builds it."""
    text, k, out = "", 0, []
    for n in range(1, len(ids) + 1):
        now, text, k = current_text(decode, ids[:n], text, k)
        out.append(now)
    return out


def test_incremental_text_is_the_whole_decode_after_every_token(tok):
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    rng = np.random.default_rng(0)
    # random ids (byte tokens that split UTF-8 characters included), and real text with
    # multi-byte characters, leading spaces and a special token in the middle
    cases = [rng.integers(0, tok.vocab_size, 300).tolist()]
    cases.append(tok.encode(" Grüße, 東京 — naïve café\n\n  déjà vu: ✓ 🎉 end", add_special_tokens=False))
    cases.append(cases[1][:5] + list(tok.eos_token_ids) + cases[1][5:])
    for ids in cases:
        for n, now in enumerate(_texts(decode, ids), start=1):
            assert now == decode(ids[:n]), (n, now, decode(ids[:n]))


def test_sentencepiece_style_decoders_too():
    """Llama-2-style (metaspace words, byte fallback, a stripped leading space) and plain
    metaspace decoders: a slice's first space is stripped, which the window absorbs."""
    from tokenizers import Tokenizer, decoders, models

    words = ["<unk>", "▁Hello", "▁wor", "ld", "▁", "<0xE2>", "<0x9C>", "<0x93>", "▁caf", "é", "!", "▁▁x"]
    rng = np.random.default_rng(1)
    ids = rng.integers(1, len(words), 200).tolist() + [4, 5, 6, 7, 1, 5, 6]  # ends mid-character
    for dec in (
        decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        ),
        decoders.Metaspace(),
    ):
        t = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
        t.decoder = dec
        for n, now in enumerate(_texts(t.decode, ids), start=1):
            assert now == t.decode(ids[:n]), (n, now, t.decode(ids[:n]))


def test_a_window_of_skipped_special_tokens_absorbs_no_stripped_space():
    """A window whose ids all decode to nothing (special tokens skipped) cannot absorb a
    metaspace decoder's stripped leading space: after ``WINDOW`` or more of them the next
    word's space was lost ('AB' streamed where the whole decode is 'A B')."""
    from tokenizers import Tokenizer, decoders, models

    from bijax.detokenize import WINDOW

    words = ["<unk>", "▁A", "▁B", "<x>"]
    t = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    t.add_special_tokens(["<x>"])
    t.decoder = decoders.Metaspace()
    decode = lambda ids: t.decode(ids, skip_special_tokens=True)  # noqa: E731
    for run in (WINDOW - 1, WINDOW, WINDOW + 3):
        ids = [1] + [3] * run + [2, 3, 1]
        assert decode(ids) == "A B A"
        for n, now in enumerate(_texts(decode, ids), start=1):
            assert now == decode(ids[:n]), (run, n, now, decode(ids[:n]))


def test_a_decoder_that_does_not_concatenate_gets_the_whole_decode():
    # a toy decoder that rewrites "ab" across token boundaries: a later token changes the text
    # of earlier ones, which the window check must catch
    words = ["a", "b", "c", " "]
    decode = lambda ids: "".join(words[i] for i in ids).replace("ab", "X")  # noqa: E731
    ids = [2, 3, 0, 0, 1, 2, 0, 3, 2, 2, 3, 3, 0, 1]
    for n, now in enumerate(_texts(decode, ids), start=1):
        assert now == decode(ids[:n])
    # control: appending each token's own text (no window, no check) goes wrong here
    naive = "".join(decode([i]) for i in ids)
    assert naive != decode(ids)


def test_stop_prefix_len_is_the_longest_suffix_a_stop_string_begins_with():
    assert stop_prefix_len("a, 6, ", [" 7"]) == 1
    assert stop_prefix_len("a, 6,", [" 7"]) == 0
    assert stop_prefix_len("xxab", ["abc", "b"]) == 2  # "ab" of "abc" (a whole "b" would have stopped)
    assert stop_prefix_len("", ["abc"]) == 0 and stop_prefix_len("ab", []) == 0
    assert (
        stop_prefix_len("aaa", ["aaab"]) == 3 and stop_prefix_len("aab", ["aab"]) == 0
    )  # shorter than the stop
    rng = np.random.default_rng(0)  # held text only grows: a shown prefix is never taken back
    text = "".join(rng.choice(list("ab "), 200))
    shown = [t[: len(t) - stop_prefix_len(t, ["ab a", "bb"])] for t in (text[:i] for i in range(201))]
    assert all(b.startswith(a) for a, b in itertools.pairwise(shown))


def test_stop_prefix_len_equals_the_plain_search():
    """The prefix-function version against the obvious search (one endswith per length), on
    random texts and stops over a small alphabet with a NUL (the separator's character)."""
    rng = np.random.default_rng(1)

    def plain(text, stops):
        return max(
            [
                next((k for k in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:k])), 0)
                for s in stops
            ],
            default=0,
        )

    for _ in range(3000):
        text = "".join(rng.choice(list("ab\0"), rng.integers(0, 12)))
        stops = ["".join(rng.choice(list("ab\0"), rng.integers(1, 7))) for _ in range(rng.integers(0, 4))]
        assert stop_prefix_len(text, stops) == plain(text, stops), (text, stops)


def test_partial_text_is_a_prefix_of_the_final_text_on_cjk(tok):
    """SmolLM2's tokenizer cuts 答 and 案 into two tokens each: the partial texts of "foo\n答案 is
    42" end in U+FFFD between them. Shown partial texts drop it and hold back a forming stop
    string, so each is a prefix of the final text (cut at the stop), with and without stops;
    the control: the raw incremental texts are not."""
    ids = tok.encode("foo\n答案 is 42", add_special_tokens=False)
    raw = _texts(tok.decode, ids)
    final = tok.decode(ids)
    assert any(not final.startswith(r) for r in raw)  # the control: U+FFFD in a raw partial
    for stops in ([], ["答案"], ["\n答案"], ["案 is"]):
        cut = min([final.find(s) for s in stops if s in final], default=len(final))
        for r in raw:
            if not any(s in r for s in stops):  # (the engine stops at the first partial that holds one)
                assert final[:cut].startswith(partial_text(r, stops)), (stops, r)
