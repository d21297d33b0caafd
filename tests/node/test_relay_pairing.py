"""Pairing by a short code through the real relay on loopback: ``sfchat --tail`` without a code
prints one, a head with that code chats, a wrong one is refused (and the chat UI's runtime asks
for another), a guesser in a loop neither locks the tail nor keeps the head that knows the code
out, and nothing a token holder sends as a would-be head makes the tail give up its relay slot."""

from __future__ import annotations

import queue
import random
import re
import threading
import time

import pytest

from sfchat import UserError
from sfchat.events import CodeWanted, ReplyFinished, RuntimeFailed, RuntimeReady
from sfchat.link import LinkClosed, PeerGone
from sfchat.link.pairing import ATTEMPT_INTERVAL_S, BURST
from sfchat.link.relay import RelayLink
from sfchat.node import tail as tail_node
from sfchat.node.worker import RuntimeWorker
from sfchat.params import Ask
from sfchat.link.secure import WrongCode

from threaded_relay import TOKEN, relay  # noqa: F401  (the relay fixture)
from relay_heads import open_head, reply, settings
from machines import PROMPT


@pytest.fixture
def tail_log(monkeypatch):
    """Every line the tail logs (also printed), and every relay connection it dials."""
    lines, dials = [], []
    log = tail_node.log
    monkeypatch.setattr(tail_node, "log", lambda msg: (lines.append(msg), log(msg)))

    class CountedLink(RelayLink):
        def __init__(self, *args, **kwargs):
            dials.append(args)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(tail_node, "RelayLink", CountedLink)
    return lines, dials


def wait_for(lines: list[str], pattern: str, timeout: float = 60) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in list(lines):
            m = re.search(pattern, line)
            if m:
                return m
        time.sleep(0.02)
    raise AssertionError(f"the tail logged no line matching {pattern!r}: {lines}")


def start_tail(s):
    result = []
    thread = threading.Thread(target=lambda: result.append(tail_node.serve(s, once=True)), daemon=True)
    thread.start()
    return thread, result


def test_a_tail_without_a_code_prints_one_and_pairs_with_the_head_that_types_it(zoo, relay, tail_log):
    lines, dials = tail_log
    model = zoo["llama-tied"]
    tail, result = start_tail(settings(relay.url, "code", model, secret=None))
    code = wait_for(lines, r"pairing code: (\d+-[a-z]+-[a-z]+)").group(1)
    with pytest.raises(WrongCode, match="wrong pairing code"):
        open_head(settings(relay.url, "code", model, secret="1-wrong-guess"), [])
    wait_for(lines, r"a pairing attempt failed.*1 so far")
    head = open_head(settings(relay.url, "code", model, secret=code.replace("-", " ").upper()), [])
    out, _ = reply(head, 6)
    assert len(out.token_ids) == 6
    head.engine.link.close()
    tail.join(20)
    assert result == [0] and len(dials) == 1


def test_forged_pairing_messages_do_not_make_the_tail_give_up_its_relay_slot(zoo, relay, tail_log):
    """Today's finding: a forged key exchange made the tail drop its relay connection, so a token
    holder could take the free tail slot while the honest tail looped on 409."""
    lines, dials = tail_log
    model = zoo["llama-tied"]
    tail, result = start_tail(settings(relay.url, "evict", model))
    wait_for(lines, "waiting for a head")
    attacker = RelayLink(relay.url, TOKEN, "evict", "head", connect_timeout=5)
    attacker.wait_peer(5)
    for forged in (b"SFX1\x01H" + bytes(104), b"SFX2\x03" + bytes(32), b"garbage"):  # an old-style key exchange too
        attacker.send(forged)
    wait_for(lines, r"ignored \d+ bytes|ending this head's session")
    with pytest.raises(UserError, match="refused to join"):  # the tail still holds its slot
        RelayLink(relay.url, TOKEN, "evict", "tail", connect_timeout=5)
    assert len(dials) == 1
    from sfchat.link.pairing import HeadPairing, password

    guess = HeadPairing(password("5-some-guess"), "evict")  # a well-formed opening with a guessed code
    attacker.send(b"SFX2\x01" + guess.nonce + guess.message)
    assert attacker.recv(5)[:5] == b"SFX2\x02"  # the tail answered the one guess
    attacker.close()
    wait_for(lines, r"a pairing attempt failed: the head left")
    with pytest.raises(UserError, match="refused to join"):
        RelayLink(relay.url, TOKEN, "evict", "tail", connect_timeout=5)
    head = open_head(settings(relay.url, "evict", model), [])
    out, _ = reply(head, 4)
    head.engine.link.close()
    tail.join(20)
    assert result == [0] and len(dials) == 1


class Guesser:
    """A token holder who knows the session name, guessing the code in a loop through the relay: a
    new head connection per guess (the tail answers one per connection), dialled again a moment
    after each answer. It counts the answers it got: each one tests one guess."""

    def __init__(self, url: str, session: str):
        self.url, self.session = url, session
        self.answers, self.refusals, self.stop = 0, 0, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        from sfchat.link.pairer import ANSWER, MAGIC, OPEN, REFUSE
        from sfchat.link.pairing import HeadPairing, password

        n = 0
        while not self.stop.is_set():
            try:
                link = RelayLink(self.url, TOKEN, self.session, "head", connect_timeout=5)
            except UserError:  # the slot is taken (by the honest head): try again soon
                time.sleep(0.2)
                continue
            try:
                n += 1
                guess = HeadPairing(password(f"{n}-guessed-word"), self.session)
                link.send(MAGIC + bytes([OPEN]) + guess.nonce + guess.message)
                kind = link.recv(15)[4]
                self.answers += kind == ANSWER
                self.refusals += kind == REFUSE
            except (TimeoutError, LinkClosed, PeerGone):
                pass
            finally:
                link.close()
            time.sleep(random.uniform(0.3, 0.6))


def test_a_guesser_in_a_loop_neither_locks_the_tail_nor_keeps_a_head_with_the_code_from_pairing(zoo, relay, tail_log):
    """Today's finding: three wrong guesses locked the tail for 30 s (60, 120 ... an hour), replaced
    its code, and a head that knew the code was refused as 'locked' and gave up. Now the guesser's
    attempts wait for their turn (BURST, then one per ATTEMPT_INTERVAL_S), the code stays, and the
    head that holds the session's slot is the next one answered."""
    lines, _ = tail_log
    model = zoo["llama-tied"]
    tail, result = start_tail(settings(relay.url, "jam", model, secret=None))
    code = wait_for(lines, r"pairing code: (\S+)").group(1)
    guesser = Guesser(relay.url, "jam")
    t0 = time.monotonic()
    try:
        deadline = time.monotonic() + 60
        while guesser.answers + guesser.refusals <= BURST and time.monotonic() < deadline:
            time.sleep(0.05)  # until the guesser has spent the budget
        events = []
        head = open_head(settings(relay.url, "jam", model, secret=code), events)
        out, _ = reply(head, 4)
        head.engine.link.close()
    finally:
        guesser.stop.set()
        guesser.thread.join(20)
    elapsed = time.monotonic() - t0
    assert len(out.token_ids) == 4
    tail.join(20)
    assert result == [0]
    assert guesser.answers >= BURST + 1 and guesser.refusals == 0  # it was answered, slowly, never refused
    assert any(re.search(r"a pairing attempt waits .* for its turn", line) for line in lines)
    assert guesser.answers <= BURST + elapsed / ATTEMPT_INTERVAL_S + 1  # the guess rate the budget allows
    # no line speaks of a lock (the code's own words aside: a code may be "63-clock-guitar")
    assert sum("pairing code:" in line for line in lines) == 1
    assert not any(re.search(r"\block", line.replace(code, "")) for line in lines)


def next_event(events: queue.Queue, kind, timeout: float = 120):
    """The next event of ``kind`` (others are skipped; a fatal failure ends the wait)."""
    deadline = time.monotonic() + timeout
    while True:
        event = events.get(timeout=max(deadline - time.monotonic(), 0.01))
        if isinstance(event, kind):
            return event
        assert not (isinstance(event, RuntimeFailed) and event.fatal), event


def test_the_runtime_asks_for_the_code_again_instead_of_dying(zoo, relay, tail_log):
    """Today's finding: a wrong code ended the chat UI's runtime ("runtime failed") and the person
    could only restart the head. Now the runtime reports CodeWanted and waits for set_code; close()
    ends that wait."""
    lines, _ = tail_log
    model = zoo["llama-tied"]
    tail, result = start_tail(settings(relay.url, "ask", model, secret=None))
    code = wait_for(lines, r"pairing code: (\S+)").group(1)

    events = queue.Queue()
    closing = RuntimeWorker(settings(relay.url, "ask", model, secret="1-wrong-guess"))
    closing.start(events.put)
    assert "wrong pairing code" in next_event(events, CodeWanted).reason
    closing.close()  # the person quits while asked
    assert closing.join(30)
    assert all(not isinstance(e, RuntimeFailed) for e in list(events.queue))

    events = queue.Queue()
    worker = RuntimeWorker(settings(relay.url, "ask", model, secret="2-wrong-guess"))
    worker.start(events.put)
    try:
        assert "wrong pairing code" in next_event(events, CodeWanted).reason
        worker.set_code("short")
        assert "the pairing code has 5 characters" in next_event(events, CodeWanted).reason
        worker.set_code(code.upper().replace("-", " "))  # as a person may type it
        next_event(events, RuntimeReady)
        worker.submit([{"role": "user", "content": PROMPT}], Ask(4))
        assert len(next_event(events, ReplyFinished).token_ids) == 4
    finally:
        worker.close()
        assert worker.join(30)
    tail.join(20)
    assert result == [0]


def test_resumption_attempts_have_a_budget_of_their_own(zoo, relay, tail_log):
    """Round four: each resumption attempt cost the tail a full key exchange, with no budget (half
    a core under a flood). Now RESUME_BURST are answered at once, then one per RESUME_INTERVAL_S;
    the others wait for their turn, and the code's budget is not touched."""
    import os

    from sfchat.link.pairer import ANSWER, MAGIC, RESUME
    from sfchat.link.pairing import HeadPairing, RESUME_BURST, RESUME_INTERVAL_S
    from sfchat.link.resume import ResumeFile

    lines, _ = tail_log
    s = settings(relay.url, "flood", zoo["llama-tied"])
    ResumeFile(tail_node.resume_path(s)).keep(os.urandom(32))  # a tail that paired once
    tail, _ = start_tail(s)
    wait_for(lines, "waiting for a head")
    answered, t0 = 0, time.monotonic()
    for _ in range(RESUME_BURST + 6):  # a token holder, one connection per attempt
        link = RelayLink(relay.url, TOKEN, "flood", "head", connect_timeout=5)
        try:
            attempt = HeadPairing(os.urandom(32), "flood", "resume")
            link.send(MAGIC + bytes([RESUME]) + attempt.nonce + attempt.message)
            answered += link.recv(0.5)[4] == ANSWER
        except TimeoutError:
            pass  # held for its turn
        finally:
            link.close()
    elapsed = time.monotonic() - t0
    wait_for(lines, r"a resumption attempt waits .* for its turn")
    assert RESUME_BURST <= answered <= RESUME_BURST + elapsed / RESUME_INTERVAL_S + 1
    assert not any("a pairing attempt" in line for line in lines)  # the code's budget is not involved
