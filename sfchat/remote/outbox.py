"""What one side of a chat link sent and the other has not acknowledged, sent again after a reconnect.

Contract
--------
``Outbox(name)`` numbers sequenced messages (``put(make)``: ``make(seq)`` builds the message
with the next number, 1, 2, 3 ...), keeps them until ``ack(seen)`` says the other side took
every one up to ``seen``, and sends them, in order, from a thread of its own to the link given
by ``attach(link, after)``: every kept message numbered above ``after`` first, then each new one.
``detach()`` stops sending (the link is gone); ``close()`` ends the thread. ``restart(seq)``
forgets every message and numbers the next ``seq + 1`` (the other side forgot ours).
``rewrite_unsent(fn)`` hands the messages never sent since the last ``attach`` to ``fn`` and
keeps, renumbered, what it returns (the host folds what a detached client has not seen yet); it
returns how many are kept in all. A message the link refuses to send detaches the outbox: the
caller's receiving side sees the link's end and attaches again. The sender never holds the lock
while it sends. Torch-free; knows nothing of what the messages mean (see ``protocol.chat``).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import deque
from typing import Callable

from sfchat.protocol import chat

_log = logging.getLogger(__name__)


class Outbox:
    def __init__(self, name: str):
        self._cond = threading.Condition()
        self._items: deque = deque()  # messages kept, oldest first, numbered consecutively
        self.last = 0  # the number of the newest message made
        self._sent = 0  # the newest number handed to the current link
        self._link = None
        self._epoch = 0  # counts attachments: a send for an earlier one does not move the cursor
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, make: Callable[[int], object]) -> object:
        with self._cond:
            self.last += 1
            message = make(self.last)
            self._items.append(message)
            self._cond.notify_all()
            return message

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)

    def ack(self, seen: int) -> None:
        with self._cond:
            while self._items and self._items[0].seq <= min(seen, self._sent):
                self._items.popleft()

    def kept_after(self, seen: int) -> bool:
        """Whether every message numbered above ``seen`` is still kept (a resumption can go on)."""
        with self._cond:
            first = self._items[0].seq if self._items else self.last + 1
            return first - 1 <= seen <= self.last

    def attach(self, link, after: int) -> None:
        with self._cond:
            self.ack(after)
            self._link, self._sent = link, after
            self._epoch += 1
            self._cond.notify_all()

    def detach(self) -> None:
        with self._cond:
            self._link = None
            self._epoch += 1

    def restart(self, seq: int = 0) -> None:
        with self._cond:
            self._items.clear()
            self.last = self._sent = seq
            self._epoch += 1

    def rewrite_unsent(self, fn: Callable[[list], list]) -> int:
        with self._cond:
            sent = [m for m in self._items if m.seq <= self._sent]
            unsent = fn([m for m in self._items if m.seq > self._sent])
            renumbered = [dataclasses.replace(m, seq=self._sent + i + 1) for i, m in enumerate(unsent)]
            self._items = deque(sent + renumbered)
            self.last = self._sent + len(renumbered)
            return len(self._items)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._link = None
            self._cond.notify_all()

    def _next(self):
        """(link, message, epoch) to send next, waiting until there is one; None once closed."""
        with self._cond:
            while True:
                if self._closed:
                    return None
                if self._link is not None and self.last > self._sent:
                    message = next(m for m in self._items if m.seq > self._sent)
                    self._sent = message.seq
                    return self._link, message, self._epoch
                self._cond.wait()

    def _run(self) -> None:
        while (item := self._next()) is not None:
            link, message, epoch = item
            try:
                link.send(chat.encode(message))
            except Exception as exc:  # the link is gone (or refused the frame): the receiver re-attaches
                _log.debug("chat outbox: send failed: %s", exc)
                with self._cond:
                    if self._epoch == epoch:
                        self._link = None
