"""The HTTP side of ``sfchat --serve``: a Starlette app speaking OpenAI's chat-completions API.

Contract
--------
``build_app(generator, metrics, options)`` returns the ASGI app, to be run by uvicorn on the
event loop's thread. Routes:

* ``POST /v1/chat/completions`` — validated by ``protocol.parse_chat_request``, encoded by the
  session's tokenizer (off the event loop), queued on the ``GenerationThread``. Non-streaming:
  one ``chat.completion`` with ``usage``; ``stream: true``: server-sent events, one
  ``chat.completion.chunk`` per round's text, a last chunk with the finish reason and sfchat's
  figures, a usage chunk when ``stream_options.include_usage``, then ``data: [DONE]``.
* ``GET /v1/models`` (and ``/v1/models/{id}``) — the one served model.
* ``GET /metrics`` — Prometheus text format.

Every failure is an OpenAI error object, never a traceback: 400 malformed JSON or fields and a
prompt past the context window (naming both sizes), 401 a wrong or missing key (when
``options.api_key`` is set, every route requires ``Authorization: Bearer KEY``), 404 an
unknown model or route, 413 a body over the limit, 429 a full queue, 500/503 a failure while
generating. A client that disconnects (mid-stream, or while a non-streaming reply is being
made or waits in the queue) cancels its generation. The app never touches the models: it
hands jobs to the generation thread, which calls back with ``loop.call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import secrets
import time
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.concurrency import run_in_threadpool

from sfchat.serve import protocol
from sfchat.serve.generator import GenerationThread, Job, QueueFull
from sfchat.serve.metrics import CONTENT_TYPE, ServerMetrics
from sfchat.serve.protocol import ApiError, Limits

ROUTES = ("/v1/chat/completions", "/v1/models", "/metrics")


@dataclass(frozen=True)
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_queue: int = 16  # requests that may wait while one is generated; more get 429
    max_body_bytes: int = 1 << 20
    max_messages: int = 256


def error_response(exc: ApiError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


class Guard:
    """ASGI middleware: the API key check, and one request count per answer (route, status)."""

    def __init__(self, app, api_key: str | None, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics
        self.key = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        route = next((r for r in ROUTES if path == r or path.startswith(r + "/")), "other")
        status = []

        async def counting_send(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            if self.key is not None:
                given = dict(scope.get("headers") or []).get(b"authorization", b"")
                if not hmac.compare_digest(given, self.key):
                    message = "a wrong API key was given" if given else \
                        "no API key was given: send the header Authorization: Bearer KEY"
                    resp = error_response(ApiError(401, message, code="invalid_api_key"))
                    return await resp(scope, receive, counting_send)
            await self.app(scope, receive, counting_send)
        finally:
            self.metrics.request(route, status[0] if status else 499)  # 499: the client left first


def build_app(generator: GenerationThread, metrics: ServerMetrics, options: ServeOptions = ServeOptions()):
    info = generator.info
    model_id = info.model
    created = int(time.time())
    limits = Limits(options.max_body_bytes, options.max_messages, info.max_context)
    s = generator.settings

    async def read_body(request: Request) -> bytes:
        size = request.headers.get("content-length", "")
        if size.isdigit() and int(size) > limits.max_body_bytes:
            raise ApiError(413, f"the request body has {size} bytes; at most {limits.max_body_bytes} are accepted")
        parts, total = [], 0
        async for piece in request.stream():
            total += len(piece)
            if total > limits.max_body_bytes:
                raise ApiError(413, f"the request body exceeds {limits.max_body_bytes} bytes")
            parts.append(piece)
        return b"".join(parts)

    def encode(messages) -> list[int]:
        try:
            return generator.encode(list(messages))
        except Exception as exc:  # a chat template may refuse an order of roles
            raise ApiError(400, f"the chat template refused these messages: {exc}", "messages") from None

    async def chat_completions(request: Request) -> Response:
        req = protocol.parse_chat_request(await read_body(request), limits)
        if req.model is not None and req.model != model_id:
            raise ApiError(404, f"the model {req.model!r} does not exist: this server serves {model_id!r}",
                           "model", "model_not_found")
        ids = await run_in_threadpool(encode, req.messages)
        if len(ids) >= info.max_context:
            raise ApiError(400, f"the prompt has {len(ids)} tokens but the context window is {info.max_context} "
                                f"tokens: shorten the conversation", "messages", "context_length_exceeded")
        loop = asyncio.get_running_loop()
        items: asyncio.Queue = asyncio.Queue()

        def deliver(item):  # called on the generation thread
            try:
                loop.call_soon_threadsafe(items.put_nowait, item)
            except RuntimeError:  # the loop is gone (shutting down): nobody is listening
                pass

        job = Job(ids, req.max_tokens or min(s.max_new_tokens, info.max_context),
                  s.temperature if req.temperature is None else req.temperature,
                  s.top_k if req.top_k is None else req.top_k, s.top_p if req.top_p is None else req.top_p,
                  s.seed if req.seed is None else req.seed, req.stop, deliver)
        try:
            generator.submit(job)
        except QueueFull:
            raise ApiError(429, f"the server is busy: {options.max_queue} requests already wait for the model; "
                                "retry later", code="queue_full") from None
        cid, now = f"chatcmpl-{secrets.token_hex(12)}", int(time.time())
        if req.stream:
            return StreamingResponse(stream(job, items, req, cid, now), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        watcher = asyncio.ensure_future(cancel_on_disconnect(request, job))
        try:
            text = []
            while True:
                item = await items.get()
                if item[0] == "text":
                    text.append(item[1])
                elif item[0] == "failed":
                    raise ApiError(item[1], item[2])
                elif item[0] == "finished":
                    out = item[1]
                    use = protocol.usage(out.prompt_tokens, out.completion_tokens, out.cached_tokens)
                    return JSONResponse(protocol.completion(cid, now, model_id, "".join(text), out.finish_reason,
                                                            use, out.figures))
        finally:
            watcher.cancel()
            job.cancel()  # a no-op once finished; stops the generation if this handler was cancelled

    async def stream(job: Job, items: asyncio.Queue, req, cid: str, now: int):
        def sse(obj) -> str:
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

        try:
            yield sse(protocol.chunk(cid, now, model_id, {"role": "assistant", "content": ""}))
            while True:
                item = await items.get()
                if item[0] == "text":
                    yield sse(protocol.chunk(cid, now, model_id, {"content": item[1]}))
                elif item[0] == "failed":
                    yield sse(ApiError(item[1], item[2]).body())
                    return
                elif item[0] == "finished":
                    out = item[1]
                    use = protocol.usage(out.prompt_tokens, out.completion_tokens, out.cached_tokens)
                    yield sse(protocol.chunk(cid, now, model_id, {}, out.finish_reason, out.figures))
                    if req.include_usage:
                        yield sse(protocol.chunk(cid, now, model_id, None, use=use))
                    yield "data: [DONE]\n\n"
                    return
        finally:  # the client disconnected (Starlette cancels this generator) or the reply ended
            job.cancel()

    async def models(request: Request) -> Response:
        return JSONResponse(protocol.model_list(model_id, created))

    async def model(request: Request) -> Response:
        if request.path_params["name"] != model_id:
            raise ApiError(404, f"the model {request.path_params['name']!r} does not exist", "model",
                           "model_not_found")
        return JSONResponse(protocol.model_card(model_id, created))

    async def prometheus(request: Request) -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    async def api_error(request: Request, exc: ApiError) -> Response:
        return error_response(exc)

    async def http_error(request: Request, exc: HTTPException) -> Response:
        message = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
        return error_response(ApiError(exc.status_code, message.get(exc.status_code, str(exc.detail))))

    async def internal_error(request: Request, exc: Exception) -> Response:
        return error_response(ApiError(500, f"internal error: {type(exc).__name__}"))

    app = Starlette(routes=[
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{name:path}", model, methods=["GET"]),
        Route("/metrics", prometheus, methods=["GET"]),
    ], exception_handlers={ApiError: api_error, HTTPException: http_error, Exception: internal_error})
    return Guard(app, options.api_key, metrics)


async def cancel_on_disconnect(request: Request, job: Job) -> None:
    """Wait for the client to hang up (the body is already read), then cancel its job."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            job.cancel()
            return
