"""Speculative decoding with the bits of plain decoding.

A sequence in decode proposes k draft tokens after its last token; the step computes the last
token and the drafts as one chunk and samples every row with the key of its own position, the
same key plain decoding uses there. A row's logits have the same bits in a chunk as in a decode
step (the kernels are batch invariant), so each row's sample is exactly the token plain decoding
would emit at that position. The engine emits those samples while the drafts equal them and
stops after the first that differs (it is the corrected token): the same token ids and float32
logprobs as without speculation, in fewer steps when drafts are accepted.

Drafts come from prompt lookup (``ngram``: the tokens that followed the latest earlier
occurrence of the sequence's last n tokens) or from a smaller ``draft_model`` with the same
vocabulary. The draft model runs every step's batch too (its own paged KV cache, laid out in the
same blocks as the target's, so prefix-cache hits and preemption need nothing extra) and drafts
with the target's sampling keys: the Gumbel noise of position p is shared, so a draft model
equal to the target drafts exactly the target's tokens and every draft is accepted.

Drafts never change an output, only the speed: a sequence whose drafts are rarely accepted
stops drafting for a while (``ADAPT_*``) so that low acceptance costs little.
"""

from __future__ import annotations

import dataclasses
import os

from bijax.model_runner import Chunk, ModelRunner
from models.llama import Llama
from pallas_kernels.checks import check_positive_int

METHODS = ("ngram", "draft_model")
# The longest n-gram prompt lookup may match: its index keeps every n-gram from
# prompt_lookup_min to prompt_lookup_max of a sequence, so its memory and time grow with the
# span (a span of 10**7 took 51 s and 1.6 GB for one 56-token sequence).
PROMPT_LOOKUP_LIMIT = 16
# Adaptive drafting, two rules. Per engine: the engine's decode-only intervals (step to step,
# or read-back to read-back with async scheduling, the pipeline drained and refilled for a
# drafted step included) give tokens emitted per second with and without drafts (per
# batch-size bucket, exponential averages of an interval's seconds and tokens); each regime is
# measured first (drafted, then plain), then the faster runs, and the other is probed after
# PROBE_EVERY decisions, then after twice as many while the choice stands (at most PROBE_MAX:
# a probe that loses costs a drained pipeline), back to PROBE_EVERY when the choice changes. A
# probe lasts until the other regime has been measured (a plain interval with async scheduling
# needs a few plain decisions in a row; a drafting probe waits for a sequence with drafts), at
# most PROBE_TRIES decisions. Per sequence: after a sequence's last
# ADAPT_WINDOW drafted tokens were accepted at a rate below ADAPT_MIN_ACCEPTANCE, it decodes
# plainly for ADAPT_BACKOFF tokens, twice as long after each further miss (and resets when it
# is above the rate again).
ADAPT_WINDOW = 8
ADAPT_MIN_ACCEPTANCE = 0.3
ADAPT_BACKOFF = 16
PROBE_EVERY = 16
PROBE_MAX = 128
PROBE_TRIES = 32
EMA = 0.2


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's ``speculative_config`` names. ``method``: "ngram" (prompt lookup: drafts are the
    tokens that followed the latest earlier match of the last n tokens, n from
    ``prompt_lookup_max`` down to ``prompt_lookup_min``) or "draft_model" (``model``: anything
    ``LLM`` accepts, with the target's vocabulary). ``num_speculative_tokens``: drafts per step.
    ``adaptive`` (bijax's, default True): stop drafting where it does not pay (the rules above;
    False drafts whenever it can - outputs are the same either way)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    model: object = None
    adaptive: bool = True

    @classmethod
    def create(cls, spec) -> SpeculativeConfig | None:
        """From a dict (or a SpeculativeConfig, or None: no speculation); ValueError naming
        the bad key."""
        if spec is None or isinstance(spec, SpeculativeConfig):
            return spec
        if not isinstance(spec, dict):
            raise TypeError(f"speculative_config must be a dict, got {type(spec).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(spec) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key {unknown[0]!r} (known: {sorted(known)})")
        method = spec.get("method")
        if method not in METHODS:
            raise ValueError(f"speculative_config['method'] must be one of {METHODS}, got {method!r}")
        if "num_speculative_tokens" not in spec:
            raise ValueError("speculative_config needs 'num_speculative_tokens'")
        spec = dict(spec)
        for key in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            check_positive_int(f"speculative_config[{key!r}]", spec.get(key, 1))
            if key in spec:
                spec[key] = int(spec[key])  # (a numpy int too; the config holds Python ints)
        adaptive = spec.get("adaptive", True)
        if not isinstance(adaptive, bool):
            raise ValueError(f"speculative_config['adaptive'] must be true or false, got {adaptive!r}")
        if method == "ngram":
            if "model" in spec:
                raise ValueError("speculative_config: 'model' is for method 'draft_model', not 'ngram'")
            lo, hi = spec.get("prompt_lookup_min", 2), spec.get("prompt_lookup_max", 4)
            if "prompt_lookup_min" in spec and "prompt_lookup_max" not in spec:
                hi = max(hi, lo)  # a default never contradicts the key given
            if "prompt_lookup_max" in spec and "prompt_lookup_min" not in spec:
                lo = min(lo, hi)
            if lo > hi:
                raise ValueError(f"speculative_config: prompt_lookup_min ({lo}) > prompt_lookup_max ({hi})")
            if hi > PROMPT_LOOKUP_LIMIT:
                raise ValueError(
                    f"speculative_config: prompt_lookup_max ({hi}) is over {PROMPT_LOOKUP_LIMIT}: each "
                    "sequence keeps an index of every n-gram up to it"
                )
            return cls("ngram", spec["num_speculative_tokens"], hi, lo, adaptive=adaptive)
        bad = [k for k in ("prompt_lookup_max", "prompt_lookup_min") if k in spec]
        if bad:
            raise ValueError(f"speculative_config: {bad[0]!r} is for method 'ngram', not 'draft_model'")
        if spec.get("model") is None:
            raise ValueError("speculative_config: method 'draft_model' needs 'model'")
        _check_draft(spec["model"])
        return cls("draft_model", spec["num_speculative_tokens"], model=spec["model"], adaptive=adaptive)


def _check_draft(model) -> None:
    """A draft model is what ``LLM`` loads: a preset name, a path or a ``Llama`` (named here,
    before the target model loads)."""
    if isinstance(model, (str, os.PathLike, Llama)):
        return
    hint = " (for an LLM, pass its .model)" if type(model).__name__ == "LLM" else ""
    raise TypeError(
        "speculative_config['model'] must be a preset name, a checkpoint path or a Llama, "
        f"got {type(model).__name__}{hint}"
    )


def check_draft_vocabulary(model, tokenizer, draft, draft_tokenizer) -> None:
    """That ``draft`` (a Llama) may draft for ``model``: ids mean the same tokens to both.

    The draft's embedding may have fewer rows than the model's (checkpoints pad their
    vocabulary differently: Qwen2.5-0.5B has 151,936 rows, Qwen2.5-7B 152,064, one tokenizer),
    never more - a draft the model has no row for cannot be verified. Rows that differ are
    taken only when both tokenizers are known and their vocabularies are the same (``LLM``
    loads the draft's tokenizer only then); equal rows with two known tokenizers that differ
    are refused too. (A wrong draft could never change an output - drafts are verified - it
    would only waste every step's drafting.)"""
    rows, draft_rows = model.config.vocab_size, draft.config.vocab_size
    if draft_rows > rows:
        raise ValueError(
            f"speculative_config: the draft model's vocabulary ({draft_rows}) is larger than the "
            f"model's ({rows}): it must use the same tokenizer, with at most the model's rows"
        )
    if not hasattr(tokenizer, "vocabulary") or not hasattr(draft_tokenizer, "vocabulary"):
        tokenizer = draft_tokenizer = None  # (a tokenizer of the user's own: nothing to compare)
    if tokenizer is not None and draft_tokenizer is not None:
        if tokenizer.vocabulary() != draft_tokenizer.vocabulary():
            raise ValueError(
                "speculative_config: the draft model's tokenizer is not the model's "
                f"({draft_tokenizer.vocab_size} and {tokenizer.vocab_size} tokens, different ids)"
            )
    elif draft_rows != rows:
        raise ValueError(
            f"speculative_config: the draft model's vocabulary ({draft_rows}) is not the model's "
            f"({rows}), and without both tokenizers (a checkpoint with tokenizer.json or a GGUF "
            "file, for the model and the draft) nothing shows they share one"
        )


def ngram_propose(token_ids, k: int, max_n: int, min_n: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the last n tokens of
    ``token_ids``, for the longest n in [min_n, max_n] that occurs; [] if none does."""
    ids = list(token_ids)
    size = len(ids)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        tail = ids[size - n :]
        for start in range(size - n - 1, -1, -1):  # latest match first, not the tail itself
            if ids[start : start + n] == tail:
                follow = ids[start + n : start + n + k]
                if follow:
                    return follow
    return []


def _size(num_seqs: int) -> int:
    """The batch-size bucket of a step of ``num_seqs`` sequences (a power of two)."""
    return 1 << max(0, (num_seqs - 1).bit_length())


class NgramIndex:
    """``ngram_propose`` in O(n) per step: every n-gram of a growing token list mapped to its
    latest start (added as tokens arrive), for the n of one config."""

    def __init__(self, max_n: int, min_n: int):
        self.sizes = range(max_n, min_n - 1, -1)
        self.latest = {n: {} for n in self.sizes}
        self.upto = 0  # n-grams ending before this index are in the maps
        self.ids: list[int] = []  # the sequence's tokens the host has (``known``)

    def known(self, seq) -> list[int]:
        """``seq``'s prompt and generated tokens (not those still on the device), kept as they
        arrive: no copy of the whole sequence per step."""
        have, p = len(self.ids), len(seq.prompt_token_ids)
        if have < p:
            self.ids.extend(seq.prompt_token_ids[have:])
            have = p
        self.ids.extend(seq.output_token_ids[have - p :])
        return self.ids

    def propose(self, ids, k: int) -> list[int]:
        size = len(ids)
        for end in range(self.upto, size - 1):  # n-grams with a following token
            for n in self.sizes:
                if end - n + 1 >= 0:
                    self.latest[n][tuple(ids[end - n + 1 : end + 1])] = end - n + 1
        self.upto = max(self.upto, size - 1)
        for n in self.sizes:
            if n < size:
                start = self.latest[n].get(tuple(ids[size - n :]))
                if start is not None:
                    return list(ids[start + n : start + n + k])
        return []


class Speculator:
    """Proposes drafts for a step's decode sequences and keeps the acceptance counters."""

    def __init__(self, spec: SpeculativeConfig, config, draft_model=None):
        self.spec = spec
        self.config = config
        self.draft_model = draft_model
        self._ngrams: dict[int, NgramIndex] = {}  # by sequence id
        # batch-size bucket -> [plain, drafted], each None or [seconds, tokens] of an interval (EMAs)
        self.times: dict[int, list] = {}
        # bucket -> [decisions since a probe, probe after, the choice, decisions left in a running probe]
        self.probes: dict[int, list] = {}
        self.draft = None if draft_model is None else ModelRunner(draft_model, config)

    def verify_buckets(self, pairs) -> list[tuple[int, int, int]]:
        """The (sequences, tokens, sampled rows) buckets of steps with drafts beyond the plain
        ones (rows == sequences): rows bucketed like tokens, more than the sequences and at
        most (1 + k) a sequence, in any token bucket that holds them."""
        k = self.spec.num_speculative_tokens
        tokens = sorted({t for _, t in pairs})
        out = []
        for s, t in pairs:
            most = next(b for b in tokens if b >= min(s * (1 + k), tokens[-1]))
            out += [(s, t, r) for r in tokens if s < r <= min(t, most)]
        return out

    def _budget(self, seq, budget: int) -> int:
        """How many drafts ``seq`` may carry in its next decode step (0: decode plainly); with
        async scheduling its tokens still on the device come first."""
        if seq.num_pending != 1 or seq.finishing or not seq.output_token_ids or len(seq) < seq.spec_resume_at:
            return 0
        p = seq.params
        return max(
            0,
            min(
                self.spec.num_speculative_tokens,
                budget,
                p.max_tokens - len(seq.output_token_ids) - seq.in_flight - 1,  # the step emits up to k + 1
                self.config.max_model_len - len(seq),  # drafts' positions stay < max_model_len
            ),
        )

    def worth_it(self, num_seqs: int) -> bool:
        """Whether drafting pays for a step of ``num_seqs`` sequences, from the measured step
        times (see top). Each call is one decision (it counts towards the probes)."""
        if not self.spec.adaptive:
            return True
        bucket = _size(num_seqs)
        t = self.times.get(bucket)
        if t is None or t[1] is None:
            return True  # drafting not measured yet at this size
        if t[0] is None:
            return False  # then plain
        worth = t[1][1] / t[1][0] >= t[0][1] / t[0][0]  # tokens per second
        probe = self.probes.setdefault(bucket, [0, PROBE_EVERY, worth, 0])
        if worth != probe[2]:
            probe[:] = [0, PROBE_EVERY, worth, 0]
        if probe[3]:  # a probe runs until the other regime is measured (``timed``)
            probe[3] -= 1
            return not worth
        probe[0] += 1
        if probe[0] < probe[1]:
            return worth
        probe[0], probe[3] = 0, PROBE_TRIES - 1
        return not worth

    def timed(self, num_seqs: int, decode_only: bool, drafted: bool, seconds: float, emitted: int) -> None:
        """Records an interval of the engine's clock that ended with a step of ``num_seqs``
        sequences (decode-only: one pending token per sequence, drafts aside): its seconds and
        the tokens it emitted, in the drafted or the plain regime."""
        if not decode_only or seconds <= 0:
            return  # a prefill chunk in the step: not comparable
        bucket = _size(num_seqs)
        t = self.times.setdefault(bucket, [None, None])
        i = int(drafted)
        now = [seconds, float(emitted)]
        t[i] = now if t[i] is None else [(1 - EMA) * a + EMA * b for a, b in zip(t[i], now, strict=True)]
        probe = self.probes.get(bucket)
        if probe is not None and probe[3] and drafted != probe[2]:  # the probe has its measurement
            probe[1], probe[3] = min(2 * probe[1], PROBE_MAX), 0

    def _ngram(self, seq) -> NgramIndex:
        index = self._ngrams.get(seq.seq_id)
        if index is None:
            index = self._ngrams[seq.seq_id] = NgramIndex(
                self.spec.prompt_lookup_max, self.spec.prompt_lookup_min
            )
        return index

    def has_candidates(self, seqs) -> bool:
        """Async scheduling (n-gram drafts only): whether any running sequence in decode would
        draft from the tokens the host has now (its tokens on the device aside). The engine then
        lets the enqueued steps finish and runs a drafted step; otherwise it keeps enqueueing
        plain ones. Only a guess of the next step's drafts: outputs do not depend on it. The
        guess: the latest earlier match of the known tokens' tail is followed by more tokens
        than are on the device, so if those repeat it too, drafts follow them."""
        for seq in seqs:
            if not self._budget(seq, self.spec.num_speculative_tokens):
                continue  # in its prompt, ending, backed off, or no room for a draft
            index = self._ngram(seq)
            if len(index.propose(index.known(seq), seq.in_flight + 1)) > seq.in_flight:
                return True
        return False

    def propose(self, chunks, blocks, budget: int) -> dict[int, list[int]]:
        """Drafts by sequence id for the (sequence, n) chunks of a step whose token budget has
        ``budget`` left; allocates their KV blocks (only free ones: drafts never preempt). The
        caller has decided that the step drafts (``worth_it``)."""
        drafts: dict[int, list[int]] = {}
        want = []
        for seq, n in chunks:
            k = self._budget(seq, budget) if n == 1 else 0
            d = None
            if k and self.spec.method == "ngram":
                index = self._ngram(seq)
                d = index.propose(index.known(seq), k)
                k = len(d)
            if not k or not blocks.can_allocate(seq, 1 + k):
                continue
            blocks.allocate(seq, 1 + k)
            budget -= k
            if d is not None:
                drafts[seq.seq_id] = d
            else:
                want.append((seq, k))
        if want:
            drafts.update(self._draft_model_propose(want))
        return drafts

    def _draft_model_propose(self, want) -> dict[int, list[int]]:
        """k decode steps of the draft model from each sequence's pending token."""
        out = {seq.seq_id: [] for seq, _ in want}
        for j in range(max(k for _, k in want)):
            step = [(seq, k) for seq, k in want if j < k]
            chunks = [
                Chunk(
                    seq,
                    seq.num_computed + j,
                    (seq.token_slice(len(seq) - 1, len(seq))[0] if j == 0 else out[seq.seq_id][-1],),
                )
                for seq, _ in step
            ]
            tok, _, _ = self.draft.step(chunks)
            for (seq, _), t in zip(step, tok, strict=True):
                out[seq.seq_id].append(int(t))
        return out

    def forget(self, seq) -> None:
        """The sequence finished: drop its n-gram index."""
        self._ngrams.pop(seq.seq_id, None)

    def observe(self, chunks) -> None:
        """The draft model runs the step's batch too, so its KV follows the target's."""
        if self.draft is not None:
            self.draft.step(chunks)

    def record(self, seq, drafted: int, accepted: int) -> None:
        """Counts a verify step's drafts and accepted drafts; backs off on low acceptance."""
        seq.num_draft_tokens += drafted
        seq.num_accepted_tokens += accepted
        seq.num_verify_steps += 1
        if not self.spec.adaptive:
            return
        seq.window_drafted += drafted
        seq.window_accepted += accepted
        if seq.window_drafted >= ADAPT_WINDOW:
            if seq.window_accepted < ADAPT_MIN_ACCEPTANCE * seq.window_drafted:
                seq.spec_resume_at = len(seq) + ADAPT_BACKOFF * 2**seq.spec_misses
                seq.spec_misses += 1
            else:
                seq.spec_misses = 0
            seq.window_drafted = seq.window_accepted = 0
