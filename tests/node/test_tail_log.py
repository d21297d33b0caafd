"""What the tail's log shows and how much: peer text as plain text, a rate limit nobody can
outrun, and a relay that restarted with a new token named as such (real processes on loopback)."""

from __future__ import annotations

import shutil
import socket
import time

from tail_cases import hello_for
from machines import SECRET, TOKEN, start_relay, start_tail

from sfchat.link.relay import RelayLink
from sfchat.link.secure import secure
from sfchat.protocol.wire import MsgType, decode


HOSTILE_NAME = "evil\x1b]0;owned\x07\x1b[2Jmodel"


def test_a_hello_model_name_reaches_the_tails_log_as_plain_text(zoo, tmp_path):
    """Round four: the tail's log printed the model name of a HELLO raw ('loading NAME layers')."""
    models = tmp_path / "models"
    model = models / HOSTILE_NAME
    shutil.copytree(zoo["llama-tied"], model)
    relay, url = start_relay()
    tail = start_tail(url, "named", models)
    try:  # a head of its own making: sfchat's own refuses such a name before sending it
        link = secure(RelayLink(url, TOKEN, "named", "head", connect_timeout=30), SECRET, "named", "head", 60)
        link.send(hello_for(model))
        kinds = []
        while not {MsgType.READY, MsgType.ERROR} & set(kinds):
            kinds.append(decode(link.recv(120)).type)
        link.close()
    finally:
        tail.terminate()
        _, err = tail.communicate(timeout=30)
        relay.terminate()
        relay.wait(10)
    assert "loading " in err and "evil" in err and "model layers" in err  # the name is there, as text
    assert not any(ch in err for ch in "\x1b\x07\x9b")


def test_every_line_of_the_tails_log_passes_one_rate_limit():
    from sfchat.nodelog import LOG_BURST_BYTES, LogLimit

    now = [0.0]
    limit = LogLimit(per_s=100, burst=1000, clock=lambda: now[0])
    shown = [limit.admit("x" * 99) for _ in range(50)]  # 4.95 KB at once against a burst of 1 KB
    assert sum(line is not None for line in shown) == 10
    now[0] += 1.0  # a second later: room for one more line, which counts those left out
    assert limit.admit("y" * 99) == "(40 log lines left out: too many) " + "y" * 99
    assert limit.admit("z" * 50) is None  # 11 bytes of room left
    assert LOG_BURST_BYTES <= 1 << 20


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_tail_whose_relay_restarted_with_a_new_token_says_so_and_stops(tmp_path):
    """Issue 33.2.3: the tail retried every 10 s forever, saying 'relay not reachable'."""
    port = free_port()
    relay, url = start_relay("--port", str(port))
    tail = start_tail(url, "rotated", tmp_path)
    restarted = None
    try:
        deadline = time.monotonic() + 60
        while "waiting for a head" not in tail.stderr.readline():
            assert time.monotonic() < deadline and tail.poll() is None
        relay.terminate()
        relay.wait(10)
        restarted, _ = start_relay("--port", str(port), "--token", "a-new-token")
        _, err = tail.communicate(timeout=120)
    finally:
        for proc in (tail, relay, restarted):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(10)
    from sfchat.node.tail import TOKEN_REFUSALS

    assert tail.returncode == 2
    assert err.count("refused the token") >= TOKEN_REFUSALS
    assert "the relay runs with another token now" in err.splitlines()[-1]


def test_a_tail_in_once_mode_ends_with_its_relay_instead_of_dialling_it_forever(zoo, monkeypatch):
    """A test's tail kept dialling a relay its test had stopped, and its lines ("relay not
    reachable ... retrying") landed among the next tests' progress dots."""
    import threading

    from sfchat.node import tail as tail_node
    from threaded_relay import ThreadedRelay
    from relay_heads import settings

    lines = []
    monkeypatch.setattr(tail_node, "log", lines.append)
    relay = ThreadedRelay()
    result = []
    thread = threading.Thread(target=lambda: result.append(tail_node.serve(settings(relay.url, "gone", zoo["llama-tied"]),
                                                                      once=True)), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not any("connected to" in line for line in lines) and time.monotonic() < deadline:
            time.sleep(0.02)
        relay.stop()
        thread.join(60)
    finally:
        relay.dispose()
    assert result == [1] and not any("retrying" in line for line in lines), lines
    assert "relay connection lost" in lines[-1]
