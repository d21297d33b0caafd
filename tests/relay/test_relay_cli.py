"""``sfchat-relay`` as deployed: the startup banner (commands that work when copied, the token
through the environment, the addresses to use; issue 25 item 11, issue 26 item 2), SIGTERM, and
command-line errors, each on a real relay process."""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from urllib.parse import urlsplit

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from relay_dial import REPO, TOKEN, dial, event, pair, run


def read_banner(proc: subprocess.Popen, seconds: float = 20.0) -> str:
    """The relay's banner: its stdout up to the line about NAME (the last one), within ``seconds``."""
    lines, done = [], threading.Event()

    def read():
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("NAME:"):
                break
        done.set()

    threading.Thread(target=read, daemon=True).start()
    done.wait(seconds)
    return "".join(lines)


@pytest.fixture
def relay_cli(tmp_path):
    """Start ``python -m relay`` on a free port; returns (process, port, banner, stderr path)."""
    started = []

    def start(*args: str, env: dict | None = None, host: str = "127.0.0.1"):
        stderr_path = tmp_path / f"relay-{len(started)}.stderr"
        with open(stderr_path, "w") as stderr:
            proc = subprocess.Popen(
                [sys.executable, "-m", "relay", "--host", host, "--port", "0", *args],
                cwd=REPO, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
        started.append(proc)
        banner = read_banner(proc)
        if not (found := re.search(r"listening on ws://[^:]+:(\d+)", banner)):
            pytest.fail("relay did not start: " + stderr_path.read_text())
        return proc, int(found[1]), banner, stderr_path

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait(5)
        proc.stdout.close()


def commands_in(banner: str) -> list[list[str]]:
    """The banner's sfchat commands, as the shell would split them."""
    return [shlex.split(line[line.index("sfchat "):]) for line in banner.splitlines() if "sfchat " in line
            and not line.startswith("sfchat-relay")]


async def welcomed(url: str, token: str) -> dict:
    ws = await connect(f"{url}/session/cli?role=head", compression=None, proxy=None, open_timeout=10,
                       additional_headers={"Authorization": f"Bearer {token}"})
    try:
        return await event(ws)
    finally:
        await ws.close()


def test_the_banner_gives_the_token_through_the_environment_and_commands_that_work_copied(relay_cli):
    from sfchat.cli import build_parser

    env = {k: v for k, v in os.environ.items() if k != "SFCHAT_TOKEN"}
    proc, port, banner, _ = relay_cli(env=env)
    assert "--token" not in banner and "--secret" not in banner and "SECRET" not in banner
    exported = re.findall(r"^  export SFCHAT_TOKEN=(.*)$", banner, re.M)
    assert len(exported) == 1
    token, commands = shlex.split(exported[0])[0], commands_in(banner)
    assert banner.count(token) == 1  # shown once
    assert [argv[:2] for argv in commands] == [["sfchat", "--tail"], ["sfchat", "--relay"]]
    for argv in commands:
        given = vars(build_parser().parse_args(argv[1:]))  # flags left out are absent
        assert given["relay"] == f"ws://127.0.0.1:{port}" and given["session"] == "NAME"
        assert "token" not in given and "secret" not in given
    assert "prints a pairing code" in banner
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"http://127.0.0.1:{port}/healthz", timeout=5) as response:
        assert response.status == 200 and response.read().strip() == b"ok"

    async def scenario():
        with pytest.raises(InvalidStatus):
            await dial(port, "cli", "head", token="not-it")
        assert (await welcomed(build_parser().parse_args(commands[1][1:]).relay, token))["event"] == "welcome"
    run(scenario())
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == 0


def test_bound_to_every_address_the_banner_names_this_hosts_addresses_not_its_hostname(relay_cli):
    from relay.banner import local_addresses

    addresses = local_addresses()
    if not addresses:
        pytest.skip("this machine has no address but loopback")
    _, port, banner, _ = relay_cli(host="0.0.0.0", env=dict(os.environ, SFCHAT_TOKEN=TOKEN))
    urls = {argv[argv.index("--relay") + 1] for argv in commands_in(banner)}
    assert len(urls) == 1
    url = urls.pop()
    assert urlsplit(url).hostname in addresses and urlsplit(url).hostname != socket.gethostname()
    assert f"this host's addresses: {', '.join(addresses)}" in banner
    assert "public IP or DNS name" in banner and "wss://" in banner
    assert run(welcomed(url, TOKEN))["event"] == "welcome"  # an address of this very machine


def test_a_public_url_given_is_the_one_in_the_commands(relay_cli):
    _, _, banner, _ = relay_cli("--public-url", "wss://relay.example.com/", host="0.0.0.0",
                                env=dict(os.environ, SFCHAT_TOKEN=TOKEN))
    assert {argv[argv.index("--relay") + 1] for argv in commands_in(banner)} == {"wss://relay.example.com"}


def test_a_token_the_operator_chose_is_never_echoed_and_the_flag_draws_a_warning(relay_cli):
    _, _, banner, _ = relay_cli(env=dict(os.environ, SFCHAT_TOKEN="operator-chosen-token"))
    assert "operator-chosen-token" not in banner
    assert "  read -rs SFCHAT_TOKEN && export SFCHAT_TOKEN" in banner and "export SFCHAT_TOKEN=" not in banner
    _, port, banner, stderr = relay_cli("--token", "token-on-the-flag")
    assert "token-on-the-flag" not in banner
    assert "WARNING --token on the command line is visible to every user" in stderr.read_text()
    assert run(welcomed(f"ws://127.0.0.1:{port}", "token-on-the-flag"))["event"] == "welcome"


def test_every_string_from_outside_is_plain_text_in_the_banner():
    from relay.banner import banner

    text = banner("0.0.0.0", 8765, False, "t", False, 0,
                  addresses=["10.0.0.5\x1b]0;owned\x07", "2001:db8::1\x1b[2J\n  sfchat --evil"])
    assert "\x1b" not in text and "\x07" not in text and "ws://10.0.0.5?]0;owned?:8765" in text
    assert not any(line.startswith("  sfchat --evil") for line in text.splitlines())


def test_sigterm_closes_connections_with_1001_and_exits_0(relay_cli):
    proc, port, _, stderr = relay_cli(env=dict(os.environ, SFCHAT_TOKEN=TOKEN))

    async def scenario():
        head, tail = await pair(port, "bye")
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        for ws in (head, tail):
            with pytest.raises(ConnectionClosed):
                await asyncio.wait_for(ws.recv(), 5)
            assert ws.close_code == 1001
        return time.monotonic() - start

    assert run(scenario()) < 5
    assert proc.wait(5) == 0
    log = stderr.read_text()
    assert "session bye: head joined" in log and "Traceback" not in log


def cli_error(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "relay", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=20)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sfchat-relay: error:"), done.stderr
    return lines[0]


def test_bad_port_is_one_error_line():
    assert "99999" in cli_error("--port", "99999")


def test_missing_certificate_is_one_error_line(tmp_path):
    assert "certificate" in cli_error("--certfile", str(tmp_path / "missing.pem"), "--port", "0")


def test_port_in_use_is_one_error_line():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert "cannot listen" in cli_error("--host", "127.0.0.1", "--port", str(port), "--token", TOKEN)


def test_every_flag_is_described_in_help():
    from relay.cli import _parser

    undescribed = [a.option_strings[0] for a in _parser()._actions
                   if a.option_strings and (not a.help or a.help == argparse.SUPPRESS)]
    assert undescribed == []
    done = subprocess.run([sys.executable, "-m", "relay", "--help"], cwd=REPO,
                          capture_output=True, text=True, timeout=20)
    assert done.returncode == 0 and "--max-sessions" in done.stdout and "--log-level" in done.stdout


@pytest.mark.parametrize("flag, value", [("--emulate-rtt-ms", "inf"), ("--emulate-rtt-ms", "nan"),
                                         ("--emulate-rtt-ms", "1e9"), ("--emulate-mbps", "1e-320"),
                                         ("--emulate-mbps", "inf"), ("--emulate-mbps", "NaN")])
def test_an_emulated_link_that_is_not_finite_or_absurd_is_one_error_line(flag, value):
    """Round five: ``--emulate-rtt-ms inf`` was accepted, and then no frame was ever delivered."""
    line = cli_error("--host", "127.0.0.1", "--port", "0", "--token", TOKEN, flag, value)
    assert f"argument {flag}: {value} is" in line
    assert "not a finite number" in line or "out of range" in line


def test_a_relay_that_emulates_a_link_says_loudly_that_it_is_for_benchmarks(relay_cli):
    from relay.banner import banner

    proc, port, shown, stderr = relay_cli("--emulate-rtt-ms", "86", "--emulate-mbps", "100",
                                          env=dict(os.environ, SFCHAT_TOKEN=TOKEN))
    loud = [line for line in shown.splitlines() if line.startswith("!!!")]
    assert len(loud) == 2 and "86 ms" in loud[0] and "100 Mbit/s" in loud[0] and "FOR BENCHMARKS ONLY" in loud[1]
    assert "!!!" not in banner("127.0.0.1", 8765, False, "t", False, 0)  # a relay for real use says nothing of it
    proc.terminate()
    proc.wait(10)
    assert "for benchmarks only" in stderr.read_text()  # in its log too
