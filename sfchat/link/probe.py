"""What can be checked of a relay before anything is asked for or loaded.

Contract
--------
``check_url(url)`` returns the parts of a well-formed relay URL (``ws://`` or ``wss://``, a host,
a port in 1..65535 when one is given, no query or fragment) or raises ``UserError`` naming what
is wrong with it; ``check_session(name)`` does the same for a session name. ``probe(url, token,
session, role, timeout)`` asks the relay over plain HTTP(S), without opening a websocket, so no
session slot is taken: ``GET /healthz`` must answer 200 ``ok``, then a ``GET`` of the session's
path with the token, which the relay answers 401 before anything else when the token is wrong
(any other status means the token was taken). A relay that cannot be reached, does not answer in
``timeout`` seconds, speaks TLS where ``ws://`` was given (or not where ``wss://`` was), or is no
sfchat relay, raises a ``UserError`` of one line that says what happened and what to check
(``HINT``). Text from the relay is passed through ``sfchat.plaintext.plain``. Torch-free.
"""

from __future__ import annotations

import http.client
import re
import socket
import ssl
from typing import NamedTuple
from urllib.parse import quote, urlsplit

from sfchat import UserError
from sfchat.plaintext import plain

SESSION_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
HINT = ("check the host and port, that sfchat-relay runs there, that no firewall blocks the port, "
        "and ws:// (a relay without --certfile) vs wss:// (with it)")
PROBE_TIMEOUT_S = 10.0


class RelayAddress(NamedTuple):
    url: str
    tls: bool
    host: str
    port: int
    path: str  # without a trailing slash


def check_url(url: str) -> RelayAddress:
    """The parts of a relay URL, or a UserError saying what is wrong with it."""
    shape = "must look like ws://HOST:PORT or wss://HOST:PORT"
    parts = urlsplit(url.strip())
    if parts.scheme not in ("ws", "wss"):
        scheme = f"has the scheme {parts.scheme!r}" if parts.scheme else "has no scheme"
        raise UserError(f"relay URL {plain(url)!r} {scheme}: it {shape}")
    try:
        port = parts.port
    except ValueError:
        raise UserError(f"relay URL {plain(url)!r} has a port that is no number in 1..65535: it {shape}") from None
    if not parts.hostname:
        raise UserError(f"relay URL {plain(url)!r} names no host: it {shape}")
    if port == 0 or parts.query or parts.fragment:
        raise UserError(f"relay URL {plain(url)!r} {shape} (a port of 1..65535, no '?' or '#' part)")
    tls = parts.scheme == "wss"
    return RelayAddress(url, tls, parts.hostname, port or (443 if tls else 80), parts.path.rstrip("/"))


def check_session(name: str) -> None:
    if not SESSION_NAME.fullmatch(name):
        raise UserError(f"session name {plain(name)!r} must be 1..64 characters of [A-Za-z0-9._-]")


def probe(url: str, token: str, session: str, role: str, timeout: float = PROBE_TIMEOUT_S,
          ssl_context: ssl.SSLContext | None = None) -> None:
    """The relay at ``url`` answers as an sfchat relay and takes ``token`` (see the module docstring)."""
    where = check_url(url)
    check_session(session)
    status, body = _get(where, "/healthz", {}, timeout, ssl_context)
    if status != 200 or body.strip() != "ok":
        raise UserError(f"{where.host}:{where.port} answers HTTP, but not as an sfchat relay (GET /healthz "
                        f"answered {status}): {HINT}")
    status, _ = _get(where, f"/session/{quote(session)}?role={role}", {"Authorization": f"Bearer {token}"},
                     timeout, ssl_context)
    if status == 401:
        raise UserError(f"the relay at {where.url} refused the token (HTTP 401): use the token the relay printed "
                        "(SFCHAT_TOKEN)")


def _get(where: RelayAddress, path: str, headers: dict, timeout: float, context) -> tuple[int, str]:
    kind = http.client.HTTPSConnection if where.tls else http.client.HTTPConnection
    options = {"context": context or ssl.create_default_context()} if where.tls else {}
    connection = kind(where.host, where.port, timeout=timeout, **options)
    try:
        connection.request("GET", where.path + path, headers=headers)
        response = connection.getresponse()
        return response.status, response.read(256).decode("utf-8", "replace")
    except OSError as exc:
        raise UserError(f"cannot reach the relay at {where.url}: {_why(exc, where, timeout)}; {HINT}") from None
    except http.client.HTTPException:
        tls = " (a TLS server: use wss://?)" if not where.tls else ""
        raise UserError(f"{where.host}:{where.port} does not answer like an HTTP server{tls}; {HINT}") from None
    finally:
        connection.close()


def _why(exc: OSError, where: RelayAddress, timeout: float) -> str:
    """One phrase for what a failed connection says."""
    if isinstance(exc, socket.gaierror):
        return f"no address found for the host {where.host!r}"
    if isinstance(exc, ConnectionRefusedError):
        return f"nothing listens on port {where.port} of {where.host}"
    if isinstance(exc, TimeoutError):
        return f"no answer within {timeout:g} s (a firewall dropping the packets?)"
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"its TLS certificate is not trusted ({plain(exc.verify_message or exc)})"
    if isinstance(exc, ssl.SSLError):
        return f"TLS failed ({plain(exc.reason or exc)}: a relay that speaks ws://, not wss://?)"
    if isinstance(exc, ConnectionResetError) and not where.tls:
        return "the connection was reset (a relay that speaks wss://, not ws://?)"
    return plain(exc.strerror or exc)
