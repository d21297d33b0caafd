"""The sans-I/O round (plan, verdict checks, commit, speculating the next round) and its driver."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from sfchat.protocol import wire
from sfchat.config import Settings
from sfchat.events import ReplyFinished
from sfchat.node.driver import LinkError, RoundDriver
from sfchat.node.local_link import MemoryLink
from sfchat.engine.round import ProtocolError
from sfchat.node.head import Head
from sfchat.engine.verifier import Verifier
from sfchat.node.loading import TailLoader
from sfchat.protocol.wire import Sampling

from test_engine import PROMPT

K = 4
TARGET = "qwen2-untied"
SAMPLED = Sampling(temperature=0.9, top_k=0, top_p=0.95, seed=7)


def load(zoo, draft=TARGET, k=K, target=TARGET, link=None, **kw) -> Head:
    s = Settings(model=str(zoo[target]), draft=str(zoo[draft]), k=k, device="cpu", **kw)
    return Head.open(s, link=link)


def finished(session, ids, n, s=Sampling()) -> ReplyFinished:
    return [e for e in session.reply(ids, n, s) if isinstance(e, ReplyFinished)][-1]


def rounds_of(session, ids, n, s=Sampling()):
    return [e.stats for e in session.reply(ids, n, s) if hasattr(e, "stats")]


# -- the sans-I/O round, with verdicts made by hand ----------------------------------------------
@pytest.fixture
def planned(zoo):
    """A round planned after a real first round (so its context is cached), and its driver."""
    session = load(zoo, draft="draft")
    ids = session.encode(PROMPT)
    session.engine.begin(ids)
    session.engine.round(Sampling(), set(), 100)
    rounds = session.engine.rounds
    return rounds, rounds.plan(Sampling())


def verdict(plan, n_acc, tokens, **kw) -> wire.Verdict:
    fields = dict(round=plan.round_id, start_pos=plan.verify_start, n_accepted=n_acc, tokens=tuple(tokens),
                  tail_us=5)
    return wire.Verdict(**(fields | kw))


def test_a_plan_writes_once_where_the_target_lacks_the_context(planned):
    rounds, plan = planned
    n = len(rounds.tokens)
    assert plan.context_len == n and len(plan.drafts) == K
    assert plan.verify_start == n - 1  # t0, the last committed token, then the drafts
    frames = [wire.decode(f) for f in plan.frames]
    assert len(frames) == 1 and frames[0].want_verdict and frames[0].n_draft == K
    assert frames[0].start_pos == n - 1 and list(frames[0].tokens) == rounds.tokens[-1:] + plan.drafts
    assert rounds.head.kv.written == rounds.tokens + plan.drafts


def test_a_verdict_is_committed_and_cut_at_eos_and_budget(planned):
    rounds, plan = planned
    n = len(rounds.tokens)
    tokens = plan.drafts[:2] + [(plan.drafts[2] + 1) % rounds.vocab]
    commit = rounds.take(plan, verdict(plan, 2, tokens), set(), 100)
    assert commit.tokens == tuple(tokens) and commit.accepted == 2 and commit.finish is None
    assert rounds.tokens[n:] == tokens
    plan = rounds.plan(Sampling())
    commit = rounds.take(plan, verdict(plan, K, plan.drafts + [3]), {plan.drafts[1]}, 100)
    assert commit.tokens == tuple(plan.drafts[:2]) and commit.finish == "eos"
    plan = rounds.plan(Sampling())
    commit = rounds.take(plan, verdict(plan, K, plan.drafts + [3]), set(), 3)
    assert len(commit.tokens) == 3 and commit.finish == "length"


@pytest.mark.parametrize("case, message", [
    (lambda p, v: verdict(p, 1, p.drafts[:1] + [-1]), "outside the vocabulary"),
    (lambda p, v: verdict(p, 1, p.drafts[:1] + [v]), "outside the vocabulary"),
    (lambda p, v: verdict(p, K + 1, p.drafts + [1, 2]), f"accepting {K + 1} of {K}"),
    (lambda p, v: verdict(p, 2, p.drafts[:1] + [1, 2]), "not the drafts"),
    (lambda p, v: verdict(p, 1, p.drafts[:1] + [1, 2]), "with 3 tokens"),
    (lambda p, v: verdict(p, 0, [1], round=p.round_id + 5), "for round"),
    (lambda p, v: verdict(p, 0, [1], start_pos=p.verify_start + 1), "at position"),
])
def test_an_impossible_verdict_is_a_protocol_error_and_commits_nothing(planned, case, message):
    rounds, plan = planned
    before = list(rounds.tokens)
    with pytest.raises(ProtocolError, match=message):
        rounds.take(plan, case(plan, rounds.vocab), set(), 100)
    assert rounds.tokens == before


def test_a_speculated_round_assumes_every_draft_and_the_drafts_own_bonus(planned):
    rounds, plan = planned
    n = len(rounds.tokens)
    assert rounds.can_speculate(plan, 100, set()) and not rounds.can_speculate(plan, K + 1, set())
    assert not rounds.can_speculate(plan, 100, {plan.drafts[-1]})  # an assumed EOS ends the reply
    ahead = rounds.speculate(plan, Sampling())
    guess = ahead.basis[-1]
    assert ahead.context_len == n + K + 1 and ahead.verify_start == n + K and len(ahead.drafts) == K
    assert guess == rounds.drafter.next_token(rounds.tokens + plan.drafts)
    frame = wire.decode(ahead.frames[0])
    assert len(ahead.frames) == 1 and list(frame.tokens) == [guess] + ahead.drafts
    assert frame.epoch == plan.epoch and frame.assumes == tuple(plan.drafts) + (guess,)
    hit = verdict(plan, K, plan.drafts + [guess])
    assert rounds.holds(plan, hit)
    rounds.take(plan, hit, set(), 100)
    # the speculated round is exactly what planning after that verdict computes
    again = wire.decode(rounds.plan(Sampling()).frames[0])
    assert again.tokens == frame.tokens and again.hidden == frame.hidden and again.start_pos == frame.start_pos
    assert again.epoch == plan.epoch + 1 and again.assumes == ()


def test_a_miss_breaks_the_assumption_and_the_next_plan_writes_over_it(planned):
    rounds, plan = planned
    ahead = rounds.speculate(plan, Sampling())
    other = (ahead.basis[-1] + 1) % rounds.vocab
    miss = verdict(plan, K, plan.drafts + [other])
    assert not rounds.holds(plan, miss)
    rounds.take(plan, miss, set(), 100)
    nxt = rounds.plan(Sampling())
    assert nxt.verify_start == len(rounds.tokens) - 1
    assert rounds.head.kv.written == rounds.tokens + nxt.drafts


# -- the driver ---------------------------------------------------------------------------------
def test_local_mode_never_sends_ahead(zoo):
    session = load(zoo, draft=TARGET, max_in_flight=4)
    assert session.engine.policy.max_in_flight == 1
    rounds = rounds_of(session, session.encode(PROMPT), 30)
    assert all(r.in_flight == 1 and not r.speculated and r.overlap_ms < 1.0 for r in rounds)


# -- the driver: a hostile tail gets a protocol error, not a crash --------------------------------
class Tampering(MemoryLink):
    """A local tail whose answers pass through ``tamper(message) -> message``."""

    def __init__(self, tamper):
        super().__init__(Verifier(TailLoader(torch.device("cpu"))))
        self.tamper = tamper

    def recv(self, timeout=None) -> bytes:
        msg = wire.decode(super().recv(timeout))
        out = self.tamper(msg)
        return out if isinstance(out, bytes) else wire.encode(out)


@pytest.mark.parametrize("tamper, message", [
    (lambda m: replace(m, tokens=(-5,) * len(m.tokens)), "outside the vocabulary"),
    (lambda m: replace(m, tokens=(10 ** 6,) * len(m.tokens)), "outside the vocabulary"),
    (lambda m: replace(m, n_accepted=K, tokens=(0,) * (K + 1), path=None), "not the drafts"),
    (lambda m: replace(m, n_accepted=K + 1, tokens=(0,) * (K + 2), path=None), f"accepting {K + 1} of {K}"),
    (lambda m: replace(m, round=m.round + 7), "which was never sent"),
])
def test_a_forged_verdict_ends_the_reply_with_a_protocol_error(zoo, tamper, message):
    def forge(msg):
        return tamper(msg) if isinstance(msg, wire.Verdict) and msg.round > 1 else msg

    session = load(zoo, draft="draft", link=Tampering(forge))
    with pytest.raises(LinkError, match=f"protocol error: .*{message}"):
        finished(session, session.encode(PROMPT), 30)
    assert len(session.engine.tokens) <= len(session.encode(PROMPT)) + K + 1  # only the honest first round


def test_a_malformed_progress_frame_is_a_protocol_error(zoo):
    def forge(msg):
        if isinstance(msg, wire.Control) and msg.type is wire.MsgType.READY:
            return wire.encode(wire.Control(wire.MsgType.PROGRESS, {"stage": "load", "done": "x", "total": 1}))
        return msg

    with pytest.raises(LinkError, match="protocol error: a PROGRESS frame"):
        load(zoo, draft="draft", link=Tampering(forge))


def test_a_tail_lost_during_the_handshake_is_waited_for(zoo):
    class Gone:
        overlaps = True

        def __init__(self):
            self.closed = False

        def send(self, frame):
            pass

        def recv(self, timeout=None):
            from sfchat.link import PeerGone
            raise PeerGone("the tail left the session")

        def close(self):
            self.closed = True

    gone = Gone()
    session = load(zoo, draft="draft")
    driver = RoundDriver(session.engine.rounds, gone, reconnect=lambda timeout: MemoryLink(Verifier(TailLoader(torch.device("cpu")))),
                         reconnect_timeout=30)
    ready = driver.connect(session.engine.hello)
    assert gone.closed and ready.n_layers == session.info.n_layers
    ids = session.encode(PROMPT)
    driver.begin(ids)
    assert driver.round(Sampling(), set(), 10).commit.tokens
