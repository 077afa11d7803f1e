"""Per-sample state of a request as the scheduler and runner see it."""

from __future__ import annotations

import enum

import numpy as np

from bijax.sampling_params import SamplingParams

PENDING = -1  # a token id not yet on the host (async scheduling): the device fills it in


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class GrowingArray:
    """Values appended one at a time into a numpy array that doubles when full; ``array`` is a
    view of them (a step reads a sequence's blocks or logprobs without converting a Python list
    of a 32k-token sequence: ~60 us per sequence per step)."""

    __slots__ = ("_a", "_n")

    def __init__(self, dtype, values=()):
        self._a = np.zeros(max(16, len(values)), dtype)
        self._n = 0
        for v in values:
            self.append(v)

    def append(self, value) -> None:
        if self._n == len(self._a):
            self._a = np.concatenate([self._a, np.zeros_like(self._a)])
        self._a[self._n] = value
        self._n += 1

    @property
    def array(self) -> np.ndarray:
        """The values (a view: copy it to keep it)."""
        return self._a[: self._n]

    def __len__(self) -> int:
        return self._n


class BlockTable(GrowingArray):
    """A sequence's physical KV blocks in order (int32): appended to, cut from the end, cleared;
    otherwise read like the list it replaced."""

    __slots__ = ()

    def __init__(self, blocks=()):
        super().__init__(np.int32, blocks)

    def __bool__(self) -> bool:
        return self._n > 0

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self.array[i].tolist()
        if not -self._n <= i < self._n:
            raise IndexError(f"block {i} of a table of {self._n}")
        return int(self.array[i])

    def __delitem__(self, i) -> None:
        if not isinstance(i, slice) or i.step is not None or (i.stop is not None and i.stop < self._n):
            raise TypeError("a block table is only cut from the end: del table[k:]")
        start = 0 if i.start is None else i.start
        start = max(0, start + self._n if start < 0 else start)
        self._n = min(self._n, start)

    def __iter__(self):
        return iter(self.array.tolist())

    def __reversed__(self):
        return iter(self.array[::-1].tolist())

    def __eq__(self, other) -> bool:
        return list(self) == list(other)

    def __repr__(self) -> str:
        return f"BlockTable({list(self)})"


class Sequence:
    """One sample (``sample_index`` of its request): prompt + generated tokens, KV blocks.

    ``num_computed`` tokens have their KV in the cache; the next step feeds tokens from
    there. Generation samples only once every token so far is computed.
    """

    def __init__(
        self,
        seq_id: int,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        seed: int,
        sample_index: int,
        arrival: int,
    ):
        self.seq_id = seq_id
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.logprobs = GrowingArray(np.float32)  # of the generated tokens, bits preserved
        self.top_logprobs: list[list[tuple[int, float]]] = []
        self.params = params
        self.seed = seed
        self.sample_index = sample_index
        self.arrival = arrival
        self.status = Status.WAITING
        self.num_computed = 0
        self._block_table = BlockTable()
        self.block_keys: list[int] = []  # prefix-cache chain ids of its full blocks
        self.prefix_limit: int | None = None  # at most this many tokens may come from the cache
        self.finish_reason: str | None = None
        self.text = ""  # the text of the first ``text_tokens`` outputs (bijax.detokenize)
        self.text_tokens = 0
        self.stop_cut = False  # a stop string ended it: ``text`` is cut before it
        # speculative decoding: counters (RequestOutput.metrics) and adaptive back-off
        self.num_draft_tokens = self.num_accepted_tokens = self.num_verify_steps = 0
        self.window_drafted = self.window_accepted = 0
        self.spec_resume_at = 0  # draft again once the sequence is this long
        self.spec_misses = 0
        # async scheduling: tokens sampled on the device and not yet read back (at most 2: the one
        # the next step feeds in, and the one it samples); they stand at the end of ``token_ids``
        # as PENDING, which the runner replaces on the device with the step's sampled token.
        self.in_flight = 0
        self.finishing = False  # its in-flight token ends it (length): schedule nothing more

    @property
    def block_table(self) -> BlockTable:
        return self._block_table

    @block_table.setter
    def block_table(self, blocks) -> None:
        self._block_table = BlockTable(blocks)

    def token_slice(self, start: int, stop: int) -> list[int]:
        """``token_ids[start:stop]`` (0 <= start <= stop) without building the whole list: a
        step takes a few tokens of a sequence that may be 32k long."""
        prompt, out = self.prompt_token_ids, self.output_token_ids
        p, o = len(prompt), len(out)
        stop = min(stop, p + o + self.in_flight)
        if stop <= start:
            return []
        ids = prompt[start:stop] if start < p else []
        if stop > p and start < p + o:
            ids = ids + out[max(0, start - p) : stop - p]
        if stop > p + o:
            ids = ids + [PENDING] * (stop - max(start, p + o))
        return ids

    @property
    def token_ids(self) -> list[int]:
        """Prompt then generated token ids (then PENDING for each token still on the device)."""
        return self.prompt_token_ids + self.output_token_ids + [PENDING] * self.in_flight

    def __len__(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.in_flight

    @property
    def num_known(self) -> int:
        """Tokens whose ids the host has (prompt and generated, not those still on the device)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_pending(self) -> int:
        """Tokens whose KV is not yet in the cache."""
        return len(self) - self.num_computed

    def reset_for_recompute(self) -> None:
        """Preempted: its blocks are gone; everything so far is recomputed (as a prompt)."""
        self.num_computed = 0
        self.block_table = []
        self.block_keys = []
        self.status = Status.WAITING
