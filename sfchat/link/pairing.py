"""Pairing head and tail: SPAKE2 over a short code or a resumption secret, key confirmation, keys per pairing.

Contract
--------
Sans-I/O: these objects compute pairing messages and keys; ``sfchat.link.pairer`` frames and
moves them. The head is SPAKE2's side A and opens every pairing; the tail is side B::

    head                                                       tail
    HeadPairing(P, S, kind): nonce_H, A = SPAKE2_A(P).start()
                            ----------- nonce_H, A ----------->
                                               TailPairing(P, S, kind, nonce_H, A):
                                               nonce_T, B = SPAKE2_B(P).start(); K = finish(A)
                            <------ nonce_T, B, confirm_T -----
    finish(nonce_T, B, confirm_T): K = finish(B);
    confirm_T checked (else WrongCode)
                            ----------- confirm_H ------------>
                                               finish(confirm_H): checked (else WrongCode)

    L         = "sfchat-e2e/2" (kind "code")  or  "sfchat-e2e/2 resume" (kind "resume")
    th        = SHA-256(L | len(S) | S | nonce_H | A | nonce_T | B)
    confirm_X = HKDF-SHA256(K, salt=th, info=L + " X confirm")            X = head, tail
    key(dir)  = HKDF-SHA256(K, salt=th, info=L + " " + dir)              dir = head->tail, tail->head
    R         = HKDF-SHA256(K, salt=th, info=L + " resumption head|S tail|S")     (kind "code" only)

The password ``P`` is the normalised code (kind "code") or the 32-byte resumption secret ``R``
that an earlier code pairing of the same two nodes left (kind "resume"); SPAKE2's identities
are ``L head|S`` and ``L tail|S``, so a message of one kind, session or role never completes a
pairing of another. ``K`` is SPAKE2's shared key (python-spake2, Ed25519 group).

What this gives: a passive capture of a pairing holds nothing that tests a guessed password
offline (SPAKE2 messages are uniformly random group elements; the confirmations are keyed by K,
which an eavesdropper cannot compute from any guess); an active party that talks to one side
tests exactly one guess per pairing it starts; keys are fresh for every pairing, a resumed one
too (both SPAKE2 scalars and both nonces are new) and bound to the session name and the whole
transcript. ``R`` is a 256-bit secret that only the two parties of one code pairing can compute:
a resumption attempt by anyone else tests one guess of it, which is worth nothing. ``WrongCode``
means the other side's confirmation did not verify: a different password, or a party in the
middle. ``BadMessage`` means a message that is not a pairing message at all (wrong length, not
a group element); no guess was tested.

``Passcode`` is the tail's code and its budget of code attempts, so that guessing the code
online stays slow whoever asks: ``BURST`` answered attempts at once, then one per
``ATTEMPT_INTERVAL_S`` (a token bucket; an attempt that pairs gives its turn back). That is at
most 720 guesses an hour against 114,129,756 codes (2**26.8): one chance in 158,000 per hour of
non-stop guessing, in 13,000 per 12 hours (a notebook's life), in 220 per 30 days; a tail left up
for weeks wants a long secret of its own (``SFCHAT_CODE``) instead. Nothing fails for lack of a
turn: an attempt waits for one (see ``pairer``), and no code is ever replaced, so no stranger
can lock out, or rotate away, a code an honest head knows. ``Passcode.resumes`` is the tail's
budget of resumption attempts (``RESUME_BURST`` at once, then one per ``RESUME_INTERVAL_S``: each
costs a key exchange). ``HeadAttempts`` (``HEAD_ATTEMPTS``, one per process) is the head's own
budget of code attempts, the tail's on both counts, per session name and in total, so that
whoever answers as a tail tests guesses no faster than a head can against a tail.
``AttemptBudget`` is the token bucket all three use. ``require_secret`` is relay mode's policy
for the code (or ``--insecure``); ``check_code`` is the one length rule for every code, the chat
code included. Torch-free.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import threading
import time
from typing import Callable, NamedTuple

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from spake2 import SPAKE2_A, SPAKE2_B

from sfchat import UserError
from sfchat.link import codes

LABEL = b"sfchat-e2e/2"
LABELS = {"code": LABEL, "resume": LABEL + b" resume"}
NONCE_BYTES = 32
SPAKE_BYTES = 33  # python-spake2: one side byte, then the 32-byte Ed25519 element
CONFIRM_BYTES = 32
SECRET_BYTES = 32  # a resumption secret
BURST = 3  # code attempts a tail answers at once (a typo or two)
ATTEMPT_INTERVAL_S = 5.0  # then one per this many seconds, whoever makes them
RESUME_BURST = 8  # resumption attempts a tail answers at once (each costs it a key exchange)
RESUME_INTERVAL_S = 1.0  # then one per this many seconds
MIN_SECRET_CHARS = 8


class PairingFailed(Exception):
    """A pairing attempt that produced no keys."""


class WrongCode(PairingFailed):
    """The other side's key confirmation did not verify: a different code (or someone in between)."""


class BadMessage(PairingFailed):
    """Not a pairing message: wrong length or not a point of the group (no guess was tested)."""


class Keys(NamedTuple):
    head_to_tail: bytes
    tail_to_head: bytes


def password(code: str) -> bytes:
    """What a typed code is as a SPAKE2 password (``codes.normalize``)."""
    return codes.normalize(code).encode()


def _identities(label: bytes, session: str) -> dict:
    s = session.encode()
    return {"idA": label + b" head|" + s, "idB": label + b" tail|" + s}


def _transcript(label: bytes, session: str, nonce_h: bytes, msg_a: bytes, nonce_t: bytes, msg_b: bytes) -> bytes:
    s = session.encode()
    return hashlib.sha256(b"".join((label, len(s).to_bytes(2, "big"), s, nonce_h, msg_a, nonce_t, msg_b))).digest()


class _Derived:
    """Everything one pairing's K and transcript give: confirmations, keys, the resumption secret."""

    def __init__(self, kind: str, session: str, key: bytes, th: bytes):
        label = LABELS[kind]

        def derive(purpose: bytes) -> bytes:
            return HKDF(algorithm=hashes.SHA256(), length=32, salt=th, info=label + b" " + purpose).derive(key)

        s = session.encode()
        self.tail_confirm, self.head_confirm = derive(b"tail confirm"), derive(b"head confirm")
        self.keys = Keys(derive(b"head->tail"), derive(b"tail->head"))
        self.resumption = derive(b"resumption head|" + s + b" tail|" + s) if kind == "code" else None


def _finish(spake, message: bytes) -> bytes:
    if len(message) != SPAKE_BYTES:
        raise BadMessage(f"a pairing message of {len(message)} bytes, not {SPAKE_BYTES}")
    try:
        return spake.finish(message)
    except Exception as exc:  # the library's own refusals: off side, reflection, not on the curve
        raise BadMessage(f"not a pairing message ({type(exc).__name__})") from None


class HeadPairing:
    """The head's side of one attempt of ``kind`` ("code" or "resume") with password ``secret``:
    ``nonce`` and ``message`` go out first."""

    def __init__(self, secret: bytes, session: str, kind: str = "code"):
        self.kind, self.session = kind, session
        self._spake = SPAKE2_A(secret, **_identities(LABELS[kind], session))
        self.nonce = os.urandom(NONCE_BYTES)
        self.message = self._spake.start()

    def finish(self, nonce_t: bytes, msg_b: bytes, confirm_t: bytes) -> tuple[Keys, bytes, bytes | None]:
        """(keys, the head's confirmation, the resumption secret or None) once the tail's answer
        verifies; WrongCode or BadMessage."""
        if len(nonce_t) != NONCE_BYTES or len(confirm_t) != CONFIRM_BYTES:
            raise BadMessage("a pairing answer of the wrong size")
        key = _finish(self._spake, msg_b)
        th = _transcript(LABELS[self.kind], self.session, self.nonce, self.message, nonce_t, msg_b)
        derived = _Derived(self.kind, self.session, key, th)
        if not hmac.compare_digest(confirm_t, derived.tail_confirm):
            raise WrongCode("the tail's key confirmation does not verify")
        return derived.keys, derived.head_confirm, derived.resumption


class TailPairing:
    """The tail's side of one attempt, made from the head's opening; its answer is ``nonce``,
    ``message``, ``confirm``. Raises BadMessage for an opening that is none."""

    def __init__(self, secret: bytes, session: str, nonce_h: bytes, msg_a: bytes, kind: str = "code"):
        if len(nonce_h) != NONCE_BYTES:
            raise BadMessage("a pairing opening of the wrong size")
        self.kind = kind
        spake = SPAKE2_B(secret, **_identities(LABELS[kind], session))
        self.nonce = os.urandom(NONCE_BYTES)
        self.message = spake.start()
        key = _finish(spake, msg_a)
        self._derived = _Derived(kind, session, key, _transcript(LABELS[kind], session, nonce_h, msg_a,
                                                                 self.nonce, self.message))
        self.confirm = self._derived.tail_confirm

    def finish(self, confirm_h: bytes) -> tuple[Keys, bytes | None]:
        """(keys, the resumption secret or None) once the head's confirmation verifies; WrongCode."""
        if not hmac.compare_digest(confirm_h, self._derived.head_confirm):
            raise WrongCode("the head's key confirmation does not verify")
        return self._derived.keys, self._derived.resumption


class AttemptBudget:
    """A token bucket of attempts: ``burst`` at once, then one per ``interval`` seconds; ``clock``
    is for tests."""

    def __init__(self, burst: int = BURST, interval: float = ATTEMPT_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic):
        self.burst, self.interval, self.clock = burst, interval, clock
        self._turns, self._at = float(burst), clock()

    def _refill(self) -> None:
        now = self.clock()
        self._turns = min(self.burst, self._turns + (now - self._at) / self.interval)
        self._at = now

    def wait(self) -> float:
        """Seconds until an attempt may be made (0: now)."""
        self._refill()
        return max(1.0 - self._turns, 0.0) * self.interval

    def spend(self) -> None:
        """An attempt is made now: it takes a turn."""
        self._refill()
        self._turns -= 1.0

    def give_back(self) -> None:
        """The attempt tested no guess (it paired, or never got an answer): its turn comes back."""
        self._refill()
        self._turns = min(self.burst, self._turns + 1.0)


class Passcode(AttemptBudget):
    """The tail's pairing code (made here when none is given) and its budget of code attempts
    (see the module docstring); ``clock`` is for tests."""

    def __init__(self, code: str | None = None, clock: Callable[[], float] = time.monotonic):
        super().__init__(BURST, ATTEMPT_INTERVAL_S, clock)
        self.generated = code is None
        self.code = codes.new_code() if code is None else code
        self.failures = 0  # attempts answered that never paired, for the log
        self.resumes = AttemptBudget(RESUME_BURST, RESUME_INTERVAL_S, clock)  # resumption attempts

    def paired(self) -> None:
        """The attempt paired: a right code is no guess to count, so its turn comes back."""
        self.give_back()

    def failed(self) -> None:
        self.failures += 1


class HeadAttempts:
    """The head's own budget of code attempts, for its whole process: ``BURST`` at once, then one
    per ``ATTEMPT_INTERVAL_S``, per session name and in total, the tail's budget on both counts.
    A head spends a turn before it sends its code and gets it back when the attempt tested no
    guess (it paired, or was never answered): whoever answers as a tail can test no more guesses
    against a head than against a tail. ``clock`` is for tests."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.total = AttemptBudget(clock=clock)
        self.sessions: dict[str, AttemptBudget] = {}
        self._lock = threading.Lock()

    def _both(self, session: str) -> tuple[AttemptBudget, AttemptBudget]:
        if session not in self.sessions:
            self.sessions[session] = AttemptBudget(clock=self.clock)
        return self.sessions[session], self.total

    def wait(self, session: str) -> float:
        """Seconds until a code attempt on ``session`` may be made (0: now)."""
        with self._lock:
            return max(b.wait() for b in self._both(session))

    def spend(self, session: str) -> None:
        with self._lock:
            for b in self._both(session):
                b.spend()

    def give_back(self, session: str) -> None:
        with self._lock:
            for b in self._both(session):
                b.give_back()


HEAD_ATTEMPTS = HeadAttempts()  # this process's heads share it (a server started again, several dialers)


def require_secret(secret: str | None, insecure: bool, role: str = "head") -> None:
    """Relay mode's policy: a pairing code (a tail makes one when it has none), or --insecure."""
    if secret is not None and insecure:
        raise UserError("a pairing code and --insecure contradict each other (check SFCHAT_CODE and "
                        "SFCHAT_SECRET): drop one")
    if insecure or (role == "tail" and not secret):
        return
    if not secret:
        raise UserError("relay mode encrypts head <-> tail traffic end to end and needs the pairing code that "
                        "`sfchat --tail` printed: type it when asked (on a terminal), or set SFCHAT_CODE; the "
                        "relay never sees it. --insecure sends plaintext through the relay instead")
    check_code(secret, "the pairing code", "use the one the tail printed, or a secret of your own at least that long")


def check_code(code: str, what: str, remedy: str) -> None:
    """The rule for every code that pairs two sfchat nodes (a tail's, a chat host's, the one a head
    or a chat screen is given): at least ``MIN_SECRET_CHARS`` characters as SPAKE2 sees them
    (``codes.normalize``: case, surrounding space and runs of separators do not count), else a
    ``UserError`` that names the code (``what``), says the rule and how to mend it (``remedy``)."""
    counted = len(codes.normalize(code))
    if counted < MIN_SECRET_CHARS:
        raise UserError(f"{what} has {counted} characters (runs of spaces and hyphens count as one): a code must "
                        f"have at least {MIN_SECRET_CHARS}; {remedy}")
