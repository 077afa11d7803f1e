"""What ``generate`` returns (vLLM's names)."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class CompletionOutput:
    """One sample: ``token_ids`` (ints), ``logprobs`` (float32 array, bits preserved: the
    logprob of each sampled token under log_softmax(logits / T), or raw log_softmax for T = 0),
    ``text``, ``finish_reason`` ("stop", "length" or "abort"), and ``top_logprobs`` (per step a
    list of (token id, logprob), when ``SamplingParams.logprobs`` asked for them)."""

    index: int
    token_ids: list[int]
    logprobs: np.ndarray
    text: str
    finish_reason: str | None
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclasses.dataclass(frozen=True)
class SpeculativeMetrics:
    """Speculative decoding of one request (all its samples): draft tokens proposed, drafts
    accepted, and verify steps (steps whose chunk carried drafts)."""

    num_draft_tokens: int
    num_accepted_tokens: int
    num_verify_steps: int

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def accepted_per_step(self) -> float:
        """Accepted drafts per verify step (each such step also emits one sampled token)."""
        return self.num_accepted_tokens / self.num_verify_steps if self.num_verify_steps else 0.0


@dataclasses.dataclass
class RequestOutput:
    """One request: its prompt, the seed its samples used, ``outputs`` (n samples), and
    ``metrics`` of speculative decoding (None without it).

    ``token_ids``, ``logprobs``, ``text`` and ``finish_reason`` are those of ``outputs[0]``.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seed: int
    outputs: list[CompletionOutput]
    finished: bool
    metrics: SpeculativeMetrics | None = None  # with speculative decoding on

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def logprobs(self) -> np.ndarray:
        return self.outputs[0].logprobs

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason
