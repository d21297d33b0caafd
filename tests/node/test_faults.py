"""WAN faults on loopback with real processes: the reply survives and equals an undisturbed run.

The heads speculate (an unrelated draft, K=3: rounds that accept nothing, some or all drafts),
so a fault lands with drafts in flight, and a verdict of a round cut off by it must not be
applied after the reconnect; the undisturbed run they are compared with has no draft at all."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from test_two_machines import ENV, PROMPT, SECRET, TOKEN, local_tokens, start_relay

N_NEW = 40


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def tail_proc(url: str, session: str, models_dir):
    return subprocess.Popen([sys.executable, "-m", "sfchat.cli", "--tail", "--relay", url, "--token", TOKEN,
                             "--secret", SECRET, "--session", session, "--device", "cpu",
                             "--models-dir", str(models_dir)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV)


K = 3


def head_proc(url: str, session: str, model, draft, *extra):
    return subprocess.Popen([sys.executable, "-m", "sfchat.cli", "--relay", url, "--token", TOKEN, "--secret", SECRET,
                             "--session", session, "--model", str(model), "--draft", str(draft), "--k", str(K),
                             "--prompt", PROMPT,
                             "--max-new-tokens", str(N_NEW), "--device", "cpu", "--json",
                             "--reconnect-timeout", "90", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)


def wait_for_line(stream, needle: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = stream.readline()
        if needle in line:
            return
        if not line:
            time.sleep(0.05)
    raise AssertionError(f"no line containing {needle!r}")


def finish(head) -> tuple[dict, str]:
    out, err = head.communicate(timeout=240)
    assert head.returncode == 0, err
    reply = json.loads(out)
    assert reply["k"] == K and len(reply["accepted_histogram"]) == K + 1  # it speculated
    return reply, err


@pytest.fixture
def procs():
    started = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait(10)


@pytest.fixture(scope="module")
def undisturbed(zoo):
    return list(local_tokens(zoo["qwen3-untied"], "none", 0, N_NEW).token_ids)


def reply_under_way(zoo, procs, relay_args, session: str, seconds: float, *head_args, draft="draft"):
    """Relay, tail and a one-shot head, ``seconds`` into the reply: (relay, url, tail, head)."""
    relay, url = start_relay(*relay_args)
    tail = tail_proc(url, session, zoo["qwen3-untied"].parent)
    head = head_proc(url, session, zoo["qwen3-untied"], zoo[draft], *head_args)
    procs += [relay, tail, head]
    wait_for_line(tail.stderr, "ready:")
    time.sleep(seconds)
    return relay, url, tail, head


@pytest.mark.parametrize("budget", [0, 12])  # chains, and token trees (re-primed tail, moved K/V)
def test_tail_killed_mid_reply_and_replaced(zoo, procs, undisturbed, budget):
    _, url, first, head = reply_under_way(zoo, procs, ("--emulate-rtt-ms", "150"), "kill", 2.0,
                                          "--tree-budget", str(budget))
    first.send_signal(signal.SIGKILL)
    procs.append(tail_proc(url, "kill", zoo["qwen3-untied"].parent))
    out, err = finish(head)
    assert "reconnecting" in err
    assert out["finish_reason"] == "length" and out["token_ids"] == undisturbed
    assert out["tree_budget"] == budget


def test_tail_killed_with_frames_in_flight(zoo, procs, undisturbed):
    """The target drafting for itself: every assumption holds, so rounds go out several at a time
    and the kill cuts off frames in flight (their verdicts, if any arrive, are never applied)."""
    # a long round trip keeps the reply under way: the first verdict after ~1 s, four frames then in flight
    _, url, first, head = reply_under_way(zoo, procs, ("--emulate-rtt-ms", "1000"), "flight", 1.5,
                                          "--max-in-flight", "4", draft="qwen3-untied")
    first.send_signal(signal.SIGKILL)
    procs.append(tail_proc(url, "flight", zoo["qwen3-untied"].parent))
    out, err = finish(head)
    assert "reconnecting" in err
    assert out["finish_reason"] == "length" and out["token_ids"] == undisturbed
    assert out["in_flight_mean"] > 1.3 and out["hit_rate"] > 0.3


def test_relay_restarted_mid_reply(zoo, procs, undisturbed):
    port = free_port()
    relay, _, _, head = reply_under_way(zoo, procs, ("--port", str(port), "--emulate-rtt-ms", "150"), "restart", 2.0)
    relay.send_signal(signal.SIGKILL)
    relay.wait(10)
    time.sleep(1.0)
    again, _ = start_relay("--port", str(port), "--emulate-rtt-ms", "150")
    procs.append(again)
    out, err = finish(head)
    assert "reconnecting" in err
    assert out["token_ids"] == undisturbed


def test_stalled_link_is_waited_out(zoo, procs, undisturbed):
    relay, _, _, head = reply_under_way(zoo, procs, ("--emulate-rtt-ms", "100"), "stall", 1.5)
    os.kill(relay.pid, signal.SIGSTOP)  # the relay host freezes: nothing moves for a while
    time.sleep(5.0)
    os.kill(relay.pid, signal.SIGCONT)
    out, err = finish(head)
    assert "stalled" in err and "reconnecting" not in err
    assert out["token_ids"] == undisturbed
