"""Pairing by a short code (sfchat.link.pairing, sfchat.link.codes and SecureLink's pairing frames) over the
meddling in-memory relay of test_secure_link: what a capture holds, what one attempt tests, how the
tail budgets attempts, and that nothing a would-be head sends makes the tail raise or leave."""

from __future__ import annotations

import itertools
import re

import pytest
from hypothesis import given, strategies as st

from sfchat.link import codes, pairing
from sfchat.link.pairing import FAILURE_DELAY_S, LOCKOUT_S, MAX_FAILURES, Passcode
from sfchat.link.secure import MAGIC, OPEN, IntegrityError, PairingRefused, SecureLink, WrongCode
from test_secure_link import SECRET, Relay, fuzz, handshake_both, pair


def captured(relay: Relay) -> list[bytes]:
    return [frame for _, frame in relay.captured]


def shared_windows(a: list[bytes], b: list[bytes], width: int = 8, skip: int = 8) -> list[bytes]:
    """Byte strings of ``width`` that frames of ``a`` (past their first ``skip`` header bytes) share
    with frames of ``b``."""
    other = b"\xff".join(b)
    return [f[i:i + width] for f in a for i in range(skip, len(f) - width + 1) if f[i:i + width] in other]


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
    attacker = pairing.HeadPairing("5-wrong-guess", "s1")
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


def test_three_wrong_codes_make_a_tail_with_its_own_code_print_a_fresh_one():
    relay = Relay()
    shown, logged, now = [], [], [0.0]
    passcode = Passcode(None, on_new_code=shown.append, clock=lambda: now[0])
    assert re.fullmatch(r"[1-9][0-9]{0,2}-[a-z]{3,8}-[a-z]{3,8}", shown[0]) and passcode.generated
    tail = SecureLink(relay.join("tail"), passcode, "s1", "tail", log=logged.append)
    first = shown[0]
    for guess in range(MAX_FAILURES):
        head = SecureLink(relay.join("head"), f"{guess}-not-it", "s1", "head")
        with pytest.raises(WrongCode, match="wrong pairing code"):
            handshake_both(head, tail, 1)
        relay.leave("head")
        now[0] += FAILURE_DELAY_S
    assert len(shown) == 2 and shown[1] != first and passcode.code == shown[1]
    assert any(f"a new code was made; pairing locked for {LOCKOUT_S:.0f} s" in line for line in logged), logged
    head = SecureLink(relay.join("head"), shown[1], "s1", "head")
    with pytest.raises(PairingRefused):  # a new code comes with a lock: guessing stays slow
        handshake_both(head, tail, 1)
    relay.leave("head")
    now[0] += LOCKOUT_S
    head = SecureLink(relay.join("head"), first, "s1", "head")  # the old code is spent
    with pytest.raises(WrongCode):
        handshake_both(head, tail, 1)
    relay.leave("head")
    now[0] += FAILURE_DELAY_S
    head = SecureLink(relay.join("head"), shown[1], "s1", "head")
    handshake_both(head, tail)
    assert tail.keyed


def test_a_code_given_by_the_operator_locks_pairing_for_a_while_after_three_failures():
    now = [1000.0]
    relay = Relay()
    passcode = Passcode("operator-chosen-secret", clock=lambda: now[0])
    tail = SecureLink(relay.join("tail"), passcode, "s1", "tail")
    for _ in range(MAX_FAILURES):
        head = SecureLink(relay.join("head"), "a-wrong-secret", "s1", "head")
        with pytest.raises(WrongCode):
            handshake_both(head, tail, 1)
        relay.leave("head")
        now[0] += FAILURE_DELAY_S
    head = SecureLink(relay.join("head"), "operator-chosen-secret", "s1", "head")
    with pytest.raises(PairingRefused, match=f"refuses pairings for {int(LOCKOUT_S) - 1} s"):
        handshake_both(head, tail, 1)  # even the right code: no guess is tested while locked
    relay.leave("head")
    now[0] += LOCKOUT_S
    head = SecureLink(relay.join("head"), "operator-chosen-secret", "s1", "head")
    handshake_both(head, tail)
    assert tail.keyed


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
                          st.sampled_from([1, 2, 3, 4, 5]).flatmap(
                              lambda kind: st.binary(min_size=0, max_size=100).map(lambda b: MAGIC + bytes([kind]) + b))),
                min_size=1, max_size=4))
def test_whatever_a_would_be_head_sends_the_tail_keeps_its_link_and_pairs_with_the_next_head(frames):
    relay = Relay()
    closed = []
    inner = relay.join("tail")
    inner.close = lambda: closed.append(True)
    passcode = Passcode(None, clock=itertools.count(0, 10_000).__next__)  # every lock has passed by the next look
    tail = SecureLink(inner, passcode, "s1", "tail", log=lambda line: None)
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
    head = SecureLink(relay.join("head"), passcode.code, "s1", "head")
    handshake_both(head, tail)
    head.send(b"still serving")
    assert tail.recv(1) == b"still serving"
