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
  ``--max-connections`` connections -> 503;
* the client (its address, an IPv6 address by its /64: ``relay.gate.client_key``) already takes
  part in ``--max-sessions-per-ip`` sessions and this would be one more, or holds
  ``--max-connections-per-ip`` connections -> 503, body ``too many sessions (connections) from
  your address (N at most)``.

Two clients racing for the same slot can both pass the HTTP checks; the loser is then closed
right after the upgrade with code 4409 (4503 for the session or connection limit) and the same reason.
Refusals are logged once per client address and kind, then not again for ten minutes; every
log line, whoever writes it, also passes one rate limit (``relay.logs``).

After the upgrade
-----------------
* Binary messages are sfchat frames: forwarded verbatim and in order to the other role; one over
  256 KiB arrives as a fragmented websocket message (the same bytes, as one message).
* Text messages are JSON control events and are sent by the relay only::

      {"event": "welcome", "session": NAME, "peer_present": bool}   first message, on join
      {"event": "peer_joined", "role": "tail"}                     the other role arrived
      {"event": "peer_left", "role": "tail"}                       the other role left
      {"event": "dropped", "reason": "no peer"}                    your frames are being dropped

  A frame sent while the other role is absent is dropped; the sender hears ``dropped`` once
  per absence. Nothing is buffered for an absent peer. Events travel in the same ordered
  queue as frames, so ``peer_left`` follows the last frame of the departed peer.
* A text message from a client closes that connection with 1003; a message over
  ``--max-frame-mb`` (default ``MAX_FRAME_BYTES``, below) closes it with 1009; more than
  ``--max-frames-per-s`` frames or ``--max-mb-per-s`` MiB per second (token buckets holding one
  second's worth, and at least four maximal frames) close it with 1008; a receiver that falls too
  far behind its bounded queue, or that the shared budget sheds when everything held reaches
  ``--max-buffer-mb``, is closed with 1013 (a sender shed mid-frame is cut instead, see Memory);
  a paired session in which neither peer sent anything for ``--idle-timeout`` minutes (a
  message, or a keepalive ping or pong: a peer that answers the pings is active; the time starts
  again when a partner joins) is the session's own deadline: both peers are closed together with
  4408, so a pair's slots belong to the pair until both leave or that deadline passes, and never
  is one of them handed to a squatter while the other waits. A peer waiting alone for its partner
  is never idle: it keeps its slot as long as it answers the keepalive pings (sent every
  ``ping_interval``; no pong within ``ping_timeout`` closes it with 1011), so a squatter cannot
  wait for a waiting tail's slot to be given away. Other connections
  and sessions are unaffected.
* The relay never parses a frame, so it needs no trust in their contents: head and tail seal
  them end to end (``sfchat.link.secure``); the relay sees sizes and timing only.
* Once the tail leaves, the session keeps its head and a new tail may join (and vice versa).
  A session disappears when both roles have left.
* On SIGTERM or SIGINT the relay closes every connection with 1001 and exits 0.

Largest frame
-------------
``MAX_FRAME_BYTES`` (12 MiB) holds the largest sealed frame the sfchat protocol can produce,
whatever the HELLO says, for the protocol maximum chosen here: a FORWARD carries at most 512
positions (``PREFILL_CHUNK``: prefill chunks; a tree frame has at most 256 nodes) of at most
16 KiB of hidden state each (hidden_size <= 8192 in bf16/fp16, e.g. Qwen2.5-72B; or 4096 in
fp32), plus at most 64 bytes of per-position fields (token id, tree parent) and headers:
8.03 MiB of plaintext; sealing pads by less than 1/8 (to 9 MiB exactly) and adds 29 bytes. The
3 MiB above it are headroom kept from wire v3, whose frames also carried draft distributions.
A Qwen2.5-7B prefill chunk is 3.5 MiB, a 256-node tree 1.8 MiB. tests/test_relay_memory.py
recomputes the bound from ``sfchat.protocol.wire``, ``sfchat.link.padding`` and ``sfchat.link.secure``.

Memory
------
Every byte the relay holds for a client is counted against ``--max-buffer-mb``: frames queued
for a receiver, the frame being written to it with what its socket's write buffer may hold beside
it (see ``relay.session``: large frames go out in 256 KiB fragments taken from the frame, never
copied whole), frames still arriving (what websockets' parser holds of them) and frames received
but not yet forwarded. Nothing keeps a frame alive once it is delivered or dropped (see
``relay.gate`` for websockets' parser). Past the limit the largest holder of the client holding
the most is closed (see ``relay.budget``); a sender mid-frame is cut without a close frame.
RSS stays under rest + ``--max-buffer-mb`` + 2 frames + a few MiB: ``LINGER_FRAMES`` (1) frame
that a receiver shed politely may keep until its close completes (past that they are aborted),
one frame copied while websockets parses it (it unmasks a copy of the payload), and a few KiB per
connection (its state, at most ``relay.session.WRITE_LIMIT`` (16 KiB) left in its write buffer
between frames, at most ``relay.gate.MAX_REQUEST_BYTES`` (16 KiB) per pending handshake, one
256 KiB socket read). Measured (bench/relay_hostile.py slow, tests/relay/test_relay_memory.py):
12 sessions whose tails never read while their heads send 12 MiB frames, ``--max-buffer-mb 128``:
peak 150-156 MiB above rest against a bound of 160.

Connections and file descriptors
--------------------------------
See ``relay.gate``. Every accepted socket is counted until it closes; ``--max-pending``
connections in all, and ``--max-pending-per-ip`` per client address, may be in their handshake
(``--handshake-timeout`` seconds at most); a newcomer over a limit evicts the oldest pending
connection of the most crowded address. At start the relay raises its RLIMIT_NOFILE soft limit
as far as needed and allowed, and refuses to start when ``--max-connections`` + ``--max-pending``
+ ``FD_RESERVE`` (one accept batch, the listening sockets, the log) do not fit; sockets past
what the descriptors allow are aborted at accept. Every log line is rate limited (``relay.logs``).
"""



from __future__ import annotations

import asyncio
import hmac
import resource
import re
import ssl
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

from websockets.asyncio.server import Server, ServerConnection
from websockets.asyncio.server import serve as ws_serve
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from relay.banner import ws_url
from relay.budget import Budget, TokenBucket
from relay.gate import Gate, MeteredConnection
from relay.logs import LogOnce
from relay.session import ROLES, WRITE_LIMIT, Peer, Session, address, host, log, send_slack

SESSION_PATH = re.compile(r"/session/([A-Za-z0-9._-]{1,64})")
CLOSE_UNSUPPORTED_DATA = 1003
CLOSE_POLICY = 1008
CLOSE_IDLE = 4408
CLOSE_SLOT_TAKEN = 4409
CLOSE_RELAY_FULL = 4503
MAX_FRAME_BYTES = 12 << 20  # see "Largest frame"
LINGER_FRAMES = 1  # frames that closing receivers may keep while their close frame waits
ACCEPT_BACKLOG = 128  # asyncio accepts up to this many sockets in one go
FD_RESERVE = ACCEPT_BACKLOG + 64  # one accept batch, listening sockets, log, loop internals


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
    emulate_mbps: float = 0.0  # 0: no bandwidth limit
    max_sessions: int = 64
    max_connections: int = 256  # upgraded connections
    max_pending: int = 128  # connections in their handshake, all addresses together
    max_pending_per_host: int = 8
    max_sessions_per_client: int = 8  # sessions a client address takes part in
    max_connections_per_client: int = 16  # upgraded connections from one client address
    max_frame_bytes: int = MAX_FRAME_BYTES
    # Generous: a round is two frames of ~64 KB (Qwen2.5-7B, K=8), a prefill chunk a few MB.
    max_frames_per_s: float = 2000.0
    max_bytes_per_s: float = 512 << 20
    max_buffer_bytes: int = 1 << 30  # every byte held for clients: outboxes and inbound frames
    idle_timeout: float = 30 * 60.0  # seconds without a message from the client; 0 = never
    ping_interval: float = 20.0  # generous: a WAN spike must not kill a long generation
    ping_timeout: float = 60.0
    close_timeout: float = 3.0  # bounds shutdown when a peer never answers the close frame
    open_timeout: float = 10.0  # a client that never finishes its handshake is dropped after this
    max_queue: int = 4  # websockets' per-connection receive buffer, in frames (bounds memory)


class Relay:
    """A listening relay: the websockets server plus the live sessions."""

    def __init__(self, config: RelayConfig):
        self.config = config
        self.sessions: dict[str, Session] = {}
        self.connections: set[ServerConnection] = set()  # upgraded and not yet handled to the end
        frame = config.max_frame_bytes
        self.budget = Budget(config.max_buffer_bytes, linger=LINGER_FRAMES * (frame + send_slack(frame)))
        self.refused = LogOnce()
        self.gate: Gate | None = None
        self._server: Server | None = None

    async def start(self) -> None:
        c = self.config
        max_open = descriptor_room(c.max_connections + c.max_pending)
        self.gate = gate = Gate(self.budget, self.refused, max_open, c.max_pending, c.max_pending_per_host)

        def connection(protocol, server, **options) -> MeteredConnection:
            return MeteredConnection(protocol, server, gate=gate, **options)

        self._server = await ws_serve(
            self._handle, c.host, c.port, ssl=c.ssl, process_request=self._check_request,
            compression=None, max_size=c.max_frame_bytes, max_queue=c.max_queue, write_limit=WRITE_LIMIT,
            open_timeout=c.open_timeout,
            ping_interval=c.ping_interval, ping_timeout=c.ping_timeout, close_timeout=c.close_timeout,
            create_connection=connection, backlog=ACCEPT_BACKLOG,
        )

    @property
    def port(self) -> int:
        return self._server.sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return ws_url(self.config.host, self.port, self.config.ssl is not None)

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
        refusal = self._refusal(name, role, ws.client)
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

    def _refusal(self, name: str, role: str, client: str) -> tuple[int, str] | None:
        c = self.config
        if len(self.connections) >= c.max_connections:
            return 503, f"relay is full ({c.max_connections} connections)"
        session = self.sessions.get(name)
        if session is not None and role in session.peers:
            return 409, f"session {name} already has a {role}"
        if session is None and len(self.sessions) >= c.max_sessions:
            return 503, f"relay is full ({c.max_sessions} sessions)"
        if sum(ws.client == client for ws in self.connections) >= c.max_connections_per_client:
            return 503, f"too many connections from your address ({c.max_connections_per_client} at most)"
        joined = {s.name for s in self.sessions.values() if any(p.client == client for p in s.peers.values())}
        if name not in joined and len(joined) >= c.max_sessions_per_client:
            return 503, f"too many sessions from your address ({c.max_sessions_per_client} at most)"
        return None

    async def _handle(self, ws: MeteredConnection) -> None:
        self.gate.settle(ws)  # upgraded: no longer counts against the handshake limits
        name, role = ws.sfchat_slot
        # The HTTP check ran before the upgrade; another client may have taken the slot since.
        refusal = self._refusal(name, role, ws.client)
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

    async def _join(self, ws: MeteredConnection, name: str, role: str) -> None:
        session = self.sessions.setdefault(name, Session(name))
        # Room for a few maximal frames in flight, so one large prefill chunk never overflows.
        peer = Peer(ws, role, name, max_queued_bytes=4 * self.config.max_frame_bytes, budget=self.budget,
                    client=ws.client)
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

    async def _pump_from(self, ws: MeteredConnection, session: Session, peer: Peer) -> None:
        c = self.config
        frames = TokenBucket(c.max_frames_per_s, c.max_frames_per_s)
        volume = TokenBucket(c.max_bytes_per_s, max(c.max_bytes_per_s, 4 * c.max_frame_bytes))
        loop = asyncio.get_running_loop()
        idle = c.idle_timeout

        def active(p: Peer) -> float:
            return max(p.last_heard, p.ws.last_frame)

        def idle_until() -> float | None:
            if not idle:
                return None
            partner = session.partner(peer)
            if partner is None:  # waiting alone is not idleness: look again later
                return loop.time() + idle
            return max(active(peer), active(partner), session.paired_at) + idle

        try:
            while True:
                try:
                    async with asyncio.timeout_at(idle_until()) as quiet:
                        while await self._take(ws, session, peer, frames, volume):
                            quiet.reschedule(idle_until())
                    return
                except TimeoutError:
                    if idle_until() > loop.time():
                        continue  # alone now, a partner joined, or a keepalive came meanwhile
                    self.refused(host(ws), "idle", "session %s: %s at %s and its partner sent nothing for %g min",
                                 session.name, peer.role, peer.address, idle / 60)
                    # the pair's slots are the pair's: both go at once, none is left to a squatter
                    reason = f"idle for {idle / 60:g} min: closed by the relay"
                    partner = session.partner(peer)
                    await asyncio.gather(peer.close(CLOSE_IDLE, reason),
                                         *([partner.close(CLOSE_IDLE, reason)] if partner else []))
                    return
        except ConnectionClosed:
            pass  # oversize frame, lost connection, shutdown: the close code says which

    async def _take(self, ws: MeteredConnection, session: Session, peer: Peer, frames: TokenBucket,
                    volume: TokenBucket) -> bool:
        """Receive one message and forward it; False once ``ws`` is closed for it. The message
        is referenced only while this runs."""
        c = self.config
        message = await ws.recv()
        ws.consumed(len(message) if isinstance(message, bytes) else len(message.encode()))
        peer.last_heard = asyncio.get_running_loop().time()
        if isinstance(message, str):
            await peer.close(CLOSE_UNSUPPORTED_DATA, "text messages are reserved for the relay; send binary frames")
            return False
        if not (frames.take(1) and volume.take(len(message))):
            self.refused(host(ws), "rate", "session %s: %s at %s exceeded %g frames/s or %g MiB/s",
                         session.name, peer.role, peer.address, c.max_frames_per_s, c.max_bytes_per_s / (1 << 20))
            await peer.close(CLOSE_POLICY, "rate limit exceeded: this side sends too fast")
            return False
        session.forward(peer, message, c.emulate_rtt_ms / 2000.0, c.emulate_mbps * 1e6 / 8)
        return True


def descriptor_room(connections: int) -> int:
    """How many sockets may be open at once: RLIMIT_NOFILE (raised towards what ``connections``
    need, as far as the hard limit allows) less ``FD_RESERVE``; StartupError when too few."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = connections + FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < want:
        raised = want if hard == resource.RLIM_INFINITY else min(want, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
        except (OSError, ValueError):
            pass
    if soft == resource.RLIM_INFINITY:
        return connections
    if soft < want:
        raise StartupError(f"--max-connections plus --max-pending need {want} file descriptors "
                           f"({FD_RESERVE} kept in reserve) but ulimit -n allows {soft}: raise it or lower them")
    return soft - FD_RESERVE


async def serve(config: RelayConfig) -> Relay:
    """Start a relay listening as ``config`` says; close it with ``close()`` + ``wait_closed()``."""
    relay = Relay(config)
    await relay.start()
    return relay

