"""A blocking, thread-safe link to the other node through an sfchat relay.

Contract
--------
``RelayLink(url, token, session, role)`` dials ``url/session/<session>?role=<role>`` with
``Authorization: Bearer <token>`` (the handshake is documented in ``relay.server``) and
returns once the relay has welcomed it, so ``peer_present`` is accurate from the start.
Mistakes the user can fix (bad URL, unreachable host, wrong token, session slot taken)
raise ``sfchat.UserError`` with a one-line message that says what to check (``probe.HINT``);
a slot already taken (HTTP 409, or close code 4409 when two clients raced for it) is the
``SlotTaken`` kind, which ``join_while_taken`` retries for a while (the one way every node
does); a token refused (HTTP 401) is ``TokenRefused``.

* ``send(frame)`` hands one binary frame to the relay, from any thread; it returns once the
  frame is in the socket's buffer and raises ``LinkClosed`` when the link is gone.
* ``recv(timeout)`` returns the next frame from the other node, in order. It raises
  ``PeerGone`` where the relay reported that the other node left (frames that node sent
  before leaving come first); the link stays usable and a new peer may join later. It
  raises ``LinkClosed`` once the connection is gone (and keeps raising it), and
  ``TimeoutError`` when nothing arrived in time.
  ``last_arrival`` is when the frame it last returned came off the socket (``time.perf_counter``).
* ``wait_peer(timeout)`` blocks until the other role is connected to the relay.
* ``closed_reason`` is why the connection is gone (the relay's close code and reason, or that it
  was lost), None while it is up; it is known as soon as the connection ends, without a ``recv``:
  an idle node looks at it. websockets pings the relay every ``PING_INTERVAL`` s, so a relay that
  vanished without closing is noticed within ``PING_INTERVAL + PING_TIMEOUT`` s.

Frames sent while the other role is absent are dropped by the relay (it says so once per
absence; logged here as a warning).

Relay events are bounded as frames are, whatever a relay sends: a ``peer_left`` queues a
``PeerGone`` only when the inbox does not already end with one (repeats coalesce), and each one
queued counts ``EVENT_BYTES`` against the inbox budget below; warnings about events (``dropped``,
malformed ones) are logged at their 1st, 10th, 100th ... occurrence, so a relay cannot make a
node write a line per event.

Inbound memory is bounded whatever the other side (or anyone holding the relay token) sends:
a message over ``max_frame_bytes`` (default ``MAX_FRAME_BYTES``, the protocol's largest sealed
frame, see ``relay.server``) closes the link (1009); websockets queues at most ``MAX_QUEUE``
frames before it stops reading the socket; and the link stops taking frames from websockets
while its own inbox holds ``INBOX_BYTES`` or more, until ``recv`` takes some. So an idle node
holds at most ``INBOX_BYTES + (MAX_QUEUE + 3) * max_frame_bytes`` of received data (inbox, the
frame that crossed the mark, websockets' queue and the one it reads past the mark, a frame half
parsed): 76 MiB with the defaults. Past that the relay's bounded queue for this node overflows
and the relay closes it as too slow.

The asyncio event loop lives in one daemon thread owned by the link; callers never see it.
That loop, the inbox and its bound, ``recv``, ``send`` and ``close`` are ``FramePipe``'s, which
the direct link's two ends (``link.direct``) share. This module knows nothing of frame
contents (see ``sfchat.protocol.wire``) and imports no torch.
"""

from __future__ import annotations

import abc
import asyncio
import json
import logging
import queue
import random
import threading
import time
from typing import Callable

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI

from sfchat import UserError
from sfchat.link import LinkClosed, PeerGone
from sfchat.link.probe import HINT, check_session, check_url
from sfchat.plaintext import plain

ROLES = ("head", "tail")
CLOSE_SLOT_TAKEN = 4409  # relay.server: the loser of a race for one slot
MAX_FRAME_BYTES = 12 << 20  # relay.server.MAX_FRAME_BYTES: the largest sealed frame of the protocol
INBOX_BYTES = 16 << 20  # about four Qwen2.5-7B prefill chunks waiting for the tail
MAX_QUEUE = 2  # websockets' receive queue, in frames
PING_INTERVAL = 20.0  # the relay tolerates 60 s without a pong: WAN spikes must not drop a chat
PING_TIMEOUT = 60.0
CLOSE_TIMEOUT = 5.0
EVENT_BYTES = 256  # what one queued relay event counts against the inbox budget
SLOT_RETRY_S = (0.1, 0.3)  # seconds between two tries of a taken slot (``join_while_taken``)

log = logging.getLogger(__name__)


class SlotTaken(UserError):
    """The session already has a node of this role."""


class TokenRefused(UserError):
    """The relay refused the token (HTTP 401)."""


def join_while_taken(join: Callable[[], "RelayLink"], wait_s: float, taken: Callable[[SlotTaken], None]) -> "RelayLink":
    """``join()`` again while the relay says the slot is taken, every ``SLOT_RETRY_S`` (drawn afresh:
    a slot freed for a moment is taken at once) for up to ``wait_s`` seconds; ``taken`` is told
    the first refusal. Past the wait the last ``SlotTaken`` is raised; other errors at once."""
    deadline, told = time.monotonic() + wait_s, False
    while True:
        try:
            return join()
        except SlotTaken as exc:
            if time.monotonic() >= deadline:
                raise
            if not told:
                taken(exc)
                told = True
            time.sleep(random.uniform(*SLOT_RETRY_S))


class FramePipe(abc.ABC):
    """What every websocket link of sfchat does alike (the relay's ``RelayLink``, ``link.direct``'s two
    ends): one asyncio loop in a daemon thread, an inbox read from the socket only while it holds
    less than ``INBOX_BYTES``, ``recv`` in order (``PeerGone`` passes; ``LinkClosed`` stays),
    ``send`` bounded by ``max_frame_bytes``, ``close()`` idempotent. A subclass opens the socket,
    reads it with ``_read`` and says why it closed (``_describe``)."""

    overlaps = True  # the other node computes on its own machine
    max_frame_bytes = MAX_FRAME_BYTES

    def __init__(self, name: str):
        self._inbox: queue.Queue = queue.Queue()
        self._state = threading.Condition()
        self._closed: str | None = None  # why the link is closed, once it is
        self._closing = False
        self.last_arrival: float | None = None  # perf_counter() when the frame last returned by recv arrived
        self._ws = None
        self._inbox_bytes = 0  # touched on the loop thread only
        self._room = asyncio.Event()  # frames are only read while the inbox has room: a slow consumer pushes back
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def _run(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _read(self, ws) -> None:
        """Frames of ``ws`` into the inbox (text messages to ``_on_text``) until it closes; then
        ``_connection_closed(ws)``, by default the end of the link."""
        try:
            while True:
                while self._inbox_bytes >= INBOX_BYTES:
                    self._room.clear()
                    await self._room.wait()
                message = await ws.recv()
                if isinstance(message, bytes):
                    self._inbox_bytes += len(message)
                    self._frame_in(message)
                else:
                    self._on_text(message)
        except ConnectionClosed:
            self._connection_closed(ws)

    def _frame_in(self, message: bytes) -> None:
        self._inbox.put((time.perf_counter(), message))  # arrival time for the head's RTT

    def _on_text(self, text: str) -> None:
        pass

    def _connection_closed(self, ws) -> None:
        self._mark_closed(self._describe(ws))

    @abc.abstractmethod
    def _describe(self, ws) -> str:
        """Why ``ws`` closed, in words for a person (each end words its own peer)."""

    def _taken(self, size: int) -> None:
        """``recv`` handed ``size`` bytes to the caller (runs on the loop thread)."""
        self._inbox_bytes -= size
        if self._inbox_bytes < INBOX_BYTES:
            self._room.set()

    def _give_room(self, size: int) -> None:
        try:
            self._loop.call_soon_threadsafe(self._taken, size)
        except RuntimeError:
            pass  # close() already stopped the loop; there is nothing left to read

    def _mark_closed(self, reason: str) -> None:
        with self._state:
            if self._closed is None:
                self._closed = reason
                self._inbox.put(LinkClosed(reason))
            self._state.notify_all()

    @property
    def closed_reason(self) -> str | None:
        with self._state:
            return self._closed

    def _send(self, ws, frame) -> None:
        """Send one binary frame on ``ws`` (thread-safe); ``LinkClosed`` once the link is gone."""
        if not isinstance(frame, (bytes, bytearray, memoryview)):
            raise TypeError(f"frames are bytes, not {type(frame).__name__}")
        if len(frame) > self.max_frame_bytes:
            raise ValueError(f"frame of {len(frame)} bytes exceeds the link limit of {self.max_frame_bytes}")
        with self._state:
            if self._closed:
                raise LinkClosed(self._closed)
            future = asyncio.run_coroutine_threadsafe(ws.send(frame), self._loop)
        try:
            future.result()
        except ConnectionClosed:
            raise LinkClosed(self._describe(ws)) from None

    def recv(self, timeout: float | None = None) -> bytes:
        """Next frame from the other node; PeerGone, LinkClosed or TimeoutError otherwise."""
        if self._closing:
            raise LinkClosed(self._closed)
        try:
            item = self._inbox.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no frame from the other node within {timeout:g} s") from None
        if isinstance(item, LinkClosed):
            self._inbox.put(item)  # stays closed for every later call
            raise LinkClosed(*item.args)
        if isinstance(item, PeerGone):
            self._peer_gone(item)
            raise item
        self.last_arrival, item = item
        self._give_room(len(item))
        return item

    def _peer_gone(self, gone: PeerGone) -> None:
        """``recv`` is about to raise ``gone``."""

    def close(self) -> None:
        """Close the connection and stop the link's thread; idempotent."""
        with self._state:
            if self._closing:
                return
            self._closing = True
        self._mark_closed("the link was closed by this side")
        try:
            self._run(self._shutdown(), CLOSE_TIMEOUT + 1)
        except TimeoutError:
            log.warning("the other end did not acknowledge the close in time")
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    async def _shutdown(self) -> None:
        if self._ws is not None:
            await self._ws.close()
        reader = getattr(self, "_reader", None)
        if reader is not None:
            reader.cancel()
            try:
                await reader
            except asyncio.CancelledError:
                pass

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class RelayLink(FramePipe):
    """One node's connection to the relay, usable from plain threads."""

    def __init__(self, url: str, token: str, session: str, role: str, *, connect_timeout: float = 30.0,
                 max_frame_bytes: int = MAX_FRAME_BYTES, ssl_context=None):
        if role not in ROLES:
            raise UserError(f"role must be 'head' or 'tail', not {role!r}")
        check_session(session)
        check_url(url)
        self.url = url
        self.role = role
        self.max_frame_bytes = max_frame_bytes
        self._welcomed = False
        self._peer_present = False
        self._last_gone: PeerGone | None = None  # the PeerGone that ends the inbox, if one does
        self._warned: dict[str, int] = {}  # warnings about relay events, by kind
        super().__init__(f"relay-link-{role}")
        target = f"{url.rstrip('/')}/session/{session}?role={role}"
        try:
            self._run(self._open(target, token, connect_timeout, ssl_context))
            with self._state:
                welcomed = self._state.wait_for(lambda: self._welcomed or self._closed, connect_timeout)
                closed = self._closed
            if closed:
                kind = SlotTaken if self._ws.close_code == CLOSE_SLOT_TAKEN else UserError
                raise kind(f"relay at {url} dropped the connection: {closed}")
            if not welcomed:
                raise UserError(f"{url} accepted the connection but sent no welcome; is it an sfchat relay?")
        except BaseException:
            self.close()
            raise

    async def _open(self, target: str, token: str, timeout: float, ssl_context) -> None:
        options = {"ssl": ssl_context} if ssl_context is not None else {}
        try:
            self._ws = await connect(
                target, additional_headers={"Authorization": f"Bearer {token}"}, compression=None,
                max_size=self.max_frame_bytes, max_queue=MAX_QUEUE, open_timeout=timeout, ping_interval=PING_INTERVAL,
                ping_timeout=PING_TIMEOUT, close_timeout=CLOSE_TIMEOUT, **options)
        except InvalidStatus as exc:
            raise _refusal(self.url, exc) from None
        except InvalidURI as exc:
            raise UserError(f"bad relay URL {self.url!r}: {exc}") from None
        except TimeoutError:
            raise UserError(f"relay at {self.url} did not answer within {timeout:g} s; {HINT}") from None
        except OSError as exc:
            raise UserError(f"cannot reach the relay at {self.url}: {plain(exc.strerror or exc)}; {HINT}") from None
        except InvalidHandshake as exc:
            raise UserError(f"{self.url} does not look like an sfchat relay: {exc}") from None
        self._reader = asyncio.create_task(self._read(self._ws))

    def _frame_in(self, message: bytes) -> None:
        with self._state:
            self._last_gone = None
            super()._frame_in(message)

    def _describe(self, ws) -> str:
        return _describe_close(ws)

    def _warn(self, kind: str, message: str) -> None:
        """Log ``message`` at the 1st, 10th, 100th ... warning of ``kind``."""
        n = self._warned[kind] = self._warned.get(kind, 0) + 1
        if str(n).strip("0") == "1":
            log.warning("%s%s", message, f" ({n} times so far)" if n > 1 else "")

    def _on_text(self, text: str) -> None:
        try:
            event = json.loads(text)
            kind = event["event"]
        except (ValueError, TypeError, KeyError, RecursionError):
            self._warn("malformed", f"ignoring a malformed relay event: {plain(text[:200])}")
            return
        with self._state:
            if kind == "welcome":
                self._welcomed = True
                self._peer_present = bool(event.get("peer_present"))
            elif kind == "peer_joined":
                self._peer_present = True
            elif kind == "peer_left":
                self._peer_present = False
                if self._last_gone is None:  # repeats coalesce: one PeerGone between frames
                    role = event.get("role")
                    self._last_gone = PeerGone(f"the {role if role in ROLES else 'other node'} left the session")
                    self._inbox_bytes += EVENT_BYTES
                    self._inbox.put(self._last_gone)
            elif kind == "dropped":
                self._warn("dropped", f"relay dropped frames: {plain(str(event.get('reason', 'no peer')))[:200]}")
            self._state.notify_all()

    def _mark_closed(self, reason: str) -> None:
        with self._state:
            self._peer_present = False
            super()._mark_closed(reason)

    @property
    def peer_present(self) -> bool:
        with self._state:
            return self._peer_present

    def send(self, frame: bytes) -> None:
        """Send one binary frame to the other node (thread-safe)."""
        self._send(self._ws, frame)

    def _peer_gone(self, gone: PeerGone) -> None:
        with self._state:
            if gone is self._last_gone:
                self._last_gone = None
        self._give_room(EVENT_BYTES)

    def wait_peer(self, timeout: float | None = None) -> None:
        """Block until the other role is connected; TimeoutError or LinkClosed otherwise."""
        with self._state:
            if not self._state.wait_for(lambda: self._peer_present or self._closed, timeout):
                other = "tail" if self.role == "head" else "head"
                raise TimeoutError(f"no {other} joined the session within {timeout:g} s")
            if not self._peer_present:
                raise LinkClosed(self._closed)


def _refusal(url: str, exc: InvalidStatus) -> UserError:
    status = exc.response.status_code
    body = plain(exc.response.body.decode("utf-8", "replace").strip())[:200] if exc.response.body else ""
    if status == 401:
        return TokenRefused(f"relay at {url} refused the token (HTTP 401): use the token it printed")
    if status == 409:
        return SlotTaken(f"relay at {url} refused to join: {body or status}")
    if status in (400, 503):
        return UserError(f"relay at {url} refused to join: {body or status}")
    return UserError(f"relay at {url} answered HTTP {status}{': ' + body if body else ''}; "
                     "is it an sfchat relay?")


def _describe_close(ws: ClientConnection) -> str:
    code, reason = ws.close_code, ws.close_reason
    if code is None or code == 1006:
        return "the connection to the relay was lost"
    return f"link closed with code {code}" + (f": {plain(reason)[:200]}" if reason else "")
