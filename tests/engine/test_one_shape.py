"""One row count for every forward of the target (``--frame-rows``, a GPU's default).

A GPU kernel's arithmetic for a row depends on the row count, so a reply whose rows were computed
by forwards of several shapes depends on which frames the network's timing shaped. A CPU
computes those rows alike whatever the shape, so comparing outputs here shows nothing: these
tests check the invariant instead. Every forward of the head's and the tail's slices (the
prefill's pieces, every frame, the no-draft step) runs at the one row count, in every mode, with
frames in flight and over two segments, over windows that grow with the context (canonical
attention makes the window irrelevant to a row: ``tests/model/test_attention.py``); padding rows
change no real row and write nothing but the sink slot; and the reply still equals
``generate()``, with the canonical attention such slices run (``kv.SPAN``, ``kv.BLOCK`` and
``kv.MIN_WINDOW`` shortened here, so that rows read a context part in several blocks and frames
in flight meet the span's reach).
"""

from __future__ import annotations

import pytest
import torch

from sfchat import UserError
from sfchat.config import Settings
from sfchat.events import ReplyFinished
from sfchat.model import kv
from sfchat.model.slices import ModelSlice
from sfchat.model.source import ModelSource
from sfchat.node.head import Head
from sfchat.node.loading import frame_layout
from sfchat.protocol.wire import Sampling

from engine_runs import PROMPT, reference
from flight_links import Always, Pipelined

TARGET = "qwen2-untied"
ROWS, N_NEW = 12, 24
MODES = {  # name: (draft, k, tree budget, frames in flight, device)
    "none": ("none", 0, 0, 1, "cpu"),
    "chain": (TARGET, 4, 0, 1, "cpu"),
    "tree": ("draft", 3, 8, 1, "cpu"),
    "chain in flight": (TARGET, 4, 0, 3, "cpu"),
    "tree in flight": ("draft", 3, 8, 2, "cpu"),
    "tree over two segments": ("draft", 3, 8, 1, "cpu,cpu"),
}


@pytest.fixture(autouse=True)
def short_span(monkeypatch):
    monkeypatch.setattr(kv, "SPAN", 8)
    monkeypatch.setattr(kv, "BLOCK", 16)  # the context part in several blocks
    monkeypatch.setattr(kv, "MIN_WINDOW", 32)  # and over several windows as the context grows


def forwards(monkeypatch, keys: list | None = None) -> list[tuple[ModelSlice, int, int]]:
    """Every forward any slice runs from now on: (the slice, its rows, its attention window); and
    in ``keys`` (the slice, the graph key it runs under: what a GPU replays)."""
    seen: list[tuple[ModelSlice, int, int]] = []
    through = ModelSlice._through

    def recorded(self, x, positions, n_logits, window, tree, key):
        seen.append((self, x.shape[0], window))
        if keys is not None:
            keys.append((self, key))
        return through(self, x, positions, n_logits, window, tree, key)

    monkeypatch.setattr(ModelSlice, "_through", recorded)
    return seen


@pytest.mark.parametrize("mode", MODES)
def test_every_forward_of_the_target_runs_at_one_row_count(zoo, monkeypatch, mode):
    draft, k, budget, m, device = MODES[mode]
    s = Settings(model=str(zoo[TARGET]), draft="none" if draft == "none" else str(zoo[draft]), k=k,
                 tree_budget=budget, device=device, max_in_flight=m, frame_rows=ROWS)
    session = Head.open(s, link=Pipelined(), policy=Always(m)) if m > 1 else Head.open(s)
    session.eos = set()
    keys = []
    seen = forwards(monkeypatch, keys)
    ids = session.encode(PROMPT)
    fin = [e for e in session.reply(ids, N_NEW, Sampling()) if isinstance(e, ReplyFinished)][-1]
    assert list(fin.token_ids) == reference(zoo[TARGET], ids, N_NEW, eos=-1)
    head, tail = session.engine.spec.head, session.engine.link.verifier.model
    assert head.rows == tail.rows == ROWS
    # one graph key per slice, the prefill's pieces included: on a GPU every forward replays the
    # verify's captured graph (a prefill piece run eagerly cost 24 ms against 3 on an H100)
    assert {key for sl, key in keys if sl is head} == {(ROWS, 0, True)}
    assert {key for sl, key in keys if sl is tail} == {(ROWS, ROWS, True)}
    target = [(rows, window) for sl, rows, window in seen if sl is head or sl is tail]
    assert len(ids) > 2 * ROWS  # the prefill ran in several pieces, the last one padded
    assert {rows for rows, _ in target} == {ROWS}
    assert len({window for _, window in target}) > 1 and max(w for _, w in target) < head.max_len
    pieces = -(-(len(ids) - 1) // ROWS)  # the prompt before the root, on both slices
    assert sum(sl is head for sl, *_ in seen) >= pieces + fin.rounds  # a forward per frame
    assert sum(sl is tail for sl, *_ in seen) > pieces  # a frame whose nodes all died costs the tail none
    assert {sl for sl, *_ in seen} <= {head, tail} | ({session.engine.spec.drafter.model} if k else set())


def test_without_frame_rows_a_reply_runs_forwards_of_many_shapes(zoo, monkeypatch):
    """What the one row count replaces (and what a CPU runs by default)."""
    s = Settings(model=str(zoo[TARGET]), draft=str(zoo["draft"]), k=3, tree_budget=8, device="cpu")
    session = Head.open(s)
    seen = forwards(monkeypatch)
    ids = session.encode(PROMPT)
    list(session.reply(ids, N_NEW, Sampling()))
    head = session.engine.spec.head
    assert head.rows is None and len({rows for sl, rows, _ in seen if sl is head}) > 1


@pytest.mark.parametrize("family", ["qwen3-tied", "llama-untied"])
def test_padding_rows_change_no_real_row_and_write_only_the_sink(zoo, family):
    src = ModelSource.open(str(zoo[family]))
    sl = ModelSlice.load(src, 0, 2, embed=True, head=False, dtype=torch.float32, device=torch.device("cpu"),
                         max_len=40, rows=8)
    ids = torch.tensor([3, 17, 42, 99, 5])
    outs, caches = [], []
    for junk in ([0, 0, 0], [250, 7, 300]):  # what padding rows hold is nobody's business
        sl.reset(zero=True)
        x = torch.cat([ids, torch.tensor(junk)])
        positions = torch.tensor([0, 1, 2, 3, 4, 40, 40, 40])  # the padding rows at the sink
        outs.append(sl.run(x, positions, end=5)[:5])
        caches.append([t.clone() for t in sl.kv_tensors()])
    assert torch.equal(outs[0], outs[1])
    for a, b in zip(*caches):
        assert torch.equal(a[:, :, :40], b[:, :, :40])  # the sink (slot 40) differs; nothing before it
        assert not a[:, :, 5:40].any()
    assert any(b[:, :, 40].any() for b in caches[1])  # the junk rows wrote there
    # feed pads the last piece so; it equals an ordinary slice's forward of the real rows
    plain = ModelSlice.load(src, 0, 2, embed=True, head=False, dtype=torch.float32, device=torch.device("cpu"),
                            max_len=40)
    long_ids = torch.randint(0, 300, (19,), generator=torch.Generator().manual_seed(0))
    sl.reset(zero=True)
    fed = sl.feed(long_ids, 0)
    assert fed.shape == (19, src.config.hidden_size)
    assert torch.allclose(fed, plain.run(long_ids, torch.arange(19), end=19), rtol=1e-4, atol=1e-3)  # fp32 rounding
    # its pieces run as tree forwards of a chain (a GPU replays the verify's graph): bitwise the
    # plain padded forwards they stand for, the hidden rows and the K/V alike
    fed_kv = [t.clone() for t in sl.kv_tensors()]
    sl.reset(zero=True)
    pieces = []
    for i in range(0, 19, 8):
        piece = long_ids[i:i + 8]
        n = piece.shape[0]
        x = torch.cat([piece, torch.zeros(8 - n, dtype=piece.dtype)])
        positions = torch.cat([torch.arange(i, i + n), torch.full((8 - n,), 40)])
        pieces.append(sl.run(x, positions, end=i + n)[:n])
    assert torch.equal(fed, torch.cat(pieces))
    assert all(torch.equal(a, b) for a, b in zip(fed_kv, sl.kv_tensors()))
    with pytest.raises(ValueError, match="a forward of 5 rows on a slice whose every forward runs at 8"):
        sl.run(ids, torch.arange(5), end=5)


def test_frame_rows_under_auto_and_below_a_frame():
    assert frame_layout(Settings(), 8, cuda=True).shape == 64  # a tree of 63 drafts and its root
    assert frame_layout(Settings(tree_budget=0), 8, cuda=True).rows == 64  # a chain of 8, padded
    assert frame_layout(Settings(draft="none"), 0, cuda=True).rows == 64  # the no-draft step too
    assert frame_layout(Settings(tree_budget=127), 8, cuda=True).rows == 128
    assert frame_layout(Settings(), 8, cuda=False).rows == 0  # a CPU: each forward at its own size
    assert frame_layout(Settings(frame_rows=0), 8, cuda=True).shape == 64  # off: the frame's own size
    assert frame_layout(Settings(frame_rows=0, tree_budget=0), 8, cuda=True).shape == 9
    with pytest.raises(UserError, match="--frame-rows 8 is below a frame's 9 nodes"):
        frame_layout(Settings(frame_rows=8, tree_budget=0), 8, cuda=False)
