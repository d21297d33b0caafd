"""The direct link with real tail processes on loopback: a tail that listens (``--listen``, port 0
read back from its log), a head that dials it (``--direct``), sealed and paired as through the
relay; greedy output equals generate(), a closed port falls back to the relay, and a tail killed
mid-reply and started again on the same port loses nothing."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys

from machines import (  # noqa: F401  (procs: a fixture)
    ENV, PROMPT, SECRET, TOKEN, free_port, generate_reference, local_tokens, noisy_copy, procs, start_relay, wait_for_line)

LISTENING = re.compile(r"listening on 127\.0\.0\.1:(\d+) for a head's direct link")


def listening_tail(models_dir, port: int = 0, *extra: str, env: dict = ENV) -> tuple[subprocess.Popen, int]:
    """``sfchat --tail --listen 127.0.0.1:PORT`` (and ``extra`` flags): (process, the port it listens on)."""
    tail = subprocess.Popen([sys.executable, "-m", "sfchat.cli", "--tail", "--listen", f"127.0.0.1:{port}", *extra,
                             "--secret", SECRET, "--device", "cpu", "--models-dir", str(models_dir)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    line = wait_for_line(tail.stderr, "for a head's direct link", 120)
    return tail, int(LISTENING.search(line).group(1))


def one_shot(model, draft, k: int, n: int, *link_flags: str) -> tuple[dict, str]:
    out = subprocess.run([sys.executable, "-m", "sfchat.cli", *link_flags, "--secret", SECRET, "--model", str(model),
                          "--draft", str(draft), "--k", str(k), "--prompt", PROMPT, "--max-new-tokens", str(n),
                          "--device", "cpu", "--json"], capture_output=True, text=True, env=ENV, timeout=240)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout), out.stderr


N_PARITY = 48


def test_a_direct_link_equals_generate_and_serves_heads_in_turn(zoo, procs, tmp_path):
    """No relay at all: the head dials the tail's port, sealed with the same code; greedy output
    equals generate() for a draft that is often wrong and for one that is always right, two heads
    one after another on one listening tail."""
    tail, port = listening_tail(zoo["qwen2-untied"].parent)
    procs.append(tail)
    target = zoo["qwen2-tied"]
    prompt_len, ref = generate_reference(target, N_PARITY)
    for draft, k in ((noisy_copy(target, tmp_path / "noisy", 0.05), 3), (target, 8)):
        out, err = one_shot(target, draft, k, N_PARITY, "--direct", f"127.0.0.1:{port}")
        assert out["via"] == "direct" and out["mode"] == "relay"  # two machines, as through a relay
        assert out["prompt_tokens"] == prompt_len and out["token_ids"] == ref
        assert out["rounds"] >= 6


def test_a_tail_at_both_places_and_a_closed_direct_port_that_falls_back_to_the_relay(zoo, procs):
    """One tail on the relay and on a port: a head given both dials the port; a head whose direct
    address is closed fails at once and pairs through the relay with the same code instead."""
    relay, url = start_relay()
    procs.append(relay)
    tail, port = listening_tail(zoo["qwen2-untied"].parent, 0, "--relay", url, "--token", TOKEN, "--session", "both")
    procs.append(tail)
    target = zoo["qwen2-tied"]
    ref = generate_reference(target, 12)[1]
    relay_flags = ("--relay", url, "--token", TOKEN, "--session", "both")
    out, err = one_shot(target, "none", 0, 12, "--direct", f"127.0.0.1:{port}", *relay_flags)
    assert out["via"] == "direct" and out["token_ids"] == ref and "through the relay" not in err
    out, err = one_shot(target, "none", 0, 12, "--direct", f"127.0.0.1:{free_port()}", *relay_flags)
    assert out["via"] == "relay" and out["token_ids"] == ref
    assert "cannot reach the tail at 127.0.0.1:" in err and "through the relay instead" in err


N_KILL = 40


def test_a_tail_killed_mid_reply_over_a_direct_link_loses_nothing(zoo, procs, tmp_path):
    """The head in this process, a reply pulled token by token: after the first tokens the tail is
    killed (the head's next frames may be in flight) and started again on the same port with its state; the head
    reconnects, resumes the pairing with no code and the reply equals an undisturbed one."""
    from sfchat.config import Settings
    from sfchat.events import LinkState, ReplyFinished, TokensCommitted
    from sfchat.node.connect import HeadDialer
    from sfchat.node.head import Head
    from sfchat.protocol.wire import Sampling

    models_dir, target = zoo["qwen3-untied"].parent, zoo["qwen3-untied"]
    undisturbed = list(local_tokens(target, "none", 0, N_KILL).token_ids)
    env = dict(ENV, SFCHAT_STATE_DIR=str(tmp_path / "state"))
    first, port = listening_tail(models_dir, env=env)
    procs.append(first)
    s = Settings(direct=f"127.0.0.1:{port}", secret=SECRET, model=str(target), draft=str(zoo["draft"]), k=3,
                 device="cpu", reconnect_timeout=90.0)
    events: list = []
    dial = HeadDialer(s, events.append)
    head = Head.open(s, events.append, dial(60), redial=dial)
    try:
        done, killed = None, False
        for event in head.reply(head.encode([{"role": "user", "content": PROMPT}]), N_KILL, Sampling()):
            if isinstance(event, TokensCommitted) and not killed:
                assert len(event.token_ids) < N_KILL  # mid-reply: the head waits for this loop to go on
                first.send_signal(signal.SIGKILL)
                first.wait(30)
                again, _ = listening_tail(models_dir, port, env=env)
                procs.append(again)
                killed = True
            elif isinstance(event, ReplyFinished):
                done = event
    finally:
        head.close()
    assert killed and done is not None and done.finish_reason == "length"
    assert list(done.token_ids) == undisturbed
    states = [e.state for e in events if isinstance(e, LinkState)]
    assert "reconnecting" in states and states[-1] == "connected" and dial.via == "direct"
    assert dial.resumption.secret is not None and dial.code is None  # resumed: the code was spent once
