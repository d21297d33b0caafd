"""End-to-end encryption of the head <-> tail link, so that the relay learns nothing and can change nothing.

Contract
--------
``SecureLink(inner, code, session, role)`` wraps any frame link with RelayLink's surface
(``send``, ``recv``, ``wait_peer``, ``peer_present``, ``close``), pairs the two nodes by a
short code (``sfchat.link.pairing``: SPAKE2, then keys for this pairing only) and seals every frame
with AES-256-GCM. ``recv`` returns only frames that the other node sealed for this pairing, in
the order it sent them; anything else raises ``IntegrityError`` (altered, injected, reordered,
replayed or dropped frames). ``PeerGone``, ``LinkClosed`` and ``TimeoutError`` pass through as
RelayLink raises them. ``handshake(timeout)`` pairs eagerly so that a wrong code shows before
anything else is done. ``send`` and ``recv`` are meant for one thread (``send`` is also safe
from others).

The head opens every pairing and takes any failure as final: ``WrongCode`` (the codes differ,
or someone in between guessed), ``PairingRefused`` (the tail is locked after too many wrong
codes), ``PlaintextPeer`` (the tail does not encrypt), other ``IntegrityError``s. The tail serves
one head after another on one relay connection: a failed or forged pairing attempt never raises
there; it is counted against the code (a ``pairing.Passcode``), answered with a REFUSE and
reported through ``log``. An integrity error of a paired tail ends that head's session;
``restart()`` forgets the pairing (and the error) so that the same connection serves the next.

What the relay still sees: that a session exists, its name, the nodes' addresses, that a
pairing happened (and failed or not), the timing of every frame and its size rounded up by
``sfchat.link.padding.padded_size``. Token ids, hidden states, the model name and all metadata are
sealed; the pairing messages hold nothing to test a guessed code against.

Frames
------
::

    OPEN     "SFX2" 0x01 nonce_H(32) A(33)                head -> tail   SPAKE2 side A
    ANSWER   "SFX2" 0x02 nonce_T(32) B(33) confirm_T(32)  tail -> head   SPAKE2 side B
    CONFIRM  "SFX2" 0x03 confirm_H(32)                    head -> tail
    REFUSE   "SFX2" 0x04 reason(1) seconds(4)             either         1: the confirmation did not
                                                                         verify; 2: locked for seconds
    DATA     "SFX2" 0x05 counter(8, big-endian) ciphertext tag(16)

    nonce = direction prefix (4 bytes) + counter (8 bytes)     (96 bits; never reused per key)
    aad   = the 13 DATA header bytes + "sfchat-e2e/2" + S + direction
    plaintext = frame + 0x80 + zero bytes, to ``padded_size(len(frame) + 1)`` bytes

Pairing frames travel in clear: they are random to anyone without the code, and a forged REFUSE
can only make a pairing fail, as the relay could by dropping frames. Each direction has its own
key (``pairing.Keys``), counters start at 0 at each pairing, frames of an earlier pairing never
verify under the next one's keys. Frames sent before the pairing is keyed are held (at most
``PENDING_FRAMES``); sealed frames arriving before it (for an earlier peer) are dropped.

Padding (``sfchat.link.padding``) hides what frame lengths would otherwise tell the relay.

The receiver expects counters 0, 1, 2, ... exactly: a gap, a repeat or a reorder fails before
decryption, a changed bit fails the tag. This module imports neither torch nor the wire codec.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from sfchat import UserError
from sfchat.link import pairing
from sfchat.link.padding import pad, unpad
from sfchat.link.pairing import (
    CONFIRM_BYTES, MAX_FAILURES, NONCE_BYTES, SPAKE_BYTES, BadMessage, HeadPairing, Passcode, TailPairing,
)
from sfchat.link import LinkClosed, PeerGone

MAGIC = b"SFX2"
OPEN, ANSWER, CONFIRM, REFUSE, DATA = 1, 2, 3, 4, 5
REFUSED_WRONG, REFUSED_LOCKED = 1, 2
HEAD_BYTES = len(MAGIC) + 1
SIZES = {OPEN: HEAD_BYTES + NONCE_BYTES + SPAKE_BYTES,
         ANSWER: HEAD_BYTES + NONCE_BYTES + SPAKE_BYTES + CONFIRM_BYTES,
         CONFIRM: HEAD_BYTES + CONFIRM_BYTES,
         REFUSE: HEAD_BYTES + 5}
TAG_BYTES = 16
DATA_HEADER_BYTES = HEAD_BYTES + 8
OVERHEAD = DATA_HEADER_BYTES + TAG_BYTES  # bytes a sealed frame adds to its padded plaintext
PENDING_FRAMES = 64
LABEL = pairing.LABEL
DIRECTIONS = {"head": b"head->tail", "tail": b"tail->head"}  # keyed by the sender
NONCE_PREFIX = {b"head->tail": b"\x00\x00\x00\x01", b"tail->head": b"\x00\x00\x00\x02"}
WIRE_MAGIC = b"SFCH"  # an unencrypted sfchat frame (sfchat.protocol.wire.MAGIC)
INTEGRITY = "integrity check failed: the relay or the network altered, reordered or replayed a frame"
POLL_S = 0.1  # how often an unpaired head looks whether a tail has (re)joined

_log = logging.getLogger(__name__)


class IntegrityError(Exception):
    """A frame failed authentication or arrived out of order: end the session (not retried)."""


class SecretMismatch(IntegrityError):
    """The two nodes could not pair: the codes differ, or the other node does not encrypt."""


class WrongCode(SecretMismatch):
    """The head's pairing code is not the tail's (or someone in between tried to guess it)."""


class PairingRefused(SecretMismatch):
    """The tail refuses pairings for a while after too many wrong codes."""


class PlaintextPeer(SecretMismatch):
    """The other node sends unencrypted frames (started with --insecure, or an older sfchat)."""


def secure(inner, code: str, session: str, role: str, timeout: float = 60.0) -> "SecureLink":
    """``inner`` wrapped and paired within ``timeout`` s (no answer: a UserError). A failed
    pairing raises its ``SecretMismatch``, which a reconnecting head does not retry.
    ``inner`` is closed when this fails."""
    try:
        link = SecureLink(inner, code, session, role)
        link.handshake(timeout)
        return link
    except TimeoutError as exc:
        inner.close()
        raise UserError(f"{exc}: does it run an sfchat with end-to-end encryption?") from None
    except BaseException:
        inner.close()
        raise


class SecureLink:
    """A frame link whose frames only the two paired nodes can read or forge."""

    overlaps = True  # over a relay: the other node computes on its own machine

    def __init__(self, inner, code: "str | Passcode", session: str, role: str,
                 log: Callable[[str], None] | None = None):
        if role not in DIRECTIONS:
            raise ValueError(f"role must be 'head' or 'tail', not {role!r}")
        if not code:
            raise ValueError("a SecureLink needs a pairing code")
        self.inner, self.role, self.session = inner, role, session
        self.other = "tail" if role == "head" else "head"
        self.passcode = code if isinstance(code, Passcode) else Passcode(code)
        self.log = log or (lambda message: _log.info("%s", message))
        self._out_dir, self._in_dir = DIRECTIONS[role], DIRECTIONS[self.other]
        self._aad = {d: LABEL + session.encode() + d for d in DIRECTIONS.values()}
        self._lock = threading.RLock()  # pairing state, and seal + send as one step (counter order)
        self._failed: IntegrityError | None = None
        self._new_pairing()
        if role == "head" and getattr(inner, "peer_present", True):
            try:
                self._open_pairing()
            except LinkClosed:
                pass  # the next recv says so

    # -- pairing state -------------------------------------------------------------------------
    def _new_pairing(self) -> None:
        with self._lock:
            self._attempt: HeadPairing | TailPairing | None = None
            self._seal: AESGCM | None = None
            self._open: AESGCM | None = None
            self._sent = self._expected = 0
            self._pending: deque[bytes] = deque()
            self._dropped_stale = 0

    def restart(self) -> None:
        """Tail: forget this pairing and any integrity error; wait for the next head's pairing.
        An attempt still open counts as failed (its opener got an answer to test one guess)."""
        with self._lock:
            self._failed = None
            self._peer_gone()

    @property
    def keyed(self) -> bool:
        with self._lock:
            return self._seal is not None

    def _key(self, keys: pairing.Keys) -> None:
        mine, theirs = (keys.head_to_tail, keys.tail_to_head) if self.role == "head" else \
            (keys.tail_to_head, keys.head_to_tail)
        self._seal, self._open, self._attempt = AESGCM(mine), AESGCM(theirs), None

    def _send_control(self, kind: int, payload: bytes) -> None:
        with self._lock:
            self.inner.send(MAGIC + bytes([kind]) + payload)

    def _refuse(self, reason: int, seconds: float = 0.0) -> None:
        try:
            self._send_control(REFUSE, bytes([reason]) + min(int(seconds + 0.999), 2 ** 32 - 1).to_bytes(4, "big"))
        except LinkClosed:
            pass

    # -- the head's side -----------------------------------------------------------------------
    def _open_pairing(self) -> None:
        with self._lock:
            self._attempt = HeadPairing(self.passcode.code, self.session)
            self._send_control(OPEN, self._attempt.nonce + self._attempt.message)

    def _head_control(self, kind: int, frame: bytes) -> None:
        with self._lock:
            attempt = self._attempt if isinstance(self._attempt, HeadPairing) else None
            if kind == REFUSE and self._seal is None:
                raise self._refusal(frame[HEAD_BYTES], int.from_bytes(frame[HEAD_BYTES + 1:], "big"))
            if kind != ANSWER or attempt is None or self._seal is not None:
                raise IntegrityError(f"{INTEGRITY} (an unexpected pairing message)")
            body = frame[HEAD_BYTES:]
            nonce_t, msg_b = body[:NONCE_BYTES], body[NONCE_BYTES:NONCE_BYTES + SPAKE_BYTES]
            try:
                keys, confirm = attempt.finish(nonce_t, msg_b, body[NONCE_BYTES + SPAKE_BYTES:])
            except pairing.WrongCode:
                self._attempt = None
                self._refuse(REFUSED_WRONG)  # the tail counts it now, not when we leave
                raise WrongCode(f"wrong pairing code: the tail of session {self.session!r} paired with another "
                                f"code (use the one it printed; after {MAX_FAILURES} wrong codes a tail that "
                                "made its own prints a new one)") from None
            except BadMessage as exc:
                raise IntegrityError(f"{INTEGRITY} (a pairing answer that is none: {exc})") from None
            self._send_control(CONFIRM, confirm)  # before any data, which it keys on the tail
            self._key(keys)
            while self._pending:
                self._send_sealed(self._pending.popleft())

    def _refusal(self, reason: int, seconds: int) -> SecretMismatch:
        if reason == REFUSED_LOCKED:
            return PairingRefused(f"the tail of session {self.session!r} refuses pairings for {seconds} s after "
                                  "wrong codes: try again then (check the code it printed last)")
        return WrongCode(f"wrong pairing code: the tail of session {self.session!r} did not accept it")

    # -- the tail's side -----------------------------------------------------------------------
    def _tail_control(self, kind: int, frame: bytes) -> None:
        with self._lock:
            if self._seal is not None:
                raise IntegrityError(f"{INTEGRITY} (a pairing message inside a paired session)")
            pending = self._attempt
            if kind == OPEN:
                if pending is not None:
                    self._attempt_failed("the head started over without confirming")
                self._answer(frame[HEAD_BYTES:HEAD_BYTES + NONCE_BYTES], frame[HEAD_BYTES + NONCE_BYTES:])
            elif pending is None:
                self._dropped_stale += 1  # a confirmation or refusal with no attempt open: forged or late
            elif kind == CONFIRM:
                try:
                    keys = pending.finish(frame[HEAD_BYTES:])
                except pairing.WrongCode:
                    self._attempt_failed("the head's confirmation does not verify: a wrong code")
                    self._refuse(REFUSED_WRONG)
                    return
                self._key(keys)
                self.log(f"paired with a head on session {self.session!r}")
            elif kind == REFUSE:
                self._attempt_failed("the head did not accept this tail's confirmation: a wrong code")
            else:
                self._attempt_failed("the tail's own answer came back")

    def _answer(self, nonce_h: bytes, msg_a: bytes) -> None:
        locked = self.passcode.locked_for()
        if locked > 0:
            self.log(f"refused a pairing attempt: locked for {locked:.0f} s more after repeated wrong codes")
            self._refuse(REFUSED_LOCKED, locked)
            return
        try:
            attempt = TailPairing(self.passcode.code, self.session, nonce_h, msg_a)
        except BadMessage as exc:
            self.log(f"ignored a pairing opening that is none ({exc})")
            return
        self._attempt = attempt
        self._send_control(ANSWER, attempt.nonce + attempt.message + attempt.confirm)

    def _attempt_failed(self, why: str) -> None:
        """An attempt that got the tail's answer but never confirmed: one guess spent."""
        self._attempt = None
        code = self.passcode
        code.failed()  # may replace a generated code (which its on_new_code shows) or lock a given one
        left, locked = MAX_FAILURES - code.failures, code.locked_for()
        note = f"a new code was made; pairing locked for {locked:.0f} s" if code.generated and not code.failures \
            else f"{left} more before {'a new code' if code.generated else 'a long lock'}" if left > 0 \
            else f"pairing locked for {locked:.0f} s"
        self.log(f"a pairing attempt failed: {why} ({note})")

    def handshake(self, timeout: float) -> None:
        """Block until this pairing is keyed (a new peer may replace a departed one meanwhile)."""
        deadline = time.monotonic() + timeout
        while not self.keyed:
            if self._failed is not None:
                raise self._failed
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"the {self.other} did not answer the pairing within {timeout:g} s")
            if self.role == "head" and self._attempt is None and self.inner.peer_present:
                self._open_pairing()
            try:
                frame = self.inner.recv(min(remaining, POLL_S) if self.role == "head" else remaining)
            except PeerGone:
                self._peer_gone()
                continue
            except TimeoutError:
                continue
            if self._take(frame) is not None:  # cannot happen: data needs keys; keep it anyway
                raise IntegrityError(f"{INTEGRITY} (data before the pairing)")

    def _peer_gone(self) -> None:
        with self._lock:
            if isinstance(self._attempt, TailPairing):
                self._attempt_failed("the head left before confirming")
            self._new_pairing()

    # -- frames --------------------------------------------------------------------------------
    def send(self, frame: bytes) -> None:
        """Seal and send one frame; before the pairing is keyed it is held and sent then."""
        if not isinstance(frame, (bytes, bytearray, memoryview)):
            raise TypeError(f"frames are bytes, not {type(frame).__name__}")
        with self._lock:
            if self._seal is not None:
                self._send_sealed(frame)
            elif len(self._pending) < PENDING_FRAMES:
                self._pending.append(bytes(frame))
            else:
                raise LinkClosed(f"the {self.other} has not completed the pairing; "
                                 f"{PENDING_FRAMES} frames are waiting for it")

    def _send_sealed(self, frame) -> None:
        header = MAGIC + bytes([DATA]) + self._sent.to_bytes(8, "big")
        nonce = NONCE_PREFIX[self._out_dir] + header[HEAD_BYTES:]
        sealed = self._seal.encrypt(nonce, pad(frame), header + self._aad[self._out_dir])
        self._sent += 1  # before sending: a nonce is never used twice, whatever send does
        self.inner.send(header + sealed)

    @property
    def last_arrival(self) -> float | None:
        """When the frame last returned by ``recv`` arrived (the inner link's clock)."""
        return getattr(self.inner, "last_arrival", None)

    def recv(self, timeout: float | None = None) -> bytes:
        """Next frame the peer sealed for this pairing; IntegrityError for anything else."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._failed is not None:
                raise self._failed
            remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            try:
                frame = self.inner.recv(remaining)
            except PeerGone:
                self._peer_gone()
                raise
            plain = self._take(frame)
            if plain is not None:
                return plain

    def _take(self, frame) -> bytes | None:
        """Plaintext of a DATA frame, or None for a frame consumed here (pairing, stale)."""
        try:
            return self._classify(bytes(frame))
        except IntegrityError as exc:
            self._failed = exc
            raise

    def _classify(self, frame: bytes) -> bytes | None:
        kind = frame[HEAD_BYTES - 1] if len(frame) >= HEAD_BYTES and frame[:len(MAGIC)] == MAGIC else None
        if kind is None:
            if frame[:4] == WIRE_MAGIC and not self.keyed:
                raise PlaintextPeer(f"the {self.other} sent an unencrypted frame: it runs without end-to-end "
                                    "encryption (--insecure); give both nodes the same pairing code instead")
            if self.role == "tail" and not self.keyed:  # from a would-be head: nothing to end yet
                self._dropped_stale += 1
                if self._dropped_stale == 1:  # once per pairing: a flood must not flood the log
                    self.log(f"ignored {len(frame)} bytes from an unpaired head that are no pairing message")
                return None
            raise IntegrityError(f"{INTEGRITY} (a frame that is not sealed)")
        if kind in SIZES:
            if len(frame) != SIZES[kind]:
                raise IntegrityError(f"{INTEGRITY} (a pairing message of {len(frame)} bytes)")
            (self._head_control if self.role == "head" else self._tail_control)(kind, frame)
            return None
        if kind != DATA or len(frame) < OVERHEAD:
            raise IntegrityError(f"{INTEGRITY} (a malformed sealed frame)")
        with self._lock:
            opener = self._open
            if opener is None:  # sealed for an earlier peer, before the relay said it left
                self._dropped_stale += 1
                return None
        counter = int.from_bytes(frame[HEAD_BYTES:DATA_HEADER_BYTES], "big")
        if counter != self._expected:
            what = "replayed" if counter < self._expected else "out of order (frames missing)"
            raise IntegrityError(f"{INTEGRITY} (frame #{counter} {what}; expected #{self._expected})")
        nonce = NONCE_PREFIX[self._in_dir] + frame[HEAD_BYTES:DATA_HEADER_BYTES]
        try:
            plain = opener.decrypt(nonce, memoryview(frame)[DATA_HEADER_BYTES:],
                                   frame[:DATA_HEADER_BYTES] + self._aad[self._in_dir])
        except InvalidTag:
            raise IntegrityError(f"{INTEGRITY} (frame #{counter} failed authentication)") from None
        frame = unpad(plain)
        if frame is None:  # authentic, so the peer itself is broken: still nothing to trust
            raise IntegrityError(f"{INTEGRITY} (frame #{counter} is badly padded)")
        self._expected += 1
        return frame

    # -- the rest of the link surface ------------------------------------------------------------
    @property
    def peer_present(self) -> bool:
        return self.inner.peer_present

    def wait_peer(self, timeout: float | None = None) -> None:
        self.inner.wait_peer(timeout)

    def close(self) -> None:
        self.inner.close()

    def __enter__(self) -> "SecureLink":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
