"""A direct link between head and tail, with no relay between them: the tail listens, the head dials.

Contract
--------
``address(text, flag)`` parses ``HOST:PORT`` (``[v6]:PORT`` for an IPv6 host; port 1-65535, 0 too
with ``listen``) into ``(host, port)``, or raises a ``UserError`` that names ``flag``.

``DirectServer(host, port)`` is the tail's end (``--listen``): it binds at once (port 0 picks a
free one: read ``port``) and carries the frames of one head at a time, with the surface of a
``RelayLink`` in the tail's role, so that ``SecureLink`` and ``link.listener`` pair and serve on
it as on the relay: ``peer_present``, ``wait_peer``, ``send`` (to the connected head; dropped,
as the relay drops it, when none is), ``recv`` (a head that disconnects is a ``PeerGone`` after
the frames it sent; the server keeps listening), ``closed_reason``, ``last_arrival``, ``close()``
(the only way it closes: ``LinkClosed`` then). A second head while one is connected is refused
politely, at the handshake (HTTP 409, ``BUSY``) or, where two raced, with close code
``CLOSE_BUSY``; one that comes while the head before is closing waits for its ``PeerGone``.
The port has no token: whoever reaches it may connect, so a connection must be ``trusted()``
(the tail passes its ``SecureLink.keyed``: paired) within ``PAIR_WAIT_S`` of its
opening and stay so, or it is closed (4408): a stranger cannot hold the one place for long
(``trusted`` is called off the loop: it may wait for a lock held by a sender).

``DirectLink(host, port, connect_timeout)`` is the head's end (``--direct``): it returns once the
tail has accepted the connection, with the same surface (``peer_present`` is True while the
connection is up; a lost connection is ``LinkClosed``, and the dialer dials again). A tail that
cannot be reached, does not answer within ``connect_timeout`` or is busy raises a ``UserError``
(``Unreachable``) that says which; the dialer then tries the relay, when it has one.

Both are ``relay.FramePipe``s, as ``RelayLink`` is, with its bounds: a message over
``MAX_FRAME_BYTES`` closes the connection (1009), websockets queues at most ``MAX_QUEUE`` frames,
and neither end reads from the socket while its inbox holds ``INBOX_BYTES`` or more; pings every
``PING_INTERVAL`` s, ``PING_TIMEOUT`` s to answer; the opening handshake within ``OPEN_WAIT_S``.
Each end runs one asyncio loop in a daemon thread; callers never see it. Knows nothing of frame
contents; torch-free.
"""

from __future__ import annotations

import asyncio
import re
import time
from http import HTTPStatus
from typing import Callable

from websockets.asyncio.client import connect
from websockets.asyncio.server import serve
from websockets.exceptions import InvalidHandshake, InvalidStatus
from websockets.protocol import State

from sfchat import UserError
from sfchat.link import LinkClosed, PeerGone
from sfchat.link.relay import CLOSE_TIMEOUT, MAX_FRAME_BYTES, MAX_QUEUE, PING_INTERVAL, PING_TIMEOUT, FramePipe
from sfchat.plaintext import plain

CLOSE_BUSY = 4409  # a second head, where two raced for the one place
CLOSE_UNPAIRED = 4408  # a connection that did not pair in time
BUSY = "this tail serves another head now"
PAIR_WAIT_S = 60.0  # how long a connection may stay unpaired on a listening tail
OPEN_WAIT_S = 10.0  # the opening handshake, on either end
TRUST_POLL_S = 0.5


_HOST = r"(\[[0-9A-Fa-f:.]+\]|[^\s:\[\]/@]+)"
_PORT = r"([1-9]\d{0,3}|[1-5]\d{4}|6[0-4]\d{3}|65[0-4]\d{2}|655[0-2]\d|6553[0-5])"
DIRECT_ADDRESS = re.compile(f"{_HOST}:{_PORT}")  # what --direct takes (config.RULES checks it)
LISTEN_ADDRESS = re.compile(f"{_HOST}:(0|{_PORT[1:-1]})")  # --listen: port 0 picks a free one
ADDRESS_SHAPE = "HOST:PORT (such as 203.0.113.7:7860, box.example.org:7860 or [::1]:7860)"


def address(text: str, flag: str = "--direct", listen: bool = False) -> tuple[str, int]:
    """``(host, port)`` of ``HOST:PORT`` (see the module docstring)."""
    text = (text or "").strip()
    m = (LISTEN_ADDRESS if listen else DIRECT_ADDRESS).fullmatch(text)
    if m is None:
        raise UserError(f"{flag} takes {ADDRESS_SHAPE}, not {plain(text)[:80]!r}")
    return m[1].strip("[]"), int(m[2])


class Unreachable(UserError):
    """The tail could not be dialled directly (refused, silent or busy)."""


class DirectServer(FramePipe):
    """The tail's listening port: one head at a time (see the module docstring)."""

    def __init__(self, host: str, port: int, trusted: Callable[[], bool] = lambda: False):
        super().__init__(f"direct-server-{port}")
        self.host, self.trusted = host, trusted  # self._ws: the connected head's connection
        self._free = asyncio.Event()  # no head's connection is being served (set on the loop)
        try:
            self._server = self._run(self._open(host, port), OPEN_WAIT_S + 5)
        except OSError as exc:
            self._stop_loop()
            raise UserError(f"cannot listen on {host}:{port}: {plain(exc.strerror or exc)}") from None
        except BaseException:
            self._stop_loop()
            raise
        self.port = self._server.sockets[0].getsockname()[1]

    def _stop_loop(self) -> None:
        self._closing = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    async def _open(self, host: str, port: int):
        return await serve(self._handle, host, port, process_request=self._admit, compression=None,
                           max_size=MAX_FRAME_BYTES, max_queue=MAX_QUEUE, open_timeout=OPEN_WAIT_S,
                           ping_interval=PING_INTERVAL, ping_timeout=PING_TIMEOUT, close_timeout=CLOSE_TIMEOUT)

    def _busy(self) -> bool:
        return self._ws is not None and self._ws.state is State.OPEN

    def _admit(self, connection, request):
        if self._busy():
            return connection.respond(HTTPStatus.CONFLICT, BUSY + "\n")
        return None

    async def _handle(self, ws) -> None:
        if self._ws is not None and not self._busy():  # the head before is leaving: its PeerGone comes first
            try:
                await asyncio.wait_for(self._free.wait(), CLOSE_TIMEOUT)
            except TimeoutError:
                pass
        with self._state:
            if self._ws is not None or self._closed:
                busy = True
            else:
                busy, self._ws = False, ws
                self._free.clear()
                self._state.notify_all()
        if busy:
            await ws.close(CLOSE_BUSY, BUSY)
            return
        reader = asyncio.create_task(self._read(ws))
        try:
            await self._watch(ws, reader)
        finally:
            reader.cancel()
            with self._state:
                self._ws = None
                if not self._closed:
                    self._inbox.put(PeerGone("the head left the direct link"))
                self._state.notify_all()
            self._free.set()

    def _connection_closed(self, ws) -> None:
        pass  # the head is gone, not the port: ``_handle`` says so

    def _describe(self, ws) -> str:
        return "the head's direct connection was lost"

    async def _watch(self, ws, reader) -> None:
        """Until the connection ends: it must be trusted within ``PAIR_WAIT_S`` and stay so."""
        deadline = time.monotonic() + PAIR_WAIT_S
        while True:
            await asyncio.wait([reader], timeout=TRUST_POLL_S)
            if reader.done():
                return
            # in a worker thread: ``trusted`` may wait for a lock held by a sender that waits for this loop
            if await asyncio.to_thread(self.trusted):
                deadline = time.monotonic() + PAIR_WAIT_S
            elif time.monotonic() > deadline:
                await ws.close(CLOSE_UNPAIRED, "not paired in time")
                return

    @property
    def peer_present(self) -> bool:
        with self._state:
            return self._ws is not None

    def wait_peer(self, timeout: float | None = None) -> None:
        with self._state:
            if not self._state.wait_for(lambda: self._ws is not None or self._closed, timeout):
                raise TimeoutError(f"no head connected within {timeout:g} s")
            if self._closed:
                raise LinkClosed(self._closed)

    def send(self, frame) -> None:
        with self._state:
            ws = self._ws
        if ws is None:
            with self._state:
                if self._closed:
                    raise LinkClosed(self._closed)
            return  # no head: dropped, as the relay drops a frame for an absent peer
        try:
            self._send(ws, frame)
        except LinkClosed:
            if self.closed_reason:
                raise  # the head alone is gone: its PeerGone is on its way

    async def _shutdown(self) -> None:
        self._server.close()
        await self._server.wait_closed()


class DirectLink(FramePipe):
    """The head's connection to a listening tail (see the module docstring)."""

    def __init__(self, host: str, port: int, connect_timeout: float = OPEN_WAIT_S):
        super().__init__(f"direct-link-{port}")
        self.where = f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"
        try:
            self._ws = self._run(self._open(host, port, connect_timeout))
        except BaseException:
            self.close()
            raise

    async def _open(self, host: str, port: int, timeout: float):
        where = self.where
        try:
            ws = await connect(f"ws://{where}/", compression=None, max_size=MAX_FRAME_BYTES, max_queue=MAX_QUEUE,
                               open_timeout=timeout, ping_interval=PING_INTERVAL, ping_timeout=PING_TIMEOUT,
                               close_timeout=CLOSE_TIMEOUT)
        except InvalidStatus as exc:
            status = exc.response.status_code
            why = BUSY if status == HTTPStatus.CONFLICT else f"it answered HTTP {status}: is it an sfchat --listen?"
            raise Unreachable(f"the tail at {where} refused the direct link: {why}") from None
        except TimeoutError:
            raise Unreachable(f"the tail at {where} did not answer within {timeout:g} s") from None
        except OSError as exc:
            raise Unreachable(f"cannot reach the tail at {where}: {plain(exc.strerror or exc)}") from None
        except InvalidHandshake as exc:
            raise Unreachable(f"{where} does not look like an sfchat tail: {plain(exc)}") from None
        self._reader = asyncio.create_task(self._read(ws))
        return ws

    def _describe(self, ws) -> str:
        code, reason = ws.close_code, ws.close_reason
        if code is None or code == 1006:
            return f"the direct connection to {self.where} was lost"
        return f"the tail at {self.where} closed the direct link ({code}" + (f": {plain(reason)[:200]})" if reason else ")")

    @property
    def peer_present(self) -> bool:
        return self.closed_reason is None

    def wait_peer(self, timeout: float | None = None) -> None:
        if self.closed_reason is not None:
            raise LinkClosed(self.closed_reason)

    def send(self, frame) -> None:
        self._send(self._ws, frame)
