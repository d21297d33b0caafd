"""A ``--serve`` head and its pairing codes, with a real relay and real tails on loopback.

Round four's finding (issue 32.1): a head whose tail went away dialled again on every request
and, when the tail refused resumption, fell back to its code by itself, so whoever held the free
tail slot tested one guess of the code per request. Now the head tries a code once per time it is
given one: a refused resumption fails the request with a reason, and ``Server.set_code`` gives
the running server the new code (issue 33.2.1), which ``serve.cli.start_server`` run twice replaces
rather than fails beside.
"""

from __future__ import annotations

import dataclasses
import signal
import socket
import subprocess
import sys
import threading
import time

import openai
import pytest
from serve_clients import ask, client, settings_for
from threaded_relay import TOKEN as LINK_TOKEN, relay  # noqa: F401  (the in-process relay fixture)
from machines import ENV, SECRET, TOKEN, start_relay, start_tail

from sfchat import UserError
from sfchat.serve import cli
from sfchat.config import Settings
from sfchat.events import LinkState
from sfchat.link import pairing
from sfchat.link.pairing import ATTEMPT_INTERVAL_S, BURST
from sfchat.link.resume import Resumption
from sfchat.link.secure import SecretMismatch
from sfchat.node import connect
from sfchat.node.connect import HeadDialer
from sfchat.link import LinkClosed, PeerGone
from sfchat.link.pairer import ANSWER, MAGIC, NO_RESUME, OPEN, REFUSE, RESUME
from sfchat.link.pairing import TailPairing, password
from sfchat.link.relay import RelayLink
from sfchat.serve.app import ServeOptions
from sfchat.serve.main import Server

NEW_CODE = "the-restarted-tails-code"


class Squatter:
    """A token holder in the session's free tail slot, answering as a tail would: it refuses every
    resumption and answers every code opening with a guess (or, not ``answer``ing, neither);
    ``openings`` counts the code openings the head sent it (each answer tests one guess of the code
    against the head)."""

    def __init__(self, url: str, session: str, token: str = TOKEN, answer: bool = True):
        self.session, self.openings, self.resumptions, self.answer = session, 0, 0, answer
        deadline = time.monotonic() + 30
        while True:  # the killed tail's slot is freed once the relay has seen its socket close
            try:
                self.link = RelayLink(url, token, session, "tail", connect_timeout=5)
                break
            except UserError:
                assert time.monotonic() < deadline, "the tail slot was never freed"
                time.sleep(0.1)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop.is_set():
            try:
                frame = self.link.recv(0.2)
            except (TimeoutError, PeerGone):
                continue
            except LinkClosed:
                return
            if frame[:4] != MAGIC:
                continue
            self.resumptions += frame[4] == RESUME
            self.openings += frame[4] == OPEN
            if not self.answer:
                continue
            if frame[4] == RESUME:
                self.link.send(MAGIC + bytes([REFUSE, NO_RESUME]))
            elif frame[4] == OPEN:
                guess = TailPairing(password(f"{self.openings}-guessed-word"), self.session, frame[5:37], frame[37:])
                self.link.send(MAGIC + bytes([ANSWER]) + guess.nonce + guess.message + guess.confirm)

    def leave(self):
        self.stop.set()
        self.thread.join(10)
        self.link.close()


def tail_without_state(url: str, session: str, models_dir, state) -> subprocess.Popen:
    """A tail restarted without its resumption file, with a new code."""
    return subprocess.Popen([sys.executable, "-m", "sfchat.cli", "--tail", "--relay", url, "--token", TOKEN,
                             "--secret", NEW_CODE, "--session", session, "--device", "cpu",
                             "--models-dir", str(models_dir)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True,
                            env=dict(ENV, SFCHAT_STATE_DIR=str(state)))


def test_a_head_never_tries_its_code_on_whoever_refuses_resumption_and_takes_a_new_code_running(zoo, tmp_path):
    relay, url = start_relay()
    procs = [relay]
    srv = squatter = None
    try:
        procs.append(tail := start_tail(url, "codes", zoo["tokenizer"].parent))
        relayed = dataclasses.replace(settings_for(zoo), relay=url, token=TOKEN, secret=SECRET, session="codes",
                                      reconnect_timeout=60.0)
        srv = Server(relayed, ServeOptions(port=0)).start()
        c = client(srv)
        assert ask(c, srv, max_tokens=4).usage.completion_tokens >= 1
        tail.send_signal(signal.SIGKILL)
        tail.wait(10)
        squatter = Squatter(url, "codes")
        for _ in range(4):  # the attack of the issue: one request, one guess of the code
            with pytest.raises(openai.InternalServerError) as info:
                ask(c, srv, max_tokens=4)
            assert info.value.status_code == 503
            message = info.value.message
            assert "did not resume this head's pairing" in message and "server.set_code" in message
            assert "wrong pairing code" not in message
        assert squatter.resumptions >= 4 and squatter.openings == 0
        squatter.leave()
        squatter = None
        procs.append(tail_without_state(url, "codes", zoo["tokenizer"].parent, tmp_path / "lost"))
        with pytest.raises(UserError, match="characters"):
            srv.set_code("short")
        srv.set_code(NEW_CODE)  # the notebook's cell: the new code, no restart
        deadline = time.monotonic() + 120
        while True:  # until the restarted tail has joined the relay
            try:
                reply = ask(c, srv, max_tokens=4)
                break
            except openai.InternalServerError as exc:
                assert time.monotonic() < deadline, exc.message
                time.sleep(0.5)
        assert reply.usage.completion_tokens >= 1
    finally:
        if squatter is not None:
            squatter.leave()
        if srv is not None:
            srv.close()
        for proc in procs:
            proc.terminate()
            proc.wait(10)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_starting_the_server_again_in_one_process_replaces_the_old_one(zoo):
    """Issue 33.2.1: the notebook's server cell run twice started a second server that died with
    'Address already in use' while the old one, with the old code, kept answering."""
    s = settings_for(zoo)
    port = free_port()
    argv = ["--model", s.model, "--draft", s.draft, "--k", "3", "--device", "cpu", "--max-context",
            str(s.max_context), "--host", "127.0.0.1", "--port", str(port)]
    first = cli.start_server(argv)
    url = first.url
    try:
        assert ask(client(first), first, max_tokens=2).usage.completion_tokens >= 1
        second = cli.start_server(["--serve", *argv])
        try:
            assert second.url == url == f"http://127.0.0.1:{port}"
            assert not first.generator.thread.is_alive()  # the old one's models are dropped
            assert ask(client(second), second, max_tokens=2).usage.completion_tokens >= 1
        finally:
            second.close()
    finally:
        first.close()


# -- the dialer's own budget and deadlines, against an in-process relay ------------------------------
def dial_settings(url: str, session: str, code: str | None = SECRET) -> Settings:
    return Settings(relay=url, token=LINK_TOKEN, session=session, secret=code)


def test_a_head_tries_each_code_once_and_its_attempts_have_the_tails_budget(relay, monkeypatch):
    """A person (or a loop calling set_code) giving code after code: each is tried once, BURST at
    once, then one per ATTEMPT_INTERVAL_S, whoever answers as the tail."""
    now = [1000.0]
    slept = []
    monkeypatch.setattr(pairing, "HEAD_ATTEMPTS", pairing.HeadAttempts(clock=lambda: now[0]))
    monkeypatch.setattr(connect.time, "sleep", lambda s: (slept.append(s), now.__setitem__(0, now[0] + s)))
    squatter = Squatter(relay.url, "budget", LINK_TOKEN)
    given, events = [], []

    def ask_code(reason: str) -> str:
        assert "wrong pairing code" in reason
        if len(given) == 6:
            raise KeyboardInterrupt  # the person stops typing
        given.append(f"{len(given)}-typed-code")
        return given[-1]

    try:
        with pytest.raises(KeyboardInterrupt):
            HeadDialer(dial_settings(relay.url, "budget", "0-first-code"), events.append, ask_code)(30)
    finally:
        squatter.leave()
    assert squatter.openings == 1 + len(given) == 7  # one guess per code given, never more
    waits = [e.detail for e in events if e.state == "waiting" and "attempts are limited" in e.detail]
    assert len(waits) == 7 - BURST and all(abs(s - ATTEMPT_INTERVAL_S) < 0.01 for s in slept if s > 1)
    assert sum(s for s in slept if s > 1) >= (7 - BURST) * ATTEMPT_INTERVAL_S - 0.01


def test_the_budget_counts_per_session_and_in_total():
    now = [0.0]
    budget = pairing.HeadAttempts(clock=lambda: now[0])
    for _ in range(BURST):
        assert budget.wait("a") == 0
        budget.spend("a")
    assert budget.wait("a") == pytest.approx(ATTEMPT_INTERVAL_S)
    assert budget.wait("b") == pytest.approx(ATTEMPT_INTERVAL_S)  # the total binds another session too
    budget.give_back("a")  # an attempt that paired, or was never answered
    assert budget.wait("a") == 0
    now[0] += ATTEMPT_INTERVAL_S * 10
    assert budget.wait("a") == budget.wait("b") == 0


def test_a_refused_resumption_without_a_new_code_fails_and_says_why(relay):
    squatter = Squatter(relay.url, "refuse", LINK_TOKEN)
    dialer = HeadDialer(dial_settings(relay.url, "refuse"))
    dialer.code, dialer.tried = None, True  # its code paired once; this secret is what it left
    dialer.resumption = Resumption(bytes(32))
    try:
        with pytest.raises(SecretMismatch, match="did not resume this head's pairing") as info:
            dialer(30)
    finally:
        squatter.leave()
    assert "wrong pairing code" not in str(info.value)
    assert squatter.resumptions == 1 and squatter.openings == 0


def test_a_tail_that_never_answers_the_pairing_is_waited_for_no_longer_than_asked(relay):
    """The pairing waited a fixed 60 s whatever --reconnect-timeout said."""
    silent = Squatter(relay.url, "silent", LINK_TOKEN, answer=False)
    t0 = time.monotonic()
    try:
        with pytest.raises(UserError, match="did not answer the pairing"):
            HeadDialer(dial_settings(relay.url, "silent"))(3)
    finally:
        silent.leave()
    # the fixed wait was 60 s: 45 s is fifteen times the 3 s asked for, which no load reaches
    assert time.monotonic() - t0 < 45
    assert silent.openings == 1


def test_while_a_paired_tail_restarts_the_head_says_no_code_is_needed(relay):
    """Issue 33.2.3: the head said 'use the code it prints' though a restarted tail resumes."""
    events = []
    dialer = HeadDialer(dial_settings(relay.url, "restart"), events.append)
    dialer.code, dialer.tried, dialer.resumption = None, True, Resumption(bytes(32))
    with pytest.raises(TimeoutError):
        dialer(1.5)
    (waiting,) = [e.detail for e in events if isinstance(e, LinkState) and e.state == "waiting"]
    assert "resumes this pairing by itself, no code needed" in waiting and "use the code it prints" not in waiting
    events.clear()
    with pytest.raises(TimeoutError):
        HeadDialer(dial_settings(relay.url, "fresh"), events.append)(1.5)  # never paired: the code is needed
    assert "use the code it prints" in events[0].detail
