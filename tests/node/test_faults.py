"""WAN faults on loopback with real processes: the reply survives and equals an undisturbed run.

The heads speculate (an unrelated draft, K=3: rounds that accept nothing, some or all drafts),
so a fault lands with drafts in flight, and a verdict of a round cut off by it must not be
applied after the reconnect; the undisturbed run they are compared with has no draft at all.
A tail that makes its own code and restarts is resumed with no code typed again; one that lost
its state is given the new code through the chat UI's runtime (CodeWanted, set_code)."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import time

import pytest

import relay_process
from machines import (  # noqa: F401  (procs: a fixture)
    ENV, PROMPT, SECRET, TOKEN, free_port, local_tokens, procs, start_relay, wait_for_line)

N_NEW = 40
CODE = re.compile(r"pairing code: (\S+)")


def tail_proc(url: str, session: str, models_dir, token: str = TOKEN, code: tuple = ("--secret", SECRET),
              env: dict = ENV):
    return subprocess.Popen([sys.executable, "-m", "sfchat.cli", "--tail", "--relay", url, "--token", token,
                             *code, "--session", session, "--device", "cpu", "--models-dir", str(models_dir)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)


K = 3


def head_proc(url: str, session: str, model, draft, *extra, token: str = TOKEN, code: tuple = ("--secret", SECRET),
              env: dict = ENV):
    return subprocess.Popen([sys.executable, "-m", "sfchat.cli", "--relay", url, "--token", token, *code,
                             "--session", session, "--model", str(model), "--draft", str(draft), "--k", str(K),
                             "--prompt", PROMPT,
                             "--max-new-tokens", str(N_NEW), "--device", "cpu", "--json",
                             "--reconnect-timeout", "90", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def finish(head, budget: int = 0) -> tuple[dict, str]:
    out, err = head.communicate(timeout=240)
    assert head.returncode == 0, err
    reply = json.loads(out)
    # it speculated: a verdict may commit every node of a frame, a chain of K drafts or a tree's budget
    assert reply["k"] == K and len(reply["accepted_histogram"]) == (budget or K) + 1
    return reply, err


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
    out, err = finish(head, budget)
    assert "reconnecting" in err
    assert out["finish_reason"] == "length" and out["token_ids"] == undisturbed
    assert out["tree_budget"] == budget


N_FLIGHT = 80  # rounds enough for the calibration to send frames ahead well before the kill


@pytest.fixture(scope="module")
def undisturbed_long(zoo):
    return list(local_tokens(zoo["qwen3-untied"], "none", 0, N_FLIGHT).token_ids)


def test_tail_killed_with_frames_in_flight(zoo, procs, undisturbed_long):
    """The target drafting for itself: every assumption holds, so once the calibration has seen the
    drafts accepted, rounds go out several at a time and the kill cuts off frames in flight (their
    verdicts, if any arrive, are never applied)."""
    # a long round trip keeps the reply under way: a verdict a second, frames sent ahead from the 5th or so
    _, url, first, head = reply_under_way(zoo, procs, ("--emulate-rtt-ms", "1000"), "flight", 9.0,
                                          "--max-in-flight", "4", "--max-new-tokens", str(N_FLIGHT),
                                          draft="qwen3-untied")
    first.send_signal(signal.SIGKILL)
    procs.append(tail_proc(url, "flight", zoo["qwen3-untied"].parent))
    out, err = finish(head)
    assert "reconnecting" in err
    assert out["finish_reason"] == "length" and out["token_ids"] == undisturbed_long
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


def coded_tail(url: str, session: str, zoo, state, procs) -> tuple[subprocess.Popen, str]:
    """A tail that makes its own code (no --secret) and keeps its state in ``state``: (process, code)."""
    tail = tail_proc(url, session, zoo["qwen3-untied"].parent, token=relay_process.TOKEN, code=(),
                     env=dict(ENV, SFCHAT_STATE_DIR=str(state)))
    procs.append(tail)
    return tail, CODE.search(wait_for_line(tail.stderr, "pairing code:", 60)).group(1)


def test_a_restarted_tail_resumes_the_pairing_and_nothing_is_typed_again(zoo, procs, undisturbed, tmp_path):
    """Today's finding: the restarted tail printed a new code, the head dialled again with the one it
    was given, got 'wrong pairing code' and the reply was lost. The restarted tail reads back the
    resumption secret of the first pairing: the head pairs again with no code, the reply goes on."""
    relay, port = relay_process.start_relay(subprocess.DEVNULL, "--emulate-rtt-ms", "150")
    procs.append(relay)
    url = f"ws://127.0.0.1:{port}"
    first, code = coded_tail(url, "resume", zoo, tmp_path / "state", procs)
    head = head_proc(url, "resume", zoo["qwen3-untied"], zoo["draft"], token=relay_process.TOKEN, code=(),
                     env=dict(ENV, SFCHAT_CODE=code))  # the code as the tail printed it, given once
    procs.append(head)
    wait_for_line(first.stderr, "ready:")
    time.sleep(2.0)
    first.send_signal(signal.SIGKILL)
    second, new_code = coded_tail(url, "resume", zoo, tmp_path / "state", procs)
    assert new_code != code  # the head was never told this one
    out, err = finish(head)
    assert "reconnecting" in err
    assert out["finish_reason"] == "length" and out["token_ids"] == undisturbed
    wait_for_line(second.stderr, "a head resumed its pairing", 30)


def test_a_tail_that_lost_its_state_is_given_its_new_code_through_the_runtime(zoo, procs, undisturbed, tmp_path):
    """The chat UI's runtime mid-reply: the tail comes back without its state and with a new code,
    so the head cannot resume. It asks (CodeWanted) instead of dying, saying that the tail did not
    resume (not 'wrong pairing code': nobody typed one, and the head tries no code by itself); a
    cancel ends that reply, the next message asks again, and set_code brings the tail back."""
    from sfchat.config import Settings
    from sfchat.events import CodeWanted, ReplyFinished, RuntimeFailed, RuntimeReady, TokensCommitted
    from sfchat.node.worker import RuntimeWorker
    from sfchat.params import Ask

    relay, port = relay_process.start_relay(subprocess.DEVNULL, "--emulate-rtt-ms", "300")
    procs.append(relay)
    url = f"ws://127.0.0.1:{port}"
    first, code = coded_tail(url, "lost", zoo, tmp_path / "first", procs)
    events = queue.Queue()

    def next_event(kind):
        while True:
            event = events.get(timeout=180)
            if isinstance(event, kind):
                return event
            assert not isinstance(event, RuntimeFailed), event

    worker = RuntimeWorker(Settings(relay=url, token=relay_process.TOKEN, session="lost", secret=code,
                                    model=str(zoo["qwen3-untied"]), draft=str(zoo["draft"]), k=K, device="cpu",
                                    reconnect_timeout=90.0))
    worker.start(events.put)
    try:
        next_event(RuntimeReady)
        ask = [{"role": "user", "content": PROMPT}]
        worker.submit(ask, Ask(N_NEW))
        next_event(TokensCommitted)
        first.send_signal(signal.SIGKILL)
        second, new_code = coded_tail(url, "lost", zoo, tmp_path / "second", procs)  # no secret to resume
        reason = next_event(CodeWanted).reason
        assert "did not resume this head's pairing" in reason and "wrong pairing code" not in reason
        worker.cancel()  # the person dismisses the question: this reply ends, the runtime lives
        failed = next_event(RuntimeFailed)
        assert not failed.fatal and "cancelled while waiting for the pairing code" in failed.message
        worker.submit(ask, Ask(N_NEW))
        assert "did not resume this head's pairing" in next_event(CodeWanted).reason
        worker.set_code(new_code)
        done = next_event(ReplyFinished)
    finally:
        worker.close()
        assert worker.join(60)
    assert done.finish_reason == "length" and list(done.token_ids) == undisturbed
