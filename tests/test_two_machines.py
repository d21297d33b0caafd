"""Relay mode with real processes on loopback: relay, tail and one-shot head."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

from sfchat.config import Settings
from sfchat.events import ReplyFinished
from sfchat.runtime.session import ChatSession
from sfchat.wire import Sampling

ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
TOKEN = "test-token-123"
SECRET = "test-session-secret"  # end-to-end key material; the relay never gets it
PROMPT = "hello world, how are you?"


def start_relay(*extra):
    proc = subprocess.Popen([sys.executable, "-m", "relay.server", "--host", "127.0.0.1", "--port", "0",
                             "--token", TOKEN, *extra], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, env=ENV)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        m = re.search(r"listening on ws://[^:]+:(\d+)", line)
        if m:
            return proc, f"ws://127.0.0.1:{m.group(1)}"
    proc.kill()
    raise AssertionError("relay did not start")


def start_tail(url, session, models_dir):
    return subprocess.Popen([sys.executable, "-m", "sfchat.cli", "--tail", "--relay", url, "--token", TOKEN,
                             "--secret", SECRET, "--session", session, "--device", "cpu",
                             "--models-dir", str(models_dir)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV)


def head(url, session, model, draft, k, *extra):
    out = subprocess.run([sys.executable, "-m", "sfchat.cli", "--relay", url, "--token", TOKEN, "--secret", SECRET,
                          "--session", session,
                          "--model", str(model), "--draft", str(draft), "--k", str(k), "--prompt", PROMPT,
                          "--max-new-tokens", "24", "--device", "cpu", "--json", *extra],
                         capture_output=True, text=True, env=ENV, timeout=240)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.fixture
def relay():
    procs = []

    def make(*extra):
        proc, url = start_relay(*extra)
        procs.append(proc)
        return url

    yield make
    for p in procs:
        p.terminate()
        p.wait(10)


def local_tokens(model, draft, k, n=24):
    session = ChatSession.load(Settings(model=str(model), draft=str(draft), k=k, device="cpu"))
    ids = session.encode([{"role": "user", "content": PROMPT}])
    return [e for e in session.reply(ids, n, Sampling()) if isinstance(e, ReplyFinished)][0]


def test_relay_mode_equals_local_mode_and_serves_heads_in_turn(zoo, relay):
    url = relay()
    tail = start_tail(url, "s1", zoo["qwen2-untied"].parent)
    try:
        for draft, k in ((zoo["draft"], 3), (zoo["qwen2-untied"], 8)):
            out = head(url, "s1", zoo["qwen2-untied"], draft, k)
            ref = local_tokens(zoo["qwen2-untied"], draft, k)
            assert out["token_ids"] == list(ref.token_ids)
            assert out["mode"] == "relay" and out["rounds"] == ref.rounds
            assert out["rtt_ms"] >= 0 and out["round_ms"] > 0
    finally:
        tail.terminate()
        tail.wait(10)


def test_emulated_rtt_shows_in_the_measured_rtt(zoo, relay):
    fast, slow = relay(), relay("--emulate-rtt-ms", "100")
    tails = [start_tail(fast, "a", zoo["llama-tied"].parent), start_tail(slow, "b", zoo["llama-tied"].parent)]
    try:
        base = head(fast, "a", zoo["llama-tied"], "none", 1)
        delayed = head(slow, "b", zoo["llama-tied"], "none", 1)
    finally:
        for t in tails:
            t.terminate()
            t.wait(10)
    assert base["token_ids"] == delayed["token_ids"]
    extra = delayed["rtt_ms"] - base["rtt_ms"]
    assert 80 <= extra <= 200, (base["rtt_ms"], delayed["rtt_ms"])


def test_wrong_token_is_a_clear_error(zoo, relay):
    url = relay()
    out = subprocess.run([sys.executable, "-m", "sfchat.cli", "--relay", url, "--token", "wrong", "--secret", SECRET,
                          "--model", str(zoo["qwen2-untied"]), "--prompt", "hi", "--json"],
                         capture_output=True, text=True, env=ENV, timeout=120)
    assert out.returncode == 2
    assert "token" in out.stderr and "Traceback" not in out.stderr
