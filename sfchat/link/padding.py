"""Padding of sealed frames, so that their lengths tell the relay little.

Contract: ``pad(frame)`` appends 0x80 and zero bytes up to ``padded_size(len(frame) + 1)``;
``unpad`` undoes it (None for malformed padding). Every frame up to ``MIN_PADDED`` bytes (all
verdicts, whatever the number of accepted drafts; all control frames) has one size; above that,
sizes are rounded up so that only the top bits of the length show (less than 1/8 added; the
K=8 verify FORWARD of Qwen2.5-7B grows from 64,605 to 65,536 bytes). Prompt lengths still show
roughly through the size and number of prefill chunks. No I/O, no crypto.
"""

from __future__ import annotations

MIN_PADDED = 512  # every plaintext is at least this long once padded
PAD_MARK = b"\x80"


def padded_size(n: int) -> int:
    """The padded length of an ``n``-byte plaintext: at least ``MIN_PADDED``; above that, ``n``
    rounded up to a multiple of 2**(e - 3) where 2**e <= n < 2**(e + 1): eight possible lengths
    per power of two, and padding adds less than 1/8."""
    if n <= MIN_PADDED:
        return MIN_PADDED
    step = 1 << (n.bit_length() - 4)
    return -(-n // step) * step


def pad(frame) -> bytes:
    n = len(frame) + 1
    return b"".join((frame, PAD_MARK, bytes(padded_size(n) - n)))


def unpad(plain: bytes) -> bytes | None:
    """The frame inside a padded plaintext, or None when the padding is malformed."""
    end = len(plain.rstrip(b"\0")) - 1
    if end < 0 or plain[end] != PAD_MARK[0]:
        return None
    return plain[:end]
