"""The ``sfchat --tail`` process: a Verifier behind a relay link, serving one head after another.

Contract: ``serve(settings)`` dials the relay as the session's tail, waits for a head, feeds
every frame to the ``Verifier`` and sends its replies back. A head that leaves (or breaks the
protocol) ends only that conversation: the tail keeps its loaded model (a next head with the
same hello reuses it) and waits for the next head. A stats line is logged now and then.
A lost relay connection is re-dialled with backoff, forever: the tail is meant to be left
running in a notebook. Returns only on Ctrl+C (or, in tests, after one head with ``once``).
With a session secret every frame is sealed end to end (``sfchat.secure_link``); a frame that
fails its integrity check ends that head's session (the head is told, and the tail re-dials with
fresh keys).
"""

from __future__ import annotations

import sys
import time

from sfchat import UserError, wire
from sfchat.config import Settings
from sfchat.relay_link import LinkClosed, PeerGone, RelayLink
from sfchat.runtime.session import resolve_devices
from sfchat.runtime.tail import TailError, Verifier
from sfchat.secure_link import IntegrityError, PlaintextPeer, SecretMismatch, SecureLink, require_secret

STATS_EVERY_S = 30.0


def log(msg: str) -> None:
    print(f"[sfchat tail {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def serve(s: Settings, once: bool = False) -> int:
    if not s.relay:
        raise UserError("--tail needs --relay URL (and --token, --session)")
    if not s.token:
        raise UserError("--tail needs the relay token: --token T or SFCHAT_TOKEN")
    require_secret(s.secret, s.insecure)
    devices = resolve_devices(s.device)
    verifier = Verifier(devices[0], log=log, devices=devices)
    link = _dial(s)  # a first failure is the user's to fix
    while True:
        log(f"connected to {s.relay} as the tail of session {s.session!r}; waiting for a head")
        try:
            _serve_link(link, verifier, once)
            return 0
        except IntegrityError as exc:
            log(f"{exc}; ending this head's session")
            _tell_head(link, exc)
            if once:
                return 1
        except LinkClosed as exc:
            log(f"relay connection lost: {exc}; reconnecting")
        finally:
            link.close()
        link = _reconnect(s)


def _dial(s: Settings):
    link = RelayLink(s.relay, s.token, s.session, "tail")
    return SecureLink(link, s.secret, s.session, "tail") if s.secret else link


def _tell_head(link, exc: IntegrityError) -> None:
    """Best effort: an ERROR the head can show (in clear text to a head that does not encrypt)."""
    plain = isinstance(exc, PlaintextPeer)
    if isinstance(exc, SecretMismatch) and not plain:
        return  # the head learns it from this tail's key exchange
    message = "this tail encrypts end to end: start the head with the tail's --secret" if plain else str(exc)
    frame = wire.encode(wire.Control(wire.MsgType.ERROR, {"message": message}))
    try:
        if plain:
            link.inner.send(frame)
        elif link.keyed:
            link.send(frame)
    except LinkClosed:
        pass


def _reconnect(s: Settings) -> "RelayLink | SecureLink":
    """Dial the relay again with backoff until it answers (a restarted relay, a WAN outage)."""
    delay = 0.5
    while True:
        try:
            return _dial(s)
        except UserError as exc:
            log(f"relay not reachable ({exc}); retrying in {delay:.1f} s")
            time.sleep(delay)
            delay = min(delay * 2, 10.0)


def _serve_link(link: RelayLink, verifier: Verifier, once: bool) -> None:
    last_stats, rounds_then = time.monotonic(), verifier.rounds
    while True:
        try:
            verifier.handle(link.recv(timeout=STATS_EVERY_S), link.send)
        except TimeoutError:
            pass
        except PeerGone:
            log("the head left; waiting for the next head")
            if once:
                return
        except TailError as exc:
            log(f"refused a frame from the head: {exc}")
        now = time.monotonic()
        if now - last_stats >= STATS_EVERY_S:
            done = verifier.rounds - rounds_then
            if done:
                log(f"{done} rounds verified in the last {now - last_stats:.0f} s")
            last_stats, rounds_then = now, verifier.rounds
