"""The OpenAI-compatible HTTP front: FastAPI routes, SSE streaming, errors and metrics.

Each request is validated (protocol.py), rendered and tokenized here, then handed to the scheduler
thread as a `Request` whose sink (`_TextSink`) turns tokens into text deltas on that thread and
posts them to the request's asyncio queue. Streaming answers drain that queue into SSE chunks; when
the client goes away the stream is cancelled and the scheduler frees the request's state at the
next step boundary.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from megastep.runtime.scheduler import (STEP_BUCKETS_S, QueueFull, Request, RequestTooLarge,
                                        SamplingParams, Scheduler)
from megastep.server.chat import THINK_START, ChatRenderer, ChatTemplateError
from megastep.server.protocol import APIError, GenerationRequest, bad, parse_chat, parse_completion, parse_json
from megastep.server.text import IncrementalDetokenizer, ReasoningSplitter, StopMatcher

log = logging.getLogger("megastep.server")

COMPLETION_DEFAULT_MAX_TOKENS = 16   # the OpenAI default for /v1/completions
MAX_BODY_BYTES = 64 << 20            # a request body larger than this is refused (413)


class _CancellingStream(StreamingResponse):
    """A streaming response that cancels its request however the response ends: finished,
    client gone before the first byte, or the task cancelled (where a never-started generator
    would not run its own cleanup)."""

    def __init__(self, content, on_close, **kw) -> None:
        super().__init__(content, **kw)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


@dataclass
class ServerContext:
    scheduler: Scheduler
    tokenizer: Any                   # .encode(str) -> list[int], .decode(list[int]) -> str
    renderer: ChatRenderer
    model_name: str
    chat_default_max_tokens: int = 1024
    created: int = 0

    @property
    def served_names(self) -> set[str]:
        return {self.model_name}


class _TextSink:
    """Runs on the scheduler thread: tokens -> UTF-8-safe text -> stop strings -> (in thinking
    mode) reasoning / answer split -> the request's asyncio queue."""

    def __init__(self, loop: asyncio.AbstractEventLoop, decode, stops: list[str], thinking: bool = False) -> None:
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.detok = IncrementalDetokenizer(decode)
        self.stop = StopMatcher(stops)
        self.split = ReasoningSplitter() if thinking else None

    def _post(self, item: tuple) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:      # the event loop is gone (shutdown): nobody is listening
            pass

    def _emit(self, text: str, final: bool = False) -> None:
        reasoning, content = ("", text)
        if self.split is not None:
            reasoning, content = self.split.push(text)
            if final:
                r2, c2 = self.split.flush()
                reasoning, content = reasoning + r2, content + c2
        if reasoning:
            self._post(("reasoning", reasoning))
        if content:
            self._post(("text", content))

    def on_token(self, req: Request, token_id: int) -> bool:
        out = self.stop.push(self.detok.push(token_id))
        self._emit(out)
        return self.stop.stopped

    def on_finish(self, req: Request, reason: str, error: str | None) -> None:
        if reason in ("stop", "length"):
            out = ""
            if not self.stop.stopped:
                out = self.stop.push(self.detok.flush())
                if not self.stop.stopped:
                    out += self.stop.flush()
            self._emit(out, final=True)
        self._post(("finish", reason, error))


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def create_app(ctx: ServerContext) -> FastAPI:
    app = FastAPI(title="megastep", docs_url=None, redoc_url=None, openapi_url=None)
    sched = ctx.scheduler
    tok = ctx.tokenizer

    @app.exception_handler(Exception)
    async def _unhandled(request: HTTPRequest, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return JSONResponse(APIError(500, "internal server error", type="server_error").body(), status_code=500)

    @app.exception_handler(404)
    async def _not_found(request: HTTPRequest, exc: Exception) -> JSONResponse:
        return _error_response(APIError(404, f"no route {request.method} {request.url.path}", code="not_found"))

    @app.exception_handler(405)
    async def _bad_method(request: HTTPRequest, exc: Exception) -> JSONResponse:
        return _error_response(APIError(405, f"method {request.method} not allowed on {request.url.path}",
                                        code="method_not_allowed"))

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", **sched.snapshot()}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": ctx.model_name, "object": "model", "created": ctx.created,
                                            "owned_by": "megastep", "max_model_len": sched.max_request_tokens}]}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(render_metrics(sched), media_type="text/plain; version=0.0.4")

    # ---- shared request path ---------------------------------------------------------------
    def _tokenize(g: GenerationRequest) -> tuple[list[int], bool]:
        """-> (prompt ids, thinking): a chat prompt that ends in <think> makes the answer start
        with reasoning, which goes to `reasoning_content`."""
        if g.prompt_ids is not None:
            bad_ids = [t for t in g.prompt_ids if not 0 <= t < sched.engine.vocab_size]
            if bad_ids:
                raise bad(f"prompt token id {bad_ids[0]} is outside the vocabulary [0, {sched.engine.vocab_size})",
                          param="prompt", code="invalid_value")
            return g.prompt_ids, False
        if g.messages is not None:
            try:
                text = ctx.renderer.render(g.messages, tools=g.tools, kwargs=g.template_kwargs)
            except ChatTemplateError as e:
                raise bad(str(e), param="messages", code="invalid_value") from None
        else:
            text = g.prompt_text
        ids = list(tok.encode(text))
        if not ids:
            raise bad("the prompt tokenizes to nothing", param="prompt", code="invalid_value")
        return ids, g.messages is not None and text.rstrip().endswith(THINK_START)

    def _submit(g: GenerationRequest, default_max: int, loop) -> tuple[Request, _TextSink]:
        ids, thinking = _tokenize(g)
        room = sched.max_request_tokens - len(ids)
        if room < 1:
            raise bad(f"the prompt is {len(ids)} tokens; this server holds at most {sched.max_request_tokens} "
                      f"tokens per sequence (prompt + completion)", param="messages" if g.messages else "prompt",
                      code="context_length_exceeded")
        max_tokens = g.max_tokens if g.max_tokens is not None else min(default_max, room)
        params = SamplingParams(temperature=g.temperature, top_p=g.top_p, top_k=g.top_k,
                                max_tokens=max_tokens, seed=g.seed, ignore_eos=g.ignore_eos)
        sink = _TextSink(loop, tok.decode, g.stop, thinking)
        req = Request(prompt_ids=ids, params=params, sink=sink)
        try:
            sched.submit(req)
        except RequestTooLarge as e:
            raise bad(str(e), param="max_tokens", code="context_length_exceeded") from None
        except QueueFull as e:
            raise APIError(429, f"server overloaded: {e}; retry later", type="rate_limit_error",
                           code="queue_full", headers={"Retry-After": str(_retry_after(sched))}) from None
        return req, sink

    async def _read_body(request: HTTPRequest) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            raise APIError(413, f"request body over {MAX_BODY_BYTES >> 20} MiB", code="body_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise APIError(413, f"request body over {MAX_BODY_BYTES >> 20} MiB", code="body_too_large")
            chunks.append(chunk)
        return b"".join(chunks)

    async def _handle(request: HTTPRequest, chat: bool) -> Response:
        try:
            body = parse_json(await _read_body(request))
            g = parse_chat(body, ctx.served_names) if chat else parse_completion(body, ctx.served_names)
            # rendering and tokenizing a long prompt takes a while: keep it off the event loop
            req, sink = await asyncio.to_thread(
                _submit, g, ctx.chat_default_max_tokens if chat else COMPLETION_DEFAULT_MAX_TOKENS,
                asyncio.get_running_loop())
        except APIError as e:
            return _error_response(e)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        if g.stream:
            return _CancellingStream(_stream(req, sink, g, rid, created, chat), lambda: sched.cancel(req),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await _whole(request, req, sink, g, rid, created, chat)

    def _usage(req: Request) -> dict:
        p, c = len(req.prompt_ids), len(req.output_ids)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def _chunk(rid: str, created: int, chat: bool, text: str | None, finish: str | None, first: bool,
               reasoning: str = "") -> dict:
        if chat:
            delta: dict = {}
            if first:
                delta["role"] = "assistant"
            if reasoning:
                delta["reasoning_content"] = reasoning
            if text is not None and (text or not reasoning):
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": ctx.model_name,
                    "choices": [choice]}
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return {"id": rid, "object": "text_completion", "created": created, "model": ctx.model_name,
                "choices": [choice]}

    async def _stream(req: Request, sink: _TextSink, g: GenerationRequest, rid: str, created: int,
                      chat: bool) -> AsyncIterator[str]:
        finished = False
        try:
            first = True
            if chat:   # the role arrives first, as OpenAI does
                yield _sse(_chunk(rid, created, chat, "", None, True))
                first = False
            while True:
                item = await sink.queue.get()
                text, reasoning, fin = "", "", None
                while True:   # coalesce whatever else is already queued into one chunk
                    if item[0] == "text":
                        text += item[1]
                    elif item[0] == "reasoning":
                        reasoning += item[1]
                    else:
                        fin = item
                        break
                    if sink.queue.empty():
                        break
                    item = sink.queue.get_nowait()
                if text or reasoning:
                    yield _sse(_chunk(rid, created, chat, text, None, first, reasoning))
                    first = False
                if fin is not None:
                    finished = True
                    _, reason, error = fin
                    if reason == "error":
                        yield _sse(APIError(500, error or "generation failed", type="server_error").body())
                    elif reason == "cancelled":
                        yield _sse(APIError(503, error or "request cancelled", type="server_error").body())
                    else:
                        yield _sse(_chunk(rid, created, chat, None if chat else "", reason, first))
                        if g.include_usage:
                            yield _sse({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                                        "created": created, "model": ctx.model_name, "choices": [],
                                        "usage": _usage(req)})
                    yield "data: [DONE]\n\n"
                    return
        finally:
            if not finished:          # the client went away mid-stream
                sched.cancel(req)

    async def _whole(request: HTTPRequest, req: Request, sink: _TextSink, g: GenerationRequest, rid: str,
                     created: int, chat: bool) -> Response:
        async def watch_disconnect() -> None:
            while True:
                msg = await request.receive()
                if msg["type"] == "http.disconnect":
                    sched.cancel(req)
                    return

        watcher = asyncio.create_task(watch_disconnect())
        parts: list[str] = []
        reasoning: list[str] = []
        try:
            while True:
                item = await sink.queue.get()
                if item[0] == "text":
                    parts.append(item[1])
                    continue
                if item[0] == "reasoning":
                    reasoning.append(item[1])
                    continue
                _, reason, error = item
                break
        finally:
            watcher.cancel()
            if req.status != "finished":
                sched.cancel(req)
        if reason == "error":
            return _error_response(APIError(500, error or "generation failed", type="server_error"))
        if reason == "cancelled":
            return _error_response(APIError(503, error or "request cancelled", type="server_error"))
        text = "".join(parts)
        if chat:
            message = {"role": "assistant", "content": text}
            if sink.split is not None:
                message["reasoning_content"] = "".join(reasoning)
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
            obj = "text_completion"
        return JSONResponse({"id": rid, "object": obj, "created": created, "model": ctx.model_name,
                             "choices": [choice], "usage": _usage(req)})

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest) -> Response:
        return await _handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HTTPRequest) -> Response:
        return await _handle(request, chat=True)

    return app


def _retry_after(sched: Scheduler) -> int:
    """Seconds until a queue slot is likely free: a rough guess from the last step time."""
    est = sched._last_step_s * max(1, len(sched.waiting)) * 4
    return max(1, min(60, int(est + 0.999)))


def render_metrics(sched: Scheduler) -> str:
    s = sched.snapshot()
    m = sched.metrics
    lines = []

    def metric(name: str, kind: str, help_: str, value: float | None = None, samples: list | None = None) -> None:
        lines.append(f"# HELP megastep_{name} {help_}")
        lines.append(f"# TYPE megastep_{name} {kind}")
        if samples is None:
            samples = [("", value)]
        for labels, v in samples:
            lines.append(f"megastep_{name}{labels} {v}")

    metric("queue_depth", "gauge", "Requests waiting for admission.", s["waiting"])
    metric("running_sequences", "gauge", "Requests admitted and being decoded.", s["running"])
    metric("state_pool_tokens_used", "gauge", "State-pool tokens reserved by running requests.", s["pool_tokens_used"])
    metric("state_pool_tokens_capacity", "gauge", "State-pool size in tokens.", s["pool_tokens_capacity"])
    metric("state_pool_sequences_used", "gauge", "State-pool sequence slots in use.", s["pool_seqs_used"])
    metric("state_pool_sequences_capacity", "gauge", "State-pool sequence slots.", s["pool_seqs_capacity"])
    metric("engine_live_sequences", "gauge", "Sequence states the engine holds.", s["engine_live_sequences"])
    metric("tokens_per_second", "gauge", "Generated tokens per second over the last 10 s.",
           round(s["tokens_per_second"], 3))
    metric("prompt_tokens_total", "counter", "Prompt tokens prefilled.", m.prompt_tokens)
    metric("generated_tokens_total", "counter", "Tokens generated.", m.generated_tokens)
    metric("requests_finished_total", "counter", "Finished requests by reason.",
           samples=[(f'{{reason="{r}"}}', n) for r, n in sorted(m.finished.items())] or [('{reason="stop"}', 0)])
    metric("requests_rejected_total", "counter", "Requests refused at submission.",
           samples=[(f'{{reason="{r}"}}', n) for r, n in sorted(m.rejected.items())] or [('{reason="queue_full"}', 0)])
    lines.append("# HELP megastep_step_seconds Wall time of one scheduler step (engine + sampling).")
    lines.append("# TYPE megastep_step_seconds histogram")
    cum = 0
    for b, n in zip(STEP_BUCKETS_S, m.step_hist):
        cum += n
        lines.append(f'megastep_step_seconds_bucket{{le="{b}"}} {cum}')
    cum += m.step_hist[-1]
    lines.append(f'megastep_step_seconds_bucket{{le="+Inf"}} {cum}')
    lines.append(f"megastep_step_seconds_sum {m.step_sum}")
    lines.append(f"megastep_step_seconds_count {m.steps}")
    return "\n".join(lines) + "\n"
