"""The draft's own contract beyond what the replies show: its prefill never runs the expansion
step's compiled forward (a GPU compiles the draft for its captured step, one fixed shape)."""

from __future__ import annotations

import pytest
import torch

from sfchat.config import Settings
from sfchat.node.head import Head
from sfchat.protocol.wire import Sampling


def test_the_drafts_prefill_runs_the_plain_forward_not_the_steps_compiled_one(zoo):
    """Found: a GPU compiles the draft (``capture(compile=True)``, the default) for its expansion
    step, and the prefill of each reply's new context ran that compiled forward too: every new
    length compiled anew (8-11 s each for a tiny model on this machine's CPU; dynamic=False), and
    past dynamo's recompile limit it fell back to eager or, with --compile-attention's strict
    limits, raised mid-reply. The prefill is a plain forward now; the step's proposals are the
    same as before."""
    s = Settings(model=str(zoo["qwen2-untied"]), draft=str(zoo["draft"]), k=4, device="cpu")
    head = Head.open(s)
    drafter = head.engine.drafter
    plain, calls = drafter.forward, []

    def step_forward(*args, **kw):  # stands for the compiled one: the expansion step may use it
        calls.append(args[0].shape[0])
        return plain(*args, **kw)

    drafter.forward = step_forward
    for n in (37, 52, 70):  # prompts of three lengths: three prefills of new shapes
        drafter.sync(list(range(3, 3 + n)))
        assert calls == [], f"the prefill ran the step's forward on {calls} rows"
        proposals = drafter.expand([(9, n, "a", [])], Sampling())
        assert calls == [drafter.rows] and len(proposals[0]) == drafter.children
        calls.clear()
        drafter.scratch.release("a")
    head.close()
    fresh = Head.open(s).engine.drafter  # the same context fed by the plain forward throughout
    fresh.sync(list(range(3, 3 + 70)))
    assert fresh.expand([(9, 70, "a", [])], Sampling()) == proposals
