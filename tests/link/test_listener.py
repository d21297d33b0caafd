"""The tail role's listener (``link.listener``): peers one after another on one relay connection,
pairings restarted on integrity errors, redials with the one backoff, token refusals counted,
every line through the process's one log limit."""

from __future__ import annotations

import threading
import time

import pytest
from polling import WAIT, until
from relay_process import TOKEN
from recorder import Recorder

from sfchat import UserError, nodelog
from sfchat.link import LinkClosed, PeerGone
from sfchat.link.dialer import Dialer
from sfchat.link.listener import TOKEN_REFUSALS, Listener
from sfchat.link.pairing import Passcode
from sfchat.link.relay import RelayLink, TokenRefused
from sfchat.link.resume import Resumption
from sfchat.link.secure import IntegrityError, SecureLink

CODE = "7-crossover-clockwork"
SESSION = "listened"


def test_a_listener_pairs_two_heads_one_after_another_on_one_relay_connection(relay_url):
    passcode, dials, lines, handler = Passcode(CODE), [], [], Recorder()

    def dial():
        dials.append(1)
        return SecureLink(RelayLink(relay_url, TOKEN, SESSION, "tail"), passcode, SESSION, "tail",
                          log=lines.append, resumption=Resumption())

    listener = Listener(dial, handler, log=lines.append, poll=lambda: 0.2, greeting="waiting for a head")
    served: list[int] = []
    thread = threading.Thread(target=lambda: served.append(listener.serve()), daemon=True)
    thread.start()
    try:
        for n, word in enumerate((b"one", b"two")):
            head = Dialer(lambda timeout: RelayLink(relay_url, TOKEN, SESSION, "head", connect_timeout=timeout),
                          SESSION, CODE)(WAIT)
            head.send(word)
            assert head.recv(WAIT) == b"echo " + word
            head.close()
            assert until(lambda: handler.said.count("gone") == n + 1), handler.said
    finally:
        listener.close()
        thread.join(WAIT)
    assert served == [0] and handler.taken == [b"one", b"two"] and len(dials) == 1
    assert sum("paired with a head" in line for line in lines) == 2 and lines[0] == "waiting for a head"


class ScriptedLink:
    """A relay link whose ``recv`` plays ``script`` (frames, or exceptions to raise), then waits."""

    def __init__(self, script: list) -> None:
        self.script, self.restarts, self.closed, self.keyed = list(script), 0, False, True

    def recv(self, timeout=None) -> bytes:
        if self.closed:
            raise LinkClosed("the link was closed by this side")
        if not self.script:
            time.sleep(min(timeout or 0.01, 0.01))
            raise TimeoutError("nothing")
        item = self.script.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    def send(self, frame) -> None:
        pass

    def restart(self) -> None:
        self.restarts += 1

    def close(self) -> None:
        self.closed = True


def test_integrity_errors_end_only_the_pairing_and_a_flood_of_them_stays_within_the_log_limit(monkeypatch):
    frozen = nodelog.LogLimit(per_s=1, burst=1000, clock=lambda: 0.0)  # no refill: what is written is the burst
    monkeypatch.setattr(nodelog, "LIMIT", frozen)
    link = ScriptedLink([IntegrityError("frame #3 replayed")] * 200 + [PeerGone("the head left")])
    lines, handler, dials = [], Recorder(), []
    listener = Listener(lambda: dials.append(1) or link, handler, log=lines.append, poll=lambda: 0.01)
    thread = threading.Thread(target=listener.serve, daemon=True)
    thread.start()
    try:
        assert until(lambda: "gone" in handler.said)
    finally:
        listener.close()
        thread.join(WAIT)
    assert link.restarts == 200 and len(dials) == 1  # the same relay connection all along
    assert handler.said.count("ended: frame #3 replayed") == 200
    assert lines and "frame #3 replayed; ending this head's session" in lines[0]
    assert sum(map(len, lines)) <= 1000 and frozen.left_out > 0


def test_a_lost_relay_is_dialled_again_and_a_refused_token_stops_the_listener_after_its_count():
    first = ScriptedLink([LinkClosed("the connection to the relay was lost")])
    outcomes = [first, UserError("cannot reach the relay")] + [TokenRefused("relay refused the token")] * 9
    lines, handler = [], Recorder()

    def dial():
        outcome = outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    paused: list[float] = []
    with pytest.raises(UserError, match="the relay runs with another token now"):
        Listener(dial, handler, log=lines.append, pause=paused.append).serve()
    assert paused == [0.5, 1.0, 2.0, 4.0]  # the one backoff, no wait after the last refusal
    assert handler.said == ["lost"] and first.closed
    assert len(outcomes) == 9 - TOKEN_REFUSALS  # a refusal after an unreachable relay counts from one
    assert any("relay not reachable" in line for line in lines)
    assert sum("refused the token" in line for line in lines) == TOKEN_REFUSALS - 1


def test_with_once_the_listener_stops_when_its_relay_is_lost():
    link = ScriptedLink([b"hello", LinkClosed("the connection to the relay was lost")])
    lines = []
    assert Listener(lambda: link, Recorder(), log=lines.append, once=True).serve() == 1
    assert "stopping (once)" in lines[-1] and link.closed
