"""When preparing the next round under the wait pays: a running estimate from measured rounds.

Contract
--------
``PreparePolicy.worth()`` says whether the driver should prepare the next round while this
round's verdict travels; ``observe(...)`` feeds it each finished round. The decision compares
what a hit saves with what preparing costs, all measured, none guessed:

* ``saved``: the draft and head compute of a round planned after its verdict (a hit takes it
  off the critical path);
* ``hit``: the chance that the prepared outcome is the real one, estimated on every round as
  (every draft accepted) x (the draft's guess of the bonus was right), the second factor learned
  on the prepared rounds that accepted every draft (``GUESS_PRIOR`` until then);
* ``penalty``: how much later than the verdict's arrival the head got to it because it was
  busy preparing (GPU and interpreter contention included), learned on prepared rounds; until
  one was, what a round's compute exceeds the verdict's latency by.

It prepares when ``hit * saved > penalty``: never without acceptance, always when the wait
hides the work and drafts are accepted. The policy knows nothing about models or links.
"""

from __future__ import annotations

WEIGHT = 0.2  # of the newest round in every running estimate
GUESS_PRIOR = 0.8  # the draft's own next token is the target's bonus this often, until measured


class PreparePolicy:
    def __init__(self):
        self.latency: float | None = None  # ms from sending to the verdict's arrival
        self.saved: float | None = None
        self.penalty: float | None = None
        self.all_accepted = 0.0
        self.guess = GUESS_PRIOR

    def worth(self) -> bool:
        if self.latency is None or self.saved is None:
            return False
        penalty = self.penalty if self.penalty is not None else max(0.0, self.saved - self.latency)
        return self.all_accepted * self.guess * self.saved > penalty

    def observe(self, *, latency_ms: float, compute_ms: float | None, all_accepted: bool,
                prepared_ms: float | None = None, guess_right: bool | None = None) -> None:
        """One round: the verdict's latency, the draft + head compute if the round was planned
        after its verdict (None for a round prepared earlier), whether it accepted every draft;
        for a round under whose wait the next was prepared, the time from sending to taking the
        verdict (``prepared_ms``) and, when every draft was accepted, whether the guess was right."""
        self.latency = _ema(self.latency, latency_ms)
        if compute_ms is not None:
            self.saved = _ema(self.saved, compute_ms)
        self.all_accepted = _ema(self.all_accepted, float(all_accepted))
        if prepared_ms is not None:
            self.penalty = _ema(self.penalty, max(0.0, prepared_ms - latency_ms))
        if guess_right is not None:
            self.guess = _ema(self.guess, float(guess_right))


def _ema(old: float | None, new: float) -> float:
    return new if old is None else (1 - WEIGHT) * old + WEIGHT * new
