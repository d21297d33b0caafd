"""A ``--serve`` head and its pairing codes, with a real relay and real tails on loopback.

Round four's finding (issue 32.1): a head whose tail went away dialled again on every request
and, when the tail refused resumption, fell back to its code by itself, so whoever held the free
tail slot tested one guess of the code per request. Now the head tries a code once per time it is
given one: a refused resumption fails the request with a reason, and ``Server.set_code`` gives
the running server the new code (issue 33.2.1), which ``cli.start_server`` run twice replaces
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
from test_serve import ask, client, settings_for
from test_two_machines import ENV, SECRET, TOKEN, start_relay, start_tail

from sfchat import UserError, cli
from sfchat.link import LinkClosed, PeerGone
from sfchat.link.pairer import ANSWER, MAGIC, NO_RESUME, OPEN, REFUSE, RESUME
from sfchat.link.pairing import TailPairing, password
from sfchat.link.relay import RelayLink
from sfchat.serve.app import ServeOptions
from sfchat.serve.main import Server

NEW_CODE = "the-restarted-tails-code"


class Squatter:
    """A token holder in the session's free tail slot, answering as a tail would: it refuses every
    resumption and answers every code opening with a guess; ``openings`` counts the code openings
    the head sent it (each one a guess of the code tested against the head)."""

    def __init__(self, url: str, session: str):
        self.session, self.openings, self.resumptions = session, 0, 0
        deadline = time.monotonic() + 30
        while True:  # the killed tail's slot is freed once the relay has seen its socket close
            try:
                self.link = RelayLink(url, TOKEN, session, "tail", connect_timeout=5)
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
            if frame[4] == RESUME:
                self.resumptions += 1
                self.link.send(MAGIC + bytes([REFUSE, NO_RESUME]))
            elif frame[4] == OPEN:
                self.openings += 1
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
