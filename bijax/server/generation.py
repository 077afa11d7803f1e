"""One completion or chat request on its way through the engine loop: added (one engine request
per prompt), then answered whole or streamed as server-sent events; aborted when its client
goes away."""

from __future__ import annotations

import asyncio
import json
import time

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from bijax.llm_engine import ValidPrompt
from bijax.outputs import RequestOutput
from bijax.server.engine_loop import EngineError, next_item
from bijax.server.protocol import ApiError
from bijax.server.render import StreamState, TextOffsets, chat_logprobs, completion_logprobs, usage

SEED_HEADER = "x-bijax-seed"  # the seed of each prompt's request, comma-separated


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone away."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Job:
    """One HTTP request: its prompts (validated, one engine request each), chat or not."""

    def __init__(self, srv, request: Request, job_id: str, model: str, valid: list[ValidPrompt], chat: bool):
        self.srv, self.request, self.chat = srv, request, chat
        self.id, self.model, self.valid = job_id, model, valid
        self.rids = [job_id] if len(valid) == 1 else [f"{job_id}-{i}" for i in range(len(valid))]
        self.params = valid[0].params
        self.created = int(time.time())
        self.queue: asyncio.Queue = asyncio.Queue()
        self.seeds: list[int] = []

    async def respond(self, stream: bool, include_usage: bool, token_ids: bool, chat_logprobs: bool = False):
        self.token_ids, self.include_usage = token_ids, include_usage
        self.want_logprobs = chat_logprobs if self.chat else self.params.logprobs is not None
        await self._add_all()
        headers = {SEED_HEADER: ",".join(map(str, self.seeds))}
        if stream:
            return StreamingResponse(self._events(), media_type="text/event-stream", headers=headers)
        finals = await self._collect()
        if finals is None:  # the client went away: its requests were aborted
            return Response(status_code=499)
        return JSONResponse(self._body(finals), headers=headers)

    async def _add_all(self) -> None:
        try:  # all of them in one command: they join the same step
            self.seeds = await self.srv.loop.add(list(zip(self.rids, self.valid, strict=True)), self.queue)
        except (EngineError, ValueError, TypeError) as e:  # (none of them was added)
            status = 503 if isinstance(e, EngineError) else 400
            raise ApiError(status, str(e)) from None
        except BaseException:  # cancelled (client gone) or anything else: none may run unread
            self._abort(self.rids)  # (the loop takes commands in order; unknown ids are ignored)
            raise

    def _abort(self, rids) -> None:
        for rid in rids:
            self.srv.loop.abort(rid)

    async def _collect(self) -> list[RequestOutput] | None:
        finals: dict[str, RequestOutput] = {}

        async def wait_all():
            while len(finals) < len(self.rids):
                item = await next_item(self.queue)
                if isinstance(item, EngineError):
                    raise ApiError(500, str(item))
                if item.finished:
                    finals[item.request_id] = item

        work = asyncio.ensure_future(wait_all())
        gone = asyncio.ensure_future(_disconnected(self.request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            left = not work.done()
            if left:  # the client went away first (or this handler was cancelled)
                work.cancel()
                self._abort([r for r in self.rids if r not in finals])
        if left:
            return None
        work.result()  # raises the engine's error, if any
        return [finals[r] for r in self.rids]

    # ------------------------------------------------------------------ whole responses

    def _body(self, finals: list[RequestOutput]) -> dict:
        tok, n = self.srv.tokenizer, self.params.n
        choices = []
        for p, out in enumerate(finals):
            for o in out.outputs:
                c = {"index": p * n + o.index}
                if self.chat:
                    c["message"] = {"role": "assistant", "content": o.text}
                    lp = chat_logprobs(tok, o, 0, len(o.token_ids), True) if self.want_logprobs else None
                else:
                    c["text"] = o.text
                    lp = None
                    if self.want_logprobs:
                        lp = completion_logprobs(tok, o, 0, len(o.token_ids), TextOffsets(tok))
                c.update(logprobs=lp, finish_reason=o.finish_reason, seed=out.seed)
                if self.token_ids:
                    if not self.chat:
                        c["prompt_token_ids"] = out.prompt_token_ids
                    c["token_ids"] = o.token_ids
                choices.append(c)
        body = self._head("chat.completion" if self.chat else "text_completion")
        body["choices"] = choices
        if self.chat and self.token_ids:
            body["prompt_token_ids"] = finals[0].prompt_token_ids
        body["usage"] = self._usage(finals)
        return body

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _usage(self, finals) -> dict:
        done = sum(len(o.token_ids) for out in finals for o in out.outputs)
        return usage(sum(len(v.token_ids) for v in self.valid), done)

    # ------------------------------------------------------------------ streaming

    async def _events(self):
        n, tok = self.params.n, self.srv.tokenizer
        states = {rid: StreamState(n) for rid in self.rids}
        index = {rid: p for p, rid in enumerate(self.rids)}
        remaining, finals = set(self.rids), []
        obj = "chat.completion.chunk" if self.chat else "text_completion"

        def head() -> dict:  # (with include_usage, as OpenAI: "usage": null on every chunk but the last)
            return {**self._head(obj), "usage": None} if self.include_usage else self._head(obj)

        try:
            if self.chat:  # the role first, as OpenAI sends it
                for i in range(n):
                    chunk = head()
                    role = {"role": "assistant", "content": ""}
                    c = {
                        "index": i,
                        "delta": role,
                        "logprobs": None,
                        "finish_reason": None,
                        "seed": self.seeds[0],
                    }
                    chunk["choices"] = [c]
                    if self.token_ids:
                        chunk["prompt_token_ids"] = self.valid[0].token_ids
                    yield _sse(chunk)
            text_offsets: dict = {}
            while remaining:
                item = await next_item(self.queue)
                if isinstance(item, EngineError):
                    yield _sse(ApiError(500, str(item)).body())
                    break
                p = index[item.request_id]
                for o, a, b, _, delta, reason in states[item.request_id].deltas(item):
                    c = {"index": p * n + o.index}
                    if self.chat:
                        c["delta"] = {"content": delta} if delta or reason is None else {}
                        lp = chat_logprobs(tok, o, a, b, True) if self.want_logprobs else None
                    else:
                        c["text"] = delta
                        lp = None
                        if self.want_logprobs:  # offsets continue from the tokens already sent
                            key = (item.request_id, o.index)
                            offsets = text_offsets.setdefault(key, TextOffsets(tok))
                            lp = completion_logprobs(tok, o, a, b, offsets)
                    c.update(logprobs=lp, finish_reason=reason, seed=item.seed)
                    if self.token_ids:
                        if not self.chat and a == 0:
                            c["prompt_token_ids"] = item.prompt_token_ids
                        c["token_ids"] = o.token_ids[a:b]
                    chunk = head()
                    chunk["choices"] = [c]
                    yield _sse(chunk)
                if item.finished:
                    remaining.discard(item.request_id)
                    finals.append(item)
            if self.include_usage and not remaining:
                chunk = self._head(obj)
                chunk.update(choices=[], usage=self._usage(finals))
                yield _sse(chunk)
            yield "data: [DONE]\n\n"
        finally:  # the client went away (or the engine failed): free what is still running
            self._abort(remaining)
