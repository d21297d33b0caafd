"""Stop strings over streamed text.

Contract
--------
``StopMatcher(stops)`` takes the reply's text in pieces (``push``) and returns the part that is
safe to show: text that cannot be the beginning of a stop string is released at once, a tail
that could still grow into one is held back until the next piece decides it. Once a stop string
appears, ``hit`` is true, the text before it is released, and nothing after it ever is; the
stop string itself is not part of the output (OpenAI's rule). ``flush`` releases what is held
back when the reply ends without a stop. ``text`` is everything released so far, and ``end``
the length of the generated text up to the end of the stop string (to count the tokens it took).

Pure Python; knows nothing of tokens.
"""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: tuple[str, ...] | list[str]):
        self.stops = tuple(s for s in stops if s)
        self.seen = ""  # all text pushed so far
        self.released = 0  # how much of ``seen`` has been returned
        self.hit = False
        self.end: int | None = None  # len(seen) up to the end of the stop string, once hit

    @property
    def text(self) -> str:
        return self.seen[:self.released]

    def push(self, piece: str) -> str:
        if self.hit:
            return ""
        self.seen += piece
        # a stop string cannot start before ``released``: text there was released only once no
        # stop string could begin in it
        found = [(i, s) for s in self.stops if (i := self.seen.find(s, self.released)) >= 0]
        if found:
            i, s = min(found)
            self.hit, self.end = True, i + len(s)
            return self._release(i)
        hold = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.seen) - self.released), hold, -1):
                if self.seen.endswith(s[:n]):
                    hold = n
                    break
        return self._release(len(self.seen) - hold)

    def flush(self) -> str:
        return "" if self.hit else self._release(len(self.seen))

    def _release(self, upto: int) -> str:
        out = self.seen[self.released:upto]
        self.released = upto
        return out
