"""Response bodies in OpenAI's shapes (plus vLLM's ``token_ids`` / ``prompt_token_ids`` and
bijax's ``seed``), stream deltas, and the Prometheus text of ``/metrics``.

Logprobs are the engine's float32 values written as JSON numbers: float32 -> Python float is
exact and ``json`` writes the shortest repr that reads back as the same float, so
``np.float32(value)`` on the client has the engine's bits.
"""

from __future__ import annotations

import codecs
import math

from bijax.outputs import CompletionOutput
from bijax.server.engine_loop import STEP_BUCKETS, EngineLoop

NEG_INF = -9999.0  # written for a -inf logprob (JSON has no infinities; vLLM's convention)


def _f(x) -> float:
    x = float(x)
    return x if math.isfinite(x) else NEG_INF


def token_str(tokenizer, i: int) -> str:
    return tokenizer.decode([i]) if tokenizer is not None else f"token_id:{i}"


def token_bytes(tokenizer, i: int) -> bytes:
    """The bytes token ``i`` stands for (whole, where it holds part of a character)."""
    return tokenizer.token_bytes(i) if tokenizer is not None else token_str(None, i).encode()


def token_key(tokenizer, i: int) -> str:
    """A token as the legacy completions format names it: its text, or OpenAI's
    ``bytes:\\xNN...`` where it holds only part of a character (its text would be U+FFFD, the
    same for every such token: top_logprobs' keys would collide)."""
    text = token_str(tokenizer, i)
    if "\ufffd" in text and tokenizer is not None:
        raw = tokenizer.token_bytes(i)
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{x:02x}" for x in raw)
    return text


class TextOffsets:
    """Each token's offset in characters of the text the tokens make, token by token: a token
    that ends inside a character adds no character until the one that completes it."""

    def __init__(self, tokenizer):
        self.tokenizer, self.chars = tokenizer, 0
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def next(self, i: int) -> int:
        at = self.chars
        if self.tokenizer is not None:  # (without one the text is empty: every offset is 0, not
            # one counted in the "token_id:N" names of ``tokens``)
            self.chars += len(self.decoder.decode(token_bytes(self.tokenizer, i)))
        return at


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_logprobs(tok, o: CompletionOutput, a: int, b: int, offsets: TextOffsets) -> dict:
    """The legacy completions ``logprobs`` object for tokens a:b of ``o``; ``offsets`` has seen
    tokens :a of ``o`` (a stream's earlier chunks)."""
    tokens = [token_key(tok, t) for t in o.token_ids[a:b]]
    text_offset = [offsets.next(t) for t in o.token_ids[a:b]]
    tops = None
    if o.top_logprobs is not None:
        tops = [{token_key(tok, i): _f(v) for i, v in step} for step in o.top_logprobs[a:b]]
    return {
        "tokens": tokens,
        "token_logprobs": [_f(x) for x in o.logprobs[a:b]],
        "top_logprobs": tops,
        "text_offset": text_offset,
    }


def chat_logprobs(tok, o: CompletionOutput, a: int, b: int, top: bool) -> dict:
    """The chat ``logprobs`` object ({"content": [...]}) for tokens a:b of ``o``."""

    def entry(i, v):
        return {"token": token_str(tok, i), "logprob": _f(v), "bytes": list(token_bytes(tok, i))}

    content = []
    for k in range(a, b):
        e = entry(o.token_ids[k], o.logprobs[k])
        e["top_logprobs"] = [entry(i, v) for i, v in o.top_logprobs[k]] if top and o.top_logprobs else []
        content.append(e)
    return {"content": content}


class StreamState:
    """What each sample of one request has sent so far. A partial output's text already holds
    back an incomplete UTF-8 character and what could begin a stop string (``Engine``)."""

    def __init__(self, n: int):
        self.tokens, self.chars, self.done = [0] * n, [0] * n, [False] * n

    def deltas(self, out):
        """(sample, first new token, end, characters sent before, new text, finish reason or
        None) per changed sample."""
        result = []
        for o in out.outputs:
            i = o.index
            if self.done[i]:
                continue
            a, b = self.tokens[i], len(o.token_ids)
            shown, text = self.chars[i], o.text
            # (a partial output's text is always a prefix of the final one: ``detokenize.partial_text``)
            end = max(shown, len(text))
            delta = text[shown:end] if end > shown else ""
            if b > a or delta or o.finish_reason is not None:
                result.append((o, a, b, shown, delta, o.finish_reason))
            self.tokens[i], self.chars[i] = b, shown + len(delta)
            self.done[i] = o.finish_reason is not None
        return result


def prometheus(loop: EngineLoop, model_name: str, kv_blocks_total: int) -> str:
    """``/metrics``: requests running and waiting, KV blocks in use, tokens, step time."""
    s, m = loop.stats, loop.metrics
    escaped = model_name.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    lab = f'model_name="{escaped}"'
    lines = []

    def metric(name, kind, help_, value, labels=lab):
        lines.extend([f"# HELP bijax_{name} {help_}", f"# TYPE bijax_{name} {kind}"])
        lines.append(f"bijax_{name}{{{labels}}} {value}")

    metric("num_requests_running", "gauge", "Sequences (samples) in the running batch.", s.num_running_seqs)
    metric("num_requests_waiting", "gauge", "Sequences waiting for a slot.", s.num_waiting_seqs)
    metric("num_unfinished_requests", "gauge", "Requests in flight.", s.num_unfinished_requests)
    metric("kv_blocks_in_use", "gauge", "KV cache blocks held by sequences.", s.num_kv_blocks_in_use)
    metric("kv_blocks_total", "gauge", "KV cache blocks in the pool.", kv_blocks_total)
    metric("prefix_cache_hit_blocks_total", "counter", "KV blocks served from the prefix cache.",
           s.prefix_cache_hit_blocks)  # fmt: skip
    metric("num_preemptions_total", "counter", "Sequences preempted (recomputed).", s.num_preemptions)
    metric("requests_added_total", "counter", "Requests added to the engine.", m.requests_added)
    lines.extend(["# HELP bijax_requests_finished_total Requests finished, by reason.",
                  "# TYPE bijax_requests_finished_total counter"])  # fmt: skip
    for reason in ("stop", "length", "abort"):
        n = m.requests_finished.get(reason, 0)
        lines.append(f'bijax_requests_finished_total{{{lab},finished_reason="{reason}"}} {n}')
    metric("prompt_tokens_total", "counter", "Prompt tokens of the requests added.", m.prompt_tokens)
    metric("generation_tokens_total", "counter", "Tokens generated.", m.generation_tokens)
    metric("engine_errors_total", "counter", "Engine steps that failed.", m.engine_errors)
    lines.extend(["# HELP bijax_step_seconds Wall time of one engine step.",
                  "# TYPE bijax_step_seconds histogram"])  # fmt: skip
    for upper, count in zip(STEP_BUCKETS, m.step_buckets, strict=True):
        le = "+Inf" if math.isinf(upper) else repr(upper)
        lines.append(f'bijax_step_seconds_bucket{{{lab},le="{le}"}} {count}')
    lines.append(f"bijax_step_seconds_sum{{{lab}}} {m.step_seconds_sum}")
    lines.append(f"bijax_step_seconds_count{{{lab}}} {m.steps}")
    return "\n".join(lines) + "\n"
