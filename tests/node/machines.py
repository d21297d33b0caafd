"""What the tests of two machines on one share: a relay and tails as processes, a head in this
process, and the replies of generate() and of local mode to compare with."""

from __future__ import annotations

import json
import os
import re
import socket
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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for_line(stream, needle: str, timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = stream.readline()
        if needle in line:
            return line
        if not line:
            time.sleep(0.05)
    raise AssertionError(f"no line containing {needle!r}")


@pytest.fixture
def procs():
    """Processes a test started (append them): killed, if still running, when it ends."""
    started = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait(10)
