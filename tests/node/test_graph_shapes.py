"""The steady-state graphs are captured in the very shapes the frames then replay them with.

A CUDA graph replays fixed shapes: an input of another shape fails at replay, on the GPU only.
Here capture is stood in by a recorder (the CPU has no graphs) that holds the example inputs'
shapes and checks every replay's inputs against them, over whole replies with frames in flight."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from sfchat.config import Settings
from sfchat.events import ReplyFinished
from sfchat.model import graphs
from sfchat.node.head import Head
from sfchat.node.loading import capture_graphs, frame_layout
from sfchat.protocol.wire import Sampling


class Recorder:
    """Stands in for a captured graph: replays run the plain function, in the captured shapes only."""

    replays: list[str] = []

    def __init__(self, what, fn, inputs):
        self.what, self.fn, self.shapes = what, fn, [tuple(x.shape) for x in inputs]

    def __call__(self, *inputs):
        got = [tuple(x.shape) for x in inputs]
        assert got == self.shapes, f"{self.what}: captured with {self.shapes}, replayed with {got}"
        Recorder.replays.append(self.what)
        return self.fn(*inputs)


def test_the_head_frame_and_draft_step_replay_in_their_captured_shapes(zoo, monkeypatch):
    monkeypatch.setattr(graphs, "try_capture", lambda what, fn, inputs, log=None: Recorder(what, fn, inputs))
    Recorder.replays = []
    s = Settings(model=str(zoo["qwen2-tied"]), draft=str(zoo["draft"]), k=3, tree_budget=6, max_in_flight=2,
                 device="cpu", dtype="float32")
    session = Head.open(s)
    spec = session.engine.spec
    capture_graphs(spec.head, None, frame_layout(s, s.k, cuda=False, local=True), False, lambda *a: None)
    spec.drafter.capture()
    ids = session.encode([{"role": "user", "content": "hello world"}])
    fin = [e for e in session.reply(ids, 24, Sampling()) if isinstance(e, ReplyFinished)][0]
    model = AutoModelForCausalLM.from_pretrained(zoo["qwen2-tied"]).eval()
    ref = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, pad_token_id=0)
    assert list(fin.token_ids) == ref[0, len(ids):].tolist()
    assert any("tree forward" in w for w in Recorder.replays)
    assert any("draft's" in w for w in Recorder.replays)


def test_capturing_says_when_the_head_frame_compiles_a_minute_or_more(zoo, monkeypatch):
    """The head's capture reports its frame, and with ``--compile-frames`` that compiling it takes
    a minute or more at a first start (shown on the loading screen)."""
    monkeypatch.setattr(graphs, "try_capture", lambda what, fn, inputs, log=None: Recorder(what, fn, inputs))
    s = Settings(model=str(zoo["qwen2-tied"]), draft=str(zoo["draft"]), k=3, device="cpu", dtype="float32")
    head = Head.open(s).engine.spec.head
    layout = frame_layout(s, s.k, cuda=False, local=True)
    said = []
    capture_graphs(head, None, layout, False, lambda *a: said.append(a))
    assert said == [("capture", 0, 2, "head frame"), ("capture", 1, 2, "draft"), ("capture", 2, 2, "")]
    said.clear()
    head.compiled = True
    capture_graphs(head, None, layout, True, lambda *a: said.append(a))
    assert said[0] == ("capture", 0, 2, "head frame (compiling its forward for each attention window: a minute or "
                                        "more at the first start)")
