"""The log of a long-lived sfchat node (``sfchat --tail``, the chat host of ``--offer-chat``): one rate limit.

Contract: ``node_log(name)`` returns the function that writes one line of that node's log to
stderr: ``[sfchat NAME HH:MM:SS] message``, the message made plain (``plaintext.plain``), and
the line passed through ``LIMIT``, the one ``LogLimit`` of this process, which every node log
in it shares. So nothing a peer can cause (relay joins and leaves, pairing and resumption
attempts, frames refused) makes a process write more than ``LOG_BURST_BYTES`` at once and
``LOG_BYTES_PER_S`` on average; the lines left out are counted in the next line written.
``limited(log)`` puts any other log function behind the same limit (a node log as it is): the
listener (``sfchat.link.listener``) logs through it, whatever log it is given. ``LogLimit`` is
a token bucket of bytes; its ``clock`` is for tests. Standard library only.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Callable

from sfchat.plaintext import plain

LOG_BYTES_PER_S = 2048  # what a node's log may write per second, on average...
LOG_BURST_BYTES = 64 << 10  # ...and at once


class LogLimit:
    """A token bucket of bytes for log lines; thread-safe."""

    def __init__(self, per_s: float = LOG_BYTES_PER_S, burst: int = LOG_BURST_BYTES, clock=time.monotonic):
        self.per_s, self.burst, self.clock = per_s, burst, clock
        self.room, self.at = float(burst), clock()
        self.left_out = 0
        self._lock = threading.Lock()

    def admit(self, line: str) -> str | None:
        """``line`` as it may be written now (with a count of the lines left out before it), or None."""
        with self._lock:
            now = self.clock()
            self.room, self.at = min(self.burst, self.room + (now - self.at) * self.per_s), now
            if self.room < len(line):
                self.left_out += 1
                return None
            self.room -= len(line)
            if self.left_out:
                line, self.left_out = f"({self.left_out} log lines left out: too many) {line}", 0
            return line


LIMIT = LogLimit()  # the process's one: every node log below passes it


def node_log(name: str) -> Callable[[str], None]:
    """The log function of the node called ``name`` ("tail", "chat")."""

    def log(message: str) -> None:
        line = LIMIT.admit(f"[sfchat {name} {time.strftime('%H:%M:%S')}] {plain(message)}")
        if line is not None:
            print(line, file=sys.stderr, flush=True)

    log.limited = True
    return log


def limited(log: Callable[[str], None]) -> Callable[[str], None]:
    """``log`` with every line (made plain) through ``LIMIT``; a log that is already behind it as it is."""
    if getattr(log, "limited", False):
        return log

    def admitted(message: str) -> None:
        line = LIMIT.admit(plain(message))
        if line is not None:
            log(line)

    admitted.limited = True
    return admitted
