"""Pairing by a short code (sfchat.link.pairing, sfchat.link.codes and the pairing frames of
sfchat.link.pairer) over the meddling in-memory relay of sealed_pairs: what a capture holds,
what one attempt tests, how the tail budgets code attempts (they wait for a turn, never a lock;
the code is never replaced), and that nothing a would-be head sends makes the tail raise or leave."""

from __future__ import annotations

import contextlib
import itertools
import re
import threading
import time

import pytest
from hypothesis import given, strategies as st

from sfchat.link import codes, pairing
from sfchat.link import PeerGone
from sfchat.link.pairer import AGAIN, MAGIC, OPEN, REFUSE, HeadPairer
from sfchat.link.pairing import ATTEMPT_INTERVAL_S, BURST, Passcode
from sfchat.link.secure import IntegrityError, PairingRefused, SecureLink, WrongCode

from sealed_pairs import SECRET, Relay, fuzz, handshake_both, pair, shared_windows


def captured(relay: Relay) -> list[bytes]:
    return [frame for _, frame in relay.captured]


def test_a_capture_of_a_pairing_holds_nothing_that_depends_on_the_code_alone():
    """Today's finding: the key exchange carried an 8-byte check value derived from the secret and
    the session name only, the same in every pairing on 'default', which let a capture test guesses
    offline. Whatever two pairings with the same code share must be shared with another code's too."""
    same, again, other = Relay(), Relay(), Relay()
    pair(same, session="default")
    pair(again, session="default")
    pair(other, head_secret="2-other-code", tail_secret="2-other-code", session="default")
    constant = set(shared_windows(captured(same), captured(other)))  # framing, whatever the code
    assert [w for w in shared_windows(captured(same), captured(again)) if w not in constant] == []


def test_the_tails_answer_to_a_forged_opening_is_no_test_of_a_guess():
    """A token holder as the head sends an opening with a guessed code; the tail answers once. The
    answer verifies the guessed code only if it is right, and the attempt is counted."""
    relay = Relay()
    passcode = Passcode(SECRET)
    tail = SecureLink(relay.join("tail"), passcode, "s1", "tail")
    attacker = pairing.HeadPairing(pairing.password("5-wrong-guess"), "s1")
    relay.deliver("tail", MAGIC + bytes([OPEN]) + attacker.nonce + attacker.message)
    with pytest.raises(TimeoutError):
        tail.recv(0.1)
    (answer,) = [frame for role, frame in relay.captured if role == "tail"]
    body = answer[5:]
    with pytest.raises(pairing.WrongCode):
        attacker.finish(body[:32], body[32:65], body[65:])
    assert passcode.failures == 0  # the attempt is still open; it fails when the head leaves or retries
    tail.restart()
    assert passcode.failures == 1


@contextlib.contextmanager
def serving(tail: SecureLink):
    """The tail reading on in a thread, as ``sfchat --tail`` does, until the block ends."""
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                tail.recv(0.05)
            except (TimeoutError, PeerGone):
                pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(5)


def test_wrong_codes_neither_lock_the_tail_nor_replace_its_code_and_the_right_one_waits_its_turn():
    """Today's finding: three wrong codes replaced a made code and locked pairing for 30 s (then 60,
    120 ... an hour), so a guesser with the token and the session name kept an honest head that knew
    the code from pairing at all. Now a made code stays, and an attempt past the budget waits for
    its turn, at most ATTEMPT_INTERVAL_S, instead of being refused."""
    relay, logged = Relay(), []
    passcode = Passcode(None)
    first = passcode.code
    assert re.fullmatch(r"[1-9][0-9]{0,2}-[a-z]{3,8}-[a-z]{3,8}", first) and passcode.generated
    tail = SecureLink(relay.join("tail"), passcode, "s1", "tail", log=logged.append)
    with serving(tail):
        for guess in range(BURST + 1):  # the budget, and one more that waits for its turn
            head = SecureLink(relay.join("head"), f"{guess}-not-it", "s1", "head")
            with pytest.raises(WrongCode, match="wrong pairing code"):
                head.handshake(ATTEMPT_INTERVAL_S + 5)
            relay.leave("head")
        head = SecureLink(relay.join("head"), first, "s1", "head")
        head.handshake(ATTEMPT_INTERVAL_S + 5)  # the right code: no lock to wait out, one more turn at most
    assert passcode.code == first and passcode.failures == BURST + 1
    assert sum("waits" in line and "for its turn" in line for line in logged) >= 1, logged
    head.send(b"paired after the guesses")
    assert tail.recv(1) == b"paired after the guesses"


def test_the_budget_answers_a_burst_then_one_attempt_per_interval_and_a_pairing_gives_its_turn_back():
    now = [0.0]
    passcode = Passcode(SECRET, clock=lambda: now[0])
    for _ in range(BURST):
        assert passcode.wait() == 0
        passcode.spend()
    assert passcode.wait() == pytest.approx(ATTEMPT_INTERVAL_S)
    now[0] += ATTEMPT_INTERVAL_S / 2
    assert passcode.wait() == pytest.approx(ATTEMPT_INTERVAL_S / 2)
    answered = 0
    for _ in range(1000):  # a guesser that asks every tenth of a second for 100 s: one answer per interval
        now[0] += 0.1
        if passcode.wait() == 0:
            passcode.spend()
            answered += 1
    assert answered == int((1000 * 0.1 + ATTEMPT_INTERVAL_S / 2) // ATTEMPT_INTERVAL_S)
    now[0] += 3 * BURST * ATTEMPT_INTERVAL_S  # idle time refills the burst, no more
    for _ in range(BURST):
        passcode.spend()
    passcode.paired()  # the last was the right code: its turn comes back
    assert passcode.wait() == 0


def test_a_head_connection_gets_one_code_attempt_and_a_held_attempt_costs_nothing_when_it_leaves():
    relay = Relay()
    passcode = Passcode(SECRET)
    tail = SecureLink(relay.join("tail"), passcode, "s1", "tail", log=lambda line: None)
    head = SecureLink(relay.join("head"), "1-not-it", "s1", "head")
    with pytest.raises(WrongCode):
        handshake_both(head, tail, 2)
    guess = pairing.HeadPairing(pairing.password("2-not-it"), "s1")  # the same connection tries again
    relay.deliver("tail", MAGIC + bytes([OPEN]) + guess.nonce + guess.message)
    with pytest.raises(TimeoutError):
        tail.recv(0.2)
    assert relay.captured[-1] == ("tail", MAGIC + bytes([REFUSE, AGAIN])) and passcode.failures == 1
    again = HeadPairer(SECRET, "s1")
    again.opening()
    assert isinstance(again.take(REFUSE, bytes([AGAIN])).error, PairingRefused)  # what a head makes of it
    relay.leave("head")
    with pytest.raises(PeerGone):
        tail.recv(0.2)

    for _ in range(BURST - 1):  # the rest of the budget
        passcode.spend()
    held = pairing.HeadPairing(pairing.password(SECRET), "s1")
    relay.join("head")
    relay.deliver("tail", MAGIC + bytes([OPEN]) + held.nonce + held.message)
    with pytest.raises(TimeoutError):
        tail.recv(0.2)  # held for its turn: no answer yet
    relay.leave("head")
    with pytest.raises(PeerGone):
        tail.recv(0.2)  # the head left before its turn
    time.sleep(ATTEMPT_INTERVAL_S * 1.1)
    with pytest.raises(TimeoutError):
        tail.recv(0.1)
    assert [f for role, f in relay.captured if role == "tail"][-1][4] == REFUSE  # it was never answered
    assert passcode.wait() == 0 and passcode.failures == 1  # its turn was never spent


def test_every_pairing_has_fresh_keys():
    sealed = []
    for _ in range(2):
        relay, head, tail = pair()
        head.send(b"the same plaintext")
        assert tail.recv(1) == b"the same plaintext"
        sealed.append([f for _, f in relay.captured if f[4] == 5][0])
    assert sealed[0][:13] == sealed[1][:13] and sealed[0][13:] != sealed[1][13:]  # counter 0 in both


def test_codes_are_normalised_and_drawn_from_a_list_of_distinct_words():
    assert len(codes.WORDS) >= 300 and len(set(codes.WORDS)) == len(codes.WORDS)
    assert all(re.fullmatch(r"[a-z]{3,8}", w) for w in codes.WORDS)
    assert codes.normalize("  7 Crossover__CLOCKWORK ") == "7-crossover-clockwork"
    drawn = {codes.new_code() for _ in range(200)}
    assert len(drawn) == 200


@fuzz(150)
@given(st.lists(st.one_of(st.binary(max_size=120), st.binary(max_size=110).map(lambda b: MAGIC + b),
                          st.binary(min_size=65, max_size=65).map(lambda b: MAGIC + bytes([OPEN]) + b),
                          st.sampled_from([1, 2, 3, 4, 5, 6]).flatmap(
                              lambda kind: st.binary(min_size=0, max_size=100).map(lambda b: MAGIC + bytes([kind]) + b))),
                min_size=1, max_size=4))
def test_whatever_a_would_be_head_sends_the_tail_keeps_its_link_and_pairs_with_the_next_head(frames):
    relay = Relay()
    closed = []
    inner = relay.join("tail")
    inner.close = lambda: closed.append(True)
    passcode = Passcode(None, clock=itertools.count(0, 10_000).__next__)  # every turn has come by the next look
    tail = SecureLink(inner, passcode, "s1", "tail", log=lambda line: None)
    relay.join("head")  # the would-be head
    for frame in frames:
        relay.deliver("tail", frame)
        try:
            tail.recv(0.01)
        except TimeoutError:
            pass
        except IntegrityError:
            tail.restart()  # what sfchat --tail does: the same relay connection waits on
    assert closed == []
    tail.restart()
    relay.leave("head")
    head = SecureLink(relay.join("head"), passcode.code, "s1", "head")
    handshake_both(head, tail)
    head.send(b"still serving")
    assert tail.recv(1) == b"still serving"
