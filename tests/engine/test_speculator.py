"""The sans-I/O head (frames of the live tree, verdict checks, commits, the K/V behind them) with
verdicts made by hand, and its driver against tails that lie or talk."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch

from sfchat.config import Settings
from sfchat.engine.live import ProtocolError
from sfchat.engine.lookup import lookup
from sfchat.engine.speculator import LOOKUP_TOKENS
from sfchat.engine.verifier import TailError, Verifier
from sfchat.events import ReplyFinished
from sfchat.node.driver import LinkError, LinkLost, RoundDriver
from sfchat.node.head import Head
from sfchat.node.tail_loader import TailLoader
from sfchat.node.local_link import MemoryLink
from sfchat.protocol import wire
from sfchat.protocol.wire import Sampling

from flight_links import Pipelined
from engine_runs import PROMPT

K = 4
TARGET = "qwen2-untied"


def load(zoo, draft=TARGET, k=K, target=TARGET, link=None, **kw) -> Head:
    s = Settings(model=str(zoo[target]), draft=str(zoo[draft]), k=k, device="cpu", **kw)
    return Head.open(s, link=link)


def finished(session, ids, n, s=Sampling()) -> ReplyFinished:
    return [e for e in session.reply(ids, n, s) if isinstance(e, ReplyFinished)][-1]


def rounds_of(session, ids, n, s=Sampling()):
    return [e.stats for e in session.reply(ids, n, s) if hasattr(e, "stats")]


@pytest.fixture
def spec(zoo):
    """The speculator of a head whose draft is the target (a chain of K), after its prompt."""
    session = load(zoo, tree_budget=0)
    ids = session.encode(PROMPT)
    session.engine.spec.begin(ids)
    return session.engine.spec


def verdict(frame, path, tokens, **kw) -> wire.Verdict:
    return wire.Verdict(**(dict(round=frame.round_id, tree=frame.tree, path=tuple(path), tokens=tuple(tokens),
                                tail_us=5) | kw))


def test_a_trees_first_frame_sends_the_missing_context_then_the_root_and_its_chain(spec):
    n = len(spec.tokens)
    frame = spec.frame(Sampling(), 100)
    msgs = [wire.decode(f) for f in frame.frames]
    assert [m.verify for m in msgs] == [False] * (len(msgs) - 1) + [True]
    assert msgs[0].start_pos == 0 and sum(len(m.tokens) for m in msgs[:-1]) == n - 1  # prefill up to the root
    tree = msgs[-1]
    assert tree.start_pos == n - 1 and tree.first_id == 1 and tree.tokens[0] == spec.tokens[-1]
    assert tree.parents == tuple(range(K + 1)) and len(tree.tokens) == K + 1  # the root, then a chain of K
    assert spec.head.cached_tokens() == spec.tokens[:-1]  # the nodes sit in scratch, not in the context
    again = spec.frame(Sampling(), 100)
    nxt = wire.decode(again.frames[-1])
    assert len(again.frames) == 1 and nxt.first_id == K + 2 and nxt.parents[0] == K + 1  # below the first


def test_the_forecast_of_a_frame_from_the_root_waits_for_a_tree_that_deep(spec):
    """The policy's forecast of one frame per round trip: the tree's expected yield from the root
    within K steps, once the tree reaches that deep (a root alone would forecast one token where
    such a frame commits up to K + 1)."""
    assert spec.forecast() is None
    spec.frame(Sampling(), 100)  # K steps of the draft: the chain reaches K below the root
    value, deepest = spec.live.expected(spec.frame_size, spec.live.root.pos + K + 1)
    assert deepest == spec.live.root.pos + K and spec.forecast() == pytest.approx(value)
    assert 1.0 < value <= K + 1
    assert spec.forecast(ahead=1) == spec.forecast()  # a frame of K + 1 nodes reaches no deeper


def test_a_verdict_commits_the_picks_and_the_context_grows_by_the_committed_nodes(spec):
    n = len(spec.tokens)
    frame = spec.frame(Sampling(), 100)
    nodes = frame.nodes
    picks = [m.token for m in nodes[1:3]] + [(nodes[3].token + 1) % spec.vocab]  # two accepted, then another
    commit = spec.take(frame, verdict(frame, [0, 1, 2], picks), set(), 100)
    assert commit.tokens == tuple(picks) and commit.finish is None and spec.tokens[n:] == picks
    assert spec.head.cached_tokens() == spec.tokens[:-1]  # the committed nodes' K/V moved into the context
    assert spec.live.root.token == picks[-1] and not spec.live.root.sent
    frame = spec.frame(Sampling(), 100)
    assert wire.decode(frame.frames[-1]).parents[0] == nodes[2].id  # the new root hangs under the last committed


def test_a_reply_is_cut_at_eos_budget_and_window(spec):
    frame = spec.frame(Sampling(), 100)
    picks = [m.token for m in frame.nodes[1:]] + [3]
    commit = spec.take(frame, verdict(frame, range(K + 1), picks), {picks[1]}, 100)
    assert commit.tokens == tuple(picks[:2]) and commit.finish == "eos" and spec.live is None
    spec.begin(spec.tokens)
    frame = spec.frame(Sampling(), 2)  # a budget of two tokens: nodes beyond it are not sent
    assert len(frame.nodes) == 2
    commit = spec.take(frame, verdict(frame, [0, 1], [frame.nodes[1].token, 7]), set(), 2)
    assert len(commit.tokens) == 2 and commit.finish == "length"


@pytest.mark.parametrize("case, message", [
    (lambda f, v: verdict(f, [0], [-1]), "outside the vocabulary"),
    (lambda f, v: verdict(f, [0], [v]), "outside the vocabulary"),
    (lambda f, v: verdict(f, [0, 2], [f.nodes[1].token, 1]), "picks down the tree"),
    (lambda f, v: verdict(f, [1], [1]), "start at the root"),
    (lambda f, v: verdict(f, [], []), "holds the root"),
    (lambda f, v: verdict(f, [0, 99], [f.nodes[1].token, 1]), "does not have"),
    (lambda f, v: verdict(f, [0], [1], round=f.round_id + 5), "for frame"),
    (lambda f, v: verdict(f, [0], [1], tree=f.tree + 1), "of tree"),
])
def test_an_impossible_verdict_is_a_protocol_error_and_commits_nothing(spec, case, message):
    frame = spec.frame(Sampling(), 100)
    before, written = list(spec.tokens), list(spec.head.cached_tokens())
    with pytest.raises(ProtocolError, match=message):
        spec.take(frame, case(frame, spec.vocab), set(), 100)
    assert spec.tokens == before and spec.head.cached_tokens() == written


def test_a_frame_built_ahead_hedges_and_its_nodes_die_with_the_outcome_it_lost(zoo):
    session = load(zoo, draft="draft", tree_budget=8)  # an unrelated draft: a tree of 8
    spec = session.engine.spec
    spec.begin(session.encode(PROMPT))
    first = spec.frame(Sampling(), 100)
    second = spec.frame(Sampling(), 100)  # before the first's verdict
    assert {n.parent for n in second.nodes} & set(first.nodes)  # hangs under the first frame's nodes
    held = spec.scratch.free
    assert all(n in spec.scratch for n in first.nodes + second.nodes)
    other = next(t for t in range(spec.vocab) if t not in first.nodes[0].children)
    spec.take(first, verdict(first, [0], [other]), set(), 100)  # the target picked what nobody proposed
    assert spec.live.root.token == other and not spec.live.root.sent
    # every node of both frames died (the root's K/V became context): their slots came back
    assert not any(n in spec.scratch for n in first.nodes + second.nodes)
    assert spec.scratch.free == spec.scratch.size - 1 > held
    assert spec.take(second, verdict(second, [], []), set(), 100).tokens == ()


# -- the driver: a hostile tail gets a protocol error, not a crash, and never holds the head --------
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
    (lambda m: replace(m, path=(0, 1), tokens=(0, 0)), "picks down the tree"),
    (lambda m: replace(m, path=(), tokens=()), "holds the root"),
    (lambda m: replace(m, round=m.round + 7), "which was never sent"),
])
def test_a_forged_verdict_ends_the_reply_with_a_protocol_error(zoo, tamper, message):
    def forge(msg):
        return tamper(msg) if isinstance(msg, wire.Verdict) and msg.round > 1 else msg

    session = load(zoo, draft="draft", tree_budget=0, link=Tampering(forge))
    with pytest.raises(LinkError, match=f"protocol error: .*{message}"):
        finished(session, session.encode(PROMPT), 30)
    assert len(session.engine.tokens) <= len(session.encode(PROMPT)) + K + 1  # only the honest first frame


def test_a_malformed_progress_frame_is_a_protocol_error(zoo):
    def forge(msg):
        if isinstance(msg, wire.Control) and msg.type is wire.MsgType.READY:
            return wire.encode(wire.Control(wire.MsgType.PROGRESS, {"stage": "load", "done": "x", "total": 1}))
        return msg

    with pytest.raises(LinkError, match="protocol error: a PROGRESS frame"):
        load(zoo, draft="draft", link=Tampering(forge))


class Talkative(MemoryLink):
    """A paired tail that never gives a verdict but says something every ``every`` seconds: a
    PROGRESS frame, or a stale verdict (of frame 0) again and again."""

    overlaps = True

    def __init__(self, say: bytes, every: float = 0.1):
        super().__init__(Verifier(TailLoader(torch.device("cpu"))))
        self.say, self.every, self.ready = say, every, False

    def recv(self, timeout=None) -> bytes:
        if not self.ready:  # the handshake is honest
            frame = super().recv(timeout)
            msg = wire.decode(frame)
            self.ready = isinstance(msg, wire.Control) and msg.type is wire.MsgType.READY
            return frame
        time.sleep(min(self.every, timeout or self.every))
        if timeout is not None and timeout < self.every:
            raise TimeoutError
        return self.say


@pytest.mark.parametrize("say", [
    wire.encode(wire.Control(wire.MsgType.PROGRESS, {"stage": "load", "done": 1, "total": 2, "detail": ""})),
    wire.encode(wire.Verdict(0, 1, (), ())),
], ids=["progress", "an old verdict"])
def test_a_talkative_tail_cannot_hold_the_head_past_the_round_timeout(zoo, say):
    """Whatever arrives meanwhile, the round timeout is a deadline for the verdict (on the old
    driver each frame restarted the wait: this reply never ended)."""
    session = load(zoo, draft="draft", link=Talkative(say), round_timeout=1.0)
    t0 = time.monotonic()
    with pytest.raises(LinkLost, match="no verdict for 1 s"):
        finished(session, session.encode(PROMPT), 30)
    # the old driver never returned; 60 s is sixty times the timeout, which no load reaches
    assert time.monotonic() - t0 < 60


def test_a_tails_word_about_its_compute_never_exceeds_the_time_it_took(zoo):
    session = load(zoo, draft="draft", link=Tampering(
        lambda m: replace(m, tail_us=2 ** 32 - 1) if isinstance(m, wire.Verdict) else m))
    rounds = rounds_of(session, session.encode(PROMPT), 12)
    assert all(0 <= r.tail_ms <= r.round_ms and r.rtt_ms >= 0 for r in rounds)


class Eager(MemoryLink):
    """A tail whose verdict is in before ``send`` returns: a relay link's send waits for its loop
    thread to write the frame, and on a loaded machine the verdict may be back by then."""

    overlaps = True

    def send(self, frame: bytes) -> None:
        super().send(frame)
        while self.outbox:
            try:
                self.verifier.handle(self.outbox.popleft(), lambda reply: self.inbox.append((time.perf_counter(), reply)))
            except TailError:
                pass


def test_a_verdict_back_before_send_returns_still_counts_the_tails_compute(zoo):
    """The clock of a frame starts before it is sent (it started after, so such a verdict seemed
    to take no time at all: the tail's compute and the link both read 0)."""
    session = load(zoo, draft="draft", link=Eager(Verifier(TailLoader(torch.device("cpu")))))
    rounds = rounds_of(session, session.encode(PROMPT), 12)
    assert all(r.tail_ms > 0 and r.rtt_ms >= 0 and r.tail_ms + r.rtt_ms <= r.round_ms for r in rounds), rounds


def test_local_mode_never_sends_ahead(zoo):
    session = load(zoo, draft=TARGET, max_in_flight=4)
    assert session.engine.policy.max_in_flight == 1
    rounds = rounds_of(session, session.encode(PROMPT), 30)
    assert all(r.in_flight == 1 and not r.speculated and r.ahead_steps == 0 and r.schedule == "round" for r in rounds)


def test_a_tail_lost_during_the_handshake_is_waited_for(zoo):
    class Gone:
        overlaps, last_arrival = True, None

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
    driver = RoundDriver(session.engine.spec, gone, reconnect_timeout=30,
                         reconnect=lambda timeout: MemoryLink(Verifier(TailLoader(torch.device("cpu")))))
    ready = driver.connect(session.engine.hello)
    assert gone.closed and ready.n_layers == session.info.n_layers
    driver.begin(session.encode(PROMPT))
    assert driver.round(Sampling(), set(), 10).commit.tokens


def test_drafting_ahead_of_a_new_root_keeps_the_prompt_lookup_branch(spec):
    """A wait's draft step may reach a root no frame has carried yet: the continuation of the
    context's latest repeat still hangs under it, as it would without drafting ahead."""
    ctx = spec.tokens + spec.tokens[:8]  # ends with a repeat of the prompt's first tokens
    spec.begin(ctx)
    branch = lookup(ctx, LOOKUP_TOKENS)
    assert len(branch) == LOOKUP_TOKENS
    assert spec.grow(Sampling(), 100) and spec.live.root.expanded
    node = spec.live.root
    for token in branch:
        assert token in node.children, (token, list(node.children))
        node = node.children[token]
    frame = spec.frame(Sampling(), 100)
    assert [n.token for n in frame.nodes[:3]] == [ctx[-1]] + branch[:2]


def test_drafting_ahead_leaves_the_next_frames_own_steps_their_room(zoo):
    """However long a verdict takes, the steps run while waiting stop short of filling the draft's
    pool: the next frame's own steps and the catch-up of committed nodes always find slots (a head
    whose link overlaps, as a relay's does: local mode's pool has no room for drafting ahead)."""
    session = load(zoo, tree_budget=0, link=Pipelined(), draft_ahead=8)
    spec = session.engine.spec
    spec.begin(session.encode(PROMPT))
    spec.frame(Sampling(), 100)
    grown = 0
    while spec.grow(Sampling(), 100):
        grown += 1
    d = spec.drafter
    assert grown > 0 and d.scratch.free >= spec.steps * d.width + d.rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_frames_hidden_states_are_checked_finite_on_their_bits_not_on_torchs_thread_pool(dtype, monkeypatch):
    """The head refuses to send states that are not finite (fp16 overflow) with its remedies. It
    checks the copied bits with numpy: torch's own CPU op over a frame's rows runs on the
    intra-op pool, which cost a compiled tree frame 38 ms on an H100 host (RESULTS, seventh
    session), so the op is not called at all here."""
    from sfchat import UserError
    from sfchat.engine.speculator import hidden_bytes

    def pooled(*a, **kw):
        raise AssertionError("torch.isfinite on the host: the intra-op thread pool")
    monkeypatch.setattr(torch, "isfinite", pooled)
    info = torch.finfo(dtype)
    edge = torch.tensor([info.max, -info.max, info.tiny, info.tiny / 4, 0.0, -0.0, 1.5], dtype=dtype)
    good = torch.randn(64, 48).to(dtype)
    good.view(-1)[:len(edge)] = edge  # the largest, the smallest and subnormal values are finite
    assert hidden_bytes(good, "x") == good.view(torch.uint8).numpy().tobytes()
    assert hidden_bytes(good.t(), "x") == good.t().contiguous().view(torch.uint8).numpy().tobytes()
    for bad in (float("inf"), float("-inf"), float("nan")):
        for at in (0, 1234, 64 * 48 - 1):
            h = good.clone()
            h.view(-1)[at] = bad
            with pytest.raises(UserError, match="not finite"):
                hidden_bytes(h, "states that are not finite; use --dtype bfloat16")
