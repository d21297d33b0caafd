"""A conversation longer than the context window: its oldest turns are left out of the prompt.

Contract
--------
``ContextWindow(max_context)`` is the one place that fits a chat's conversation into the window,
used by every front end that keeps a conversation (the chat screen, local or remote, through
``Head.ask``). ``fit(messages, max_new_tokens, encode)`` returns a ``Fitted``: the prompt ids
(``encode(messages)`` of what is kept) and how many turns were left out.

* A *turn* is a user message and everything after it up to the next user message (the reply).
  The system prompt (a first message of role "system") is always kept, and so is the last turn,
  the one of the newest user message; only whole turns are left out, the oldest first.
* The reply's room is its token limit, but at most a quarter of the window. A conversation whose
  prompt and that room fit the window is kept whole. Otherwise turns are left out:

  1. the same turns as last time, when this conversation still begins with what was left out
     last time and that is enough (the prompt's start stays the same, so the K/V cached for it
     is reused: the head reuses the longest cached prefix of every prompt);
  2. else as many as it takes to bring the prompt down to half the window (llama.cpp's context
     shift frees half as well): the turns that come next keep that same start, and reuse its
     K/V, until the window is full again;
  3. else (the kept turns are long) the fewest that leave the reply its room;
  4. else all but the newest, when that still leaves the reply one token;
  5. else a ``UserError``: the newest message alone does not fit.

  Token counts come from ``encode`` itself, never estimated: each rendering is counted, and
  the turns to leave out are found by bisection (a few renderings, about ``2 log2(turns)``), which
  takes it that a prompt does not grow as turns are left out.
* ``forget()`` (a new chat) drops what was left out last time.

The ``--serve`` endpoint does not use it: an API client manages its own messages, and gets a
clear error past the window. Knows nothing of models or links.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from sfchat import UserError

ROOM_SHARE = 4  # the reply's room is at most 1 / ROOM_SHARE of the window


@dataclass(frozen=True)
class Fitted:
    ids: list[int]  # the prompt: what is kept, encoded
    dropped: int  # turns left out, the oldest ones


def turn_starts(messages: list[dict]) -> list[int]:
    """Indices where the turns begin: after a system prompt, each user message (and the first
    message, whatever its role, so that nothing before the first user message is orphaned)."""
    first = 1 if messages and messages[0].get("role") == "system" else 0
    return [i for i in range(first, len(messages)) if i == first or messages[i].get("role") == "user"]


class ContextWindow:
    def __init__(self, max_context: int):
        self.max_context = max_context
        self._left_out: list[dict] = []  # the system prompt and the turns left out last time

    def forget(self) -> None:
        self._left_out = []

    def fit(self, messages: list[dict], max_new_tokens: int, encode: Callable[[list[dict]], list[int]]) -> Fitted:
        """The prompt of ``messages`` that fits the window (see the module's contract)."""
        starts = turn_starts(messages)
        system = messages[:starts[0]] if starts else list(messages)
        limit = self.max_context - max(1, min(max_new_tokens, self.max_context // ROOM_SHARE))
        encoded: dict[int, list[int]] = {}

        def ids(dropped: int) -> list[int]:
            if dropped not in encoded:
                encoded[dropped] = encode(system + messages[starts[dropped]:] if dropped else list(messages))
            return encoded[dropped]

        droppable = max(0, len(starts) - 1)
        dropped = 0 if len(ids(0)) <= limit else self._same_as_before(messages, starts, limit, ids)
        if dropped is None:
            dropped = self._fewest(droppable, self.max_context // 2, ids) or self._fewest(droppable, limit, ids)
        if dropped is None:
            dropped = droppable
            if len(ids(dropped)) >= self.max_context:
                alone = " with only the system prompt and the newest message kept" if dropped else ""
                raise UserError(f"the prompt has {len(ids(dropped))} tokens{alone}, the context window is "
                                f"{self.max_context}: shorten it or raise --max-context")
        self._left_out = list(messages[:starts[dropped]]) if dropped else []
        return Fitted(ids(dropped), dropped)

    def _same_as_before(self, messages, starts, limit: int, ids) -> int | None:
        """The turns left out last time, when this conversation begins with them and they suffice."""
        kept = len(self._left_out)
        if not self._left_out or kept not in starts[1:] or messages[:kept] != self._left_out:
            return None
        dropped = starts.index(kept)
        return dropped if len(ids(dropped)) <= limit else None

    @staticmethod
    def _fewest(droppable: int, bound: int, ids) -> int | None:
        """The fewest oldest turns (at least one) to leave out for a prompt of at most ``bound``
        tokens; None when leaving out every droppable one is not enough."""
        if droppable == 0 or len(ids(droppable)) > bound:
            return None
        lo, hi = 1, droppable  # hi is enough
        while lo < hi:
            mid = (lo + hi) // 2
            if len(ids(mid)) <= bound:
                hi = mid
            else:
                lo = mid + 1
        return hi
