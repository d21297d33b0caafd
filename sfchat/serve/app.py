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
* ``GET /v1/models`` (and ``/v1/models/{id}``) — the one served model, under its name: a hub id
  as it is, a local directory by its own name (never its path). A request may name it so, by
  the name's last part, in any case, or by a path ending in it (``protocol.same_model``).
* ``GET /metrics`` — Prometheus text format.

``Guard`` checks, in this order, the API key (when ``options.api_key`` is set, every route
requires ``Authorization: Bearer KEY``), the framing (a request with both ``Content-Length``
and ``Transfer-Encoding`` is refused with 400 and its connection closed: nothing smuggled after
it is answered), then reads the body, then the requests in progress. A body must arrive within
``body_timeout`` seconds of its headers (408) and hold at most ``max_body_bytes`` (413); bodies
still arriving are bounded apart (``BodyGate``): ``max_bodies_per_client`` from one client and
``max_bodies`` in all, a newcomer over a limit closing the oldest body in flight of its own
client, or of the client with the most (503). A request counts as in progress only once its body
is complete: at most ``max_requests_per_client`` from one client (429) and ``max_requests`` in
all (503), so half-sent bodies hold no request's slot; idle connections count nowhere (``gate``).
A client is its socket's address, an IPv6 address by its /64 (``client_key``), as at the relay.
A client that hangs up mid-body is a closed client: no answer, no traceback, counted as 499.
Refusals count in ``sfchat_http_refused_total``.

Every failure is an OpenAI error object, never a traceback: 400 malformed JSON or fields, a
prompt past the context window (naming both sizes) and a chat template that fails or runs past
its bound, 401 a wrong or missing key, 404 an unknown model or route, 408 a body too slow, 413 a
body over the limit, 429 a full queue or a client's requests at its limit, 500/503 a failure
while generating. Messages that carry text from elsewhere (the tail, the model's template) are
``plaintext.plain``. A client that disconnects (mid-stream, or while a non-streaming reply is
being made or waits in the queue) cancels its generation. The KV cache of one client's
conversation is reused only by the same client (``generator``): ``cached_tokens`` never tells a
client about another's prompt. The app never touches the models: it hands jobs to the
generation thread, which calls back with ``loop.call_soon_threadsafe``.
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

from sfchat import UserError
from sfchat.plaintext import plain
from sfchat.serve import protocol
from sfchat.serve.gate import client_key
from sfchat.serve.generator import Failed, Finished, GenerationThread, Job, QueueFull, Text, TokenizerBusy
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
    header_timeout: float = 10.0  # seconds a connection has to send its request's headers (gate)
    body_timeout: float = 30.0  # seconds a request has to send its body, from its headers
    max_waiting: int = 512  # connections waiting for their request, in all (gate)
    max_waiting_per_client: int = 64  # the same, from one client address
    max_requests: int | None = None  # requests in progress at once; None: max_queue + 64
    max_requests_per_client: int | None = None  # the same, from one address; None: half of max_requests
    max_bodies: int = 32  # request bodies still arriving, in all (each up to max_body_bytes)
    max_bodies_per_client: int = 8  # the same, from one client

    def request_limits(self) -> tuple[int, int]:
        """(requests in progress in all, from one client address)."""
        total = self.max_requests or self.max_queue + 64
        return total, self.max_requests_per_client or max(1, total // 2)


def error_response(exc: ApiError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else {}
    if exc.close:  # the request's body may be unread: end the connection with the answer
        headers["Connection"] = "close"
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


class ClientGone(Exception):
    """The client hung up before its request's body was complete."""


class BodyGate:
    """Request bodies still arriving, per client and in all (runs on the event loop's thread)."""

    def __init__(self, options: ServeOptions, metrics: ServerMetrics):
        self.options, self.metrics = options, metrics
        self.arriving: dict[str, dict[asyncio.Future, None]] = {}  # per client, oldest first
        self.count = 0

    def _admit(self, client: str) -> asyncio.Future:
        mine = self.arriving.get(client, {})
        if len(mine) >= self.options.max_bodies_per_client:
            self._evict(next(iter(mine)), "client_bodies")
        elif self.count >= self.options.max_bodies:
            self._evict(next(iter(max(self.arriving.values(), key=len))), "bodies")
        evicted = asyncio.get_running_loop().create_future()
        self.arriving.setdefault(client, {})[evicted] = None
        self.count += 1
        return evicted

    def _evict(self, evicted: asyncio.Future, reason: str) -> None:
        self.metrics.refused(reason)
        evicted.set_result(reason)
        self._leave(evicted)

    def _leave(self, evicted: asyncio.Future) -> None:
        for client, mine in list(self.arriving.items()):
            if evicted in mine:
                del mine[evicted]
                self.count -= 1
                if not mine:
                    del self.arriving[client]

    async def read(self, client: str, receive) -> bytes:
        """The whole body of the request ``receive`` belongs to; ApiError (408, 413, 503) or ClientGone."""
        o = self.options
        evicted, getting = self._admit(client), None
        parts, total = [], 0
        try:
            async with asyncio.timeout(o.body_timeout):
                while True:
                    getting = asyncio.ensure_future(receive())
                    await asyncio.wait({getting, evicted}, return_when=asyncio.FIRST_COMPLETED)
                    if not getting.done():
                        mine = "from your address " if evicted.result() == "client_bodies" else ""
                        raise ApiError(503, f"too many request bodies {mine}are arriving at once; this one was the "
                                            "oldest: retry", code="server_busy", close=True)
                    message, getting = getting.result(), None
                    if message["type"] == "http.disconnect":
                        raise ClientGone()
                    total += len(message.get("body", b""))
                    if total > o.max_body_bytes:
                        raise ApiError(413, f"the request body exceeds {o.max_body_bytes} bytes", close=True)
                    parts.append(message.get("body", b""))
                    if not message.get("more_body", False):
                        return b"".join(parts)
        except TimeoutError:
            self.metrics.refused("body_timeout")
            raise ApiError(408, f"the request body did not arrive within {o.body_timeout:g} s of its headers",
                           close=True) from None
        finally:
            if getting is not None:
                getting.cancel()
            if not evicted.done():
                evicted.cancel()
                self._leave(evicted)


def replayed(body: bytes, receive):
    """An ASGI ``receive`` that gives ``body`` as one message, then passes on to ``receive``."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay():
        return pending.pop() if pending else await receive()

    return replay


class Guard:
    """ASGI middleware: the API key check, the framing, the body (``BodyGate``), then the limits on
    requests in progress, and one request count per answer (route, status)."""

    def __init__(self, app, options: ServeOptions, metrics: ServerMetrics):
        self.app, self.metrics, self.options = app, metrics, options
        self.key = f"Bearer {options.api_key}".encode() if options.api_key else None
        self.limit, self.client_limit = options.request_limits()
        self.bodies = BodyGate(options, metrics)
        self.per_client: dict[str, int] = {}  # requests in progress per client
        self.total = 0

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
            headers = scope.get("headers") or []
            if self.key is not None:
                given = dict(headers).get(b"authorization", b"")
                if not hmac.compare_digest(given, self.key):
                    message = "a wrong API key was given" if given else \
                        "no API key was given: send the header Authorization: Bearer KEY"
                    resp = error_response(ApiError(401, message, code="invalid_api_key"))
                    return await resp(scope, receive, counting_send)
            if refusal := self.framing(headers):
                return await error_response(refusal)(scope, receive, counting_send)
            client = client_key((scope.get("client") or ("",))[0])
            try:
                body = await self.bodies.read(client, receive)
            except ApiError as exc:
                return await error_response(exc)(scope, receive, counting_send)
            except ClientGone:
                return  # nobody to answer: counted as 499 below
            if refusal := self.refusal(client):
                return await error_response(refusal)(scope, receive, counting_send)
            self.total += 1
            self.per_client[client] = self.per_client.get(client, 0) + 1
            self.metrics.in_progress.set(self.total)
            try:
                await self.app(scope, replayed(body, receive), counting_send)
            finally:
                self.total -= 1
                self.metrics.in_progress.set(self.total)
                self.per_client[client] -= 1
                if not self.per_client[client]:
                    del self.per_client[client]
        finally:
            self.metrics.request(route, status[0] if status else 499)  # 499: the client left first

    def framing(self, headers) -> ApiError | None:
        """A request whose length two headers give (a smuggling attempt through a proxy) is refused."""
        names = {name.lower() for name, _ in headers}
        if b"transfer-encoding" in names and b"content-length" in names:
            self.metrics.refused("framing")
            return ApiError(400, "a request may give Content-Length or Transfer-Encoding, not both", close=True)
        size = dict(headers).get(b"content-length", b"")
        if size.isdigit() and int(size) > self.options.max_body_bytes:
            return ApiError(413, f"the request body has {size.decode()} bytes; at most {self.options.max_body_bytes} "
                                 "are accepted", close=True)
        return None

    def refusal(self, client: str) -> ApiError | None:
        mine = self.per_client.get(client, 0)
        if mine >= self.client_limit:
            self.metrics.refused("client_requests")
            return ApiError(429, f"your address has {mine} requests in progress, the most one client may have; "
                                 f"retry when one has ended", code="too_many_requests", close=True)
        if self.total >= self.limit:
            self.metrics.refused("requests")
            return ApiError(503, f"the server has {self.total} requests in progress, its limit; retry later",
                            code="server_busy", close=True)
        return None


def build_app(generator: GenerationThread, metrics: ServerMetrics, options: ServeOptions = ServeOptions()):
    info = generator.info
    model_id = protocol.served_name(info.model)
    created = int(time.time())
    limits = Limits(options.max_body_bytes, options.max_messages, info.max_context)
    s = generator.settings

    async def read_body(request: Request) -> bytes:
        return await request.body()  # read whole, under its bounds, by the Guard

    def encode(messages) -> list[int]:
        try:
            return generator.encode(list(messages))
        except TokenizerBusy as exc:
            raise ApiError(503, str(exc), code="server_busy") from None
        except UserError as exc:  # the template ran past its bound
            raise ApiError(400, plain(exc), "messages") from None
        except Exception as exc:  # a chat template may refuse an order of roles
            raise ApiError(400, f"the chat template refused these messages: {plain(exc)}", "messages") from None

    def unknown(asked: str) -> ApiError:
        return ApiError(404, f"the model {asked[:100]!r} is not served here: this server serves {model_id!r}",
                        "model", "model_not_found")

    async def chat_completions(request: Request) -> Response:
        req = protocol.parse_chat_request(await read_body(request), limits)
        if req.model is not None and not protocol.same_model(model_id, req.model):
            raise unknown(req.model)
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

        job = Job(ids, req.max_tokens or min(s.max_new_tokens, info.max_context), req.gen, req.stop, deliver,
                  client=request.client.host if request.client else "")
        try:
            generator.submit(job)
        except QueueFull:
            raise ApiError(429, f"the server is busy: {options.max_queue} requests already wait for the model; "
                                "retry later", code="queue_full") from None
        cid, now = f"chatcmpl-{secrets.token_hex(12)}", int(time.time())
        if req.stream:
            return StreamingResponse(stream(job, items, req, cid, now), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        watcher = asyncio.ensure_future(cancel_on_disconnect(request, job, items))
        try:
            text = []
            while True:
                match await items.get():
                    case Text(piece):
                        text.append(piece)
                    case Failed(status, message):
                        raise ApiError(status, message)
                    case Finished(out):
                        use = protocol.usage(out.prompt_tokens, out.completion_tokens, out.cached_tokens)
                        return JSONResponse(protocol.completion(cid, now, model_id, "".join(text),
                                                                out.finish_reason, use, out.figures))
        finally:
            watcher.cancel()
            job.cancel()  # a no-op once finished; stops the generation if this handler was cancelled

    async def stream(job: Job, items: asyncio.Queue, req, cid: str, now: int):
        def sse(obj) -> str:
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

        try:
            yield sse(protocol.chunk(cid, now, model_id, {"role": "assistant", "content": ""}))
            while True:
                match await items.get():
                    case Text(piece):
                        yield sse(protocol.chunk(cid, now, model_id, {"content": piece}))
                    case Failed(status, message):
                        yield sse(ApiError(status, message).body())
                        return
                    case Finished(out):
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
        if not protocol.same_model(model_id, request.path_params["name"]):
            raise unknown(request.path_params["name"])
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
    return Guard(app, options, metrics)


async def cancel_on_disconnect(request: Request, job: Job, items: asyncio.Queue) -> None:
    """Wait for the client to hang up (the body is already read), then cancel its job and end its
    wait (a job cancelled while queued is dropped without a word when its turn comes)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            job.cancel()
            items.put_nowait(Failed(499, "the client closed the connection"))
            return
