"""Pairing by a short code through the real relay on loopback: ``sfchat --tail`` without a code
prints one, a head with that code chats, a wrong one is refused, and nothing a token holder sends
as a would-be head makes the tail give up its relay slot."""

from __future__ import annotations

import re
import threading
import time

import pytest

from sfchat import UserError
from sfchat.link.pairing import FAILURE_DELAY_S
from sfchat.link.relay import RelayLink
from sfchat.node import tail as tail_node
from sfchat.link.secure import WrongCode
from test_relay_link import TOKEN, relay  # noqa: F401  (the relay fixture)
from test_relay_security import open_head, reply, settings


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


def wait_for(lines: list[str], pattern: str, timeout: float = 15) -> re.Match:
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
    wait_for(lines, r"a pairing attempt failed.*2 more before a new code")
    time.sleep(FAILURE_DELAY_S)  # each failed attempt locks pairing for a second
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
    from sfchat.link.pairing import HeadPairing

    guess = HeadPairing("5-some-guess", "evict")  # a well-formed opening with a guessed code
    attacker.send(b"SFX2\x01" + guess.nonce + guess.message)
    assert attacker.recv(5)[:5] == b"SFX2\x02"  # the tail answered the one guess
    attacker.close()
    wait_for(lines, r"a pairing attempt failed: the head left before confirming")
    with pytest.raises(UserError, match="refused to join"):
        RelayLink(relay.url, TOKEN, "evict", "tail", connect_timeout=5)
    time.sleep(FAILURE_DELAY_S)  # the attacker's failed guess locked pairing for a second
    head = open_head(settings(relay.url, "evict", model), [])
    out, _ = reply(head, 4)
    head.engine.link.close()
    tail.join(20)
    assert result == [0] and len(dials) == 1
