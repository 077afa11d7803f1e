"""The invariance suite behind ``bijax check``: does a request's output depend on anything but
the request?

Every dimension of the contract (docs/design.md) is exercised against one model: each request is
first generated alone on a fresh engine (the reference), then again under one change - sharing
a batch, arriving mid-flight among other requests ("needle in a batch"), scored by prefill
instead of decoded, prefilled in different chunk sizes, served from the prefix cache, preempted
and recomputed. Token ids and float32 logprob bits must equal the reference's. The same
comparisons on the plain-XLA path (``invariant=False``) are the negative control: if they find
no difference either, the suite could not tell on this model and machine, and says so.

All engines share one model and one set of step shapes, so the compiled steps are shared.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from bijax.config import EngineConfig
from bijax.llm_engine import Engine
from bijax.sampling_params import SamplingParams
from pallas_kernels.checks import check_positive_int

# (temperature, top_p, top_k, min_p) cycled over the requests: greedy and seeded sampling
# with each filter.
_STYLES = [(0.0, 1.0, -1, 0.0), (0.8, 0.9, -1, 0.0), (0.8, 1.0, 20, 0.0), (0.8, 1.0, -1, 0.05)]


@dataclasses.dataclass
class Row:
    """One line of the report: ``status`` is "PASS", "FAIL", "N/A" (identical, but the run did
    not exercise the dimension, e.g. no preemption happened), "SKIPPED" (the engine's flags turn
    the dimension off, e.g. prefix caching), "DETECTED" (the negative control
    found differences, as it should) or "NO DIFF" (it found none: inconclusive)."""

    dimension: str
    status: str
    detail: str


@dataclasses.dataclass
class Report:
    rows: list[Row]
    seconds: float

    @property
    def failed(self) -> list[Row]:
        return [r for r in self.rows if r.status == "FAIL"]

    @property
    def control_inconclusive(self) -> bool:
        return any(r.status == "NO DIFF" for r in self.rows)

    @property
    def ok(self) -> bool:
        return not self.failed

    def table(self) -> str:
        w0 = max([len("dimension"), *(len(r.dimension) for r in self.rows)])
        w1 = max([len("result"), *(len(r.status) for r in self.rows)])
        lines = [f"{'dimension':<{w0}}  {'result':<{w1}}  detail", f"{'-' * w0}  {'-' * w1}  {'-' * 6}"]
        lines += [f"{r.dimension:<{w0}}  {r.status:<{w1}}  {r.detail}" for r in self.rows]
        return "\n".join(lines)

    def summary(self) -> str:
        if self.failed:
            names = ", ".join(r.dimension for r in self.failed)
            return f"FAILED: outputs changed with {names} - the engine is not batch invariant here."
        asked = [r.dimension for r in self.rows if r.status == "SKIPPED"]
        also = f" ({', '.join(asked)}: skipped, as the engine flags ask)" if asked else ""
        skipped = [r.dimension for r in self.rows if r.status == "N/A"]
        if skipped:
            return (
                f"Identical wherever exercised, but {', '.join(skipped)} did not happen with these "
                f"settings (use more requests or --max-tokens){also}."
            )
        if self.control_inconclusive:
            return (
                f"All dimensions identical{also}, but the negative control (invariant=False) found no "
                "difference either, so on this model and machine the check could not tell."
            )
        if not any(r.dimension == "negative control" for r in self.rows):
            return f"All dimensions bit-identical{also} (the negative control was not run)."
        return f"All dimensions bit-identical{also}; the negative control shows the plain-XLA path is not."


_SKIPPED = "skipped: "  # a dimension's note that says the engine's flags turned it off


@dataclasses.dataclass
class _Out:
    token_ids: list[int]
    logprobs: np.ndarray


def _same(a: _Out, b: _Out) -> bool:
    return a.token_ids == b.token_ids and np.array_equal(
        a.logprobs.view(np.uint32), b.logprobs.view(np.uint32)
    )


def _requests(vocab: int, eos: set[int], n: int, max_tokens: int, budget: int, seed: int, max_len: int):
    """``n`` requests with random prompts (up to 1.5x a step's token budget, so even the base
    engine chunks some) and a mix of greedy and seeded sampling; EOS ignored so every
    output has max_tokens tokens."""
    rng = np.random.default_rng(seed)
    longest = max(4, min(budget + budget // 2 + 3, max_len - max_tokens))
    lengths = np.linspace(3, longest, n).astype(int)
    rng.shuffle(lengths)
    allowed = np.setdiff1d(np.arange(vocab), np.fromiter(eos, int, len(eos)))
    reqs = []
    for i, length in enumerate(lengths):
        t, top_p, top_k, min_p = _STYLES[i % len(_STYLES)]
        params = SamplingParams(
            temperature=t,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            seed=int(rng.integers(2**32)) if t > 0 else None,
            max_tokens=max_tokens,
            ignore_eos=True,
        )
        reqs.append(([int(x) for x in rng.choice(allowed, length)], params))
    return reqs


def _run(engine: Engine, reqs, arrivals=None, tag="r") -> list[_Out]:
    """Generates ``reqs``; request i is added before step ``arrivals[i]`` (default: all at once)."""
    arrivals = [0] * len(reqs) if arrivals is None else arrivals
    order = sorted(range(len(reqs)), key=lambda i: arrivals[i])
    done: dict[int, _Out] = {}
    step, k = 0, 0
    while k < len(order) or engine.has_unfinished_requests():
        while k < len(order) and arrivals[order[k]] <= step:
            i = order[k]
            engine.add_request(f"{tag}{i}", reqs[i][0], reqs[i][1])
            k += 1
        for out in engine.step(partial=False):
            if out.finished:
                done[int(out.request_id[len(tag) :])] = _Out(list(out.token_ids), out.logprobs)
        step += 1
    return [done[i] for i in range(len(reqs))]


class _Suite:
    def __init__(self, model, tokenizer, config: EngineConfig, reqs, progress, speculative=None):
        self.model, self.tokenizer, self.config, self.reqs = model, tokenizer, config, reqs
        self.progress = progress
        self.speculative = speculative  # (SpeculativeConfig, draft model or None) or None

    def engine(self, speculative=None, **changes) -> Engine:
        spec, draft = speculative or (None, None)
        return Engine(self.model, self.tokenizer, dataclasses.replace(self.config, **changes), spec, draft)

    def tick(self, what: str):
        if self.progress is not None:
            self.progress(what)


def _compare(ref: list[_Out], got: list[_Out], idx=None) -> tuple[int, int, int]:
    """(requests identical, requests compared, tokens compared)."""
    idx = range(len(ref)) if idx is None else idx
    same = sum(_same(ref[i], got[j]) for j, i in enumerate(idx))
    return same, len(idx), sum(len(ref[i].token_ids) for i in idx)


def _fillers(suite: _Suite, n: int, seed: int):
    v = suite.model.config.vocab_size
    eos = set(suite.model.config.eos_token_ids)
    return _requests(
        v,
        eos,
        n,
        suite.reqs[0][1].max_tokens,
        suite.config.max_num_batched_tokens,
        seed,
        suite.config.max_model_len,
    )


# (a note's end that makes a dimension N/A: with max_num_seqs 1 no step holds two sequences)
_ONE_AT_A_TIME = " - none happened (max_num_seqs 1: one sequence at a time)"


def _dimensions(
    suite: _Suite, *, invariant: bool, first_diff: bool = False
) -> list[tuple[str, tuple[int, int, int], str]]:
    """Runs the comparisons on one path; returns (dimension, (same, compared, tokens), note).
    The negative control (``invariant=False``) skips the prefix-cache and preemption runs, tries
    the cheapest dimensions first and, with ``first_diff``, stops at the first that differs."""
    reqs, cfg = suite.reqs, suite.config
    base = dict(invariant=invariant, enable_prefix_caching=False)

    suite.tick("solo runs")
    eng = suite.engine(**base)
    solo = [_run(eng, [r])[0] for r in reqs]

    def needle():
        suite.tick("needle in a batch")
        fill = _fillers(suite, max(2, cfg.max_num_seqs), seed=12345)
        idx, slot = len(reqs) - 1, 1
        # The needle arrives while fillers are already decoding, and more arrive after it.
        mix = fill[:slot] + [reqs[idx]] + fill[slot:]
        arrivals = [0] * slot + [2] + [3] * (len(fill) - slot)
        got = _run(eng, mix, arrivals)[slot]
        note = "joins mid-flight among other requests"
        if cfg.max_num_seqs < 2:
            note += _ONE_AT_A_TIME
        return [("needle in a batch", _compare([solo[idx]], [got]), note)]

    def prefill_vs_decode():
        suite.tick("prefill vs decode")
        scored = [None] * len(reqs)
        for temp in sorted({p.temperature for _, p in reqs}):
            idx = [i for i, (_, p) in enumerate(reqs) if p.temperature == temp]
            lps = eng.score(
                [reqs[i][0] + solo[i].token_ids for i in idx],
                [len(reqs[i][0]) for i in idx],
                temperature=temp,
            )
            for i, lp in zip(idx, lps, strict=True):
                scored[i] = _Out(solo[i].token_ids, lp)
        return [("prefill vs decode", _compare(solo, scored), "score() of the generated tokens")]

    def batch():
        suite.tick("batch 1 vs N")
        caching = invariant and cfg.enable_prefix_caching
        e = suite.engine(invariant=invariant, enable_prefix_caching=caching)
        batched = _run(e, reqs)  # a fresh cache: every prefix misses
        note = f"{len(reqs)} requests in one batch" + (_ONE_AT_A_TIME if cfg.max_num_seqs < 2 else "")
        out = [("batch 1 vs N", _compare(solo, batched), note)]
        if invariant and not cfg.enable_prefix_caching:
            out.append(("prefix cache hit/miss", (0, 0, 0), _SKIPPED + "prefix caching is off"))
        if caching:
            suite.tick("prefix cache")
            before = e.stats().prefix_cache_hit_blocks
            hit = _run(e, reqs)
            hits = e.stats().prefix_cache_hit_blocks - before
            note = f"second run served from the cache ({hits} blocks reused)"
            if hits == 0:
                note += " - no hit happened: prompts shorter than a block?"
            out.append(("prefix cache hit/miss", _compare(solo, hit), note))
        return out

    def chunks():
        suite.tick("chunk sizes")
        # 16-token chunks, or half the engine's where it takes 16 or fewer a step
        chunk = 16 if cfg.max_num_batched_tokens > 16 else max(1, cfg.max_num_batched_tokens // 2)
        got = _run(
            suite.engine(**base, max_num_batched_tokens=chunk, max_num_seqs=min(cfg.max_num_seqs, chunk)),
            reqs,
        )
        note = f"prefill in chunks of {chunk} vs {cfg.max_num_batched_tokens}"
        if chunk == cfg.max_num_batched_tokens or all(len(ids) <= chunk for ids, _ in reqs):
            note += " - none happened (the same chunks both ways)"
        return [("chunk sizes", _compare(solo, got), note)]

    def preemption():
        suite.tick("preemption")
        e = suite.engine(**base)
        bs = cfg.block_size
        need = [-(-(len(ids) + p.max_tokens) // bs) for ids, p in reqs]
        # A pool that holds the largest request but not all of them at once: the scheduler must
        # preempt (and later recompute) running sequences. The cache keeps its shape (no compile).
        usable = max(need) + 1
        if usable < min(cfg.num_kv_blocks, sum(need) + 1):
            e.limit_kv_pool(usable)
        got = _run(e, reqs)
        n_pre = e.stats().num_preemptions
        note = f"{n_pre} preemptions (pool of {usable - 1} blocks), recomputed"
        if n_pre == 0:
            note += " - none happened"
        return [("preemption", _compare(solo, got), note)]

    def speculative():
        suite.tick("speculative vs plain")
        e = suite.engine(suite.speculative, **base)
        got = _run(e, reqs)
        drafted, accepted = e.stats().num_draft_tokens, e.stats().num_accepted_tokens
        spec = suite.speculative[0]
        note = f"{spec.method}, k={spec.num_speculative_tokens}: {accepted}/{drafted} drafts accepted"
        if drafted == 0:
            note += " - none happened"
        return [("speculative vs plain", _compare(solo, got), note)]

    def scheduling():
        suite.tick("async vs sync scheduling")
        e = suite.engine(**base, async_scheduling=not eng.async_scheduling)
        got = _run(e, reqs)
        how = (
            "async (next step enqueued before this one is read back)" if e.async_scheduling else "synchronous"
        )
        note = f"{how} vs the engine's default"
        if e.async_scheduling == eng.async_scheduling:  # e.g. across processes: async is off
            note = "only synchronous scheduling runs here - none happened"
        return [("async vs sync scheduling", _compare(solo, got), note)]

    order = [needle, prefill_vs_decode, batch, chunks, preemption, scheduling]
    if suite.speculative is not None:
        order.append(speculative)
    if not invariant:  # batch 1 vs N first: it reuses the solo runs' compiled steps
        order = [batch, prefill_vs_decode, chunks, needle]
    results = []
    for dimension in order:
        results += dimension()
        if first_diff and any(same < compared for _, (same, compared, _), _ in results):
            break
    return results


def run_check(
    model,
    tokenizer=None,
    *,
    num_requests: int = 4,
    max_tokens: int = 12,
    max_num_seqs: int = 4,
    max_num_batched_tokens: int = 64,
    max_model_len: int | None = None,
    block_size: int = 16,
    num_kv_blocks: int | None = None,
    seed: int = 0,
    control: bool = True,
    full_control: bool = False,
    progress: bool = True,
    speculative=None,
    tensor_parallel_size: int = 1,
    async_scheduling: bool = True,
    enable_prefix_caching: bool = True,
) -> Report:
    """Runs the invariance suite on ``model`` (a ``models.Llama``); returns a Report.

    ``num_requests`` random prompts (lengths up to 1.5x ``max_num_batched_tokens``, so some
    prefills are chunked), ``max_tokens`` each, mixed greedy and seeded sampling. ``control``:
    also run the plain-XLA path as the negative control; it stops at the first dimension where
    that path's bits differ (that proves the check can see a difference) unless
    ``full_control``, which runs every dimension on it. ``speculative``: (a speculative config
    or its dict, the loaded draft model or None) adds the dimension "speculative vs plain".
    ``tensor_parallel_size``: every engine of the suite splits the model over that many devices;
    ``async_scheduling``: the reference engine's scheduling (the other is a dimension);
    ``enable_prefix_caching`` False skips the prefix-cache dimension (its row says so).
    """
    if not isinstance(num_requests, int) or num_requests < 2:
        raise ValueError(f"num_requests must be an int >= 2, got {num_requests!r}")
    check_positive_int("max_tokens", max_tokens, numpy=False)
    t0 = time.perf_counter()
    mcfg = model.config
    max_model_len = min(mcfg.max_position_embeddings, 1024) if max_model_len is None else max_model_len
    if max_model_len < max_tokens + 4:
        raise ValueError(
            f"max_model_len ({max_model_len}) leaves no room for prompts of max_tokens={max_tokens}"
        )
    if num_kv_blocks is None:
        num_kv_blocks = max_num_seqs * -(-max_model_len // block_size) + 1
    config = EngineConfig(
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        block_size=block_size,
        num_kv_blocks=num_kv_blocks,
        seed=seed,
        tensor_parallel_size=tensor_parallel_size,
        async_scheduling=async_scheduling,
        enable_prefix_caching=enable_prefix_caching,
    )
    eos = set(tokenizer.eos_token_ids if tokenizer is not None else mcfg.eos_token_ids)
    reqs = _requests(
        mcfg.vocab_size, eos, num_requests, max_tokens, max_num_batched_tokens, seed, max_model_len
    )
    paths = [True, False] if control else [True]
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(
            total=7 + (speculative is not None) + 5 * control, desc="bijax check", unit="stage", leave=False
        )

    def tick(what, path):
        if bar is not None:
            bar.set_postfix_str(f"{what} ({'invariant' if path else 'XLA control'})")
            bar.update(1)

    rows: list[Row] = []
    try:
        found = {}
        for invariant in paths:
            suite = _Suite(model, tokenizer, config, reqs, lambda w, p=invariant: tick(w, p), speculative)
            first_diff = not invariant and not full_control  # the invariant side always runs everything
            found[invariant] = _dimensions(suite, invariant=invariant, first_diff=first_diff)
    finally:
        if bar is not None:
            bar.close()
    for name, (same, compared, tokens), note in found[True]:
        status = "PASS" if same == compared else "FAIL"
        if status == "PASS" and ("none happened" in note or "no hit happened" in note):
            status = "N/A"  # identical, but the dimension was not exercised
        if note.startswith(_SKIPPED):
            status, note = "SKIPPED", note[len(_SKIPPED) :]
        detail = (
            note if status == "SKIPPED" else f"{same}/{compared} requests identical ({tokens} tokens); {note}"
        )
        rows.append(Row(name, status, detail))
    if control:
        diff = [(name, compared - same) for name, (same, compared, _), _ in found[False] if same < compared]
        total = sum(c for _, (_, c, _), _ in found[False])
        if diff:
            where = ", ".join(f"{name} ({n})" for name, n in diff)
            detail = f"invariant=False changed {sum(n for _, n in diff)}/{total} outputs: {where}"
            if not full_control:
                detail += " (stopped at the first difference)"
            rows.append(Row("negative control", "DETECTED", detail))
        else:
            rows.append(
                Row(
                    "negative control",
                    "NO DIFF",
                    f"invariant=False changed 0/{total} outputs: the check could not tell here",
                )
            )
    return Report(rows, time.perf_counter() - t0)
