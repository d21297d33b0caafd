"""The ``sfchat --tail`` process: a Verifier behind a relay link, serving one head after another.

Contract: ``serve(settings)`` dials the relay as the session's tail, waits for a head, feeds
every frame to the ``Verifier`` and sends its replies back. A head that leaves (or breaks the
protocol) ends only that conversation: the tail keeps its loaded model (a next head with the
same hello reuses it) and waits for the next head. A stats line is logged now and then.
A lost relay connection is re-dialled with backoff, forever: the tail is meant to be left
running in a notebook. Returns only on Ctrl+C (or, in tests, after one head with ``once``).
"""

from __future__ import annotations

import sys
import time

from sfchat import UserError
from sfchat.config import Settings
from sfchat.relay_link import LinkClosed, PeerGone, RelayLink
from sfchat.runtime.session import resolve_device
from sfchat.runtime.tail import TailError, Verifier

STATS_EVERY_S = 30.0


def log(msg: str) -> None:
    print(f"[sfchat tail {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def serve(s: Settings, once: bool = False) -> int:
    if not s.relay:
        raise UserError("--tail needs --relay URL (and --token, --session)")
    if not s.token:
        raise UserError("--tail needs the relay token: --token T or SFCHAT_TOKEN")
    verifier = Verifier(resolve_device(s.device), log=log)
    link = RelayLink(s.relay, s.token, s.session, "tail")  # a first failure is the user's to fix
    while True:
        log(f"connected to {s.relay} as the tail of session {s.session!r}; waiting for a head")
        try:
            _serve_link(link, verifier, once)
            return 0
        except LinkClosed as exc:
            log(f"relay connection lost: {exc}; reconnecting")
        finally:
            link.close()
        link = _reconnect(s)


def _reconnect(s: Settings) -> RelayLink:
    """Dial the relay again with backoff until it answers (a restarted relay, a WAN outage)."""
    delay = 0.5
    while True:
        try:
            return RelayLink(s.relay, s.token, s.session, "tail")
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
