"""``SamplingParams`` (vLLM's names) with validation that names the bad field."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from pallas_kernels.checks import short_repr

MAX_LOGPROBS = 20  # top-n logprobs per token at most
MAX_SEED = 2**32
MAX_N = 4096  # samples per request at most (each is a sequence the engine holds)
MAX_TOP_K = 2**31 - 1  # (an int32 on the device; any k >= the vocabulary keeps every token)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# A non-zero temperature's range: logits * (1 / T) is float32 on every platform, so T must be a
# normal float32 whose reciprocal scales any real model's logits (|z| < 1e8) without overflow.
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-30, 1e30


def check_temperature(value, name: str = "temperature", *, scalar: bool = False) -> None:
    """The one rule for a temperature (SamplingParams, ``score``, ``bijax.logprobs``): a real
    number, or a concrete array of them, 0 (greedy) or in [MIN_TEMPERATURE, MAX_TEMPERATURE].
    TypeError for a wrong type, ValueError for a wrong value, naming ``name``; ``scalar``: one
    number only (a request's; arrays are ``bijax.logprobs``' rows)."""
    if scalar and np.ndim(value) != 0:
        raise TypeError(f"{name} must be one number, got shape {np.shape(value)}")
    dtype = getattr(value, "dtype", None)
    if isinstance(value, bool) or (dtype is not None and np.dtype(dtype) == np.bool_):
        raise TypeError(f"{name} must be a real number, got a bool")
    if dtype is None and not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a real number, got {value!r}")
    a = np.asarray(value)
    if not (np.issubdtype(a.dtype, np.floating) or np.issubdtype(a.dtype, np.integer)):
        raise TypeError(
            f"{name} must be a real number or an array of ints or numpy floats (float16/32/64), got dtype "
            f"{a.dtype}"
        )
    if not np.isfinite(a).all():
        raise ValueError(f"{name} must be finite, got {value!r}")
    if (a < 0).any():
        raise ValueError(f"{name} must be >= 0 (0 = greedy), got {a.min().item()!r}")
    hot = a[a != 0]
    if ((hot < MIN_TEMPERATURE) | (hot > MAX_TEMPERATURE)).any():
        worst = hot[(hot < MIN_TEMPERATURE) | (hot > MAX_TEMPERATURE)].flat[0].item()
        raise ValueError(
            f"{name} must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}] (logits / T "
            f"in float32), got {worst!r}"
        )


def temperature_ok(t):
    """``check_temperature``'s value rule on a traced float array, elementwise (False for NaN
    and infinities): where it cannot raise, the caller poisons what a bad value would produce."""
    return (t == 0) | ((t >= MIN_TEMPERATURE) & (t <= MAX_TEMPERATURE))


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one request.

    temperature: 0 = greedy; top_p in (0, 1] (1 = off); top_k = -1 or 0 (off) or >= 1; min_p in
    [0, 1] (0 = off); seed: the request's random stream (None: drawn from the engine seed and
    reported in ``RequestOutput.seed``); n: samples per prompt; max_tokens >= 1; stop: strings
    that end the output (not included in the text); stop_token_ids; ignore_eos; logprobs: also
    return the top-n logprobs of each step (0..20; the sampled token's logprob is always returned).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    n: int = 1
    max_tokens: int = 16
    stop: str | list[str] | tuple[str, ...] | None = None
    stop_token_ids: list[int] | tuple[int, ...] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self):
        def bad(field, why):
            raise ValueError(f"SamplingParams.{field} {why}, got {short_repr(getattr(self, field))}")

        check_temperature(self.temperature, "SamplingParams.temperature", scalar=True)
        # the number it holds (a numpy or JAX scalar, a 0-d array: kept as is, the params were
        # unhashable and compared as arrays)
        object.__setattr__(self, "temperature", float(np.asarray(self.temperature)))
        for f in ("top_p", "min_p", "top_k", "n", "max_tokens", "seed", "logprobs"):
            v = getattr(self, f)  # a numpy or JAX scalar (0-d, a number's dtype) is the number it holds
            dtype = getattr(v, "dtype", None)
            if dtype is not None and np.ndim(v) == 0 and np.dtype(dtype) != np.bool_:
                v = np.asarray(v).item()
                object.__setattr__(self, f, float(v) if f in ("top_p", "min_p") else v)
        for f in ("top_p", "min_p"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise TypeError(f"SamplingParams.{f} must be a finite number, got {v!r}")
        if not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        for f in ("top_k", "n", "max_tokens"):
            if not _is_int(getattr(self, f)):
                raise TypeError(f"SamplingParams.{f} must be an int, got {getattr(self, f)!r}")
        for f in ("seed", "logprobs"):
            if getattr(self, f) is not None and not _is_int(getattr(self, f)):
                raise TypeError(f"SamplingParams.{f} must be None or an int, got {getattr(self, f)!r}")
        if self.top_k == 0:  # vLLM's and the server's other "off" (SamplingParams reports -1)
            object.__setattr__(self, "top_k", -1)
        if self.top_k < -1 or self.top_k > MAX_TOP_K:
            bad("top_k", f"must be -1 or 0 (off) or in [1, {MAX_TOP_K}]")
        if not 1 <= self.n <= MAX_N:
            bad("n", f"must be in [1, {MAX_N}]")
        if self.max_tokens < 1:
            bad("max_tokens", "must be >= 1")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < MAX_SEED):
            bad("seed", "must be None or an int in [0, 2**32)")
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            bad("logprobs", f"must be None or an int in [0, {MAX_LOGPROBS}]")
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        elif not isinstance(stop, (list, tuple)):
            raise TypeError(
                f"SamplingParams.stop must be a string or a list of strings, got {short_repr(stop)}"
            )
        stop = tuple(stop)
        if any(not isinstance(s, str) or not s for s in stop):
            bad("stop", "must be a string or a list of non-empty strings")
        object.__setattr__(self, "stop", stop)
        ids = self.stop_token_ids
        if isinstance(ids, np.ndarray) and ids.ndim == 1 and np.issubdtype(ids.dtype, np.integer):
            ids = ids.tolist()
        if ids is not None and not isinstance(ids, (list, tuple)):
            raise TypeError(f"SamplingParams.stop_token_ids must be a list of ints, got {short_repr(ids)}")
        ids = tuple(int(i) if isinstance(i, np.integer) else i for i in ids or ())
        if any(not _is_int(i) or i < 0 for i in ids):
            bad("stop_token_ids", "must be a list of non-negative ints")
        ids = tuple(dict.fromkeys(ids))  # each once (in order): a token checks against a set of them
        object.__setattr__(self, "stop_token_ids", ids)
        object.__setattr__(self, "_stop_id_set", frozenset(ids))
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"SamplingParams.ignore_eos must be a bool, got {self.ignore_eos!r}")

    def stops_at(self, token_id: int) -> bool:
        """Whether ``token_id`` is one of ``stop_token_ids`` (a set lookup: the list may be long)."""
        return token_id in self._stop_id_set
