"""The ``sfchat --tail`` process: a Verifier behind a relay link or a listening port, serving one head after another.

Contract: ``serve(settings)`` holds the session's tail slot (``--relay``) or listens on
``settings.listen`` for heads that dial it directly (``--listen``: a ``link.direct.DirectServer``,
which takes one head at a time and logs the address it listens on) through a
``link.listener.Listener`` with the ``Verifier`` behind it (``VerifierHandler``): every frame of
the paired head goes to the verifier and its replies back. Pairing and resumption are the same on
either: the direct port has no token, so a connection that does not pair within
``direct.PAIR_WAIT_S`` is closed. With ``--listen`` and ``--relay`` both, the listener serves
both places as one (``listener.Places``): one head at a time, from whichever place it came; a head
at the other place meanwhile is told that the tail is busy. A head that leaves (or breaks the protocol) ends only that
conversation: the tail keeps its loaded model (a next head with the same hello reuses it) and
waits for the next head. A stats line is logged now and then. A lost relay connection is
re-dialled by the listener with the one backoff, for as long as the relay cannot be reached;
a relay that refuses the token ``TOKEN_REFUSALS`` times in a row (it restarted with a new one)
stops the tail with an error that says so. Returns only on Ctrl+C (or, in tests, with ``once``:
after one head, or when the relay connection is lost, so that no tail outlives its test and
writes its log among the next tests' output).

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
session only (the head is told, ``VerifierHandler.pairing_ended``), and the same connection waits
for the next head. Local model directories are opened only inside ``--models-dir``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import platformdirs

from sfchat import UserError
from sfchat.config import Settings
from sfchat.link.pairing import Passcode, require_secret
from sfchat.link import LinkClosed
from sfchat.link.listener import TOKEN_REFUSALS, Listener, sealed  # noqa: F401  (TOKEN_REFUSALS: the tail's)
from sfchat.link.direct import DirectServer, address
from sfchat.link.relay import RelayLink
from sfchat.link.resume import ResumeFile
from sfchat.model.devices import resolve_devices
from sfchat.engine.verifier import TailError, Verifier
from sfchat.node.tail_loader import TailLoader
from sfchat.protocol.messages import Failure
from sfchat.link.secure import IntegrityError, PlaintextPeer
from sfchat.nodelog import node_log

STATS_EVERY_S = 30.0
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
    if not s.relay and not s.listen:
        raise UserError("--tail needs --relay URL (and --token, --session), or --listen HOST:PORT")
    if s.relay and not s.token:
        raise UserError("--tail needs the relay token: SFCHAT_TOKEN (or --token T)")
    require_secret(s.secret, s.insecure, role="tail")
    devices = resolve_devices(s.device)
    if s.compile_attention:  # the head's choice, told in its hello: both halves of a token run one code
        log("--compile-attention is the head's setting: this tail runs canonical attention as each head's hello says")
    if s.compile_frames:
        log("--compile-frames is the head's setting: this tail compiles its forwards as each head's hello says")
    verifier = Verifier(TailLoader(devices[0], devices, models_dirs(s), log), log=log)
    passcode = resumption = None
    if not s.insecure:
        passcode, resumption = Passcode(s.secret), ResumeFile(resume_path(s), log)
        if passcode.generated:
            show_code(passcode.code)
        if resumption.secret is not None:
            log(f"the head this tail paired with last resumes without a code (its secret: {resumption.path})")

    dials, greetings = [], []
    if s.relay:
        dials.append(lambda: RelayLink(s.relay, s.token, s.session, "tail"))
        greetings.append(f"connected to {s.relay} as the tail of session {s.session!r}")
    if s.listen:
        host, port = address(s.listen, "--listen", listen=True)
        server = DirectServer(host, port, trusted=lambda: True)
        where = f"{'[' + host + ']' if ':' in host else host}:{server.port}"
        log(f"listening on {where} for a head's direct link (sfchat --direct HOST:{server.port})")
        dials.append(lambda: server)
        greetings.append(f"listening on {where}")
    if passcode is not None:
        dials = [sealed(join, passcode, s.session, resumption, log) for join in dials]
        if s.listen:
            direct = dials[-1]

            def paired_in_time():
                link = direct()
                server.trusted = lambda: link.keyed  # a connection that does not pair is closed in time
                return link
            dials[-1] = paired_in_time
    listener = Listener(dials if len(dials) > 1 else dials[0], VerifierHandler(verifier), log=log,
                        poll=lambda: STATS_EVERY_S, once=once, greeting="; ".join(greetings) + "; waiting for a head")
    return listener.serve()


class VerifierHandler:
    """The ``Verifier`` behind the listener: frames in, its answers out, a stats line now and then."""

    def __init__(self, verifier: Verifier):
        self.verifier = verifier
        self.last_stats, self.rounds_then = time.monotonic(), verifier.rounds

    def take(self, frame: bytes, link) -> None:
        try:
            self.verifier.handle(frame, link.send)
        except TailError as exc:
            log(f"refused a frame from the head: {exc}")

    def tick(self, link) -> None:
        now = time.monotonic()
        if now - self.last_stats >= STATS_EVERY_S:
            done = self.verifier.rounds - self.rounds_then
            if done:
                log(f"{done} frames verified in the last {now - self.last_stats:.0f} s")
            self.last_stats, self.rounds_then = now, self.verifier.rounds

    def peer_gone(self) -> None:
        log("the head left; waiting for the next head")

    def pairing_ended(self, link, exc: IntegrityError | None) -> None:
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

    def link_lost(self) -> None:
        pass
