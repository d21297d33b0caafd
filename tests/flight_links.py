"""Test links and policies for frames in flight: a local link whose frames queue as a relay's do,
and a policy that always answers the same frame size and number in flight."""

from __future__ import annotations

import torch

from sfchat.engine.policy import ROUND, Schedule
from sfchat.engine.verifier import Verifier
from sfchat.node.tail_loader import TailLoader
from sfchat.node.local_link import MemoryLink
from sfchat.protocol import wire
from sfchat.protocol.wire import Forward, decode


class Pipelined(MemoryLink):
    """Local mode's link, with frames queued as a relay queues them: the head sends frames ahead
    (``overlaps``), and the tail runs each frame, in order, when the head waits for a verdict."""

    overlaps = True

    def __init__(self, verifier=None):
        super().__init__(verifier or Verifier(TailLoader(torch.device("cpu"))))
        self.sent: list[wire.Forward] = []

    def send(self, frame: bytes) -> None:
        msg = decode(frame)
        if isinstance(msg, Forward):
            self.sent.append(msg)
        super().send(frame)


class Always:
    """A policy that always answers ``m`` frames in flight: the mechanism under test, not the choice."""

    min_yield = 0.0  # every frame goes out, however unlikely its nodes

    def __init__(self, m: int):
        self.m, self.max_in_flight = m, m

    def choose(self) -> int:
        return self.m

    def schedule(self):
        return ROUND if self.m == 1 else Schedule("always", None, self.m)  # every frame runs all its steps

    def step_gain(self) -> float:
        return 0.0  # every frame runs all its draft steps

    def observe(self, *args, **kw):
        pass
