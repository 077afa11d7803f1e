"""Per-sample state of a request as the scheduler and runner see it."""

from __future__ import annotations

import enum

from bijax.sampling_params import SamplingParams

PENDING = -1  # a token id not yet on the host (async scheduling): the device fills it in


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


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
        self.logprobs: list = []  # float32 scalars (numpy), bits preserved
        self.top_logprobs: list[list[tuple[int, float]]] = []
        self.params = params
        self.seed = seed
        self.sample_index = sample_index
        self.arrival = arrival
        self.status = Status.WAITING
        self.num_computed = 0
        self.block_table: list[int] = []
        self.block_keys: list[tuple] = []  # prefix-cache keys of its full blocks
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
