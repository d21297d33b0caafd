"""What the speculator hands the driver: a frame ready to send, and what a verdict committed. Torch-free.

Contract: a ``Frame`` is one frame's encoded FORWARDs (prefill ones first, the tree FORWARD last),
the live-tree nodes its verdict is checked against, the tree's estimate of what it commits, and
its build's figures; the driver stamps ``sent_at``, ``ahead`` and ``schedule``. A ``Commit`` is the tokens a
verdict committed after the reply's EOS, budget and window cut them, and why the reply ended
(None while it goes on). Plain data: no models, no links.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sfchat.engine.live import Node


@dataclass(frozen=True)
class Commit:
    tokens: tuple[int, ...]  # committed by the verdict (after truncation)
    finish: str | None  # None, "eos", "length" or "context"


@dataclass
class Frame:
    """One frame, ready to send: its FORWARDs and the nodes the verdict is checked against."""

    round_id: int
    tree: int
    nodes: list[Node]
    frames: list[bytes]
    expected: float  # the tree's estimate of the tokens it commits
    draft_ms: float
    head_ms: float
    steady: bool  # no prefill: its compute is a frame's alone
    steps: int = 0  # draft steps its build ran
    sent_at: float = 0.0  # perf_counter just before its FORWARDs were handed to the link
    ahead: bool = False  # it went out while another frame was in flight
    schedule: str = ""  # the policy's schedule it was built under (``engine.policy.Schedule.name``)
    forward_bytes: int = field(init=False)
    sent_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.forward_bytes = len(self.frames[-1])
        self.sent_bytes = sum(map(len, self.frames))
