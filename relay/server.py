"""sfchat-relay: a websocket relay that pairs a head and a tail and forwards frames verbatim.

Both GPU machines sit behind NAT, so both dial out to this relay; it joins them by session
name. It needs only ``websockets``: no torch, nothing from ``sfchat``, and it never parses
the frames it forwards.

Handshake
---------
Connect to ``ws[s]://HOST:PORT/session/<name>?role=head|tail`` with the header
``Authorization: Bearer <token>``; ``<name>`` is 1..64 characters of ``[A-Za-z0-9._-]``.
Before upgrading, the relay answers with a plain HTTP status instead when:

* ``GET /healthz`` (no upgrade, no token needed) -> 200 ``ok``;
* the token is missing or wrong (compared with ``hmac.compare_digest``) -> 401;
* the path, role or name is malformed -> 400;
* the session already has a peer of that role -> 409, body ``session NAME already has a tail``;
* the relay already holds ``--max-sessions`` sessions and this would open another, or
  ``--max-connections`` connections -> 503.

Two clients racing for the same slot can both pass the HTTP checks; the loser is then closed
right after the upgrade with code 4409 (4503 for the session or connection limit) and the same reason.
Refusals are logged once per client address and kind, then not again for ten minutes.

After the upgrade
-----------------
* Binary messages are sfchat frames: forwarded verbatim and in order to the other role.
* Text messages are JSON control events and are sent by the relay only::

      {"event": "welcome", "session": NAME, "peer_present": bool}   first message, on join
      {"event": "peer_joined", "role": "tail"}                     the other role arrived
      {"event": "peer_left", "role": "tail"}                       the other role left
      {"event": "dropped", "reason": "no peer"}                    your frames are being dropped

  A frame sent while the other role is absent is dropped; the sender hears ``dropped`` once
  per absence. Nothing is buffered for an absent peer. Events travel in the same ordered
  queue as frames, so ``peer_left`` follows the last frame of the departed peer.
* A text message from a client closes that connection with 1003; a message over
  ``--max-frame-mb`` closes it with 1009; more than ``--max-frames-per-s`` frames or
  ``--max-mb-per-s`` MiB per second (token buckets holding one second's worth, and at least
  four maximal frames) close it with 1008; a receiver that falls too far behind its bounded
  queue, or holds the most bytes when all queues together reach ``--max-buffer-mb``, is closed
  with 1013; a connection that sends nothing for ``--idle-timeout`` minutes (keepalive pings and
  pongs do not count) is closed with 4408. Other connections and sessions are unaffected.
* The relay never parses a frame, so it needs no trust in their contents: head and tail seal
  them end to end (``sfchat.secure_link``); the relay sees sizes and timing only.
* Once the tail leaves, the session keeps its head and a new tail may join (and vice versa).
  A session disappears when both roles have left.
* On SIGTERM or SIGINT the relay closes every connection with 1001 and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import logging
import os
import re
import secrets
import shlex
import signal
import socket
import ssl
import sys
import time
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

from websockets.asyncio.server import Server, ServerConnection
from websockets.asyncio.server import serve as ws_serve
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from relay.session import ROLES, Budget, LogOnce, Peer, Session, address, close_firmly, host, log

SESSION_PATH = re.compile(r"/session/([A-Za-z0-9._-]{1,64})")
CLOSE_UNSUPPORTED_DATA = 1003
CLOSE_POLICY = 1008
CLOSE_IDLE = 4408
CLOSE_SLOT_TAKEN = 4409
CLOSE_RELAY_FULL = 4503


class StartupError(Exception):
    """A user mistake found while starting (bad certificate, port in use): one line, exit 2."""


@dataclass(frozen=True)
class RelayConfig:
    """Everything a running relay needs; ``main`` builds it from the command line."""

    token: str
    host: str = "0.0.0.0"
    port: int = 8765
    ssl: ssl.SSLContext | None = None
    emulate_rtt_ms: float = 0.0
    max_sessions: int = 64
    max_connections: int = 256
    max_frame_bytes: int = 32 << 20
    # Generous: a round is two frames of ~64 KB (Qwen2.5-7B, K=8), a prefill chunk a few MB.
    max_frames_per_s: float = 2000.0
    max_bytes_per_s: float = 512 << 20
    max_buffer_bytes: int = 1 << 30  # every session's send queues together
    idle_timeout: float = 30 * 60.0  # seconds without a message from the client; 0 = never
    ping_interval: float = 20.0  # generous: a WAN spike must not kill a long generation
    ping_timeout: float = 60.0
    close_timeout: float = 3.0  # bounds shutdown when a peer never answers the close frame
    open_timeout: float = 10.0  # a client that never finishes its handshake is dropped after this
    max_queue: int = 4  # websockets' per-connection receive buffer, in frames (bounds memory)


class TokenBucket:
    """``rate`` units per second with room for ``burst``; ``take`` says whether ``n`` still fit."""

    def __init__(self, rate: float, burst: float):
        self.rate, self.burst = rate, burst
        self.level, self.stamp = burst, time.monotonic()

    def take(self, n: float) -> bool:
        now = time.monotonic()
        self.level = min(self.burst, self.level + (now - self.stamp) * self.rate)
        self.stamp = now
        if n > self.level:
            return False
        self.level -= n
        return True


class Relay:
    """A listening relay: the websockets server plus the live sessions."""

    def __init__(self, config: RelayConfig):
        self.config = config
        self.sessions: dict[str, Session] = {}
        self.connections: set[ServerConnection] = set()  # upgraded and not yet handled to the end
        self.budget = Budget(config.max_buffer_bytes)
        self.refused = LogOnce()
        self._server: Server | None = None

    async def start(self) -> None:
        c = self.config
        self._server = await ws_serve(
            self._handle, c.host, c.port, ssl=c.ssl, process_request=self._check_request,
            compression=None, max_size=c.max_frame_bytes, max_queue=c.max_queue, open_timeout=c.open_timeout,
            ping_interval=c.ping_interval, ping_timeout=c.ping_timeout, close_timeout=c.close_timeout,
        )

    @property
    def port(self) -> int:
        return self._server.sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return _url(self.config.host, self.port, self.config.ssl is not None)

    def close(self) -> None:
        """Stop listening and close every connection with 1001 (going away)."""
        self._server.close()

    async def wait_closed(self) -> None:
        await self._server.wait_closed()

    async def __aenter__(self) -> "Relay":
        return self

    async def __aexit__(self, *exc_info) -> None:
        self.close()
        await self.wait_closed()

    def _check_request(self, ws: ServerConnection, request: Request) -> Response | None:
        """Answer with an HTTP status instead of upgrading, or return None to accept."""
        target = urlsplit(request.path)
        if target.path == "/healthz":
            return ws.respond(200, "ok\n")
        if not self._token_ok(request.headers):
            self.refused(host(ws), "401", "refused %s for %.80r: bad or missing token", address(ws), request.path)
            response = ws.respond(401, "relay refused the token\n")
            response.headers["WWW-Authenticate"] = 'Bearer realm="sfchat-relay"'
            return response
        match = SESSION_PATH.fullmatch(target.path)
        roles = parse_qs(target.query).get("role", [])
        if match is None or len(roles) != 1 or roles[0] not in ROLES:
            self.refused(host(ws), "400", "refused %s: bad request target %.80r", address(ws), request.path)
            return ws.respond(400, "expected /session/NAME?role=head|tail, "
                                   "NAME being 1..64 characters of [A-Za-z0-9._-]\n")
        name, role = match[1], roles[0]
        refusal = self._refusal(name, role)
        if refusal is not None:
            status, reason = refusal
            self.refused(host(ws), str(status), "session %s: refused %s at %s: %s", name, role, address(ws), reason)
            return ws.respond(status, reason + "\n")
        ws.sfchat_slot = (name, role)
        return None

    def _token_ok(self, headers: Headers) -> bool:
        values = headers.get_all("Authorization")
        if len(values) != 1:
            return False
        scheme, _, presented = values[0].partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            presented.strip().encode(), self.config.token.encode())

    def _refusal(self, name: str, role: str) -> tuple[int, str] | None:
        if len(self.connections) >= self.config.max_connections:
            return 503, f"relay is full ({self.config.max_connections} connections)"
        session = self.sessions.get(name)
        if session is not None and role in session.peers:
            return 409, f"session {name} already has a {role}"
        if session is None and len(self.sessions) >= self.config.max_sessions:
            return 503, f"relay is full ({self.config.max_sessions} sessions)"
        return None

    async def _handle(self, ws: ServerConnection) -> None:
        name, role = ws.sfchat_slot
        # The HTTP check ran before the upgrade; another client may have taken the slot since.
        refusal = self._refusal(name, role)
        if refusal is not None:
            status, reason = refusal
            self.refused(host(ws), str(status), "session %s: refused %s at %s: %s", name, role, address(ws), reason)
            await ws.close(CLOSE_SLOT_TAKEN if status == 409 else CLOSE_RELAY_FULL, reason)
            return
        self.connections.add(ws)
        try:
            await self._join(ws, name, role)
        finally:
            self.connections.discard(ws)

    async def _join(self, ws: ServerConnection, name: str, role: str) -> None:
        session = self.sessions.setdefault(name, Session(name))
        # Room for a few maximal frames in flight, so one large prefill chunk never overflows.
        peer = Peer(ws, role, name, max_queued_bytes=4 * self.config.max_frame_bytes, budget=self.budget)
        session.join(peer)
        log.info("session %s: %s joined from %s (%s)", name, role, peer.address,
                 "peer present" if len(session.peers) == 2 else "waiting for its peer")
        try:
            await self._pump_from(ws, session, peer)
        finally:
            await peer.stop()
            session.leave(peer)
            if not session.peers:
                del self.sessions[name]
            log.info("session %s: %s at %s left (code %s%s)", name, role, peer.address,
                     ws.close_code, f": {ws.close_reason}" if ws.close_reason else "")

    async def _pump_from(self, ws: ServerConnection, session: Session, peer: Peer) -> None:
        c = self.config
        delay = c.emulate_rtt_ms / 2000.0
        frames = TokenBucket(c.max_frames_per_s, c.max_frames_per_s)
        volume = TokenBucket(c.max_bytes_per_s, max(c.max_bytes_per_s, 4 * c.max_frame_bytes))
        loop = asyncio.get_running_loop()
        idle = c.idle_timeout or None
        try:
            async with asyncio.timeout_at(loop.time() + idle if idle else None) as quiet:
                async for message in ws:
                    if idle:
                        quiet.reschedule(loop.time() + idle)
                    if isinstance(message, str):
                        await close_firmly(ws, CLOSE_UNSUPPORTED_DATA,
                                           "text messages are reserved for the relay; send binary frames")
                        return
                    if not (frames.take(1) and volume.take(len(message))):
                        self.refused(host(ws), "rate", "session %s: %s at %s exceeded %g frames/s or %g MiB/s",
                                     session.name, peer.role, peer.address, c.max_frames_per_s,
                                     c.max_bytes_per_s / (1 << 20))
                        await close_firmly(ws, CLOSE_POLICY, "rate limit exceeded: this side sends too fast")
                        return
                    session.forward(peer, message, delay)
        except TimeoutError:
            self.refused(host(ws), "idle", "session %s: %s at %s sent nothing for %g min",
                         session.name, peer.role, peer.address, idle / 60)
            await close_firmly(ws, CLOSE_IDLE, f"idle for {idle / 60:g} min: closed by the relay")
        except ConnectionClosed:
            pass  # oversize frame, lost connection, shutdown: the close code says which


async def serve(config: RelayConfig) -> Relay:
    """Start a relay listening as ``config`` says; close it with ``close()`` + ``wait_closed()``."""
    relay = Relay(config)
    await relay.start()
    return relay


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        # One line, no usage block: the relay often runs under a process manager's log.
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _bounded(kind, low, high=None):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if value < low or (high is not None and value > high):
            limit = f"{low}..{high}" if high is not None else f">= {low}"
            raise argparse.ArgumentTypeError(f"{text} is out of range ({limit})")
        return value
    return parse


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="sfchat-relay", description="Pair sfchat heads and tails by session name "
                                                 "and forward their frames.")
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    p.add_argument("--port", type=_bounded(int, 0, 65535), default=8765,
                   help="port to listen on; 0 picks a free one (default 8765)")
    p.add_argument("--token", default=os.environ.get("SFCHAT_TOKEN"),
                   help="shared secret clients must present (default: $SFCHAT_TOKEN, else generated)")
    p.add_argument("--certfile", help="TLS certificate (PEM) to serve wss://")
    p.add_argument("--keyfile", help="TLS private key (PEM), if not inside --certfile")
    p.add_argument("--emulate-rtt-ms", type=_bounded(float, 0.0), default=0.0, metavar="MS",
                   help="delay every forwarded frame by MS/2 each way, to rehearse a WAN locally")
    d = RelayConfig(token="")
    p.add_argument("--max-sessions", type=_bounded(int, 1), default=d.max_sessions)
    p.add_argument("--max-connections", type=_bounded(int, 2), default=d.max_connections,
                   help=f"open websocket connections at most (default {d.max_connections})")
    p.add_argument("--max-frame-mb", type=_bounded(float, 0.001), default=32.0,
                   help="largest message accepted, in MiB (default 32)")
    p.add_argument("--max-frames-per-s", type=_bounded(float, 1.0), default=d.max_frames_per_s,
                   help=f"per connection; faster senders are closed (default {d.max_frames_per_s:g})")
    p.add_argument("--max-mb-per-s", type=_bounded(float, 0.001), default=d.max_bytes_per_s / (1 << 20),
                   help=f"per connection, in MiB; faster senders are closed (default {d.max_bytes_per_s >> 20})")
    p.add_argument("--max-buffer-mb", type=_bounded(float, 1.0), default=d.max_buffer_bytes / (1 << 20),
                   help=f"frames queued for all receivers together, in MiB (default {d.max_buffer_bytes >> 20})")
    p.add_argument("--idle-timeout", type=_bounded(float, 0.0), default=d.idle_timeout / 60, metavar="MIN",
                   help=f"close connections that send nothing for MIN minutes; 0 = never "
                        f"(default {d.idle_timeout / 60:g})")
    p.add_argument("--log-level", default="INFO", type=str.upper,
                   choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def _tls_context(certfile: str | None, keyfile: str | None) -> ssl.SSLContext | None:
    if certfile is None:
        if keyfile is not None:
            raise StartupError("--keyfile needs --certfile")
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(certfile, keyfile)
    except (OSError, ssl.SSLError) as exc:
        raise StartupError(f"cannot load TLS certificate {certfile!r}: {exc.strerror or exc}") from None
    return context


def _url(host: str, port: int, tls: bool) -> str:
    host = f"[{host}]" if ":" in host else host  # IPv6 literal
    return f"{'wss' if tls else 'ws'}://{host}:{port}"


def _banner(relay: Relay, token_generated: bool) -> str:
    host = relay.config.host
    public = socket.gethostname() if host in ("0.0.0.0", "::", "") else host
    public_url = _url(public, relay.port, relay.config.ssl is not None)
    common = f"--relay {public_url} --token {shlex.quote(relay.config.token)} --session NAME"
    lines = [f"sfchat-relay listening on {relay.url}"]
    if token_generated:
        lines.append("token generated for this run; pass --token or set SFCHAT_TOKEN to keep one")
    if relay.config.emulate_rtt_ms:
        lines.append(f"emulating a round trip of {relay.config.emulate_rtt_ms:g} ms")
    lines += ["run, with any NAME and a SECRET of your own shared by both sides (the relay never sees it):",
              f"  head:  sfchat {common} --secret SECRET",
              f"  tail:  sfchat --tail {common} --secret SECRET"]
    return "\n".join(lines)


async def _run(config: RelayConfig, token_generated: bool) -> None:
    try:
        relay = await serve(config)
    except OSError as exc:
        raise StartupError(f"cannot listen on {config.host}:{config.port}: {exc.strerror or exc}") from None
    print(_banner(relay, token_generated), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    log.info("shutting down: closing %d session(s)", len(relay.sessions))
    relay.close()
    await relay.wait_closed()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=args.log_level,
                        format="%(asctime)s %(levelname)s %(message)s")
    # websockets logs every handshake at INFO; our own join/leave/refusal lines replace those.
    logging.getLogger("websockets").setLevel(max(logging.getLevelName(args.log_level), logging.WARNING))
    token = args.token or secrets.token_urlsafe(24)
    try:
        config = RelayConfig(
            token=token, host=args.host, port=args.port,
            ssl=_tls_context(args.certfile, args.keyfile), emulate_rtt_ms=args.emulate_rtt_ms,
            max_sessions=args.max_sessions, max_frame_bytes=int(args.max_frame_mb * (1 << 20)),
            max_connections=args.max_connections, max_frames_per_s=args.max_frames_per_s,
            max_bytes_per_s=args.max_mb_per_s * (1 << 20), max_buffer_bytes=int(args.max_buffer_mb * (1 << 20)),
            idle_timeout=args.idle_timeout * 60,
        )
        asyncio.run(_run(config, token_generated=not args.token))
    except StartupError as exc:
        print(f"sfchat-relay: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
