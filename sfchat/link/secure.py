"""End-to-end encryption of the head <-> tail link, so that the relay learns nothing and can change nothing.

Contract
--------
``SecureLink(inner, code, session, role, log, resumption, names)`` wraps any frame link with RelayLink's
surface (``send``, ``recv``, ``wait_peer``, ``peer_present``, ``closed_reason``, ``close``), pairs the two nodes
(``sfchat.link.pairer``: SPAKE2 over the short code, or over the resumption secret an earlier
code pairing left in ``resumption``; keys for this pairing only) and seals every frame with
AES-256-GCM. ``recv`` returns only frames that the other node sealed for this pairing, in the
order it sent them; anything else raises ``IntegrityError`` (altered, injected, reordered,
replayed or dropped frames). ``PeerGone``, ``LinkClosed`` and ``TimeoutError`` pass through as
RelayLink raises them. ``handshake(timeout)`` pairs eagerly so that a wrong code shows before
anything else is done. ``send`` and ``recv`` are meant for one thread (``send`` is also safe
from others).

The head opens every pairing (a resumption first when it holds a secret, then its code, when it
was given one: ``code`` None means resumption only) and takes a failure as final: ``WrongCode``
(the codes differ, or someone in between guessed), ``ResumptionRefused`` (no resumption, and no
code to try), ``PairingRefused`` (a second attempt on one connection), ``PlaintextPeer`` (the
tail does not encrypt), other ``IntegrityError``s. The tail (``code`` a ``pairing.Passcode``, shared
by its links) serves one head after another on one relay connection: a failed or forged
pairing attempt never raises there; it is answered within the code's budget (an opening that
must wait for its turn is answered from inside ``recv`` or ``handshake`` once the turn comes),
counted and reported through ``log``, in the words of ``names`` (``pairer.Names``). An integrity error of a paired tail ends that head's
session; ``restart()`` forgets the pairing (and the error) so that the same connection serves
the next.

What the relay still sees: that a session exists, its name, the nodes' addresses, that a
pairing happened (whether it was a resumption, and failed or not), the timing of every frame
and its size rounded up by ``sfchat.link.padding.padded_size``. Token ids, hidden states, the
model name and all metadata are sealed; the pairing messages hold nothing to test a guessed
code (or resumption secret) against.

Frames
------
The pairing frames are ``sfchat.link.pairer``'s; data travels in::

    DATA     "SFX2" 0x05 counter(8, big-endian) ciphertext tag(16)

    nonce = direction prefix (4 bytes) + counter (8 bytes)     (96 bits; never reused per key)
    aad   = the 13 DATA header bytes + "sfchat-e2e/2" + S + direction
    plaintext = frame + 0x80 + zero bytes, to ``padded_size(len(frame) + 1)`` bytes

A forged REFUSE can only make a pairing fail, as the relay could by dropping frames. Each
direction has its own key (``pairing.Keys``), counters start at 0 at each pairing, frames of an
earlier pairing never verify under the next one's keys. Frames sent before the pairing is keyed
are held (at most ``PENDING_FRAMES``); sealed frames arriving before it (for an earlier peer)
are dropped. Padding (``sfchat.link.padding``) hides what frame lengths would otherwise tell the relay.

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
from sfchat.link.pairer import (  # noqa: F401  (the pairing errors are this link's errors too)
    DATA, HEAD_BYTES, INTEGRITY, MAGIC, SIZES, CodeNeeded, HeadPairer, IntegrityError, Names, PairingRefused,
    PlaintextPeer, ResumptionRefused, SecretMismatch, TailPairer, WrongCode,
)
from sfchat.link.pairing import Passcode
from sfchat.link.resume import Resumption
from sfchat.link import LinkClosed, PeerGone

TAG_BYTES = 16
DATA_HEADER_BYTES = HEAD_BYTES + 8
OVERHEAD = DATA_HEADER_BYTES + TAG_BYTES  # bytes a sealed frame adds to its padded plaintext
PENDING_FRAMES = 64
LABEL = pairing.LABEL
DIRECTIONS = {"head": b"head->tail", "tail": b"tail->head"}  # keyed by the sender
NONCE_PREFIX = {b"head->tail": b"\x00\x00\x00\x01", b"tail->head": b"\x00\x00\x00\x02"}
WIRE_MAGIC = b"SFCH"  # an unencrypted sfchat frame (sfchat.protocol.wire.MAGIC)
POLL_S = 0.1  # how often an unpaired head looks whether a tail has (re)joined

_log = logging.getLogger(__name__)


def secure(inner, code: str | None, session: str, role: str, timeout: float = 60.0,
           resumption: Resumption | None = None) -> "SecureLink":
    """``inner`` wrapped and paired within ``timeout`` s (no answer: a UserError). A failed
    pairing raises its ``SecretMismatch``, which a reconnecting head does not retry.
    ``inner`` is closed when this fails."""
    try:
        link = SecureLink(inner, code, session, role, resumption=resumption)
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

    def __init__(self, inner, code: "str | Passcode | None", session: str, role: str,
                 log: Callable[[str], None] | None = None, resumption: Resumption | None = None,
                 names: Names = Names()):
        if role not in DIRECTIONS:
            raise ValueError(f"role must be 'head' or 'tail', not {role!r}")
        if not code and (role == "tail" or resumption is None or resumption.secret is None):
            raise ValueError("a SecureLink needs a pairing code (a head: or a resumption secret)")
        self.inner, self.role, self.session = inner, role, session
        self.other = "tail" if role == "head" else "head"
        self.log = log or (lambda message: _log.info("%s", message))
        if role == "head":
            self._pairer: HeadPairer | TailPairer = HeadPairer(code, session, resumption)
        else:
            passcode = code if isinstance(code, Passcode) else Passcode(code)
            self._pairer = TailPairer(passcode, session, resumption, self.log, names)
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
            self._seal: AESGCM | None = None
            self._open: AESGCM | None = None
            self._sent = self._expected = 0
            self._pending: deque[bytes] = deque()
            self._dropped_stale = 0

    def restart(self) -> None:
        """Tail: forget this pairing and any integrity error; wait for the next head's pairing.
        An attempt still open counts as failed (its opener got an answer to test one guess);
        the head connection keeps the attempts it has made."""
        with self._lock:
            self._failed = None
            self._pairer.reset()
            self._new_pairing()

    @property
    def paired_by(self) -> str | None:
        """Head: how this link paired, "code" or "resume" (None before it has)."""
        return getattr(self._pairer, "paired_by", None)

    @property
    def keyed(self) -> bool:
        with self._lock:
            return self._seal is not None

    def _key(self, keys: pairing.Keys) -> None:
        mine, theirs = (keys.head_to_tail, keys.tail_to_head) if self.role == "head" else \
            (keys.tail_to_head, keys.head_to_tail)
        self._seal, self._open = AESGCM(mine), AESGCM(theirs)

    def _send_all(self, frames: list[bytes]) -> None:
        with self._lock:
            for frame in frames:
                self.inner.send(frame)

    def _open_pairing(self) -> None:
        with self._lock:
            self._send_all([self._pairer.opening()])

    def _control(self, kind: int, frame: bytes) -> None:
        with self._lock:
            if self._seal is not None:
                raise IntegrityError(f"{INTEGRITY} (a pairing message inside a paired session)")
            step = self._pairer.take(kind, frame[HEAD_BYTES:])
            try:
                self._send_all(step.send)  # a CONFIRM before any data, which it keys on the tail
            except LinkClosed:
                if step.keys is not None:
                    raise
            if step.error is not None:
                raise step.error
            if step.keys is not None:
                self._key(step.keys)
                while self._pending:
                    self._send_sealed(self._pending.popleft())

    def _answer_held(self) -> None:
        """Tail: a held opening whose turn has come is answered now."""
        with self._lock:
            try:
                self._send_all(self._pairer.tick())
            except LinkClosed:
                pass  # the next recv says so

    def handshake(self, timeout: float) -> None:
        """Block until this pairing is keyed (a new peer may replace a departed one meanwhile)."""
        deadline = time.monotonic() + timeout
        while not self.keyed:
            if self._failed is not None:
                raise self._failed
            if time.monotonic() >= deadline:
                raise TimeoutError(f"the {self.other} did not answer the pairing within {timeout:g} s")
            if self.role == "head" and self._pairer.attempt is None and self.inner.peer_present:
                self._open_pairing()
            try:
                frame = self._next(min(deadline, time.monotonic() + POLL_S) if self.role == "head" else deadline)
            except PeerGone:
                self._peer_gone()
                continue
            except TimeoutError:
                continue
            if frame is not None and self._take(frame) is not None:  # cannot happen: data needs keys
                raise IntegrityError(f"{INTEGRITY} (data before the pairing)")

    def _peer_gone(self) -> None:
        with self._lock:
            if isinstance(self._pairer, TailPairer):
                self._pairer.peer_gone()
            else:
                self._pairer.reset()
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
    def closed_reason(self) -> str | None:
        """Why the inner link is gone, None while it is up."""
        return getattr(self.inner, "closed_reason", None)

    @property
    def last_arrival(self) -> float | None:
        """When the frame last returned by ``recv`` arrived (the inner link's clock)."""
        return getattr(self.inner, "last_arrival", None)

    def _next(self, deadline: float | None):
        """The inner link's next frame by ``deadline`` (``time.monotonic``; None: no limit), or None
        when a held pairing opening's turn came first (it is answered then)."""
        due = self._pairer.due() if isinstance(self._pairer, TailPairer) else None
        held_first = due is not None and (deadline is None or due < deadline)
        until = due if held_first else deadline
        try:
            return self.inner.recv(None if until is None else max(until - time.monotonic(), 0.0))
        except TimeoutError:
            if not held_first:
                raise
        self._answer_held()
        return None

    def recv(self, timeout: float | None = None) -> bytes:
        """Next frame the peer sealed for this pairing; IntegrityError for anything else."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._failed is not None:
                raise self._failed
            try:
                frame = self._next(deadline)
            except PeerGone:
                self._peer_gone()
                raise
            plain = self._take(frame) if frame is not None else None
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
                    self.log(f"ignored {len(frame)} bytes that are no pairing message from "
                             f"{self._pairer.names.a_peer} not paired yet")
                return None
            raise IntegrityError(f"{INTEGRITY} (a frame that is not sealed)")
        if kind in SIZES:
            if len(frame) != SIZES[kind]:
                raise IntegrityError(f"{INTEGRITY} (a pairing message of {len(frame)} bytes)")
            self._control(kind, frame)
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
