"""The ``sfchat --tail`` process: a Verifier behind a relay link, serving one head after another.

Contract: ``serve(settings)`` dials the relay as the session's tail, waits for a head, feeds
every frame to the ``Verifier`` and sends its replies back. A head that leaves (or breaks the
protocol) ends only that conversation: the tail keeps its loaded model (a next head with the
same hello reuses it) and waits for the next head. A stats line is logged now and then.
A lost relay connection is re-dialled with backoff (up to ``REDIAL_MAX_S`` between tries), for as
long as the relay cannot be reached: the tail is meant to be left running in a notebook. A relay
that refuses the token (it restarted with a new one) is no outage: after ``TOKEN_REFUSALS``
refusals in a row the tail stops with an error that says so. Returns only on Ctrl+C (or, in
tests, with ``once``: after one head, or when the relay connection is lost, so that no tail
outlives its test and writes its log among the next tests' output).

The log (``sfchat.nodelog``): every line is ``plaintext.plain`` (a HELLO's model name, a peer's
error text) and all of them pass the process's one rate limit, so that no peer can make the tail
write more than it allows; lines left out are counted in the next one shown.

Pairing (``sfchat.link.secure``, ``sfchat.link.pairer``): without a code of its own the tail
makes one (``7-crossover-clockwork``), prints it and pairs with the head that types it; the code
stays the same for the tail's whole life, whatever strangers try (code attempts wait for their
turn in ``pairing.Passcode``'s budget instead). A code pairing leaves a resumption secret, kept
in ``resume_path(settings)`` (``SFCHAT_STATE_DIR``, else the platform's user state directory;
one file per session name, 0600): a restarted tail reads it back, prints a new code for new
heads, and the head it served before pairs again without one. Nothing a peer sends makes the
tail give up its relay connection (which would free its slot for someone else): a failed or
forged pairing is answered and counted, an integrity error of a paired session ends that head's
session only (the head is told), and the same connection waits for the next head. Local model
directories are opened only inside ``--models-dir``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import platformdirs

from sfchat import UserError
from sfchat.config import Settings
from sfchat.link.pairing import Passcode, require_secret
from sfchat.link import LinkClosed, PeerGone
from sfchat.link.relay import RelayLink, TokenRefused
from sfchat.link.resume import ResumeFile
from sfchat.model.devices import resolve_devices
from sfchat.engine.verifier import TailError, Verifier
from sfchat.node.tail_loader import TailLoader
from sfchat.protocol.messages import Failure
from sfchat.link.secure import IntegrityError, PlaintextPeer, SecureLink
from sfchat.nodelog import node_log

STATS_EVERY_S = 30.0
REDIAL_MAX_S = 10.0  # the longest wait between two dials of an unreachable relay
TOKEN_REFUSALS = 4  # refusals of the token in a row after which the tail stops
log = node_log("tail")


def show_code(code: str) -> None:
    log(f"pairing code: {code}   (on the head: type it when asked, or set SFCHAT_CODE)")


def resume_path(s: Settings) -> Path:
    """Where the tail of ``s.session`` keeps its resumption secret."""
    state = os.environ.get("SFCHAT_STATE_DIR") or platformdirs.user_state_dir("sfchat")
    return Path(state).expanduser() / f"tail-{s.session}.resume"


def models_dirs(s: Settings) -> list[Path]:
    return [Path(p).expanduser() for p in (s.models_dir or "").split(os.pathsep) if p]


def serve(s: Settings, once: bool = False) -> int:
    if not s.relay:
        raise UserError("--tail needs --relay URL (and --token, --session)")
    if not s.token:
        raise UserError("--tail needs the relay token: SFCHAT_TOKEN (or --token T)")
    require_secret(s.secret, s.insecure, role="tail")
    devices = resolve_devices(s.device)
    verifier = Verifier(TailLoader(devices[0], devices, models_dirs(s), log), log=log)
    passcode = resumption = None
    if not s.insecure:
        passcode, resumption = Passcode(s.secret), ResumeFile(resume_path(s), log)
        if passcode.generated:
            show_code(passcode.code)
        if resumption.secret is not None:
            log(f"the head this tail paired with last resumes without a code (its secret: {resumption.path})")
    link = _dial(s, passcode, resumption)  # a first failure is the user's to fix
    try:
        while True:
            log(f"connected to {s.relay} as the tail of session {s.session!r}; waiting for a head")
            try:
                _serve_link(link, verifier, once)
                return 0
            except IntegrityError as exc:
                log(f"{exc}; ending this head's session")
                served = link.keyed or isinstance(exc, PlaintextPeer)  # a head got an answer
                _tell_head(link, exc)
                if once and served:
                    return 1
                link.restart()  # same relay connection: a meddler must not free the tail's slot
            except LinkClosed as exc:
                if once:
                    log(f"relay connection lost: {exc}; stopping (once)")
                    return 1
                log(f"relay connection lost: {exc}; reconnecting")
                link.close()
                link = _reconnect(s, passcode, resumption)
    finally:
        link.close()


def _dial(s: Settings, passcode: Passcode | None, resumption: ResumeFile | None):
    link = RelayLink(s.relay, s.token, s.session, "tail")
    if passcode is None:
        return link
    return SecureLink(link, passcode, s.session, "tail", log=log, resumption=resumption)


def _tell_head(link, exc: IntegrityError) -> None:
    """Best effort: an ERROR the head can show (in clear text to a head that does not encrypt)."""
    plain = isinstance(exc, PlaintextPeer)
    message = "this tail encrypts end to end: start the head with the tail's pairing code" if plain else str(exc)
    frame = Failure(message).to_frame()
    try:
        if plain:
            link.inner.send(frame)
        elif link.keyed:
            link.send(frame)
    except LinkClosed:
        pass


def _reconnect(s: Settings, passcode: Passcode | None, resumption: ResumeFile | None) -> "RelayLink | SecureLink":
    """Dial the relay again with backoff until it answers (a restarted relay, a WAN outage); a
    relay that keeps refusing the token ends the tail (a UserError)."""
    delay, refusals = 0.5, 0
    while True:
        try:
            return _dial(s, passcode, resumption)
        except TokenRefused as exc:
            refusals += 1
            if refusals >= TOKEN_REFUSALS:
                raise UserError(f"{exc} {refusals} times in a row: the relay runs with another token now (it "
                                "restarted?); give this tail the relay's token (SFCHAT_TOKEN) and start it again") \
                    from None
            log(f"{exc}: the relay may have restarted with a new token; trying again in {delay:.1f} s "
                f"({TOKEN_REFUSALS - refusals} more tries)")
        except UserError as exc:
            refusals = 0
            log(f"relay not reachable ({exc}); retrying in {delay:.1f} s")
        time.sleep(delay)
        delay = min(delay * 2, REDIAL_MAX_S)


def _serve_link(link: RelayLink, verifier: Verifier, once: bool) -> None:
    last_stats, rounds_then = time.monotonic(), verifier.rounds
    served = False  # with ``once``: a head that only failed to pair does not count
    while True:
        try:
            frame = link.recv(timeout=STATS_EVERY_S)
            served = True
            verifier.handle(frame, link.send)
        except TimeoutError:
            pass
        except PeerGone:
            log("the head left; waiting for the next head")
            if once and served:
                return
        except TailError as exc:
            log(f"refused a frame from the head: {exc}")
        now = time.monotonic()
        if now - last_stats >= STATS_EVERY_S:
            done = verifier.rounds - rounds_then
            if done:
                log(f"{done} frames verified in the last {now - last_stats:.0f} s")
            last_stats, rounds_then = now, verifier.rounds
