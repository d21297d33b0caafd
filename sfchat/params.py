"""The generation parameters a reply is asked for: one typed value from the settings to sampling.

Contract
--------
``GenParams`` is a frozen dataclass of the five values that shape a reply's sampling:
``temperature`` (0: greedy), ``top_k`` (0: off), ``top_p`` (1: off), ``repetition_penalty`` (1:
off) and ``seed``. Each is None where whoever asks leaves it to the next source: a request to the
head's settings, the settings to the model's own ``generation_config.json``, that to ``BUILT_IN``
(greedy, every filter off, no seed: fresh randomness for every reply); ``over(other)`` fills each
None from ``other``, and ``given()`` is the values set, by name.

``BOUNDS`` is the one table of what each value may be (its type and range; ``above``: the low end
itself excluded): ``config.RULES``, the chat protocol (``protocol.chat``) and ``--serve``'s request
check (``serve.protocol``) each read their ranges from it and word a refusal their own way. Making
a ``GenParams`` checks every value against it (a ValueError naming the value; a float value takes
an integer and holds it as a float, a bool is no number, NaN and infinities are refused), so a
``GenParams`` is valid wherever it goes and what receives one does not check it again.

``Ask`` is what a chat screen sends with every prompt, to a head in this process or elsewhere: the
reply's token limit (``DEFAULT_MAX_NEW_TOKENS``, the setting's default, unless given) and its
``GenParams``.

Torch-free; imports nothing of sfchat.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

MAX_TEMPERATURE = 2.0  # the OpenAI API's range, which the server keeps too: above it replies turn to noise
MAX_TOP_K = 1 << 20
REPETITION_PENALTY = (0.01, 10.0)  # the range every source of a repetition penalty is held to; 1.0: off
SEED = (-(1 << 63), (1 << 64) - 1)  # 64 bits, signed or not; the wire carries it unsigned
DEFAULT_MAX_NEW_TOKENS = 1024


@dataclass(frozen=True)
class Bound:
    """A value of ``kind`` in ``lo``..``hi`` (``above``: lo itself excluded)."""

    kind: type
    lo: float
    hi: float
    above: bool = False

    def fits(self, value) -> bool:
        if type(value) is not self.kind or (self.kind is float and not math.isfinite(value)):
            return False
        return (value > self.lo if self.above else value >= self.lo) and value <= self.hi


BOUNDS: dict[str, Bound] = {
    "temperature": Bound(float, 0.0, MAX_TEMPERATURE),
    "top_k": Bound(int, 0, MAX_TOP_K),
    "top_p": Bound(float, 0.0, 1.0, above=True),
    "repetition_penalty": Bound(float, *REPETITION_PENALTY),
    "seed": Bound(int, *SEED),
}


@dataclass(frozen=True)
class GenParams:
    """A reply's sampling as asked (see the module's contract); None: the next source's to choose."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        for name, bound in BOUNDS.items():
            value = getattr(self, name)
            if value is None:
                continue
            if bound.kind is float and type(value) is int:
                value = float(value)
                object.__setattr__(self, name, value)
            if not bound.fits(value):
                shown = repr(value)
                raise ValueError(f"{name} must be {'a number' if bound.kind is float else 'a whole number'} "
                                 f"{'above' if bound.above else 'from'} {bound.lo} to {bound.hi}, "
                                 f"not {shown if len(shown) <= 60 else shown[:57] + '...'}")

    def given(self) -> dict:
        """The values set (not None), by name."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    def over(self, other: "GenParams") -> "GenParams":
        """These values, each None taken from ``other``."""
        return dataclasses.replace(other, **self.given())


BUILT_IN = GenParams(temperature=0.0, top_k=0, top_p=1.0, repetition_penalty=1.0)  # greedy, every filter off


@dataclass(frozen=True)
class Ask:
    """What a chat screen asks with a prompt: at most ``max_new_tokens`` tokens, sampled by ``gen``."""

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    gen: GenParams = GenParams()
