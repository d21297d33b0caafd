"""Waiting in tests for something another thread does: poll with a generous deadline, never time it."""

from __future__ import annotations

import time

WAIT = 60.0  # a bound on a hung test, not a measurement: a loaded machine stays far below it


def until(condition, wait: float = WAIT) -> bool:
    """Poll ``condition()`` until it holds (True) or ``wait`` seconds have passed (False)."""
    deadline = time.monotonic() + wait
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True
