"""The engine: requests in, one scheduled step at a time, RequestOutputs out.

``Engine`` is the only door to the engine: ``LLM``, the CLI and ``bijax check`` use its public
methods (requests, steps, validation, warm-up, weights, statistics, the KV pool) and never its
scheduler, block manager or model runner.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Sized

import jax
import numpy as np

from bijax import prompts, scoring
from bijax.block_manager import BlockManager
from bijax.config import EngineConfig, bucket
from bijax.detokenize import current_text, partial_text
from bijax.model_runner import Chunk, Launched, ModelRunner, num_compiled_steps
from bijax.outputs import CompletionOutput, RequestOutput, SpeculativeMetrics
from bijax.prompts import ValidPrompt
from bijax.sampling_params import MAX_LOGPROBS, SamplingParams, check_temperature
from bijax.scheduler import Scheduler
from bijax.sequence import Sequence, Status
from bijax.speculative import SpeculativeConfig, Speculator, check_draft_vocabulary
from pallas_kernels.attention_math import HEAD_DIMS
from pallas_kernels.checks import is_int


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """Counters since the engine was built: KV blocks served from the prefix cache, sequences
    preempted (recomputed later), free KV blocks now, compiled step buckets, requests in flight."""

    prefix_cache_hit_blocks: int
    num_preemptions: int
    num_free_blocks: int
    num_compiled_buckets: int
    num_unfinished_requests: int
    num_compiled_steps: int  # step programs this process has compiled, all engines together
    num_running_seqs: int  # sequences (samples) scheduled now, and those waiting for a slot
    num_waiting_seqs: int
    num_kv_blocks_in_use: int  # KV blocks held by sequences (block 0, the null block, not counted)
    num_draft_tokens: int = 0  # speculative decoding: drafts proposed and accepted
    num_accepted_tokens: int = 0
    num_drafted_steps: int = 0  # steps that carried drafts
    # async scheduling: steps the queue of enqueued steps was emptied for (a sequence looked
    # like it would draft), and of them those that in the end carried no drafts (the guess
    # from the host's tokens missed: a drained pipeline for nothing)
    num_drained_steps: int = 0
    num_drained_steps_without_drafts: int = 0
    speculation_host_seconds: float = 0.0  # host time spent deciding on and proposing drafts
    # steps whose forward ran as the chain of programs, and as one program (step_programs);
    # tiered: programs compiled in the background so far (whole forwards, and the chains of
    # buckets whose steps ran in a larger compiled bucket meanwhile; the draft model's too), and
    # those steps (the same bits in any bucket)
    num_chain_steps: int = 0
    num_whole_steps: int = 0
    num_upgraded_programs: int = 0
    num_larger_bucket_steps: int = 0


# EngineStats' integer counters of speculative decoding (the engine keeps them by these names)
_SPEC_COUNTERS = (
    "num_draft_tokens",
    "num_accepted_tokens",
    "num_drafted_steps",
    "num_drained_steps",
    "num_drained_steps_without_drafts",
)


@dataclasses.dataclass
class _InFlight:
    """An enqueued step (async scheduling): its chunks, which of them sample, the device handles."""

    run: list[Chunk]
    chunks: list[tuple[Sequence, int]]
    samples: list[bool]
    launched: Launched


class _Request:
    def __init__(self, request_id, prompt, prompt_token_ids, params, seed, seqs):
        self.request_id, self.prompt, self.prompt_token_ids = request_id, prompt, prompt_token_ids
        self.params, self.seed, self.seqs = params, seed, seqs


class Engine:
    """``add_request`` / ``step`` / ``has_unfinished_requests`` / ``abort`` (vLLM's LLMEngine)."""

    def __init__(
        self, model, tokenizer, config: EngineConfig, speculative=None, draft_model=None, draft_tokenizer=None
    ):
        """``speculative``: a ``SpeculativeConfig`` or its dict (None: off); ``draft_model``: the
        loaded draft for method "draft_model", ``draft_tokenizer`` its tokenizer if known (the
        vocabularies must be one: ``speculative.check_draft_vocabulary``)."""
        self.config = config
        self.closed = False  # ``close``
        for m, what in ((model, "model"), (draft_model, "draft model")):
            if config.invariant and m is not None and m.config.head_dim not in HEAD_DIMS:
                raise ValueError(
                    f"the {what}'s head_dim is {m.config.head_dim}: the invariant attention kernels "
                    f"take {' or '.join(map(str, HEAD_DIMS))} (invariant=False runs XLA's attention)"
                )
        spec = SpeculativeConfig.create(speculative)
        if spec is not None and spec.method == "draft_model":
            if draft_model is None:
                raise ValueError("speculative method 'draft_model' needs the loaded draft_model")
            check_draft_vocabulary(model, tokenizer, draft_model, draft_tokenizer)
        self.speculator = None if spec is None else Speculator(spec, config, draft_model)
        # speculation's counters, by EngineStats field
        self._spec_totals = dict.fromkeys(_SPEC_COUNTERS, 0)
        self._spec_totals["speculation_host_seconds"] = 0.0
        self.model_config = model.config
        # top logprobs a step computes when a row asks for any (a vocabulary may be smaller)
        self._top_n = min(MAX_LOGPROBS, model.config.vocab_size)
        self.tokenizer = tokenizer
        self._token = object()  # marks the ValidPrompts this engine checked
        self.runner = ModelRunner(model, config)
        self._model = model  # (a draft that is this object follows set_weights)
        self.blocks = BlockManager(
            config.num_kv_blocks, config.block_size, enable_prefix_caching=config.enable_prefix_caching
        )
        self.scheduler = Scheduler(config, self.blocks)
        self.eos_ids = set(tokenizer.eos_token_ids if tokenizer is not None else model.config.eos_token_ids)
        self._seeds = np.random.default_rng(config.seed)
        self._requests: dict[str, _Request] = {}
        self._next_seq = 0
        self._arrivals = 0
        self._aborted: list[_Request] = []
        self._kept: list[RequestOutput] = []  # other requests' outputs from ``release``'s steps
        self._partial = True  # step(partial=False): build only finished requests' outputs
        # Async scheduling: the step on the device while the host schedules and enqueues the
        # next (its sampled tokens feed the next step on the device; the host reads them after).
        # With n-gram drafts too: drafts are built from tokens on the host, so when a sequence
        # would draft, the enqueued steps are read back first and the drafted step runs
        # synchronously (``_drafting``). Not with a draft model (it runs every step's batch) nor
        # across processes (every process would have to agree on the timing of host reads).
        self.async_scheduling = (
            config.async_scheduling
            and (self.speculator is None or self.speculator.draft is None)
            and jax.process_count() == 1
        )
        self._in_flight: list[_InFlight] = []  # enqueued, not yet read back (oldest first; at most 2)
        self._drain = False  # a drafted step is next: read back the enqueued ones, enqueue none
        # The adaptive rule's clock: every read-back or synchronous step ends an interval since
        # the one before (time, compiles at its end); an interval is the drafted regime's when
        # it drains the queue for a drafted step, is that step, or restarts the queue after it
        # (``_restart``): so the emptied pipeline's cost is counted where it is paid.
        self._last_event: tuple | None = None
        self._restart = False

    # ------------------------------------------------------------------ input checks

    def validate(self, prompt, params: SamplingParams | None = None) -> ValidPrompt:
        """Tokenizes ``prompt`` (a str, a list of token ids, {"prompt_token_ids": [...]} or
        {"prompt": "..."}) and checks it with ``params`` against this engine (vocabulary,
        max_model_len, KV pool);
        ValueError / TypeError naming the problem. The result goes to ``add_request`` as is."""
        self._require_open("validate")
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        if params.stop and self.tokenizer is None:  # they could never match: say so
            raise ValueError("stop strings need a tokenizer; this model has none (use stop_token_ids)")
        text, ids = self._tokenize(prompt)
        self._check(ids, params)
        return ValidPrompt(text, tuple(ids), params, self._token)

    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        return prompts.tokenize(self.tokenizer, prompt)

    def _check(self, ids: list[int], params: SamplingParams) -> None:
        prompts.check_request(ids, params, self.model_config.vocab_size, self.config, self.blocks.num_blocks)

    # ------------------------------------------------------------------ API

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None) -> int:
        """Queues a request; returns the seed its samples use. ``prompt``: as ``validate`` takes
        it, or the ``ValidPrompt`` it returned (then ``params`` must be None or the same)."""
        self._require_open("add_request")
        if not isinstance(request_id, str) or request_id in self._requests:
            raise ValueError(f"request_id must be a new str, got {request_id!r}")
        if any(o.request_id == request_id for o in self._kept):  # (one id, one request's outputs)
            raise ValueError(
                f"request_id {request_id!r} finished, but the next step() has yet to return its output"
            )
        if isinstance(prompt, ValidPrompt):
            if params is not None and params is not prompt.params:
                raise ValueError("a ValidPrompt carries its SamplingParams: pass params=None")
            valid = prompt
            if prompt.checked_by is not self._token:  # checked by another engine: check here too
                self._check(list(prompt.token_ids), prompt.params)
        else:
            valid = self.validate(prompt, params)
        text, ids, params = valid.text, list(valid.token_ids), valid.params
        seed = params.seed if params.seed is not None else int(self._seeds.integers(2**32))
        seqs = []
        for i in range(params.n):
            seqs.append(Sequence(self._next_seq, request_id, ids, params, seed, i, self._arrivals))
            self._next_seq += 1
            self._arrivals += 1
        self._requests[request_id] = _Request(request_id, text, ids, params, seed, seqs)
        for s in seqs:
            self.scheduler.add(s)
        return seed

    def has_unfinished_requests(self) -> bool:
        return self._running() or bool(self._kept)

    def _running(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._aborted) or bool(self._in_flight)

    def check_weights(self) -> None:
        """Raises (before anything is scheduled) when the weights - the draft model's too - were
        deleted, e.g. donated to a train step since ``set_weights``."""
        try:
            self.runner.check_params()
        except RuntimeError as e:
            if not self.has_unfinished_requests():
                raise
            n = len(self._requests)  # (new weights go in only while idle)
            raise RuntimeError(
                f"{e} - after aborting the {n} request(s) in flight, whose KV came from the old weights"
            ) from None
        sp = self.speculator
        if sp is not None and sp.draft is not None and sp.draft_model is not self._model:
            sp.draft.check_params(
                "the draft model's weights have been deleted (donated to a train step?); "
                "update_weights does not change a draft that is another model: give the LLM a new "
                "draft (a new LLM), or keep the draft's arrays out of the train step"
            )

    def changed_in_place(self, model) -> bool:
        """Whether ``model`` is the model object this engine runs and its weights were changed in
        place since the engine took them (an optimizer step on it, ``nnx.update``):
        ``set_weights(model)`` takes them. (~0.8 ms for llama3-8b's variables.)"""
        return self._model is model and not self.runner.follows()

    def set_weights(self, model) -> None:
        """Runs with ``model``'s weights from now on (same attention heads, k_shards, shapes and
        dtypes, else an error before anything changes; another config, such as an epsilon,
        recompiles the steps) and empties the prefix cache, whose KV came from the old weights. A draft model that is this model object
        (self-speculation) follows it; another draft keeps its own weights."""
        self._require_idle("set_weights")
        self.runner.check_model(model)  # (nothing changes unless the steps can run it)
        sp = self.speculator
        follows = sp is not None and sp.draft is not None and sp.draft_model is self._model
        self.runner.set_model(model)
        self._model = model
        if follows:
            sp.draft_model = model
            sp.draft.set_model(model)
        self.blocks.reset_prefix_cache()  # its KV came from the old weights

    @property
    def speculative(self) -> tuple[SpeculativeConfig, object] | None:
        """(speculative config, loaded draft model or None), or None without speculation."""
        sp = self.speculator
        return None if sp is None else (sp.spec, sp.draft_model)

    @property
    def compiles_in_background(self) -> bool:
        """Whether this engine's steps do not wait on their forward's compile once a larger
        bucket is ready (tiered step programs, the GPUs' default): a step whose bucket's forward
        is not compiled yet runs in the smallest larger bucket whose forward is (the same bits)
        while its own compiles in the background - so a warm-up can leave out the buckets of
        later steps (``bijax generate`` warms up only the prompt's: the first token sooner). A
        sampling program for a row count not seen yet still compiles when its step comes. Not
        for ``invariant=False``, whose bits follow the bucket."""
        return self.runner._tiered and self.config.invariant

    @property
    def num_compiled_buckets(self) -> int:
        return len(self.runner.compiled_buckets)

    def pending_buckets(
        self, *, logprobs: bool = False, max_step_tokens: int | None = None, step_tokens=None
    ) -> list[tuple[int, int]]:
        """The (sequences, tokens) step buckets ``warmup`` makes ready (their programs that do not
        exist yet are compiled; with ``logprobs`` the top-logprobs variant too); with
        ``max_step_tokens``, only token buckets up to the one that holds that many tokens;
        with ``step_tokens`` (the token counts of the steps to expect, e.g. one prompt's
        chunks and then decoding), only the token buckets of those steps. (A closed engine:
        RuntimeError - ``warmup`` asks this first, before its progress bar.)"""
        self._require_open("warmup")
        pairs = self.runner.bucket_pairs()
        buckets = self.config.token_buckets
        if max_step_tokens is not None and step_tokens is not None:
            raise ValueError("give max_step_tokens or step_tokens, not both")
        if max_step_tokens is not None:
            if (
                isinstance(max_step_tokens, bool)
                or not isinstance(max_step_tokens, (int, np.integer))
                or max_step_tokens < 1
            ):
                raise ValueError(f"max_step_tokens must be an int >= 1, got {max_step_tokens!r}")
            cap = bucket(min(int(max_step_tokens), buckets[-1]), buckets)
            pairs = [(s, t) for s, t in pairs if t <= cap]
        if step_tokens is not None:
            counts = list(step_tokens) if isinstance(step_tokens, (list, tuple)) else []
            if not counts or any(not is_int(n) or n < 1 for n in counts):
                raise ValueError(f"step_tokens must be a non-empty list of ints >= 1, got {step_tokens!r}")
            want = {bucket(min(int(n), buckets[-1]), buckets) for n in counts}
            pairs = [(s, t) for s, t in pairs if t in want]
        # (every bucket in range: a bucket whose steps ran has only the sampling programs those
        # steps used; ``ModelRunner.warmup`` skips the programs that exist)
        return pairs

    def warmup(
        self,
        *,
        logprobs: bool = False,
        on_bucket=None,
        max_step_tokens: int | None = None,
        step_tokens=None,
    ) -> float:
        """Compiles every pending step bucket (and with ``logprobs`` the top-logprobs variant);
        ``on_bucket(num_seqs, num_tokens, with_logprobs)`` after each. ``max_step_tokens``,
        ``step_tokens``: see ``pending_buckets`` (a step that needs another bucket compiles it
        when it comes). Returns the seconds spent tracing and lowering (the rest compiles or
        loads)."""
        self._require_open("warmup")
        if not isinstance(logprobs, (bool, np.bool_)):
            raise TypeError(f"warmup: logprobs must be True or False, got {logprobs!r}")
        pairs = self.pending_buckets(
            logprobs=logprobs, max_step_tokens=max_step_tokens, step_tokens=step_tokens
        )
        tracing = 0.0
        for num_logprobs in [0, self._top_n] if logprobs else [0]:
            tick = None if on_bucket is None else (lambda s, t, n=num_logprobs: on_bucket(s, t, bool(n)))
            tracing += self.runner.warmup(pairs, num_logprobs, tick)
        if self.speculator is not None:  # verify steps sample every token row: (s, t, t)
            verify = self.speculator.verify_buckets(self.runner.bucket_pairs())
            for num_logprobs in [0, self._top_n] if logprobs else [0]:  # (verify rows sample too)
                tracing += self.runner.warmup(verify, num_logprobs)
            if self.speculator.draft is not None:  # its decode steps, and the verify steps it runs too
                tracing += self.speculator.draft.warmup(self.runner.bucket_pairs() + verify)
        return tracing

    def programs_made(self) -> int:
        """Step programs ``warmup`` has made ready so far (the draft model's included)."""
        n = self.runner.programs_made
        if self.speculator is not None and self.speculator.draft is not None:
            n += self.speculator.draft.programs_made
        return n

    def pending_upgrades(self) -> int:
        """Tiered: whole forwards still compiling in the background (the draft model's too)."""
        n = self.runner.pending_upgrades()
        if self.speculator is not None and self.speculator.draft is not None:
            n += self.speculator.draft.pending_upgrades()
        return n

    def wait_for_upgrades(self, timeout: float | None = None) -> float:
        """Tiered step programs (``BIJAX_STEP_PROGRAMS=tiered``): waits until the whole
        forwards compiling in the background are ready (the draft model's too); returns the
        seconds waited (0 when none are pending). Raises TimeoutError after ``timeout`` s."""
        waited = self.runner.wait_upgrades(timeout)
        if self.speculator is not None and self.speculator.draft is not None:
            waited += self.speculator.draft.wait_upgrades(timeout)
        return waited

    def programs_lowered_elsewhere(self) -> int:
        """Of ``programs_made``, those lowered by helper processes (``parallel_lowering``)."""
        n = self.runner.programs_lowered_elsewhere
        if self.speculator is not None and self.speculator.draft is not None:
            n += self.speculator.draft.programs_lowered_elsewhere
        return n

    def stats(self) -> EngineStats:
        return EngineStats(
            prefix_cache_hit_blocks=self.blocks.hit_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            num_free_blocks=self.blocks.num_free,
            num_compiled_buckets=self.num_compiled_buckets,
            num_unfinished_requests=len(self._requests),
            num_compiled_steps=num_compiled_steps(),
            num_running_seqs=len(self.scheduler.running),
            num_waiting_seqs=len(self.scheduler.waiting),
            num_kv_blocks_in_use=self.blocks.num_blocks - 1 - self.blocks.num_free,
            num_chain_steps=self.runner.steps_by_form["chain"],
            num_whole_steps=self.runner.steps_by_form["whole"],
            num_upgraded_programs=self.runner.programs_upgraded
            + (
                0
                if self.speculator is None or self.speculator.draft is None
                else self.speculator.draft.programs_upgraded
            ),
            num_larger_bucket_steps=self.runner.larger_bucket_steps,
            **self._spec_totals,
        )

    def reset_prefix_cache(self) -> None:
        """Empties the prefix cache (only while idle): the next requests compute every prompt
        token, as on a fresh engine - what a benchmark's timed run must start from."""
        self._require_idle("reset_prefix_cache")
        self.blocks.reset_prefix_cache()

    def limit_kv_pool(self, num_blocks: int) -> None:
        """Schedules into the first ``num_blocks`` KV blocks only (block 0 reserved), without
        prefix caching: a pool too small for a batch forces preemption (``bijax check``). The
        cache keeps its shape, so nothing recompiles. Only while idle."""
        self._require_idle("limit_kv_pool")
        if not is_int(num_blocks) or not 2 <= num_blocks <= self.config.num_kv_blocks:
            raise ValueError(
                f"num_blocks must be an int in [2, {self.config.num_kv_blocks}], got {num_blocks!r}"
            )
        num_blocks = int(num_blocks)
        hits, preemptions = self.blocks.hit_blocks, self.scheduler.num_preemptions
        self.blocks = BlockManager(num_blocks, self.config.block_size, enable_prefix_caching=False)
        self.scheduler = Scheduler(self.config, self.blocks)
        # (``stats`` counts since the engine was built, not since the pool changed)
        self.blocks.hit_blocks, self.scheduler.num_preemptions = hits, preemptions
        self._token = object()  # prompts checked against the whole pool are checked again

    def settle(self) -> None:
        """Reads back the enqueued steps that no request waits for any more - what an interrupt
        inside ``release`` leaves (a second Ctrl-C while the first one's steps run): they hold
        no request's tokens, and once they are on the host the engine is idle. Nothing happens
        while any request, or any output kept for the next ``step()``, is here."""
        while (
            self._in_flight and not self._requests and not self._kept and not self.scheduler.has_unfinished()
        ):
            self.step(partial=False)

    def _require_idle(self, what: str) -> None:
        self._require_open(what)
        self.settle()
        if self.has_unfinished_requests():
            raise RuntimeError(f"{what} runs when no generation is in flight")

    def _require_open(self, what: str) -> None:
        if self.closed:
            raise RuntimeError(
                f"{what}: this engine was closed (close() freed its KV cache); build a new LLM or Engine"
            )

    def close(self) -> None:
        """Frees the device memory the engine holds besides the model's weights - the KV cache
        (the draft model's too), staged inputs, its references to compiled steps - now, so that
        another engine on the same model fits (only while idle; a second call does nothing).
        The engine runs nothing afterwards: the methods that would raise RuntimeError saying so."""
        if self.closed:
            return
        self._require_idle("close")
        self.closed = True
        try:
            self.runner.close()
        finally:  # (each runner frees its buffers whatever the other's close did)
            if self.speculator is not None and self.speculator.draft is not None:
                self.speculator.draft.close()

    def abort(self, request_id: str) -> None:
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
        req = self._requests.get(request_id)
        if req is None:
            raise ValueError(f"no request {request_id!r}")
        if any(r is req for r in self._aborted):  # aborted twice before a step: one output
            return
        for s in req.seqs:
            if s.status != Status.FINISHED:
                self._finish(s, "abort")
        self._aborted.append(req)

    def release(self, request_ids) -> None:
        """Aborts ``request_ids`` (those still here) and runs the steps that free them, so the
        engine is idle after a failure: what ``LLM.generate`` and the server's engine loop do
        when a step, a callback or the device fails. Requests not named run to their end in
        those steps; their final outputs are not lost - the next ``step()`` returns them (and
        ``has_unfinished_requests()`` stays true until it has). A failing engine frees what it
        can."""
        if isinstance(request_ids, (str, bytes)) or not isinstance(request_ids, Iterable):
            raise TypeError(f"request_ids must be a list of str, got {type(request_ids).__name__}")
        request_ids = list(request_ids)
        if not all(isinstance(r, str) for r in request_ids):
            raise TypeError("request_ids must be a list of str")
        released = set()
        for rid in request_ids:
            if rid in self._requests:
                self.abort(rid)
                released.add(rid)
        try:
            while self._running():
                self.hand_back([o for o in self.step(partial=False) if o.request_id not in released])
        except Exception:  # the engine itself is failing: nothing more to free here
            pass

    def hand_back(self, outputs) -> None:
        """Final outputs that a caller's ``step()`` returned but that belong to someone else
        (``release``'s steps; ``LLM.generate`` stepping requests that its ``on_output`` added
        here): the next ``step()`` returns them, and ``has_unfinished_requests()`` stays true
        until it has. Partial outputs are snapshots, and later ones supersede them: only
        finished outputs are kept."""
        if isinstance(outputs, RequestOutput) or not isinstance(outputs, Iterable):
            raise TypeError(f"outputs must be a list of RequestOutput, got {type(outputs).__name__}")
        outputs = list(outputs)
        if not all(isinstance(o, RequestOutput) for o in outputs):
            raise TypeError("outputs must be a list of RequestOutput")
        self._kept += [o for o in outputs if o.finished]

    def step(self, *, partial: bool = True) -> list[RequestOutput]:
        """Runs one scheduled step; returns the outputs of the requests it advanced
        (``finished`` set on those that are done). With async scheduling it enqueues the next
        step, then waits for the one before and returns what that one advanced: the device
        never waits for the host between steps (the first call after a synchronous step may
        return nothing). With n-gram drafts a step that drafts runs synchronously: the calls
        before it only read back the enqueued steps. The tokens and logprobs are the same bits
        either way (a row's bits do not depend on what else is in its step).

        ``partial=False``: only the outputs of requests that finished (or were aborted); no
        snapshot of the others is built (a snapshot copies its prompt and outputs: per-step
        host work that grows with them, wasted where only the final outputs are wanted)."""
        self._partial = partial
        outputs, self._kept = self._kept, []  # (release's steps' outputs of other requests)
        outputs += [self._output(r) for r in self._aborted]
        for r in self._aborted:
            self._requests.pop(r.request_id, None)
        self._aborted = []
        if self.async_scheduling and not self._drafting():
            outputs += self._step_async()
        elif self._in_flight:  # a drafted step is next: the enqueued steps' tokens come first
            outputs += self._read_back()
        else:
            outputs += self._step_sync()
        if not self.has_unfinished_requests():  # idle: no decision or timing carries over
            self._drain, self._restart, self._last_event = False, False, None
        return outputs

    def _drafting(self) -> bool:
        """Async scheduling with n-gram drafts: whether the next step drafts (decided once, then
        kept until that step has run): some sequence would draft from its known tokens and
        drafting pays at this batch size."""
        if self.speculator is None:
            return False
        running = self.scheduler.running
        # (the rule first: it is one decision per step, as in synchronous mode, and the scan
        # of the sequences runs only where drafting would pay)
        t0 = time.perf_counter()
        if (
            not self._drain
            and self.speculator.worth_it(len(running))
            and self.speculator.has_candidates(running)
        ):
            self._drain = True
        self._spec_totals["speculation_host_seconds"] += time.perf_counter() - t0
        return self._drain

    def _interval(self, num_seqs: int, decode_only: bool, drafted: bool, emitted: int) -> None:
        """Ends an interval of the adaptive rule's clock (see ``__init__``): its time since the
        last one and the tokens it emitted go to the speculator, unless something compiled."""
        now = (time.perf_counter(), num_compiled_steps())
        last, self._last_event = self._last_event, now
        if self.speculator is not None and last is not None and last[1] == now[1]:
            self.speculator.timed(num_seqs, decode_only, drafted, now[0] - last[0], emitted)

    def _step_sync(self) -> list[RequestOutput]:
        """Schedules, runs and reads back one step (drafts in it with speculative decoding)."""
        if not self.scheduler.has_unfinished():
            return []
        self.check_weights()  # before scheduling: a failure leaves every request as it was
        chunks = self.scheduler.schedule()
        drafts = {}
        if self.speculator is not None:
            t0 = time.perf_counter()
            if self._drain or self.speculator.worth_it(len(chunks)):
                left = self.config.max_num_batched_tokens - sum(n for _, n in chunks)
                drafts = self.speculator.propose(chunks, self.blocks, left)
            self._spec_totals["speculation_host_seconds"] += time.perf_counter() - t0
        drained, self._drain = self._drain, False
        self._spec_totals["num_drafted_steps"] += bool(drafts)
        self._spec_totals["num_drained_steps"] += drained
        self._spec_totals["num_drained_steps_without_drafts"] += drained and not drafts
        run = [Chunk.pending(seq, n, drafts.get(seq.seq_id, ())) for seq, n in chunks]
        num_logprobs = self._top_n if any(s.params.logprobs for s, _ in chunks) else 0
        tok, lp, top = self.runner.step(run, num_logprobs)
        if self.speculator is not None:
            self.speculator.observe(run)
        emitted = 0  # tokens this step appends, and whether every chunk is a decode (adaptive rule)
        decode_only = True
        touched = {}
        row = 0
        for c, (seq, n) in zip(run, chunks, strict=True):
            first, row = row, row + c.num_rows
            decode_only = decode_only and len(c.tokens) == c.num_rows  # one pending token + drafts
            seq.num_computed += n
            if seq.num_computed < len(seq):
                self.blocks.register(seq)
                continue  # mid-prompt chunk: nothing sampled yet
            before = len(seq.output_token_ids)
            reason = self._emit(seq, c, tok, lp, top, first)
            emitted += len(seq.output_token_ids) - before
            seq.num_computed = len(seq) - 1  # the last token (sampled) is pending, as in plain decoding
            self.blocks.register(seq)
            if reason is not None:
                self._finish(seq, reason)
            elif c.num_rows > 1:
                self.blocks.trim(seq)  # blocks of rejected drafts go back
            touched[seq.request_id] = self._requests[seq.request_id]
        # A step the queue was emptied for counts as drafted even if in the end nothing was
        # drafted (the guess from the known tokens missed): emptying the queue was its cost, and
        # so is refilling it (the next read-back's interval).
        drafted = bool(drafts or drained)
        self._interval(len(run), decode_only, drafted, emitted)
        self._restart = drafted and self.async_scheduling
        return self._outputs(touched.values())

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        if self.speculator is not None:
            self.speculator.forget(seq)

    def _step_async(self) -> list[RequestOutput]:
        """Enqueues the next step (unless one is already waiting to be read back), then reads
        back the oldest enqueued step. A step leaves the queue only once its tokens are on the
        host: an interrupt or device error while waiting leaves it there, and the next call
        reads it again (nothing of the host's state moved)."""
        steps = self._in_flight
        dispatched = False
        if len(steps) < 2 and self.scheduler.has_unfinished():
            self.check_weights()  # before scheduling: a failure leaves every request as it was
            chunks = self.scheduler.schedule()
            if chunks:
                run = [Chunk.pending(seq, n) for seq, n in chunks]
                num_logprobs = self._top_n if any(s.params.logprobs for s, _ in chunks) else 0
                launched = self.runner.dispatch(run, num_logprobs, steps[-1].launched if steps else None)
                samples = []
                for seq, n in chunks:  # the host's view moves on now; the tokens come back later
                    seq.num_computed += n
                    samples.append(seq.num_computed == len(seq))
                    if samples[-1]:
                        seq.in_flight += 1
                        left = seq.params.max_tokens - len(seq.output_token_ids) - seq.in_flight
                        seq.finishing = left <= 0 or len(seq) >= self.config.max_model_len
                steps.append(_InFlight(run, chunks, samples, launched))
                dispatched = True
        if not steps or (dispatched and len(steps) == 1):
            return []
        return self._read_back()

    def _read_back(self) -> list[RequestOutput]:
        """Waits for the oldest enqueued step and applies its tokens."""
        step = self._in_flight[0]
        tok, lp, top = self.runner.collect(step.launched)  # waits; may raise: the step stays queued
        self._in_flight.pop(0)
        decode_only = all(step.samples) and all(n == 1 for _, n in step.chunks)
        self._interval(len(step.chunks), decode_only, self._drain or self._restart, sum(step.samples))
        self._restart = False
        return self._apply(step, tok, lp, top)

    def _apply(self, step: _InFlight, tok, lp, top) -> list[RequestOutput]:
        """Applies a read-back step's sampled tokens (async scheduling)."""
        touched = {}
        row = 0
        for c, (seq, _), sampled in zip(step.run, step.chunks, step.samples, strict=True):
            first, row = row, row + c.num_rows
            if seq.status == Status.FINISHED:  # ended (stop, abort) after this step was enqueued
                continue
            if not sampled:  # mid-prompt chunk: nothing sampled yet
                self.blocks.register(seq)
                continue
            seq.in_flight -= 1
            reason = self._emit(seq, c, tok, lp, top, first)
            self.blocks.register(seq)
            if reason is not None:
                self._finish(seq, reason)
            touched[seq.request_id] = self._requests[seq.request_id]
        return self._outputs(touched.values())

    def _outputs(self, requests) -> list[RequestOutput]:
        """The outputs of the requests a step advanced; finished ones leave the engine."""
        outputs = []
        for req in requests:
            if not self._partial and not all(s.status == Status.FINISHED for s in req.seqs):
                continue
            out = self._output(req)
            outputs.append(out)
            if out.finished:
                del self._requests[req.request_id]
        return outputs

    # ------------------------------------------------------------------ internals

    def _emit(self, seq: Sequence, c: Chunk, tok, lp, top, first: int) -> str | None:
        """Appends the chunk's sampled tokens - the last row's, then each draft row's while the
        draft before it equals the token sampled for its position - until one finishes the
        sequence; returns the finish reason (None: still running)."""
        drafts = c.tokens[len(c.tokens) - c.num_rows + 1 :]
        accepted = 0
        reason = None
        for j in range(c.num_rows):
            r = first + j
            seq.output_token_ids.append(int(tok[r]))
            seq.logprobs.append(lp[r])
            if seq.params.logprobs:
                k = seq.params.logprobs
                seq.top_logprobs.append(
                    [(int(i), float(v)) for i, v in zip(top[0][r, :k], top[1][r, :k], strict=True)]
                )
            reason = self._finish_reason(seq)
            if reason is not None or j == len(drafts) or drafts[j] != seq.output_token_ids[-1]:
                break
            accepted += 1
        if drafts:
            self.speculator.record(seq, len(drafts), accepted)
            self._spec_totals["num_draft_tokens"] += len(drafts)
            self._spec_totals["num_accepted_tokens"] += accepted
        return reason

    def _text(self, ids) -> str:
        """The text of generated ids; ids past the tokenizer's vocabulary (a model's padded
        vocabulary rows, e.g. Qwen's) have no text and are skipped, never an error."""
        v = self.tokenizer.vocab_size
        return self.tokenizer.decode([i for i in ids if i < v], skip_special_tokens=True)

    def _current_text(self, seq: Sequence) -> str:
        """The text of ``seq``'s outputs so far, decoding only the new tokens (bijax.detokenize)."""
        now, seq.text, seq.text_tokens = current_text(
            self._text, seq.output_token_ids, seq.text, seq.text_tokens
        )
        return now

    def _finish_reason(self, seq: Sequence) -> str | None:
        p, last = seq.params, seq.output_token_ids[-1]
        if (not p.ignore_eos and last in self.eos_ids) or p.stops_at(last):
            return "stop"
        if p.stop and self.tokenizer is not None:
            kept = seq.text  # searched at earlier tokens: only the new end can hold a stop now
            now = self._current_text(seq)  # decoded once per token, searched for every stop string
            start = len(kept) if now.startswith(kept) else 0
            if any(now.find(s, max(0, start - len(s) + 1)) >= 0 for s in p.stop):
                text = self._text(seq.output_token_ids)  # the cut comes from a whole decode
                hits = [i for i in (text.find(s) for s in p.stop) if i >= 0]
                if hits:
                    seq.text = text[: min(hits)]  # may be "" (the stop string came first)
                    seq.stop_cut = True
                    return "stop"
        if len(seq.output_token_ids) >= p.max_tokens or seq.num_known >= self.config.max_model_len:
            return "length"
        return None

    def _output(self, req: _Request) -> RequestOutput:
        outs = []
        for s in req.seqs:
            text = s.text
            if not s.stop_cut and self.tokenizer is not None:
                # partial outputs (streaming) from the incremental text; a finished one decoded whole
                done = s.status == Status.FINISHED
                text = (
                    self._text(s.output_token_ids)
                    if done
                    else partial_text(self._current_text(s), s.params.stop)
                )
            outs.append(
                CompletionOutput(
                    index=s.sample_index,
                    token_ids=list(s.output_token_ids),
                    logprobs=s.logprobs.array.copy(),
                    text=text,
                    finish_reason=s.finish_reason,
                    top_logprobs=list(s.top_logprobs) if s.params.logprobs else None,
                )
            )
        done = all(s.status == Status.FINISHED for s in req.seqs)
        metrics = None
        if self.speculator is not None:
            metrics = SpeculativeMetrics(
                sum(s.num_draft_tokens for s in req.seqs),
                sum(s.num_accepted_tokens for s in req.seqs),
                sum(s.num_verify_steps for s in req.seqs),
            )
        return RequestOutput(
            req.request_id, req.prompt, list(req.prompt_token_ids), req.seed, outs, done, metrics
        )

    def score(self, token_ids, prompt_lens, temperature: float = 1.0) -> list[np.ndarray]:
        """float32 logprob of each token at index >= prompt_len given the tokens before it,
        under log_softmax(logits / T) (raw for T = 0) - bit-equal to generate's logprobs."""
        self._require_idle("score")
        self.check_weights()
        check_temperature(temperature, scalar=True)
        for name, arg in (("token_ids", token_ids), ("prompt_lens", prompt_lens)):
            if isinstance(arg, (str, bytes, dict)) or not isinstance(arg, Sized):
                raise TypeError(f"{name} must be a list (one entry per sequence), got {type(arg).__name__}")
        if len(token_ids) != len(prompt_lens):
            raise ValueError(f"{len(token_ids)} sequences but {len(prompt_lens)} prompt_lens")
        seqs = []
        dummy = SamplingParams(max_tokens=1)
        for i, (ids, pl) in enumerate(zip(token_ids, prompt_lens, strict=True)):
            if isinstance(ids, (str, bytes, dict)) or not isinstance(ids, Iterable):  # (text: its characters)
                raise TypeError(f"token_ids[{i}] must be a list of int token ids, got {type(ids).__name__}")
            try:
                _, ids = self._tokenize(ids)  # (any iterable of ids; numpy's and JAX's arrays)
            except TypeError as e:
                raise TypeError(f"token_ids[{i}]: {e}") from None
            if not ids:
                raise ValueError(f"token_ids[{i}] is empty: a sequence to score needs at least one token")
            if len(ids) > self.config.max_model_len:
                raise ValueError(
                    f"token_ids[{i}]: {len(ids)} tokens exceed max_model_len ({self.config.max_model_len})"
                )
            if not is_int(pl) or not 1 <= pl <= len(ids):
                raise ValueError(f"prompt_lens[{i}] must be an int in [1, {len(ids)}], got {pl!r}")
            pl = int(pl)
            vocab = self.model_config.vocab_size
            # checked as a prompt and the tokens after it (at least one: a request's max_tokens),
            # which hold the whole sequence - nothing to score (pl == len) at max_model_len fits
            split = pl - 1 if pl == len(ids) > 1 else pl
            bad = [t for t in ids[split:] if not 0 <= t < vocab]
            if bad:  # (the prompt's ids are _check's)
                raise ValueError(f"token_ids[{i}]: token id {bad[0]} is outside the vocabulary [0, {vocab})")
            try:
                self._check(ids[:split], SamplingParams(max_tokens=max(1, len(ids) - split)))
            except ValueError as e:  # (which sequence: the check's own message names none)
                raise ValueError(f"token_ids[{i}]: {e}") from None
            seq = Sequence(-1 - i, f"score-{i}", ids, dummy, 0, 0, i)
            seq.prefix_limit = pl - 1  # positions from pl - 1 on need their logits
            seqs.append(seq)
        return scoring.score_sequences(self.runner, self.blocks, self.config, seqs, prompt_lens, temperature)
