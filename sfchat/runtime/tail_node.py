"""The ``sfchat --tail`` process: a Verifier behind a relay link, serving one head after another.

Contract: ``serve(settings)`` dials the relay as the session's tail, waits for a head, feeds
every frame to the ``Verifier`` and sends its replies back. A head that leaves (or breaks the
protocol) ends only that conversation: the tail keeps its loaded model (a next head with the
same hello reuses it) and waits for the next head. A stats line is logged now and then.
Returns only on a fatal link error or Ctrl+C.
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
    while True:
        link = RelayLink(s.relay, s.token, s.session, "tail")
        log(f"connected to {s.relay} as the tail of session {s.session!r}; waiting for a head")
        try:
            _serve_link(link, verifier, once)
            return 0
        except LinkClosed as exc:
            log(f"relay connection lost: {exc}; reconnecting")
            time.sleep(1.0)
        finally:
            link.close()


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
