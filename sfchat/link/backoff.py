"""One backoff for every redial of a relay session, and the loop that applies it under one deadline.

Contract
--------
``Backoff(first, longest)`` is the one redial policy: ``next()`` returns the wait before the next
try, ``first`` at first, doubled after each, never more than ``longest`` (``REDIAL_S`` unless
given); ``reset()`` starts it over (a try that succeeded). ``redial(attempt, retry_on, ...)``
calls ``attempt(left)`` until it returns, ``left`` being what is left of ``deadline`` (at least
``MIN_WAIT_S``; None without a deadline); an exception of ``retry_on`` is handed to
``on_retry(exc, delay)`` (which may raise, to stop), then ``pause(delay)`` waits (it may raise
too: a closed owner) and the next try comes. A try that would start past ``deadline`` is not
made: ``GaveUp`` is raised, carrying the last failure. Everything else passes through. The
listener (``link.listener``) and the dialer's two callers, the head's round driver
(``node.driver``) and the chat screen's runtime (``remote.client``), redial through it; no other
backoff is written in sfchat (a dial that finds the head slot taken tries again within that
dial: ``relay.join_while_taken``). ``clock`` and ``pause`` are for tests.
Standard library only.
"""

from __future__ import annotations

import time
from typing import Callable, TypeVar

REDIAL_S = (0.5, 10.0)  # the first wait between two dials, and the longest
MIN_WAIT_S = 1.0  # the least a try is given of what is left of a deadline

T = TypeVar("T")


class GaveUp(Exception):
    """The deadline passed before a try succeeded; ``last`` is the last failure."""

    def __init__(self, last: BaseException):
        super().__init__(str(last))
        self.last = last


class Backoff:
    """Waits that double from ``first`` up to ``longest``."""

    def __init__(self, first: float = REDIAL_S[0], longest: float = REDIAL_S[1]):
        self.first, self.longest = first, longest
        self.reset()

    def reset(self) -> None:
        self.delay = self.first

    def next(self) -> float:
        delay, self.delay = self.delay, min(self.delay * 2, self.longest)
        return delay


def redial(attempt: Callable[[float | None], T], retry_on: type[BaseException] | tuple, *,
           deadline: float | None = None, on_retry: Callable[[BaseException, float], None] = lambda exc, delay: None,
           pause: Callable[[float], None] | None = None, backoff: Backoff | None = None,
           clock: Callable[[], float] = time.monotonic) -> T:
    """``attempt(left)`` until it returns, with ``backoff`` between tries (see the module docstring)."""
    backoff = backoff or Backoff()
    while True:
        left = None if deadline is None else max(deadline - clock(), MIN_WAIT_S)
        try:
            return attempt(left)
        except retry_on as exc:
            delay = backoff.next()
            if deadline is not None and clock() + delay > deadline:
                raise GaveUp(exc) from exc
            on_retry(exc, delay)
            (pause or time.sleep)(delay)
