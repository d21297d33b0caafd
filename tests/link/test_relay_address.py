"""What is checked of a relay before anything is asked for or loaded (sfchat.link.probe, the CLI's
check_relay), against real relays and sockets on loopback: each mistake is one line saying what
to check, and it comes before the code prompt and before torch."""

from __future__ import annotations

import http.server
import os
import pty
import select
import socket
import subprocess
import sys
import threading
import time

import pytest

from sfchat import UserError
from sfchat.link.probe import HINT, check_url, probe
from sfchat.link.relay import RelayLink

from threaded_relay import TOKEN, relay  # noqa: F401  (the relay fixture)

ENV = {k: v for k, v in os.environ.items() if not k.startswith("SFCHAT_") or k == "SFCHAT_STATE_DIR"}


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("url, message", [
    ("foo", "has no scheme"),
    ("http://127.0.0.1:8765", "has the scheme 'http'"),
    ("ws://:8765", "names no host"),
    ("ws://127.0.0.1:99999", "a port that is no number in 1..65535"),
    ("ws://127.0.0.1:port", "a port that is no number in 1..65535"),
    ("ws://127.0.0.1:8765?x=1", "no '\\?' or '#' part"),
])
def test_a_malformed_url_says_what_is_wrong_with_it(url, message):
    with pytest.raises(UserError, match=message) as refused:
        check_url(url)
    assert "must look like ws://HOST:PORT or wss://HOST:PORT" in str(refused.value)


def test_the_probe_passes_a_relay_that_takes_the_token_and_takes_no_slot(relay):
    probe(relay.url, TOKEN, "probed", "tail")
    tail = RelayLink(relay.url, TOKEN, "probed", "tail", connect_timeout=5)  # the slot is still free
    tail.close()
    with pytest.raises(UserError, match=r"refused the token \(HTTP 401\): use the token the relay printed"):
        probe(relay.url, "not-the-token", "probed", "head")


def test_nothing_listening_and_a_wrong_scheme_say_what_to_check(relay):
    port = closed_port()
    with pytest.raises(UserError, match=f"nothing listens on port {port} of 127.0.0.1") as refused:
        probe(f"ws://127.0.0.1:{port}", TOKEN, "s", "head")
    assert str(refused.value).endswith(HINT) and "firewall" in HINT and "wss://" in HINT
    with pytest.raises(UserError, match=r"TLS failed .*a relay that speaks ws://, not wss://\?"):
        probe(relay.url.replace("ws://", "wss://"), TOKEN, "s", "head")
    with pytest.raises(UserError, match=r"no address found for the host 'no-such-host\.invalid'"):
        probe("ws://no-such-host.invalid:8765", TOKEN, "s", "head")


def test_a_server_that_is_no_relay_is_named_as_such():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(UserError, match=r"answers HTTP, but not as an sfchat relay \(GET /healthz answered 404\)"):
            probe(f"ws://127.0.0.1:{server.server_address[1]}", TOKEN, "s", "head")
    finally:
        server.shutdown()
        server.server_close()


def on_a_terminal(*args: str, timeout: float = 60) -> str:
    """What ``sfchat ARGS`` writes on a terminal (a pty as stdin, stdout and stderr) until it exits
    or asks for something: it is stopped then."""
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "sfchat.cli", *args], stdin=slave, stdout=slave, stderr=slave,
                            env=ENV, start_new_session=True)
    os.close(slave)
    out, deadline = b"", time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and b"pairing code" not in out:
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(master, 4096)
                except OSError:  # the other end closed: the process is gone
                    break
                if not chunk:
                    break
                out += chunk
            elif proc.poll() is not None:
                break
    finally:
        proc.kill()
        proc.wait(10)
        os.close(master)
    return out.decode(errors="replace")


@pytest.mark.parametrize("flags, message", [
    (("--relay", "foo"), "relay URL 'foo' has no scheme"),
    (("--relay", "ws://127.0.0.1:8765"), "--relay needs the relay token that sfchat-relay printed"),
    (("--relay", "ws://127.0.0.1:{port}", "--token", "t"), "nothing listens on port {port}"),
    (("--tail", "--relay", "ws://127.0.0.1:{port}", "--token", "t"), "nothing listens on port {port}"),
])
def test_the_cli_checks_the_relay_before_it_asks_for_the_code(flags, message):
    """Today's finding: `--relay foo` asked for the code, loaded torch and only then said the URL
    was malformed (7 s per try). Now the one error line comes first, and nothing is asked."""
    port = closed_port()
    flags = [f.format(port=port) for f in flags]
    shown = on_a_terminal(*flags, *([] if "--tail" in flags else ["--prompt", "hello"]))  # a tail takes no prompt
    assert "pairing code" not in shown
    assert message.format(port=port) in shown and shown.count("sfchat: error:") == 1, shown


def test_a_relay_mistake_is_found_before_torch_is_imported():
    check = ("import sys; from sfchat.cli import main; rc = main(sys.argv[1:]); "
             "print(rc, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", check, "--relay", "ws://127.0.0.1:8765", "--prompt", "hi"],
                         capture_output=True, text=True, env=ENV, timeout=60)
    assert out.stdout.split() == ["2", "False"], out.stderr
    assert "needs the relay token" in out.stderr
