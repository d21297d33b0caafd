"""The direct link with real tail processes on loopback: a tail that listens (``--listen``, port 0
read back from its log), a head that dials it (``--direct``), sealed and paired as through the
relay; greedy output equals generate(), a closed port falls back to the relay, and a tail killed
mid-reply and started again on the same port loses nothing."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from machines import ENV, PROMPT, SECRET, generate_reference, noisy_copy, wait_for_line

LISTENING = re.compile(r"listening on 127\.0\.0\.1:(\d+) for a head's direct link")


def listening_tail(models_dir, port: int = 0, env: dict = ENV) -> tuple[subprocess.Popen, int]:
    """``sfchat --tail --listen 127.0.0.1:PORT`` (no relay): (process, the port it listens on)."""
    tail = subprocess.Popen([sys.executable, "-m", "sfchat.cli", "--tail", "--listen", f"127.0.0.1:{port}",
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


@pytest.fixture
def procs():
    started = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait(10)


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
