"""``sfchat-relay``: the command line, the startup banner and the process around a ``Relay``.

Contract
--------
``main(argv)`` parses the flags (every one described in ``--help``; a bad one is one error line
and exit 2), installs the rate-limited log handler (``relay.logs``) for every logger, runs the
relay until SIGTERM or SIGINT and returns 0; a startup mistake (bad certificate, port in use,
too few file descriptors for the limits asked) is one line on stderr and exit 2. The handshake,
limits and memory accounting are documented in ``relay.server``.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import logging
import os
import secrets
import shlex
import signal
import socket
import ssl
import sys

from relay.logs import RateLimitedHandler
from relay.server import MAX_FRAME_BYTES, Relay, RelayConfig, StartupError, _url, log, serve

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
    p.add_argument("--max-sessions", type=_bounded(int, 1), default=d.max_sessions,
                   help=f"sessions (head/tail pairs, or one side waiting) at most; a client that would "
                        f"open one more is refused with 503 (default {d.max_sessions})")
    p.add_argument("--max-connections", type=_bounded(int, 2), default=d.max_connections,
                   help=f"open websocket connections at most (default {d.max_connections})")
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
                   help=f"close connections that send nothing for MIN minutes; 0 = never "
                        f"(default {d.idle_timeout / 60:g})")
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
    token = args.token or secrets.token_urlsafe(24)
    try:
        config = RelayConfig(
            token=token, host=args.host, port=args.port,
            ssl=_tls_context(args.certfile, args.keyfile), emulate_rtt_ms=args.emulate_rtt_ms,
            max_sessions=args.max_sessions, max_frame_bytes=int(args.max_frame_mb * (1 << 20)),
            max_connections=args.max_connections, max_pending=args.max_pending,
            max_pending_per_host=args.max_pending_per_ip, open_timeout=args.handshake_timeout,
            max_frames_per_s=args.max_frames_per_s,
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
