"""Frames in flight on one live tree: output that never depends on how many frames were in flight,
the tree or the draft; verdicts of frames the head left behind are never applied."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from sfchat.config import Settings
from sfchat.events import ReplyFinished
from sfchat.node.head import Head
from sfchat.node import prompts
from sfchat.protocol import wire
from sfchat.protocol.wire import Sampling, decode, encode

from flight_links import Always, Pipelined
from engine_runs import PROMPT, reference

K = 4
TARGET = "qwen2-untied"


def in_flight(zoo, m: int, draft=TARGET, budget=0, link=None, ahead=0) -> Head:
    s = Settings(model=str(zoo[TARGET]), draft="none" if draft == "none" else str(zoo[draft]), k=K, tree_budget=budget, device="cpu",
                 max_in_flight=m, draft_ahead=ahead)
    session = Head.open(s, link=link or Pipelined(), policy=Always(m))
    session.eos = set()  # replies run their whole length: frames enough to compare
    return session


def finished(session, ids, n, s=Sampling()) -> ReplyFinished:
    return [e for e in session.reply(ids, n, s) if isinstance(e, ReplyFinished)][-1]


@pytest.mark.parametrize("draft", [TARGET, "draft"])
def test_greedy_replies_in_flight_with_the_drafts_attention_in_blocks_equal_generate(zoo, draft, monkeypatch):
    """The draft's steps in blocks (here over its one window, its whole cache: the tiny models' 256
    positions and a 129-slot scratch, rounded up to whole blocks of 128): trees in flight, the
    target's own reply, and the blocks ran."""
    from sfchat.engine import draft as drafting
    from sfchat.model import attention

    monkeypatch.setattr(drafting, "BLOCKS_FROM", 256)
    blocked, calls = attention.in_blocks, []
    monkeypatch.setattr(attention, "in_blocks", lambda *a: calls.append((a[1].shape[2], a[3].block)) or blocked(*a))
    session = in_flight(zoo, 3, draft, 8)
    assert session.engine.drafter.model.windows == [512]  # 256 + 129 slots, rounded up to whole blocks
    ids = session.encode(PROMPT)
    assert list(finished(session, ids, 40).token_ids) == reference(zoo[TARGET], ids, 40, eos=-1)
    assert calls and set(calls) == {(512, 128)}


@pytest.mark.parametrize("draft, budget, m", [
    (TARGET, 0, 3),  # full acceptance: frames ahead continue the chain
    (TARGET, 8, 4),  # ... with trees
    ("draft", 0, 3),  # an unrelated draft: most nodes die, the frames behind them too
    ("draft", 8, 2),
])
def test_greedy_replies_in_flight_equal_generate(zoo, draft, budget, m):
    session = in_flight(zoo, m, draft, budget)
    ids = session.encode(PROMPT)
    fin = finished(session, ids, 40)
    assert list(fin.token_ids) == reference(zoo[TARGET], ids, 40, eos=-1)
    assert fin.in_flight_mean > 1.5
    tail = session.engine.link.verifier
    if draft == TARGET:
        assert fin.hit_rate > 0.5 and fin.tokens_per_round > 1.5
    else:  # nodes died: the tail computed none of them
        assert tail.skipped > 0
    trees = [f for f in session.engine.link.sent if f.verify]
    assert all(b.first_id == a.first_id + len(a.tokens) for a, b in zip(trees, trees[1:]))
    prefill = [f for f in session.engine.link.sent if not f.verify]
    assert sum(len(f.tokens) for f in prefill) == len(ids) - 1  # a miss never sends the context again
    # a second turn over the same cache: the K/V of dead nodes is never reused wrongly
    again = ids + list(fin.token_ids) + session.encode([{"role": "user", "content": "and then?"}])[-6:]
    fin2 = finished(session, again, 20)
    assert list(fin2.token_ids) == reference(zoo[TARGET], again, 20, eos=-1)


@pytest.mark.parametrize("draft, budget, m", [
    ("none", 0, 1),  # no draft: one token per round
    (TARGET, 0, 1),  # chains
    ("draft", 8, 1),  # trees
    ("draft", 0, 3),  # frames in flight, most of their nodes dead
    (TARGET, 8, 3),  # trees in flight below nodes still in flight
])
def test_greedy_replies_with_a_repetition_penalty_equal_generate(zoo, draft, budget, m):
    """Each row's penalty comes from its own path (the tail's committed context, the row's ancestors
    in its frame, itself): the reply is generate(do_sample=False, repetition_penalty=) token for
    token, in a follow-up turn over the same cache too."""
    session = in_flight(zoo, m, draft, budget)
    ids = session.encode(PROMPT)
    s = Sampling(repetition_penalty=2.0)
    fin = finished(session, ids, 40, s)
    ref = reference(zoo[TARGET], ids, 40, eos=-1, repetition_penalty=2.0)
    assert ref != reference(zoo[TARGET], ids, 40, eos=-1)  # the penalty changes the reply
    assert list(fin.token_ids) == ref
    again = ids + list(fin.token_ids) + session.encode([{"role": "user", "content": "and then?"}])[-6:]
    fin2 = finished(session, again, 20, replace(s, repetition_penalty=0.5))
    assert list(fin2.token_ids) == reference(zoo[TARGET], again, 20, eos=-1, repetition_penalty=0.5)


def test_sampled_replies_are_the_same_whatever_the_draft_tree_and_frames_in_flight(zoo):
    """Each committed token is the target's draw at its position from the stream of the reply's seed
    and that position alone: the same seed gives the same reply for any draft, tree and number in
    flight (test_sampling_distribution checks that the replies follow the target's distribution)."""
    for seed in range(3):
        s = Sampling(temperature=0.9, top_k=0, top_p=0.95, seed=seed)
        outs = [finished(in_flight(zoo, m, draft, budget), in_flight(zoo, 1).encode(PROMPT), 24, s)
                for draft, budget, m in [(TARGET, 0, 1), (TARGET, 0, 3), ("draft", 8, 3), ("draft", 0, 1)]]
        ahead = in_flight(zoo, 2, "draft", 8, link=Slow(3), ahead=3)
        outs.append(finished(ahead, ahead.encode(PROMPT), 24, s))
        assert ahead.engine.link.refused > 0
        assert len({o.token_ids for o in outs}) == 1, [o.token_ids for o in outs]
        assert outs[0].in_flight_mean == 1.0 and outs[1].in_flight_mean > 1.0


class Slow(Pipelined):
    """A pipelined link whose every verdict takes ``polls`` looks to arrive: a head that drafts while
    it waits gets up to that many steps in before each verdict (``refused`` counts the looks)."""

    def __init__(self, polls: int):
        super().__init__()
        self.polls, self.left, self.refused = polls, polls, 0

    def recv(self, timeout=None) -> bytes:
        if timeout == 0 and self.left > 0:
            self.left -= 1
            self.refused += 1
            raise TimeoutError
        self.left = self.polls
        return super().recv(timeout)


@pytest.mark.parametrize("draft, budget, m, saves", [
    (TARGET, 8, 1, True),  # full acceptance: the nodes grown ahead are the ones the next frame takes
    ("draft", 8, 2, False),  # an unrelated draft: most of what was grown ahead dies with its subtree
    ("draft", 0, 3, True),
])
def test_drafting_while_a_verdict_travels_changes_no_token_and_spares_the_frames_steps(zoo, draft, budget, m, saves):
    """--draft-ahead: the draft grows the live tree while each verdict travels; the reply is the
    target's own, and frames built after a verdict never need more draft steps of their own."""
    steps = {}
    for ahead in (0, 6):
        link = Slow(6)
        session = in_flight(zoo, m, draft, budget, link=link, ahead=ahead)
        ids = session.encode(PROMPT)
        events = list(session.reply(ids, 40, Sampling()))
        rounds = [e.stats for e in events if hasattr(e, "stats")]
        fin = events[-1]
        assert list(fin.token_ids) == reference(zoo[TARGET], ids, 40, eos=-1)
        steps[ahead] = sum(r.draft_steps for r in rounds[1:]), sum(r.ahead_steps for r in rounds), len(rounds)
        assert (link.refused > 0) == (ahead > 0)
    (own_before, waiting_before, _), (own_after, waiting_after, _) = steps[0], steps[6]
    assert waiting_before == 0 and 0 < waiting_after <= 6 * len(rounds)
    assert own_after < own_before if saves else own_after <= own_before, steps


class Lying(Pipelined):
    """A tail that, before each verdict, repeats a forged one for the frame before it (a frame the
    head has taken, or left with its tree at the end of a reply): what a broken or hostile tail
    might send."""

    lies = 0

    def recv(self, timeout=None) -> bytes:
        frame = super().recv(timeout)
        msg = decode(frame)
        if isinstance(msg, wire.Verdict) and msg.round > 1 and not getattr(self, "told", False):
            self.lies += 1
            self.told = True
            self.inbox.appendleft((0.0, frame))
            return encode(wire.Verdict(msg.round - 1, msg.tree, (0, 1), (7, 7), 1))
        self.told = False
        return frame


def test_a_verdict_for_a_frame_the_head_left_is_never_applied(zoo):
    session = in_flight(zoo, 3, "draft", link=Lying())
    ids = session.encode(PROMPT)
    for n in (12, 12, 12):  # replies end with frames in flight: their tree is left behind
        ids = ids + list(finished(session, ids, n).token_ids)
    fin = finished(session, ids, 16)
    assert list(fin.token_ids) == reference(zoo[TARGET], ids, 16, eos=-1)
    assert session.engine.link.lies > 0


def test_a_hello_after_a_reply_that_ended_with_frames_in_flight_takes_the_tails_ready(zoo):
    """A reply ends (its budget) with frames still in flight; their verdicts come back in order,
    before the READY of a HELLO sent after them (a new handshake on the same link, as a benchmark
    switching modes does): they are dropped unapplied, not taken for a broken tail."""
    session = in_flight(zoo, 4, draft="draft")  # an unrelated draft: a verdict commits a token or two
    ids = session.encode(PROMPT)
    ref = reference(zoo[TARGET], ids, 24, eos=-1)
    session.eos = {ref[10]}  # the reply ends there, far from its budget: frames below it are in flight
    assert finished(session, ids, 24).finish_reason == "eos"
    session.eos = set()
    driver = session.engine
    link = driver.link
    assert link.outbox or link.inbox  # frames, or their verdicts, that the head left behind
    ready = driver.connect(driver.hello)
    assert ready.reused and driver.flight == type(driver.flight)()
    fin = finished(session, ids, 24)
    assert list(fin.token_ids) == ref


@pytest.mark.parametrize("draft", [TARGET, "draft"])
def test_the_policys_schedules_switching_mid_reply_change_no_token(zoo, draft, monkeypatch):
    """The product's own policy, its trials cut to two verdicts and its stream held at three frames
    in flight (so that the switches do not depend on this machine's timing), switching between a
    stream of shallow frames in flight and one frame per round trip several times in one reply:
    the reply is the target's own, and no streamed tree frame ran more than its cap of steps (a
    round frame's steps stop where a step is worth less than its time: how many that is depends on
    the timing)."""
    from sfchat.engine import policy as pol

    monkeypatch.setattr(pol, "TRIAL_MS", 0.0)
    monkeypatch.setattr(pol, "TRIAL_VERDICTS", 2)
    monkeypatch.setattr(pol, "REVISIT_MS", 0.0)
    monkeypatch.setattr(pol, "UNSURE_MS", 0.0)
    monkeypatch.setattr(pol, "RETRIAL_SHARE", 1.0)  # no wait for a long trial either
    monkeypatch.setattr(pol, "SETTLE", 0)
    monkeypatch.setattr(pol, "FORECAST_MARGIN", math.inf)  # no trial ruled out by its forecast
    s = Settings(model=str(zoo[TARGET]), draft="none" if draft == "none" else str(zoo[draft]), k=K, tree_budget=8, device="cpu", max_in_flight=4)
    policy = pol.PipelinePolicy(4, schedules=(pol.Schedule("stream", pol.STREAM_STEPS, 3), pol.ROUND))
    session = Head.open(s, link=Pipelined(), policy=policy)
    session.eos = set()
    built = []
    frame = session.engine.spec.frame

    def recorded(*args, **kw):
        f = frame(*args, **kw)
        if f is not None:
            built.append((policy.schedule().name, f.steps))
        return f

    session.engine.spec.frame = recorded
    forecasts, observe = [], policy.observe
    policy.observe = lambda **kw: (forecasts.append(kw["forecast"]), observe(**kw))
    ids = session.encode(PROMPT)
    events = list(session.reply(ids, 96, Sampling()))
    fin = [e for e in events if isinstance(e, ReplyFinished)][-1]
    assert list(fin.token_ids) == reference(zoo[TARGET], ids, 96, eos=-1)
    switches = sum(a != b for (a, _), (b, _) in zip(built, built[1:]))
    assert policy.counts["round"] > 0 and policy.counts["stream"] > 0 and switches >= 2, built
    # each verdict's figures name the schedule its frame was built under: as many of each as the policy counted
    named = [e.stats.schedule for e in events if hasattr(e, "stats")]
    assert {name: named.count(name) for name in policy.counts} == policy.counts, named
    assert max(steps for name, steps in built if name == "stream") <= pol.STREAM_STEPS
    # every verdict brings the tree's forecast of a frame from the root (the root's pick, at most a
    # frame), or None while the tree does not reach such a frame's depth (here, frames verified at
    # once, it never does: the tree holds the root alone after each verdict)
    assert len(forecasts) == sum(policy.counts.values()) and all(f is None or 1.0 <= f <= 8.0 for f in forecasts)


def test_a_chat_that_leaves_turns_out_stays_exact_with_trees_in_flight(zoo):
    """Past the window the prompt's start shrinks back to the system prompt: the head, the draft and
    the tail drop the K/V after the common start, and every reply is still generate()'s."""
    s = Settings(model=str(zoo[TARGET]), draft=str(zoo["draft"]), k=K, tree_budget=8, device="cpu",
                 max_in_flight=3, max_context=128, system="be brief")
    session = Head.open(s, link=Pipelined(), policy=Always(3))
    session.eos = set()
    messages, dropped = [], []
    for prompt in ["hello world", "the quick brown fox", "how are you today", "numbers 0 1 2 3", "and then"]:
        messages.append({"role": "user", "content": prompt})
        events = list(session.ask(messages, 16, Sampling()))
        users = [i for i, m in enumerate(messages) if m["role"] == "user"]
        dropped.append(events[0].dropped_turns)
        ids = prompts.encode(session.tokenizer, [{"role": "system", "content": "be brief"}] + messages[users[dropped[-1]]:])
        assert events[0].prompt_tokens == len(ids)
        assert list(events[-1].token_ids) == reference(zoo[TARGET], ids, 16, eos=-1), dropped
        held = session.engine.link.verifier.model.cached_tokens()  # the tail's K/V: of this context only
        assert held == (ids + list(events[-1].token_ids))[:len(held)]
        messages.append({"role": "assistant", "content": events[-1].text})
    assert any(b > a for a, b in zip(dropped, dropped[1:])), dropped


def test_the_policy_rates_schedules_by_the_tokens_their_frames_committed(zoo, monkeypatch):
    """A schedule's rate counts the tokens each verdict committed, not the tree's estimate of the
    frame's yield (steadier, but biased while the calibration is young and for frames hung below
    frames in flight)."""
    from sfchat.engine import policy as pol

    monkeypatch.setattr(pol, "TRIAL_MS", 0.0)
    monkeypatch.setattr(pol, "TRIAL_VERDICTS", 3)
    monkeypatch.setattr(pol, "UNSURE_MS", 0.0)
    monkeypatch.setattr(pol, "RETRIAL_SHARE", 1.0)  # no wait for a long trial either
    s = Settings(model=str(zoo[TARGET]), draft=str(zoo[TARGET]), k=K, tree_budget=8, device="cpu", max_in_flight=4)
    policy = pol.PipelinePolicy(4, schedules=(pol.Schedule("stream", pol.STREAM_STEPS, 3), pol.ROUND))
    session = Head.open(s, link=Pipelined(), policy=policy)
    session.eos = set()
    counted = {"stream": 0, "round": 0}
    observe = policy.observe

    def recorded(**kw):
        before = {name: m.n for name, m in policy.measured.items()}
        observe(**kw)
        for name, m in policy.measured.items():
            if m.n == before[name] + 1:  # counted (a restart only ever sets n to 0)
                counted[name] += kw["tokens"]
            elif m.n != before[name]:
                counted[name] = 0 if m.n == 0 else counted[name]

    policy.observe = recorded
    finished(session, session.encode(PROMPT), 64)
    assert policy.measured["stream"].n > 0 or policy.measured["round"].n > 0
    for name, m in policy.measured.items():
        assert m.tokens == counted[name], (name, m.tokens, counted[name])
