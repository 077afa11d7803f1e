"""Request bodies (OpenAI's and vLLM's field names), checked into ``SamplingParams``.

Every check fails with ``ApiError`` naming the field (``param``), which the app returns as
OpenAI's error JSON - never a traceback.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from bijax.sampling_params import SamplingParams
from models.tokenizer import message_text
from pallas_kernels.checks import short_repr

_MAX_MESSAGE = 1000  # characters of an error message, at most
# Stop strings a request may give (every one is searched for at every step of the engine
# thread, which all clients share: 200,000 of them had slowed the other clients 2.3x).
MAX_STOPS, MAX_STOP_CHARS = 64, 1000


class ApiError(Exception):
    """An error returned to the client as {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        if len(message) > _MAX_MESSAGE:  # (a message that quotes a huge input)
            message = f"{message[:_MAX_MESSAGE]}... ({len(message)} characters)"
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = {401: "authentication_error", 404: "not_found_error"}.get(self.status, "invalid_request_error")
        if self.status >= 500:
            kind = "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


# Fields OpenAI/vLLM have that bijax does not implement: accepted only at their neutral value
# (anything else would be ignored - a sample the client did not ask for). Other unknown fields
# are ignored, as vLLM does (``user``, ``metadata``, ``store``, ...: no effect on a sample).
_OFF = (None, False)


def _zero_biases(value) -> bool:
    """A ``logit_bias`` whose every bias is 0 (neutral, as ``{}``)."""
    return isinstance(value, dict) and all(
        isinstance(b, (int, float)) and not isinstance(b, bool) and b == 0 for b in value.values()
    )


_NEUTRAL = {
    "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "length_penalty": (None, 1, 1.0),
    "logit_bias": lambda v: v is None or _zero_biases(v),  # (biases of 0 change no sample)
    "echo": _OFF,
    "suffix": (None, ""),
    "tools": (None, []),
    "functions": (None, []),
    "tool_choice": (None, "none", "auto"),  # (no tools can be given)
    "function_call": (None, "none", "auto"),
    "response_format": (None, {"type": "text"}),
    "min_tokens": (None, 0),
    "include_stop_str_in_output": _OFF,
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "logits_processors": (None, []),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "structured_outputs": (None,),
    "prompt_logprobs": (None,),
    "use_beam_search": _OFF,
    "truncate_prompt_tokens": (None,),
    "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True),
    "priority": (None, 0),
    "chat_template": (None,),
    "chat_template_kwargs": (None, {}),
    "continue_final_message": _OFF,
    "documents": (None, []),
    "prediction": (None,),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "reasoning_effort": (None,),
}
_STREAM_OPTIONS = ("include_usage", "continuous_usage_stats")  # (the second: only false or null)


class _Body(BaseModel):
    """A request body: strict types, unknown fields ignored (as vLLM does), and an explicit null
    read as the field's default (OpenAI's schema allows null for its optional fields)."""

    model_config = ConfigDict(strict=True, extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data):
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if not (v is None and k in cls.model_fields)}
        return data


class _Sampling(_Body):
    """What both endpoints share."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = 1
    seed: int | None = None
    stop: Any = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: dict | None = None
    return_token_ids: bool = False
    best_of: int | None = None

    def include_usage(self) -> bool:
        opts = self.stream_options or {}
        if not self.stream and self.stream_options is not None:
            raise ApiError(400, "stream_options is only allowed with stream: true", param="stream_options")
        for key, value in opts.items():
            if key not in _STREAM_OPTIONS:
                raise ApiError(
                    400,
                    f"stream_options: {short_repr(key)} is not supported by bijax",
                    param="stream_options",
                )
            if value is not None and not isinstance(value, bool):
                raise ApiError(400, f"stream_options.{key} must be a bool", param="stream_options")
        if opts.get("continuous_usage_stats"):
            raise ApiError(
                400, "stream_options.continuous_usage_stats is not supported by bijax", param="stream_options"
            )
        return bool(opts.get("include_usage"))

    # another endpoint's fields, which this one would ignore: name -> what to use here
    _ELSEWHERE: ClassVar[dict[str, str]] = {}

    def check_unsupported(self) -> None:
        for name, value in (self.model_extra or {}).items():
            if name in self._ELSEWHERE and value is not None:
                raise ApiError(
                    400, f"{name} is not a field of this endpoint: {self._ELSEWHERE[name]}", param=name
                )
            neutral = _NEUTRAL.get(name)
            if neutral is not None and not (neutral(value) if callable(neutral) else value in neutral):
                raise ApiError(400, f"{name} is not supported by bijax (got {short_repr(value)})", param=name)
        if self.best_of is not None and self.best_of != self.n:
            raise ApiError(400, "best_of is not supported by bijax (only best_of == n)", param="best_of")

    def sampling_params(
        self, max_tokens: int, logprobs: int | None, logprobs_field: str, max_tokens_field: str = "max_tokens"
    ) -> SamplingParams:
        stop = self.stop
        if stop is not None and not isinstance(stop, (str, list)):
            raise ApiError(400, "stop must be a string or a list of strings", param="stop")
        if isinstance(stop, list) and len(stop) > MAX_STOPS:
            raise ApiError(400, f"stop: at most {MAX_STOPS} stop strings, got {len(stop)}", param="stop")
        longest = max(
            (len(x) for x in ([stop] if isinstance(stop, str) else stop or []) if isinstance(x, str)),
            default=0,
        )
        if longest > MAX_STOP_CHARS:
            raise ApiError(
                400, f"stop: a stop string is {longest} characters (at most {MAX_STOP_CHARS})", param="stop"
            )
        kwargs = dict(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k in (None, 0) else self.top_k,  # vLLM: 0 and -1 both mean off
            min_p=0.0 if self.min_p is None else self.min_p,
            seed=self.seed,
            n=self.n,
            max_tokens=max_tokens,
            stop=stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
        )
        try:
            return SamplingParams(**kwargs)
        except (ValueError, TypeError) as e:
            msg = str(e)
            m = re.search(r"SamplingParams\.(\w+)", msg)
            field = m.group(1) if m else None
            field = {"logprobs": logprobs_field, "max_tokens": max_tokens_field}.get(field, field)
            msg = msg.replace(f"SamplingParams.{m.group(1)}", field) if m else msg
            raise ApiError(400, msg, param=field) from None


class CompletionRequest(_Sampling):
    prompt: Any = None
    max_tokens: int | None = 16
    logprobs: int | None = None

    _ELSEWHERE: ClassVar[dict[str, str]] = {  # (chat's fields)
        "max_completion_tokens": "use max_tokens",
        "top_logprobs": "use logprobs (the number of top log-probabilities)",
        "messages": "use prompt, or /v1/chat/completions",
    }


class ChatRequest(_Sampling):
    messages: Any = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: Any = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


def parse(model: type[BaseModel], raw: bytes):
    """The request body as ``model``; ApiError(400) naming the first bad field."""
    try:
        return model.model_validate_json(raw or b"{}")
    except ValidationError as e:
        err = e.errors()[0]
        if err["type"] == "json_invalid":
            hint = ""
            if "hex escape" in err["msg"] and re.search(rb"\\u[dD][89a-fA-F]", raw or b""):
                hint = " (a \\ud800-\\udfff escape outside a surrogate pair: the text is not valid Unicode)"
            raise ApiError(400, f"the body is not valid JSON: {err['msg']}{hint}") from None
        loc = [str(x) for x in err["loc"] if isinstance(x, int) or "[" not in str(x)]
        field = ".".join(loc) if loc else None
        got = short_repr(err.get("input"))
        if field is None:
            raise ApiError(400, f"the body must be a JSON object, got {got}") from None
        if err["type"] == "missing":
            raise ApiError(400, f"{field} is required", param=field) from None
        raise ApiError(400, f"{field}: {err['msg']} (got {got})", param=field) from None


def prompts(value) -> list:
    """``prompt`` as a list of prompts, each a str or a list of token ids."""
    bad = ApiError(400, "prompt must be a string, a list of token ids, or a list of those", param="prompt")
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value:
        raise bad

    def ids(x) -> bool:
        return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

    if ids(value):
        return [value]
    for i, p in enumerate(value):
        if isinstance(p, list) and not p:
            raise ApiError(400, f"prompt[{i}] is an empty list of token ids", param="prompt")
        if not (isinstance(p, str) or ids(p)):
            raise bad
    return value


def messages(value) -> list[dict]:
    """``messages`` for the chat template: content given as a list of text parts is joined."""
    if not isinstance(value, list) or not value:
        raise ApiError(400, "messages must be a non-empty list of {role, content} objects", param="messages")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a string role", param="messages")
        try:
            content = message_text(m, f"messages[{i}].content")
        except TypeError as e:
            raise ApiError(400, str(e), param="messages") from None
        out.append({**m, "content": content})
    return out
