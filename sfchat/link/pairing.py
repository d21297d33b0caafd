"""Pairing head and tail by a short code: SPAKE2, key confirmation, keys per pairing.

Contract
--------
Sans-I/O: these objects compute pairing messages and keys; ``sfchat.link.secure`` frames and
moves them. The head is SPAKE2's side A and opens every pairing; the tail is side B::

    head                                                       tail
    HeadPairing(code, S):   nonce_H, A = SPAKE2_A(code).start()
                            ----------- nonce_H, A ----------->
                                               TailPairing(code, S, nonce_H, A):
                                               nonce_T, B = SPAKE2_B(code).start(); K = finish(A)
                            <------ nonce_T, B, confirm_T -----
    finish(nonce_T, B, confirm_T): K = finish(B);
    confirm_T checked (else WrongCode)
                            ----------- confirm_H ------------>
                                               finish(confirm_H): checked (else WrongCode)

    th        = SHA-256("sfchat-e2e/2" | len(S) | S | nonce_H | A | nonce_T | B)
    confirm_X = HKDF-SHA256(K, salt=th, info="sfchat-e2e/2 X confirm")       X = head, tail
    key(dir)  = HKDF-SHA256(K, salt=th, info="sfchat-e2e/2 " + dir)         dir = head->tail, tail->head

``K`` is SPAKE2's shared key (python-spake2, Ed25519 group, identities ``sfchat-e2e/2 head|S``
and ``sfchat-e2e/2 tail|S``). What this gives: a passive capture of a pairing holds nothing
that tests a guessed code offline (SPAKE2 messages are uniformly random group elements; the
confirmations are keyed by K, which an eavesdropper cannot compute from any guess); an active
party that talks to one side tests exactly one guess per pairing it starts; keys are fresh for
every pairing (both SPAKE2 scalars and both nonces are new) and bound to the session name and
the whole transcript. ``WrongCode`` means the other side's confirmation did not verify: a wrong
code, or a party in the middle. ``BadMessage`` means a message that is not a pairing message at
all (wrong length, not a group element); no guess was tested.

``Passcode`` is the tail's code and its attempt budget, so that guessing online is slow too:
every failed attempt locks pairing for ``FAILURE_DELAY_S``; a generated code (``code=None``) is
replaced after ``MAX_FAILURES`` failed attempts (``on_new_code`` is told) and pairing locks for
``LOCKOUT_S``, doubling with every replacement; a code the operator gave cannot be replaced, so
after ``MAX_FAILURES`` failures each further one locks pairing for ``LOCKOUT_S``, doubling per
failure. Locks never exceed ``MAX_LOCKOUT_S``. Against a 27-bit code that leaves an attacker
about three guesses an hour once the locks have grown. ``require_secret`` is relay
mode's policy for the code (or ``--insecure``). Torch-free.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import time
from typing import Callable, NamedTuple

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from spake2 import SPAKE2_A, SPAKE2_B

from sfchat import UserError
from sfchat.link import codes

LABEL = b"sfchat-e2e/2"
NONCE_BYTES = 32
SPAKE_BYTES = 33  # python-spake2: one side byte, then the 32-byte Ed25519 element
CONFIRM_BYTES = 32
MAX_FAILURES = 3
FAILURE_DELAY_S, LOCKOUT_S, MAX_LOCKOUT_S = 1.0, 30.0, 3600.0
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


def _identities(session: str) -> dict:
    s = session.encode()
    return {"idA": LABEL + b" head|" + s, "idB": LABEL + b" tail|" + s}


def _password(code: str) -> bytes:
    return codes.normalize(code).encode()


def _transcript(session: str, nonce_h: bytes, msg_a: bytes, nonce_t: bytes, msg_b: bytes) -> bytes:
    s = session.encode()
    return hashlib.sha256(b"".join((LABEL, len(s).to_bytes(2, "big"), s, nonce_h, msg_a, nonce_t, msg_b))).digest()


def _derive(key: bytes, th: bytes, purpose: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=th, info=LABEL + b" " + purpose).derive(key)


def _finish(spake, message: bytes) -> bytes:
    if len(message) != SPAKE_BYTES:
        raise BadMessage(f"a pairing message of {len(message)} bytes, not {SPAKE_BYTES}")
    try:
        return spake.finish(message)
    except Exception as exc:  # the library's own refusals: off side, reflection, not on the curve
        raise BadMessage(f"not a pairing message ({type(exc).__name__})") from None


class HeadPairing:
    """The head's side of one pairing attempt: ``nonce`` and ``message`` go out first."""

    def __init__(self, code: str, session: str):
        self._spake = SPAKE2_A(_password(code), **_identities(session))
        self.session = session
        self.nonce = os.urandom(NONCE_BYTES)
        self.message = self._spake.start()

    def finish(self, nonce_t: bytes, msg_b: bytes, confirm_t: bytes) -> tuple[Keys, bytes]:
        """(keys, the head's confirmation) once the tail's answer verifies; WrongCode or BadMessage."""
        if len(nonce_t) != NONCE_BYTES or len(confirm_t) != CONFIRM_BYTES:
            raise BadMessage("a pairing answer of the wrong size")
        key = _finish(self._spake, msg_b)
        th = _transcript(self.session, self.nonce, self.message, nonce_t, msg_b)
        if not hmac.compare_digest(confirm_t, _derive(key, th, b"tail confirm")):
            raise WrongCode("the tail's key confirmation does not verify")
        return Keys(_derive(key, th, b"head->tail"), _derive(key, th, b"tail->head")), _derive(key, th, b"head confirm")


class TailPairing:
    """The tail's side of one attempt, made from the head's opening; its answer is
    ``nonce``, ``message``, ``confirm``. Raises BadMessage for an opening that is none."""

    def __init__(self, code: str, session: str, nonce_h: bytes, msg_a: bytes):
        if len(nonce_h) != NONCE_BYTES:
            raise BadMessage("a pairing opening of the wrong size")
        spake = SPAKE2_B(_password(code), **_identities(session))
        self.nonce = os.urandom(NONCE_BYTES)
        self.message = spake.start()
        key = _finish(spake, msg_a)
        th = _transcript(session, nonce_h, msg_a, self.nonce, self.message)
        self.confirm = _derive(key, th, b"tail confirm")
        self._head_confirm = _derive(key, th, b"head confirm")
        self._keys = Keys(_derive(key, th, b"head->tail"), _derive(key, th, b"tail->head"))

    def finish(self, confirm_h: bytes) -> Keys:
        if not hmac.compare_digest(confirm_h, self._head_confirm):
            raise WrongCode("the head's key confirmation does not verify")
        return self._keys


class Passcode:
    """The tail's pairing code and its budget of failed attempts (see the module docstring)."""

    def __init__(self, code: str | None = None, on_new_code: Callable[[str], None] = lambda code: None,
                 clock: Callable[[], float] = time.monotonic):
        self.generated = code is None
        self.code = codes.new_code() if code is None else code
        self.on_new_code, self.clock = on_new_code, clock
        self.failures = self.replaced = 0
        self._locked_until = 0.0
        if self.generated:
            on_new_code(self.code)

    def locked_for(self) -> float:
        """Seconds until the next attempt is allowed (0: now)."""
        return max(self._locked_until - self.clock(), 0.0)

    def failed(self) -> None:
        """One more failed attempt: a short lock; after MAX_FAILURES a new code, or a long lock."""
        self.failures += 1
        lock = FAILURE_DELAY_S
        if self.failures >= MAX_FAILURES and self.generated:
            self.code, self.failures = codes.new_code(), 0
            self.replaced += 1
            lock = LOCKOUT_S * 2 ** (self.replaced - 1)
            self.on_new_code(self.code)
        elif self.failures >= MAX_FAILURES:
            lock = LOCKOUT_S * 2 ** (self.failures - MAX_FAILURES)
        self._locked_until = self.clock() + min(lock, MAX_LOCKOUT_S)


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
    if len(secret) < MIN_SECRET_CHARS:
        raise UserError(f"the pairing code has {len(secret)} characters: use the one the tail printed, or a "
                        f"secret of at least {MIN_SECRET_CHARS}")
