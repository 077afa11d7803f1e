"""Output text built as tokens come: each step decodes a few tokens, not the whole output.

Decoding a whole output after every token costs O(length) per token (~150 us for 256 tokens
with SmolLM2's tokenizer: ~5 ms of host time per step at 64 sequences). Instead a sequence keeps
the text of its first k output tokens, and a new token's text is the difference between the
decode of a window of ``WINDOW`` tokens before k plus the new ones and the decode of that window
alone. The window absorbs what decoders do at a slice's first token (a stripped leading space;
a window whose tokens decode to nothing - skipped special tokens - absorbs nothing, so then the
whole output is decoded);
a decode ending in U+FFFD (an incomplete UTF-8 character) is shown but not kept, so the next
token completes it. For decoders whose text concatenates so (byte-level BPE, SentencePiece
metaspace) the result is the decode of the whole output; a decoder caught not doing so (the
window's text not a prefix of the longer decode) gets the whole output decoded. Final texts and
stop-string cuts are taken from a whole decode anyway (``Engine``)."""

from __future__ import annotations

WINDOW = 4


def current_text(decode, ids, text: str, k: int) -> tuple[str, str, int]:
    """``decode`` (ids -> str), the output ``ids``, and the text kept for ``ids[:k]``; returns
    (the text of ``ids`` now, the text to keep, how many ids it covers)."""
    if k == len(ids):
        return text, text, k
    p = max(0, k - WINDOW)
    head = decode(ids[p:k]) if p < k else ""
    tail = decode(ids[p:])
    # a window with no text (special tokens, skipped) absorbs nothing a decoder does at a
    # slice's start (a stripped leading space); nor does a decoder whose text does not
    # concatenate keep its window's text: either way, decode it all
    if (p > 0 and not head) or not tail.startswith(head):
        now = decode(ids)
        return (now, text, k) if now.endswith("\ufffd") else (now, now, len(ids))
    now = text + tail[len(head) :]
    return (now, text, k) if tail.endswith("\ufffd") else (now, now, len(ids))


def stop_prefix_len(text: str, stops) -> int:
    """How many characters at the end of ``text`` could begin one of the stop strings ``stops``
    (the longest such suffix, shorter than that stop): a partial output holds them back, so
    streamed text never shows what the final text cuts. Runs every step for every sequence with
    stop strings, so the work is the C-level string search: per stop, the places in the text's
    last len(stop) - 1 characters where the stop's first character occurs, from the earliest
    (the longest suffix) on."""
    longest, end = 0, len(text)
    for s in stops:
        n = min(len(s) - 1, end)
        if n <= longest or s.find(text[-1], 0, n) == -1:  # (the suffix's last character is in s[:n])
            continue
        i = text.find(s[0], end - n)
        while i != -1 and end - i > longest:
            if s.startswith(text[i:]):
                longest = end - i
                break
            i = text.find(s[0], i + 1)
    return longest


def partial_text(text: str, stops) -> str:
    """A partial output's text as shown: without a trailing incomplete UTF-8 character (U+FFFD:
    the next token completes it) and, with stop strings, without an end that could begin one -
    so every partial text is a prefix of the final text."""
    text = text.rstrip("\ufffd")
    return text[: len(text) - stop_prefix_len(text, stops)] if stops else text
