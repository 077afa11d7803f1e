"""A request's prompt tokenized and checked against an engine, once, before it is queued."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from bijax.config import EngineConfig
from bijax.sampling_params import SamplingParams


@dataclasses.dataclass(frozen=True)
class ValidPrompt:
    """A prompt tokenized and checked by ``Engine.validate`` for one engine and SamplingParams:
    ``add_request`` takes it without tokenizing or checking again."""

    text: str | None
    token_ids: tuple[int, ...]
    params: SamplingParams
    checked_by: object  # the validating engine's token (an object, so no id() can be reused)


# A prompt traced by a caller's ``jax.jit`` / ``grad`` / ``vmap`` (told apart only where a
# conversion fails, so a concrete prompt pays nothing): it failed naming lists or ``__array__``.
TRACED = (
    "a prompt or its token ids are values traced by jax.jit, grad or vmap: generate and score run their "
    "own compiled programs on concrete values - call them outside the transformation, or use "
    "bijax.logprobs / forward_packed inside one"
)


def _scalar_int(t) -> bool:
    """An int token id: a Python or numpy int, or a 0-d integer array (JAX's scalars)."""
    if isinstance(t, bool):
        return False
    if isinstance(t, (int, np.integer)):
        return True
    dtype = getattr(t, "dtype", None)
    return getattr(t, "ndim", None) == 0 and dtype is not None and np.issubdtype(dtype, np.integer)


def as_numpy(value):
    """``value`` as a numpy array if it is another array type (a JAX array of token ids is taken
    as numpy's); anything else - a str, dict, list, tuple or numpy array - as it is."""
    if not isinstance(value, (str, bytes, dict, list, tuple, np.ndarray)) and hasattr(value, "__array__"):
        if isinstance(value, jax.core.Tracer):
            raise TypeError(TRACED)
        return np.asarray(value)
    return value


def tokenize(tokenizer, prompt) -> tuple[str | None, list[int]]:
    """(text or None, token ids) of a prompt: a str, a list of token ids, or vLLM's dict forms
    {"prompt_token_ids": [...]} and {"prompt": "..."}; ValueError / TypeError naming the problem."""
    if isinstance(prompt, dict):
        keys = set(prompt)
        if keys not in ({"prompt_token_ids"}, {"prompt"}):
            raise ValueError(
                "a dict prompt must have exactly one key, 'prompt_token_ids' (a list of token ids) or "
                f"'prompt' (text); got {sorted(map(str, keys))}"
            )
        (key,) = keys
        prompt = prompt[key]
        if (key == "prompt") != isinstance(prompt, str):  # (a str of ids was tokenized as text)
            want = "a str" if key == "prompt" else "a list of int token ids"
            raise TypeError(f"a dict prompt's '{key}' must be {want}, got {type(prompt).__name__}")
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("this model has no tokenizer: give prompts as lists of token ids")
        if not prompt:
            raise ValueError("prompt is empty")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as e:  # (a lone surrogate: half of a character)
            raise ValueError(
                f"the prompt is not valid Unicode: {prompt[e.start : e.end]!r} at character {e.start} "
                "is half of a surrogate pair"
            ) from None
        return prompt, tokenizer.encode(prompt)
    if isinstance(prompt, (bytes, bytearray)):  # (iterating bytes gives ints: never token ids)
        raise TypeError("a prompt must be a str or a list of int token ids, got bytes (decode it first)")
    prompt = as_numpy(prompt)
    if isinstance(prompt, np.ndarray):
        if prompt.ndim != 1 or not (np.issubdtype(prompt.dtype, np.integer) or prompt.size == 0):
            raise TypeError(
                f"a prompt array must be 1-D int token ids, got shape {prompt.shape} dtype {prompt.dtype}"
            )
        return None, prompt.tolist()
    items = None
    try:
        items = list(prompt)  # (once: an iterator is read a single time)
        ids = [int(t) for t in items]
    except (TypeError, ValueError):
        if items is not None and any(isinstance(t, jax.core.Tracer) for t in items):
            raise TypeError(TRACED) from None
        raise TypeError(
            f"a prompt must be a str or a list of int token ids, got {type(prompt).__name__}"
        ) from None
    if not all(map(_scalar_int, items)):
        raise TypeError("prompt token ids must be ints")
    return None, ids


def check_fits(
    prompt_tokens: int, max_tokens: int, max_model_len: int, name: str = "max_tokens", prompt: str = "prompt"
) -> None:
    """Raises ValueError when a prompt of ``prompt_tokens`` plus ``max_tokens`` exceeds ``max_model_len``
    (``name``: what the caller calls max_tokens, ``prompt``: what it calls the prompt - the
    messages of a chat request - said in the message)."""
    total = prompt_tokens + max_tokens
    if total > max_model_len:
        raise ValueError(
            f"{prompt} ({prompt_tokens} tokens) + {name} ({max_tokens}) = {total} exceeds "
            f"max_model_len ({max_model_len})"
        )


def check_request(
    ids: list[int],
    params: SamplingParams,
    vocab_size: int,
    cfg: EngineConfig,
    num_kv_blocks: int | None = None,
) -> None:
    """Raises ValueError when the prompt ids and ``params.max_tokens`` do not fit the model's
    vocabulary, ``max_model_len`` or the KV pool (``num_kv_blocks``: the pool scheduled into,
    default ``cfg``'s)."""
    pool = cfg.num_kv_blocks if num_kv_blocks is None else num_kv_blocks
    if not ids:
        raise ValueError("prompt is empty")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    if params.logprobs and params.logprobs > vocab_size:
        raise ValueError(f"logprobs ({params.logprobs}) exceeds the vocabulary size ({vocab_size})")
    bad = [t for t in params.stop_token_ids if t >= vocab_size]
    if bad:  # (it could never be sampled: a typo, or another model's id)
        raise ValueError(f"stop_token_ids: {bad[0]} is outside the vocabulary [0, {vocab_size})")
    check_fits(len(ids), params.max_tokens, cfg.max_model_len)
    total = len(ids) + params.max_tokens
    if -(-total // cfg.block_size) > pool - 1:
        raise ValueError(
            f"a request of {total} tokens needs {-(-total // cfg.block_size)} KV blocks; the pool has {pool - 1}"
        )
