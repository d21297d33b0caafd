"""Relay mode with real processes on loopback: relay, tail and one-shot head."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from sfchat.config import Settings
from sfchat.events import ReplyFinished
from sfchat.node.head import Head
from sfchat.protocol.wire import Sampling

ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
TOKEN = "test-token-123"
SECRET = "test-session-secret"  # end-to-end key material; the relay never gets it
PROMPT = "hello world, how are you?"


def start_relay(*extra):
    proc = subprocess.Popen([sys.executable, "-m", "relay", "--host", "127.0.0.1", "--port", "0",
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


def head(url, session, model, draft, k, *extra, n=24):
    out = subprocess.run([sys.executable, "-m", "sfchat.cli", "--relay", url, "--token", TOKEN, "--secret", SECRET,
                          "--session", session,
                          "--model", str(model), "--draft", str(draft), "--k", str(k), "--prompt", PROMPT,
                          "--max-new-tokens", str(n), "--device", "cpu", "--json", *extra],
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
    session = Head.open(Settings(model=str(model), draft=str(draft), k=k, device="cpu"))
    ids = session.encode([{"role": "user", "content": PROMPT}])
    return [e for e in session.reply(ids, n, Sampling()) if isinstance(e, ReplyFinished)][0]


def generate_reference(model, n):
    """transformers' own greedy generate() on the whole model, from the head's prompt ids."""
    tok = AutoTokenizer.from_pretrained(model)
    text = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    m = AutoModelForCausalLM.from_pretrained(model).eval()
    out = m.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return len(ids), out[0, len(ids):].tolist()


N_PARITY = 64


def noisy_copy(model: Path, out: Path, scale: float, seed: int = 3) -> Path:
    """``model`` with Gaussian noise of ``scale`` times each weight's spread: a draft that agrees
    with it often, not always (0.05: about half of the first drafts right here)."""
    m = AutoModelForCausalLM.from_pretrained(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=g) * p.std() * scale)
    m.save_pretrained(out)
    AutoTokenizer.from_pretrained(model).save_pretrained(out)
    return out


def test_relay_mode_equals_generate_over_many_rounds_and_serves_heads_in_turn(zoo, relay, tmp_path):
    """Through the real relay, sealed, one tail serving two heads in turn: greedy output equals
    generate() over replies long enough for rounds that accept nothing, some or all drafts."""
    url = relay()
    tail = start_tail(url, "s1", zoo["qwen2-untied"].parent)
    target = zoo["qwen2-tied"]  # its greedy reply runs the whole N_PARITY tokens (no early EOS)
    prompt_len, ref = generate_reference(target, N_PARITY)
    assert len(ref) == N_PARITY
    hists = []
    try:
        for draft, k in ((noisy_copy(target, tmp_path / "noisy", 0.05), 3), (target, 8)):
            out = head(url, "s1", target, draft, k, n=N_PARITY)
            assert out["mode"] == "relay" and out["prompt_tokens"] == prompt_len
            assert out["token_ids"] == ref
            assert out["rounds"] >= 8
            assert out["rtt_ms"] > 0 and out["round_ms"] > out["rtt_ms"]
            hists.append(out["accepted_histogram"])
    finally:
        tail.terminate()
        tail.wait(10)
    unrelated, itself = hists
    assert sum(unrelated[:-1]) > 0  # rounds that rejected a draft: the head and tail rewound
    assert sum(unrelated[1:-1]) > 0  # and partial acceptance: some drafts kept, the rest rewound
    # the target as its own draft: every frame wholly committed (the first of a chain of 8 drafts
    # holds the root too: 8 accepted; one sent while another is in flight hangs below its last
    # draft: 7 accepted and the pick), except the last verdict, cut at the reply's end
    assert sum(itself[:7]) <= 1 and sum(itself) >= 8
    print(f"\nrelay parity over {len(ref)} tokens: histograms {hists}")


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
