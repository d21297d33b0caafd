"""The relay's log: bounded whatever clients do.

Contract
--------
* ``LogOnce`` logs a refusal or a limit hit once per (client address, kind), then stays quiet
  about that pair for ``quiet_s`` and says, next time, how many were not logged.
* ``RateLimitedHandler`` is the one handler ``sfchat-relay`` installs on the root logger, so it
  bounds every line: the relay's own, websockets' and asyncio's (``socket.accept() out of system
  resource`` and its traceback included). A record longer than ``max_record`` characters is cut
  there; records are written while a token bucket of ``rate`` bytes per second (room for
  ``burst``) allows it, and dropped otherwise; the next record written is preceded by one line
  saying how many were dropped. Written bytes therefore never exceed
  ``burst + rate * seconds`` (plus one short notice per quiet spell).

A hostile client repeating itself, or very many clients each once, cannot fill the disk:
with the defaults a day of flood writes at most 64 KiB + 86,400 s x 2 KiB/s = 169 MiB, and a
30 s flood at most 124 KiB.

This module knows nothing of websockets or sessions.
"""

from __future__ import annotations

import logging
import time

from relay.budget import TokenBucket

log = logging.getLogger("relay")

LOG_RATE = 2048.0  # bytes per second, sustained
LOG_BURST = 64 << 10  # bytes
MAX_RECORD = 2048  # characters of one record, traceback included


class LogOnce:
    """Log a refusal once per (address, kind), then stay quiet about it for a while."""

    def __init__(self, quiet_s: float = 600.0, max_keys: int = 4096):
        self.quiet_s, self.max_keys = quiet_s, max_keys
        self._until: dict[tuple[str, str], float] = {}
        self._muted: dict[tuple[str, str], int] = {}

    def __call__(self, host: str, kind: str, message: str, *args) -> None:
        key, now = (host, kind), time.monotonic()
        if now < self._until.get(key, 0.0):
            self._muted[key] = self._muted.get(key, 0) + 1
            return
        muted = self._muted.pop(key, 0)
        if len(self._until) >= self.max_keys:  # bounded memory; the handler still bounds the log
            self._until.clear()
            self._muted.clear()
        self._until[key] = now + self.quiet_s
        note = f" ({muted} more like it were not logged)" if muted else ""
        log.warning(message + note + " [repeats from %s not logged for %d min]", *args, host,
                    round(self.quiet_s / 60))


class RateLimitedHandler(logging.StreamHandler):
    """A stream handler that writes at most ``burst + rate * t`` bytes in ``t`` seconds."""

    def __init__(self, stream=None, rate: float = LOG_RATE, burst: float = LOG_BURST,
                 max_record: int = MAX_RECORD):
        super().__init__(stream)
        self.bucket = TokenBucket(rate, burst)
        self.max_record = max_record
        self.dropped = 0

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.format(record)
        except Exception:  # noqa: BLE001 - a bad record must not take the relay down
            self.handleError(record)
            return
        if len(text) > self.max_record:
            text = text[:self.max_record] + f" [... {len(text) - self.max_record} characters cut]"
        notice = ""
        if self.dropped:
            notice = f"{self.formatter.formatTime(record) if self.formatter else ''} WARNING " \
                     f"{self.dropped} log records not written: log rate limit\n"
        if not self.bucket.take(len(text) + 1 + len(notice)):
            self.dropped += 1
            return
        self.dropped = 0
        try:
            self.stream.write(notice + text + self.terminator)
            self.flush()
        except Exception:  # noqa: BLE001
            self.handleError(record)
