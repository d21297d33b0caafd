"""Speculation in flight: frames sent before the verdict they assume, epochs on the tail, and
output that does not depend on how many frames were in flight."""

from __future__ import annotations

import shutil

import pytest
import torch

from sfchat.protocol import wire
from sfchat.config import Settings
from sfchat.events import ReplyFinished
from sfchat.engine.round import hidden_bytes
from sfchat.node.head import Head
from sfchat.model.slices import ModelSlice
from sfchat.model.source import ModelSource
from sfchat.engine.verifier import TailError, Verifier
from sfchat.node.loading import TailLoader
from sfchat.protocol.wire import Forward, Sampling, decode, encode

from flight_links import Always, Pipelined
from test_engine import PROMPT, reference
from test_tail import SPLIT, hello_for

K = 4
TARGET = "qwen2-untied"
SAMPLED = Sampling(temperature=0.9, top_k=0, top_p=0.95, seed=7)


def in_flight(zoo, m: int, draft=TARGET, budget=0, link=None) -> Head:
    s = Settings(model=str(zoo[TARGET]), draft=str(zoo[draft]), k=K, tree_budget=budget, device="cpu",
                 max_in_flight=m)
    session = Head.open(s, link=link or Pipelined())
    session.engine.policy = Always(session.engine.rounds.shapes[0], m)
    session.eos = set()  # replies run their whole length: rounds enough to compare
    return session


def finished(session, ids, n, s=Sampling()) -> ReplyFinished:
    return [e for e in session.reply(ids, n, s) if isinstance(e, ReplyFinished)][-1]


# -- the head: output never depends on frames in flight ------------------------------------------
@pytest.mark.parametrize("draft, budget, m", [
    (TARGET, 0, 3),  # full acceptance: every frame's assumption holds
    (TARGET, 8, 4),  # ... with token trees (the assumed path's K/V moved before its verdict)
    ("draft", 0, 3),  # an unrelated draft: most assumptions break, epochs are dropped
    ("draft", 8, 2),
])
def test_greedy_replies_in_flight_equal_generate(zoo, draft, budget, m):
    session = in_flight(zoo, m, draft, budget)
    ids = session.encode(PROMPT)
    fin = finished(session, ids, 40)
    assert list(fin.token_ids) == reference(zoo[TARGET], ids, 40, eos=-1)
    epochs = {f.epoch for f in session.engine.link.sent}
    if draft == TARGET:
        assert fin.hit_rate > 0.6 and fin.in_flight_mean > 1.5
    else:  # assumptions broke: new epochs were opened and frames of broken ones were dropped
        assert len(epochs) > 3 and session.engine.link.verifier.dropped > 0
    # a second turn over the same cache: the stale K/V of dropped frames is never reused wrongly
    again = ids + list(fin.token_ids) + session.encode([{"role": "user", "content": "and then?"}])[-6:]
    fin2 = finished(session, again, 20)
    assert list(fin2.token_ids) == reference(zoo[TARGET], again, 20, eos=-1)


@pytest.mark.parametrize("budget", [0, 8])
def test_sampled_replies_draw_the_same_with_and_without_frames_in_flight(zoo, budget):
    """Every round draws from streams keyed by its context, whenever it was sent: the same seed
    gives the same reply for any number in flight, so the distribution is the sequential one
    (which test_sampling_distribution checks is the target's)."""
    for seed in range(4):
        s = Sampling(temperature=0.9, top_k=0, top_p=0.95, seed=seed)
        outs = []
        for m in (1, 3):
            session = in_flight(zoo, m, TARGET, budget)
            fin = finished(session, session.encode(PROMPT), 24, s)
            outs.append(fin)
        assert outs[0].token_ids == outs[1].token_ids
        assert outs[0].in_flight_mean == 1.0 and outs[1].in_flight_mean > 1.0


class Lying(Pipelined):
    """A tail that also answers every verify frame it dropped, with a verdict for that frame's
    round (accepting nothing): what a broken or hostile tail might send."""

    def recv(self, timeout=None) -> bytes:
        while not self.inbox and self.outbox:
            raw = self.outbox.popleft()
            dropped = self.verifier.dropped
            self.verifier.handle(raw, lambda reply: self.inbox.append((0.0, reply)))
            msg = decode(raw)
            if self.verifier.dropped > dropped and msg.want_verdict:
                self.lies += 1
                self.inbox.append((0.0, encode(wire.Verdict(msg.round, msg.start_pos, 0, (msg.tokens[0],), 1))))
        return super().recv(timeout)

    lies = 0


def test_a_verdict_for_a_dropped_frame_is_never_applied_on_the_head(zoo):
    session = in_flight(zoo, 3, "draft", link=Lying())
    ids = session.encode(PROMPT)
    fin = finished(session, ids, 40)
    assert list(fin.token_ids) == reference(zoo[TARGET], ids, 40, eos=-1)
    assert session.engine.link.lies > 0


# -- the tail: epochs ----------------------------------------------------------------------------
@pytest.fixture
def tail(zoo):
    v = Verifier(TailLoader(torch.device("cpu")))
    v.handle(hello_for(zoo["qwen2-untied"]), lambda f: None)
    src = ModelSource.open(str(zoo["qwen2-untied"]))
    head = ModelSlice.load(src, 0, SPLIT, embed=True, head=False, dtype=torch.float32,
                           device=torch.device("cpu"), max_len=64)
    return v, head


def forward(head, tokens, start, n_draft, rnd, epoch, assumes=(), verdict=True):
    h = head.forward(torch.tensor(tokens), torch.arange(start, start + len(tokens)), window=64)
    return encode(Forward(round=rnd, start_pos=start, tokens=tuple(tokens), hidden=hidden_bytes(h),
                          dtype=wire.DType.FLOAT32, hidden_size=64, n_draft=n_draft, epoch=epoch, assumes=assumes,
                          want_verdict=verdict))


def answers(v, raw):
    out = []
    v.handle(raw, out.append)
    return [decode(f) for f in out]


PROMPT_IDS = [3, 17, 42, 99, 5, 250, 7]


def test_a_frame_of_a_broken_epoch_is_dropped_unread_and_the_next_epoch_runs(tail):
    v, head = tail
    assert answers(v, forward(head, PROMPT_IDS[:-1], 0, 0, 1, epoch=1, verdict=False)) == []  # the prefill
    first = answers(v, forward(head, [PROMPT_IDS[-1], 11, 12], 6, 2, 2, epoch=1))[0]
    written = list(v.model.kv.written)
    wrong = tuple(first.tokens[:-1]) + ((first.tokens[-1] + 1) % 500,)  # an outcome that did not happen
    start = 6 + len(first.tokens)
    assert answers(v, forward(head, [wrong[-1], 3], start, 1, 3, epoch=1, assumes=wrong)) == []
    # the rest of the broken epoch is dropped too, whatever it assumes, and so is an older epoch
    assert answers(v, forward(head, [4, 5], start + 2, 1, 4, epoch=1, assumes=(3, 4))) == []
    assert answers(v, forward(head, [4], 7, 0, 5, epoch=0, verdict=False)) == []
    assert v.dropped == 3 and v.model.kv.written == written  # no K/V written, no verdict
    # a frame that assumes the real outcome, in the next epoch's chain, is verified
    right = tuple(first.tokens)
    fresh = answers(v, forward(head, [right[-1], 9], start, 1, 6, epoch=2))[0]
    assert isinstance(fresh, wire.Verdict) and fresh.round == 6
    follow = tuple(fresh.tokens)
    after = answers(v, forward(head, [follow[-1]], start + len(follow), 0, 7, epoch=2, assumes=follow))[0]
    assert after.round == 7 and after.start_pos == start + len(follow)


def test_an_inconsistent_assumption_is_a_protocol_error(tail):
    v, head = tail
    answers(v, forward(head, PROMPT_IDS[:-1], 0, 0, 1, epoch=1, verdict=False))
    first = answers(v, forward(head, [PROMPT_IDS[-1], 11], 6, 1, 2, epoch=1))[0]
    with pytest.raises(TailError, match="assumes a verdict of that epoch"):
        v.handle(forward(head, [first.tokens[-1]], 6 + len(first.tokens), 0, 3, epoch=5,
                         assumes=tuple(first.tokens)), lambda f: None)
    v.handle(hello_for(v.hello.model), lambda f: None)  # a fresh hello: epochs start over
    answers(v, forward(head, PROMPT_IDS[:-1], 0, 0, 1, epoch=1, verdict=False))
    first = answers(v, forward(head, [PROMPT_IDS[-1], 11], 6, 1, 2, epoch=1))[0]
    with pytest.raises(TailError, match="starts at"):
        v.handle(forward(head, [first.tokens[-1]], 2, 0, 3, epoch=1, assumes=tuple(first.tokens)), lambda f: None)


def test_epochs_and_assumptions_round_trip_and_are_bounded():
    msg = Forward(round=3, start_pos=9, tokens=(1, 2), hidden=bytes(8), dtype=wire.DType.FLOAT16, hidden_size=2,
                  n_draft=1, epoch=2 ** 32 - 1, assumes=(5, 6, 7))
    assert decode(encode(msg)) == msg
    with pytest.raises(wire.WireError, match="assuming 66 tokens"):
        encode(Forward(round=3, start_pos=9, tokens=(1,), hidden=bytes(4), dtype=wire.DType.FLOAT16, hidden_size=2,
                       assumes=(1,) * 66))


@pytest.fixture(scope="module")
def nearby(zoo, tmp_path_factory):
    """A draft that agrees with the target often but not always: the target's weights plus noise."""
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("nearby") / "draft"
    shutil.copytree(zoo[TARGET], out)
    model = AutoModelForCausalLM.from_pretrained(zoo[TARGET])
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=gen) * p.std() * NOISE)
    model.save_pretrained(out)
    return out


NOISE = 0.03


def test_a_tree_miss_puts_the_saved_slots_back_instead_of_sending_the_path_again(zoo, nearby):
    """A tree's assumed path moves before its verdict; when the verdict takes another path, the
    slots saved before the move are restored and the real path moved: nothing is re-sent."""
    zoo = dict(zoo, nearby=nearby)
    session = in_flight(zoo, 2, "nearby", budget=8)
    ids = session.encode(PROMPT)
    fin = finished(session, ids, 40)
    assert list(fin.token_ids) == reference(zoo[TARGET], ids, 40, eos=-1)
    sent = session.engine.link.sent
    first_verify = next(i for i, f in enumerate(sent) if f.want_verdict)
    assert session.engine.link.verifier.dropped > 0 and 0 < fin.hit_rate < 1  # some assumptions broke
    assert fin.tokens_per_round > 1.5  # ... after accepting drafts off the assumed path
    assert all(f.want_verdict for f in sent[first_verify:])  # no prefill after the prompt's
