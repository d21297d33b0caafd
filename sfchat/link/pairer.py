"""The pairing exchange in frames: what head and tail send and accept until the link is keyed.

Contract
--------
``HeadPairer`` and ``TailPairer`` are the two sides of ``sfchat.link.pairing`` put into frames,
for ``sfchat.link.secure.SecureLink`` to move: ``take(kind, body)`` consumes one pairing frame
and returns a ``Step``: frames to send, then the keys (paired) or an error to raise (the head's
final failures). No I/O, no threads (the link holds a lock).

Frames travel in clear (they are random to anyone without the password)::

    OPEN     "SFX2" 0x01 nonce_H(32) A(33)                head -> tail   a code attempt
    RESUME   "SFX2" 0x06 nonce_H(32) A(33)                head -> tail   a resumption attempt
    ANSWER   "SFX2" 0x02 nonce_T(32) B(33) confirm_T(32)  tail -> head   to either
    CONFIRM  "SFX2" 0x03 confirm_H(32)                    head -> tail
    REFUSE   "SFX2" 0x04 reason(1)                        either   WRONG: the confirmation did not
             verify; NO_RESUME: the tail holds no resumption secret; AGAIN: this connection has had
             its attempt of that kind

The head (``opening()``) tries a resumption first when it holds the secret of an earlier code
pairing (``resume.Resumption``). When the tail refuses it or its answer does not verify (a tail
restarted without its file, one another head paired with since, or a stranger in the tail's
slot), the head falls back to its code only when it was given one for this link (``code``; the
dialer gives a code once per time a person or a setting supplies it, ``link.dialer.Dialer``);
without one it fails with ``ResumptionRefused``, so that whoever answers as a tail cannot make
the head test a guess of the code by refusing resumptions. ``CodeNeeded`` (its base) is the
head having neither. When a code attempt fails it raises ``WrongCode``, which is final for this
link. ``paired_by`` says how the link paired ("code" or "resume"). A code pairing leaves a new
resumption secret on both sides; a resumed one leaves the secret as it was.

The tail answers, per head connection (until ``peer_gone()``), at most one code attempt and one
resumption attempt; another opening of the same kind gets REFUSE AGAIN. A code attempt is
answered when the ``Passcode`` budget has a turn; before that the opening is held (``due()``
says until when; ``tick()`` answers it then), never refused: a head that holds the relay's head
slot is the only one that can be answered, and waits at most ``ATTEMPT_INTERVAL_S``. Its turn
is spent once the answer goes out (that is when one guess is tested), and comes back if the
attempt pairs; an opening held for a head that leaves costs nothing. The budget is the tail's
total on purpose: the tail cannot tell clients apart, and a budget per client would multiply a
guesser's rate by its connections; what is per client is the one attempt per connection and
the turn of the head in the slot, so a guesser cannot make another client wait longer. Resumption
attempts test only a guess of a 256-bit secret, but each costs the tail a key exchange: they have
a budget of their own (``Passcode.resumes``: ``RESUME_BURST`` at once, then one per
``RESUME_INTERVAL_S``), held the same way, and never spend the code's. ``TailPairer.take`` never raises, whatever a
would-be head sends (``SecureLink`` checks the framing first); failed attempts are logged
through ``log``, failed resumptions at 1, 10, 100 ... so that a flood cannot flood the log. The
log names the two sides by ``Names`` (a head and this tail; the chat host: the chat screen and
this head).
"""

from __future__ import annotations

import time
from typing import Callable, NamedTuple

from sfchat.link.pairing import (
    ATTEMPT_INTERVAL_S, BURST, CONFIRM_BYTES, NONCE_BYTES, RESUME_BURST, RESUME_INTERVAL_S, SPAKE_BYTES, BadMessage,
    HeadPairing, Keys, Passcode, TailPairing, password,
)
from sfchat.link import pairing
from sfchat.link.resume import Resumption

MAGIC = b"SFX2"
OPEN, ANSWER, CONFIRM, REFUSE, DATA, RESUME = 1, 2, 3, 4, 5, 6
WRONG, NO_RESUME, AGAIN = 1, 3, 4  # REFUSE reasons (2, a lock, is retired: attempts wait instead)
HEAD_BYTES = len(MAGIC) + 1
SIZES = {OPEN: HEAD_BYTES + NONCE_BYTES + SPAKE_BYTES,
         RESUME: HEAD_BYTES + NONCE_BYTES + SPAKE_BYTES,
         ANSWER: HEAD_BYTES + NONCE_BYTES + SPAKE_BYTES + CONFIRM_BYTES,
         CONFIRM: HEAD_BYTES + CONFIRM_BYTES,
         REFUSE: HEAD_BYTES + 1}
KINDS = {OPEN: "code", RESUME: "resume"}
INTEGRITY = "integrity check failed: the relay or the network altered, reordered or replayed a frame"


class IntegrityError(Exception):
    """A frame failed authentication or arrived out of order: end the session (not retried)."""


class SecretMismatch(IntegrityError):
    """The two nodes could not pair: the codes differ, or the other node does not encrypt."""


class WrongCode(SecretMismatch):
    """The head's pairing code is not the tail's (or someone in between tried to guess it)."""


class PairingRefused(SecretMismatch):
    """The tail refused this connection's attempt (it has had one): dial again."""


class CodeNeeded(SecretMismatch):
    """The head has no pairing code it may try: a person (or the setting) must give it one."""


class ResumptionRefused(CodeNeeded):
    """The tail did not resume this head's pairing, and the head was given no code to fall back to."""


class PlaintextPeer(SecretMismatch):
    """The other node sends unencrypted frames (started with --insecure, or an older sfchat)."""


class Step(NamedTuple):
    send: list[bytes]
    keys: Keys | None = None
    error: SecretMismatch | None = None


def frame(kind: int, *parts: bytes) -> bytes:
    return b"".join((MAGIC, bytes([kind]), *parts))


class HeadPairer:
    """The head's side: openings, and what the tail's answers and refusals lead to. ``code`` is
    the code this link may try (None: resumption only)."""

    def __init__(self, code: str | None, session: str, resumption: Resumption | None = None):
        self.code, self.session = code, session
        self.resumption = resumption if resumption is not None else Resumption()
        self.paired_by: str | None = None
        self.reset()

    def reset(self) -> None:
        """A new tail (or none): the next opening starts from the top."""
        self.attempt: HeadPairing | None = None
        self._resume_tried = False

    def opening(self) -> bytes:
        """The next opening: a resumption while this tail has not refused one, else the code."""
        if self.resumption.secret is not None and not self._resume_tried:
            self.attempt = HeadPairing(self.resumption.secret, self.session, "resume")
            kind = RESUME
        elif self.code is not None:
            self.attempt = HeadPairing(password(self.code), self.session, "code")
            kind = OPEN
        else:
            raise CodeNeeded(f"no pairing code to pair with the tail of session {self.session!r}: give the head "
                             "the code the tail printed")
        return frame(kind, self.attempt.nonce, self.attempt.message)

    def _fall_back(self, before: list[bytes]) -> Step:
        self._resume_tried = True
        if self.code is None:
            self.attempt = None
            return Step(before, error=ResumptionRefused(
                f"the tail of session {self.session!r} did not resume this head's pairing: it restarted without "
                "its resumption file, paired with another head since, or is not the tail this head paired with; "
                "the head tries no code by itself: give it the code the tail prints now"))
        return Step(before + [self.opening()])

    def take(self, kind: int, body: bytes) -> Step:
        attempt = self.attempt
        if kind == REFUSE:
            if attempt is None:
                return Step([])  # nothing of ours is open: late, or forged; either way it refuses nothing
            if attempt.kind == "resume" and body[0] in (WRONG, NO_RESUME):
                return self._fall_back([])
            self.attempt = None
            if body[0] == AGAIN:
                return Step([], error=PairingRefused(
                    f"the tail of session {self.session!r} answers one pairing attempt per connection and "
                    "had this one's: dial again"))
            return Step([], error=WrongCode(f"wrong pairing code: the tail of session {self.session!r} did not "
                                            "accept it"))
        if kind != ANSWER or attempt is None:
            raise IntegrityError(f"{INTEGRITY} (an unexpected pairing message)")
        nonce_t, msg_b = body[:NONCE_BYTES], body[NONCE_BYTES:NONCE_BYTES + SPAKE_BYTES]
        try:
            keys, confirm, secret = attempt.finish(nonce_t, msg_b, body[NONCE_BYTES + SPAKE_BYTES:])
        except pairing.WrongCode:
            refusal = frame(REFUSE, bytes([WRONG]))  # the tail counts it now, not when we leave
            if attempt.kind == "resume":
                return self._fall_back([refusal])
            self.attempt = None
            return Step([refusal], error=WrongCode(f"wrong pairing code: the tail of session {self.session!r} "
                                                   "paired with another code (use the one it printed last)"))
        except BadMessage as exc:
            raise IntegrityError(f"{INTEGRITY} (a pairing answer that is none: {exc})") from None
        self.attempt = None
        self.paired_by = attempt.kind
        if secret is not None:
            self.resumption.keep(secret)
        return Step([frame(CONFIRM, confirm)], keys)


class Names(NamedTuple):
    """How the answering side's log names the one that opens pairings, and itself."""

    a_peer: str = "a head"
    the_peer: str = "the head"
    this: str = "this tail"


class TailPairer:
    """The tail's side: answers within the code's budget, one attempt of each kind per connection."""

    def __init__(self, passcode: Passcode, session: str, resumption: Resumption | None = None,
                 log: Callable[[str], None] = lambda message: None, names: Names = Names()):
        self.passcode, self.session, self.log, self.names = passcode, session, log, names
        self.resumption = resumption if resumption is not None else Resumption()
        self.failed_resumptions = 0
        self.attempt: TailPairing | None = None
        self._held: tuple[str, bytes, bytes, float] | None = None  # kind, nonce_H, A, when to answer (monotonic)
        self._used: set[str] = set()  # kinds of attempt this head connection has made
        self._told_wait = {"code": -ATTEMPT_INTERVAL_S, "resume": -ATTEMPT_INTERVAL_S}  # held attempts last logged

    # -- connection and attempt state ----------------------------------------------------------------
    def peer_gone(self) -> None:
        """The head left: its open attempt failed, a held one is dropped, the next head starts afresh."""
        self.reset()
        self._used.clear()

    def reset(self) -> None:
        """Forget any attempt (an open one failed); this connection's attempts stay made."""
        if self.attempt is not None:
            self._failed(f"{self.names.the_peer} left or started over before confirming")
        self._held = None

    def _failed(self, why: str) -> None:
        """An attempt that got the tail's answer and never paired: one guess spent."""
        kind, self.attempt = self.attempt.kind, None
        if kind == "resume":
            self.failed_resumptions += 1
            if str(self.failed_resumptions).strip("0") == "1":  # 1, 10, 100, ...: a flood must not flood the log
                self.log(f"a resumption attempt failed: {why} ({self.failed_resumptions} so far)")
            return
        self.passcode.failed()
        self.log(f"a pairing attempt failed: {why} ({self.passcode.failures} so far; code attempts are "
                 f"answered {BURST} at once, then one per {ATTEMPT_INTERVAL_S:g} s)")

    # -- frames ----------------------------------------------------------------------------------------
    def take(self, kind: int, body: bytes) -> Step:
        if kind in KINDS:
            return Step(self._opening(KINDS[kind], body[:NONCE_BYTES], body[NONCE_BYTES:]))
        attempt = self.attempt
        if attempt is None:
            return Step([])  # a confirmation or refusal with no attempt open: forged or late
        if kind == CONFIRM:
            try:
                keys, secret = attempt.finish(body)
            except pairing.WrongCode:
                self._failed(f"{self.names.the_peer}'s confirmation does not verify: a wrong code")
                return Step([frame(REFUSE, bytes([WRONG]))])
            self.attempt = None
            self._paired(attempt.kind, secret)
            return Step([], keys)
        self._failed(f"{self.names.the_peer} did not accept {self.names.this}'s confirmation: a wrong code"
                     if kind == REFUSE else f"{self.names.this}'s own answer came back")
        return Step([])

    def _budget(self, kind: str):
        return self.passcode if kind == "code" else self.passcode.resumes

    def _secret(self, kind: str) -> bytes:
        return password(self.passcode.code) if kind == "code" else self.resumption.secret

    def _opening(self, kind: str, nonce_h: bytes, msg_a: bytes) -> list[bytes]:
        self.reset()
        if kind in self._used:
            return [frame(REFUSE, bytes([AGAIN]))]
        self._used.add(kind)
        if kind == "resume" and self.resumption.secret is None:
            return [frame(REFUSE, bytes([NO_RESUME]))]
        wait, now = self._budget(kind).wait(), time.monotonic()
        if wait > 0:
            self._held = (kind, nonce_h, msg_a, now + wait)
            if now - self._told_wait[kind] >= ATTEMPT_INTERVAL_S:  # held attempts cost nothing: not a line each
                self._told_wait[kind] = now
                burst, interval = (BURST, ATTEMPT_INTERVAL_S) if kind == "code" else (RESUME_BURST, RESUME_INTERVAL_S)
                what = "pairing" if kind == "code" else "resumption"
                self.log(f"a {what} attempt waits {wait:.1f} s for its turn ({kind} attempts are answered "
                         f"{burst} at once, then one per {interval:g} s)")
            return []
        return self._answer(kind, self._secret(kind), nonce_h, msg_a)

    def due(self) -> float | None:
        """When a held opening is to be answered (``time.monotonic``), or None."""
        return self._held[3] if self._held is not None else None

    def tick(self) -> list[bytes]:
        """The answer to a held opening once its turn has come (else nothing)."""
        if self._held is None or time.monotonic() < self._held[3]:
            return []
        kind, nonce_h, msg_a, _ = self._held
        if kind == "resume" and self.resumption.secret is None:
            self._held = None
            return [frame(REFUSE, bytes([NO_RESUME]))]
        wait = self._budget(kind).wait()
        if wait > 0:  # the budget's own clock is not there yet
            self._held = (kind, nonce_h, msg_a, time.monotonic() + wait)
            return []
        self._held = None
        return self._answer(kind, self._secret(kind), nonce_h, msg_a)

    def _answer(self, kind: str, secret: bytes, nonce_h: bytes, msg_a: bytes) -> list[bytes]:
        try:
            attempt = TailPairing(secret, self.session, nonce_h, msg_a, kind)
        except BadMessage as exc:
            self.log(f"ignored a pairing opening that is none ({exc})")
            return []
        self._budget(kind).spend()  # the answer tests one guess (and costs this tail a key exchange)
        self.attempt = attempt
        return [frame(ANSWER, attempt.nonce, attempt.message, attempt.confirm)]

    def _paired(self, kind: str, secret: bytes | None) -> None:
        if kind == "resume":
            self.passcode.resumes.give_back()
            self.log(f"{self.names.a_peer} resumed its pairing on session {self.session!r} (no code needed)")
            return
        self.passcode.paired()
        self.resumption.keep(secret)
        self.log(f"paired with {self.names.a_peer} on session {self.session!r}")
