"""The FastAPI app: OpenAI's /v1/completions, /v1/chat/completions, /v1/models, and vLLM's
/health, /metrics, /tokenize, /detokenize - over one ``EngineLoop``."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import hmac
import time
import uuid

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException

from bijax.llm import LLM
from bijax.prompts import check_fits
from bijax.sampling_params import MAX_N
from bijax.server import generation
from bijax.server.engine_loop import EngineLoop
from bijax.server.protocol import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    messages,
    parse,
    prompts,
)
from bijax.server.render import prometheus
from pallas_kernels.checks import short_repr

OPEN_PATHS = ("/health", "/metrics")  # never behind --api-key
MAX_REQUEST_BYTES = 32 << 20  # the default body limit (bijax serve --max-request-bytes)
HEAVY_BYTES = 1 << 20  # bodies over this are parsed, walked and tokenized in the heavy pool


class Server:
    """What the routes share: the model's names, its tokenizer and limits, the engine loop."""

    def __init__(
        self,
        llm: LLM,
        names: list[str],
        api_key: str | None,
        max_request_seqs: int = MAX_N,
        max_request_bytes: int = MAX_REQUEST_BYTES,
    ):
        self.names, self.api_key = names, api_key
        self.max_request_bytes = max_request_bytes
        # large bodies are parsed and tokenized here, two at a time, so that a few of them never
        # hold the default pool that every other request's tokenization runs in
        self.heavy = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="bijax-heavy-request")
        self.tokenizer = llm.tokenizer
        self.max_model_len = llm.config.max_model_len
        self.max_request_seqs = max_request_seqs
        # the longest request the KV pool can hold (block 0 reserved): Engine.validate's rule
        self.max_tokens_in_pool = (llm.config.num_kv_blocks - 1) * llm.config.block_size
        self.kv_blocks_total = llm.config.num_kv_blocks - 1
        self.loop = EngineLoop(llm.engine)
        self.created = int(time.time())

    def check_model(self, name: str | None) -> str:
        if name is not None and name not in self.names:
            shown = name if len(name) <= 200 else f"{name[:200]}... ({len(name)} characters)"
            raise ApiError(404, f"The model `{shown}` does not exist.", param="model", code="model_not_found")
        return name or self.names[0]

    async def body(self, request: Request) -> bytes:
        """The request's body; 413 past ``max_request_bytes`` (told by Content-Length, or
        counted as it arrives), before it is parsed."""
        limit = self.max_request_bytes
        too_big = ApiError(
            413,
            f"the request body is over {limit} bytes (bijax serve --max-request-bytes): split the request",
            code="request_too_large",
        )
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            raise too_big
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_big
            chunks.append(chunk)
        return b"".join(chunks)

    async def off_loop(self, size: int, fn, *args):
        """``fn(*args)`` in a worker thread (never on the event loop: every client waits on it);
        a request of ``size`` body bytes over HEAVY_BYTES runs in the heavy pool."""
        if size <= HEAVY_BYTES:
            return await asyncio.to_thread(fn, *args)
        return await asyncio.get_running_loop().run_in_executor(self.heavy, functools.partial(fn, *args))

    async def read_generation(self, request: Request, model: type[CompletionRequest | ChatRequest]):
        """What /v1/completions and /v1/chat/completions first do, in this order: the body parsed
        as ``model``, the model name checked, unsupported fields refused, stream_options read.
        Returns (the request, the served model name, include_usage, the body's size)."""
        req, size = await self.parse(request, model)
        name = self.check_model(req.model)
        req.check_unsupported()
        return req, name, req.include_usage(), size

    async def parse(self, request: Request, model):
        """The body parsed as ``model`` (off the event loop if it is large), and its size."""
        raw = await self.body(request)
        if len(raw) > HEAVY_BYTES:
            return await self.off_loop(len(raw), parse, model, raw), len(raw)
        return parse(model, raw), len(raw)

    def check_sequences(self, count: int) -> None:
        """400 when one request asks for more sequences (prompts x n) than ``max_request_seqs``:
        requests are admitted first come, first served, so one asking for thousands holds up
        every later client until its last sequence has a slot (and holds their memory)."""
        if count > self.max_request_seqs:
            raise ApiError(
                400,
                f"this request asks for {count} sequences (prompts x n); the server takes at most "
                f"{self.max_request_seqs} per request (bijax serve --max-request-seqs): split it",
                param="n",
            )

    def need_tokenizer(self, what: str) -> None:
        if self.tokenizer is None:
            raise ApiError(400, f"this model has no tokenizer: {what} needs one")

    def validate(self, prompt, params, field: str, index: int | None = None, max_field: str = "max_tokens"):
        """Engine.validate with its errors as ApiError (400) naming ``field`` (``stop`` for the
        stop strings' own error); ``index``: which of a list of prompts (said in the message);
        ``max_field``: the name the client gave the reply's length (chat: max_completion_tokens
        or max_tokens), in the message of a prompt and reply longer than max_model_len."""
        try:
            ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else None
            if ids is not None and (max_field != "max_tokens" or field != "prompt"):
                # (else the engine's message says it: a prompt and max_tokens, as sent)
                what = "the templated messages" if field == "messages" else field
                check_fits(len(ids), params.max_tokens, self.max_model_len, max_field, what)
            return self.loop.validate(prompt, params)
        except (ValueError, TypeError) as e:
            code = "context_length_exceeded" if "max_model_len" in str(e) or "KV blocks" in str(e) else None
            param = "stop" if str(e).startswith("stop strings") else field
            if str(e).startswith("stop_token_ids"):
                param = "stop_token_ids"
            where = "" if index is None or param != field else f"{field}[{index}]: "
            raise ApiError(400, f"{where}{e}", param=param, code=code) from None


def build_app(
    llm: LLM,
    *,
    served_model_names: list[str],
    api_key: str | None = None,
    max_request_seqs: int = MAX_N,
    max_request_bytes: int = MAX_REQUEST_BYTES,
) -> FastAPI:
    """The app serving ``llm``; the engine loop starts and stops with the app's lifespan.
    ``max_request_seqs``: the most sequences (prompts x n) one request may ask for;
    ``max_request_bytes``: the largest body (413 past it)."""
    srv = Server(llm, list(served_model_names), api_key, max_request_seqs, max_request_bytes)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        srv.loop.start()
        try:
            yield
        finally:
            srv.loop.stop()
            srv.heavy.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="bijax", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = srv
    app.state.abort_all = srv.loop.abort_all  # for the CLI on shutdown

    async def authorize(request: Request) -> None:
        if srv.api_key is None:
            return
        header = request.headers.get("authorization", "")
        given = header[7:] if header.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(given.encode(), srv.api_key.encode()):
            raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key")

    auth = [Depends(authorize)]

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        detail = str(e.detail)
        if e.status_code in (404, 405):  # (a path no route has, or a method it does not take)
            detail = f"{detail}: {request.method} {short_repr(request.url.path)}"
        # (the headers: 405's Allow, which Starlette sets)
        return JSONResponse(
            ApiError(e.status_code, detail).body(), status_code=e.status_code, headers=e.headers
        )

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):
        msg = f"internal error: {type(e).__name__}: {e}"
        return JSONResponse(ApiError(500, msg).body(), status_code=500)

    @app.api_route("/health", methods=["GET", "HEAD"])  # (load balancers probe with either)
    async def health():
        return Response(status_code=200 if srv.loop.alive else 503)

    @app.get("/metrics")
    async def metrics():
        text = prometheus(srv.loop, srv.names[0], srv.kv_blocks_total)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", dependencies=auth)
    async def models():
        data = [
            {"id": n, "object": "model", "created": srv.created, "owned_by": "bijax",
             "root": srv.names[0], "max_model_len": srv.max_model_len}
            for n in srv.names
        ]  # fmt: skip
        return {"object": "list", "data": data}

    @app.post("/v1/completions", dependencies=auth)
    async def completions(request: Request):
        req, name, include_usage, size = await srv.read_generation(request, CompletionRequest)
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        params = req.sampling_params(max_tokens, req.logprobs, "logprobs")

        def prepare():  # (off the event loop: a huge prompt must not stall the other requests)
            items = prompts(req.prompt)
            srv.check_sequences(len(items) * params.n)  # (before any prompt is tokenized)
            if any(isinstance(p, str) for p in items):
                srv.need_tokenizer("a text prompt")
            many = len(items) > 1  # (a list of prompts: the error says which)
            return [
                srv.validate(p if isinstance(p, str) else list(p), params, "prompt", i if many else None)
                for i, p in enumerate(items)
            ]

        valid = await srv.off_loop(size, prepare)
        job = generation.Job(srv, request, f"cmpl-{uuid.uuid4().hex}", name, valid, chat=False)
        return await job.respond(req.stream, include_usage, req.return_token_ids)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat(request: Request):
        req, name, include_usage, size = await srv.read_generation(request, ChatRequest)
        srv.need_tokenizer("the chat template")
        if req.top_logprobs is not None and not req.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")

        def prepare():  # (in a worker thread: a huge conversation must not stall the others)
            ids = _encode_chat(srv, messages(req.messages), req.add_generation_prompt)
            max_field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
            max_tokens = (
                req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
            )
            if max_tokens is None:  # what is left of the context, and of the KV pool
                room = min(srv.max_model_len, srv.max_tokens_in_pool)
                if len(ids) >= room:
                    raise ApiError(
                        400,
                        f"messages: the conversation is {len(ids)} tokens, which leaves no room for a "
                        f"reply (max_model_len {srv.max_model_len}, KV pool {srv.max_tokens_in_pool} tokens)",
                        param="messages",
                        code="context_length_exceeded",
                    )
                max_tokens = room - len(ids)
            lp = (req.top_logprobs or 0) if req.logprobs else None
            params = req.sampling_params(max_tokens, lp, "top_logprobs", max_field)
            srv.check_sequences(params.n)
            return [srv.validate({"prompt_token_ids": ids}, params, "messages", max_field=max_field)]

        valid = await srv.off_loop(size, prepare)
        job = generation.Job(srv, request, f"chatcmpl-{uuid.uuid4().hex}", name, valid, chat=True)
        return await job.respond(req.stream, include_usage, req.return_token_ids, chat_logprobs=req.logprobs)

    @app.post("/tokenize", dependencies=auth)
    async def tokenize(request: Request):
        req, size = await srv.parse(request, TokenizeRequest)
        srv.check_model(req.model)
        srv.need_tokenizer("/tokenize")
        if (req.prompt is None) == (req.messages is None):
            raise ApiError(400, "give exactly one of prompt and messages", param="prompt")
        if req.prompt is not None:
            encode = functools.partial(srv.tokenizer.encode, add_special_tokens=req.add_special_tokens)
            ids = await srv.off_loop(size, encode, req.prompt)
        else:
            ids = await srv.off_loop(
                size, _encode_chat, srv, messages(req.messages), req.add_generation_prompt
            )
        return {"count": len(ids), "max_model_len": srv.max_model_len, "tokens": ids}

    @app.post("/detokenize", dependencies=auth)
    async def detokenize(request: Request):
        req, size = await srv.parse(request, DetokenizeRequest)
        srv.check_model(req.model)
        srv.need_tokenizer("/detokenize")
        try:
            return {"prompt": await srv.off_loop(size, srv.tokenizer.decode, req.tokens)}
        except ValueError as e:
            raise ApiError(400, str(e), param="tokens") from None

    return app


def _encode_chat(srv: Server, msgs: list[dict], add_generation_prompt: bool) -> list[int]:
    try:
        return srv.tokenizer.encode_chat(msgs, add_generation_prompt=add_generation_prompt)
    except (ValueError, TypeError) as e:
        raise ApiError(400, str(e), param="messages") from None
