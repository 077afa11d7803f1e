"""One thread steps the engine; asyncio handlers add requests to the running batch.

The engine is touched only by this thread (``validate`` excepted: it reads the tokenizer and
the limits, never the scheduler). Handlers send commands (add, abort) through a queue and get
each request's ``RequestOutput``s on an ``asyncio.Queue``; a request added between two steps
joins the next one (continuous batching across clients).
"""

from __future__ import annotations

import asyncio
import dataclasses
import queue
import threading
import time

from bijax.llm_engine import Engine, EngineStats, ValidPrompt

# Upper bounds (seconds) of the step-time histogram's buckets.
STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, float("inf"))


@dataclasses.dataclass
class Metrics:
    """Counters since start; written by the engine thread only."""

    requests_added: int = 0
    requests_finished: dict[str, int] = dataclasses.field(default_factory=dict)  # by finish reason
    prompt_tokens: int = 0
    generation_tokens: int = 0
    steps: int = 0
    step_seconds_sum: float = 0.0
    step_buckets: list[int] = dataclasses.field(default_factory=lambda: [0] * len(STEP_BUCKETS))
    engine_errors: int = 0

    def observe_step(self, seconds: float) -> None:
        self.steps += 1
        self.step_seconds_sum += seconds
        for i, upper in enumerate(STEP_BUCKETS):
            if seconds <= upper:
                self.step_buckets[i] += 1


class EngineError(RuntimeError):
    """The engine failed while stepping: every request in flight then gets this."""


class _Sink:
    """Where one request's outputs go: an asyncio queue (several requests may share one), fed
    from the engine thread. Outputs are cumulative, so a snapshot the reader has not taken yet
    is replaced by the next one (a slow reader holds one snapshot per request, not one per
    step): the queue carries the sink itself as a marker, and ``next_item`` resolves it."""

    def __init__(self, loop: asyncio.AbstractEventLoop, q: asyncio.Queue):
        self.loop, self.queue = loop, q
        self.tokens = 0  # tokens generated so far (all samples)
        self._latest = None  # event-loop side: the snapshot not yet taken
        self._queued = False

    def put(self, item) -> None:
        self.loop.call_soon_threadsafe(self._deliver, item)

    def _deliver(self, item) -> None:  # on the event loop
        if isinstance(item, EngineError):
            self.queue.put_nowait(item)
            return
        self._latest = item
        if not self._queued:
            self._queued = True
            self.queue.put_nowait(self)

    def take(self):
        self._queued = False
        item, self._latest = self._latest, None
        return item


async def next_item(q: asyncio.Queue):
    """The next RequestOutput (the latest snapshot of its request) or EngineError from ``q``."""
    item = await q.get()
    return item.take() if isinstance(item, _Sink) else item


class EngineLoop:
    """Runs ``engine.step()`` in a thread while any request is unfinished; idles otherwise."""

    def __init__(self, engine: Engine):
        self._engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._sinks: dict[str, _Sink] = {}
        self._stopping = False
        self._draining = False  # abort_all was called: no new requests
        self._lock = threading.Lock()  # an add is queued only while the loop will still run it
        self.metrics = Metrics()
        self.stats: EngineStats = engine.stats()  # a snapshot, refreshed by the engine thread
        self._thread = threading.Thread(target=self._run, name="bijax-engine-loop", daemon=True)

    # ------------------------------------------------------------------ asyncio side

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def validate(self, prompt, params) -> ValidPrompt:
        return self._engine.validate(prompt, params)

    async def add(self, requests: list[tuple[str, ValidPrompt]], outputs: asyncio.Queue) -> list[int]:
        """Queues validated requests (request id, ValidPrompt) together - they join the same next
        step, or none is added (the first error is raised); returns the seeds they use. Their
        ``RequestOutput``s (the last one of each ``finished``), or an ``EngineError``, arrive on
        ``outputs``. Refused (EngineError) once the server is shutting down."""
        loop = asyncio.get_running_loop()
        added = loop.create_future()
        with self._lock:
            if not self.alive:
                raise EngineError("the engine loop is not running")
            if self._draining:
                raise EngineError("the server is shutting down: no new requests")
            requests = [(rid, valid, _Sink(loop, outputs)) for rid, valid in requests]  # one a request
            self._send(("add", requests, added))
        return await added

    def abort(self, request_id: str) -> None:
        """Aborts a request (its client went away): its KV blocks are freed at the next step."""
        self._send(("abort", request_id))

    def abort_all(self) -> None:
        """Shutting down: aborts every request in flight (their responses end with
        finish_reason "abort" at the next step) and refuses every later ``add`` (a request
        still being validated gets a 503, not a run that the shutdown would cut)."""
        with self._lock:
            self._draining = True
            self._send(("abort_all",))

    def stop(self, timeout: float = 10.0) -> None:
        """Aborts every request, finishes the step in progress and ends the thread."""
        with self._lock:
            self._stopping = True
        self._send(("stop",))
        self._thread.join(timeout)

    def _send(self, command) -> None:
        self._commands.put(command)
        self._wake.set()

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        try:
            self._serve()
        finally:  # stopped, or a bug outside the engine's step: no request is left waiting
            with self._lock:
                self._stopping = True
            while not self._drain():  # adds queued before the stop still get their answer
                pass
            self._fail_all(EngineError("the engine loop stopped (the server is shutting down)"))
            self.stats = self._engine.stats()

    def _serve(self) -> None:
        engine = self._engine
        while not self._stopping:
            self._wake.clear()
            if not self._drain():
                break
            if not engine.has_unfinished_requests():
                self.stats = engine.stats()
                self._wake.wait()
                continue
            t0 = time.perf_counter()
            try:
                outputs = engine.step()
            except Exception as e:  # a bug or a device failure: fail the requests in flight, keep serving
                self.metrics.engine_errors += 1
                self._fail_all(EngineError(f"the engine failed: {type(e).__name__}: {e}"))
                continue
            self.metrics.observe_step(time.perf_counter() - t0)
            self._deliver(outputs)
            self.stats = engine.stats()

    def _drain(self) -> bool:
        """Runs the queued commands; False once asked to stop."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True
            kind = command[0]
            if kind == "stop":
                return False
            if kind == "add":
                _, requests, added = command
                seeds = []
                try:
                    for rid, valid, _ in requests:
                        seeds.append(self._engine.add_request(rid, valid))
                except Exception as e:  # none of them runs; the handler reports it to its client
                    # (release, not abort: an aborted request waits for a step to leave the
                    # engine, and a stop before it left one behind)
                    self._engine.release([rid for rid, _, _ in requests[: len(seeds)]])
                    added.get_loop().call_soon_threadsafe(_set_exception, added, e)
                    continue
                for rid, valid, sink in requests:
                    self._sinks[rid] = sink
                    self.metrics.requests_added += 1
                    self.metrics.prompt_tokens += len(valid.token_ids)
                added.get_loop().call_soon_threadsafe(_set_result, added, seeds)
            elif kind == "abort" and command[1] in self._sinks:
                self._engine.abort(command[1])
            elif kind == "abort_all":
                for rid in self._sinks:
                    self._engine.abort(rid)

    def _deliver(self, outputs) -> None:
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue
            n = sum(len(o.token_ids) for o in out.outputs)
            self.metrics.generation_tokens += n - sink.tokens
            sink.tokens = n
            sink.put(out)
            if out.finished:
                del self._sinks[out.request_id]
                reasons = [o.finish_reason or "abort" for o in out.outputs]
                reason = "abort" if "abort" in reasons else reasons[0]
                self.metrics.requests_finished[reason] = self.metrics.requests_finished.get(reason, 0) + 1

    def _fail_all(self, error: EngineError) -> None:
        for sink in self._sinks.values():
            sink.put(error)
        rids = list(self._sinks)
        self._sinks.clear()
        self._engine.release(rids)  # their blocks go back to the pool


def _set_result(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, error: BaseException) -> None:
    if not fut.done():
        fut.set_exception(error)
