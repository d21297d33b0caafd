"""``sfchat-relay``: the command line and the process around a ``Relay``.

Contract
--------
``main(argv)`` parses the flags (every one described in ``--help``; a bad one, a number that is
not finite or out of its range among them, is one error line and exit 2; ``--token`` on the command line is accepted with a warning that ``ps`` shows it),
installs the rate-limited log handler (``relay.logs``) for every logger, prints the startup
banner (``relay.banner``) once listening, runs the relay until SIGTERM or SIGINT and returns 0;
a startup mistake (bad certificate, port in use, too few file descriptors for the limits asked)
is one line on stderr and exit 2. The handshake, limits and memory accounting are documented in
``relay.server``.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import logging
import math
import os
import secrets
import signal
import ssl
import sys
from urllib.parse import urlsplit

from relay.banner import banner
from relay.logs import RateLimitedHandler
from relay.server import MAX_FRAME_BYTES, RelayConfig, StartupError, log, serve

MAX_EMULATED_RTT_MS = 10_000.0  # a WAN round trip past 10 s is no link to rehearse
EMULATED_MBPS = (0.1, 100_000.0)  # below 0.1 Mbit/s one large frame takes most of a minute


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        # One line, no usage block: the relay often runs under a process manager's log.
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _bounded(kind, low, high=None, off=None):
    """A flag's parser: a finite number in ``low..high`` (``off``, when given, is allowed too)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text} is not a finite number")
        if value != off and (value < low or (high is not None and value > high)):
            limit = f"{low:g}..{high:g}" if high is not None else f">= {low:g}"
            raise argparse.ArgumentTypeError(f"{text} is out of range ({limit}{f', or {off:g}' if off is not None else ''})")
        return value
    return parse


def _relay_url(text: str) -> str:
    parts = urlsplit(text)
    if parts.scheme not in ("ws", "wss") or not parts.hostname or not text.isprintable():
        raise argparse.ArgumentTypeError(f"{text!r} is not a ws://HOST:PORT or wss://HOST URL")
    return text.rstrip("/")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="sfchat-relay", description="Pair sfchat heads and tails by session name "
                                                 "and forward their frames.")
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    p.add_argument("--port", type=_bounded(int, 0, 65535), default=8765,
                   help="port to listen on; 0 picks a free one (default 8765)")
    p.add_argument("--token", help="shared secret clients must present (default: $SFCHAT_TOKEN, else one "
                                   "generated for this run); on the command line every user of this machine "
                                   "can read it (ps): prefer the environment")
    p.add_argument("--public-url", type=_relay_url, metavar="URL",
                   help="the address other machines reach this relay by (e.g. wss://relay.example.com behind "
                        "a TLS proxy, ws://203.0.113.7:8765 behind NAT): used in the printed commands")
    p.add_argument("--certfile", help="TLS certificate (PEM) to serve wss://")
    p.add_argument("--keyfile", help="TLS private key (PEM), if not inside --certfile")
    p.add_argument("--emulate-rtt-ms", type=_bounded(float, 0.0, MAX_EMULATED_RTT_MS), default=0.0, metavar="MS",
                   help=f"for benchmarks only: delay every forwarded frame by MS/2 each way, to rehearse a WAN "
                        f"locally (0..{MAX_EMULATED_RTT_MS:g}; default 0: no delay)")
    p.add_argument("--emulate-mbps", type=_bounded(float, *EMULATED_MBPS, off=0.0), default=0.0, metavar="MBIT",
                   help=f"for benchmarks only: carry each direction at MBIT megabits per second, one frame after "
                        f"another, to rehearse a WAN's bandwidth locally ({EMULATED_MBPS[0]:g}..{EMULATED_MBPS[1]:g}; "
                        f"default 0: unlimited)")
    d = RelayConfig(token="")
    p.add_argument("--max-sessions", type=_bounded(int, 1), default=d.max_sessions,
                   help=f"sessions (head/tail pairs, or one side waiting) at most; a client that would "
                        f"open one more is refused with 503 (default {d.max_sessions})")
    p.add_argument("--max-connections", type=_bounded(int, 2), default=d.max_connections,
                   help=f"open websocket connections at most (default {d.max_connections})")
    p.add_argument("--max-sessions-per-ip", type=_bounded(int, 1), default=d.max_sessions_per_client,
                   help=f"sessions one client address (an IPv6 address: its /64) may take part in; one more "
                        f"is refused with 503 (default {d.max_sessions_per_client})")
    p.add_argument("--max-connections-per-ip", type=_bounded(int, 1), default=d.max_connections_per_client,
                   help=f"open websocket connections from one client address (an IPv6 address: its /64) "
                        f"(default {d.max_connections_per_client})")
    p.add_argument("--max-pending", type=_bounded(int, 1), default=d.max_pending,
                   help=f"TCP connections still in their handshake, all addresses together; a newcomer "
                        f"past it closes the oldest of the most crowded address (default {d.max_pending})")
    p.add_argument("--max-pending-per-ip", type=_bounded(int, 1), default=d.max_pending_per_host,
                   help=f"the same, per client address (default {d.max_pending_per_host})")
    p.add_argument("--handshake-timeout", type=_bounded(float, 0.1), default=d.open_timeout, metavar="S",
                   help=f"close a connection whose TLS and websocket handshake take longer than S seconds "
                        f"(default {d.open_timeout:g})")
    p.add_argument("--max-frame-mb", type=_bounded(float, 0.001), default=MAX_FRAME_BYTES / (1 << 20),
                   help=f"largest message accepted, in MiB (default {MAX_FRAME_BYTES >> 20}: the largest "
                        f"sealed frame of the protocol, see relay/server.py)")
    p.add_argument("--max-frames-per-s", type=_bounded(float, 1.0), default=d.max_frames_per_s,
                   help=f"per connection; faster senders are closed (default {d.max_frames_per_s:g})")
    p.add_argument("--max-mb-per-s", type=_bounded(float, 0.001), default=d.max_bytes_per_s / (1 << 20),
                   help=f"per connection, in MiB; faster senders are closed (default {d.max_bytes_per_s >> 20})")
    p.add_argument("--max-buffer-mb", type=_bounded(float, 1.0), default=d.max_buffer_bytes / (1 << 20),
                   help=f"bytes held for all clients together (queued frames and frames still "
                        f"arriving), in MiB (default {d.max_buffer_bytes >> 20})")
    p.add_argument("--idle-timeout", type=_bounded(float, 0.0), default=d.idle_timeout / 60, metavar="MIN",
                   help=f"close both peers of a pair in which neither sent anything, keepalive pings and "
                        f"pongs included, for MIN minutes; one waiting alone for its partner keeps its slot "
                        f"while it answers the keepalive pings; 0 = never (default {d.idle_timeout / 60:g})")
    p.add_argument("--log-level", default="INFO", type=str.upper,
                   choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help="least severe log records written to stderr; every line is rate limited "
                        "whatever the level (default INFO)")
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


async def _run(config: RelayConfig, token_generated: bool, token_on_command_line: bool,
               public_url: str | None) -> None:
    try:
        relay = await serve(config)
    except OSError as exc:
        raise StartupError(f"cannot listen on {config.host}:{config.port}: {exc.strerror or exc}") from None
    if config.emulate_rtt_ms or config.emulate_mbps:
        log.warning("this relay delays frames on purpose (--emulate-rtt-ms, --emulate-mbps): for benchmarks only")
    if token_on_command_line:
        log.warning("--token on the command line is visible to every user of this machine (ps, /proc): "
                    "set SFCHAT_TOKEN instead")
    c = relay.config
    print(banner(c.host, relay.port, c.ssl is not None, c.token, token_generated, c.emulate_rtt_ms, public_url,
                 emulate_mbps=c.emulate_mbps),
          flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    log.info("shutting down: closing %d session(s)", len(relay.sessions))
    relay.close()
    await relay.wait_closed()


def _return_freed_memory() -> None:
    """Make glibc hand large freed buffers back to the system at once. Its mmap threshold grows
    to the size of the largest buffer freed (up to 32 MiB), after which frames are carved from
    the heap; a fixed threshold keeps every buffer over 256 KiB a mapping of its own, unmapped
    when freed (under the partial-frame attack of tests/test_relay_memory.py: peak 76 MiB
    instead of 86 for a 48 MiB budget)."""
    try:
        ctypes.CDLL(None).mallopt(-3, 256 << 10)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass  # not glibc: nothing to tune


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    handler = RateLimitedHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    logging.basicConfig(level=args.log_level, handlers=[handler])
    _return_freed_memory()
    # websockets logs every handshake at INFO; our own join/leave/refusal lines replace those.
    logging.getLogger("websockets").setLevel(max(logging.getLevelName(args.log_level), logging.WARNING))
    chosen = args.token or os.environ.get("SFCHAT_TOKEN")
    token = chosen or secrets.token_urlsafe(24)
    try:
        config = RelayConfig(
            token=token, host=args.host, port=args.port,
            ssl=_tls_context(args.certfile, args.keyfile), emulate_rtt_ms=args.emulate_rtt_ms,
            emulate_mbps=args.emulate_mbps,
            max_sessions=args.max_sessions, max_frame_bytes=int(args.max_frame_mb * (1 << 20)),
            max_connections=args.max_connections, max_pending=args.max_pending,
            max_sessions_per_client=args.max_sessions_per_ip,
            max_connections_per_client=args.max_connections_per_ip,
            max_pending_per_host=args.max_pending_per_ip, open_timeout=args.handshake_timeout,
            max_frames_per_s=args.max_frames_per_s,
            max_bytes_per_s=args.max_mb_per_s * (1 << 20), max_buffer_bytes=int(args.max_buffer_mb * (1 << 20)),
            idle_timeout=args.idle_timeout * 60,
        )
        asyncio.run(_run(config, token_generated=not chosen, token_on_command_line=args.token is not None,
                         public_url=args.public_url))
    except StartupError as exc:
        print(f"sfchat-relay: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
