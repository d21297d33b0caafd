"""A node's half cut into segments, as on a notebook with two GPUs (``--device cpu,cpu`` runs the
same segments on the CPU): greedy output is generate()'s in local and relay mode, with a tree and a
draft whose committed paths skip likelier siblings, so that every segment's K/V must move."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from sfchat.config import Settings
from sfchat.events import ReplyFinished
from sfchat.model.devices import resolve_devices
from sfchat.node.head import Head
from sfchat.protocol.wire import Sampling

from machines import ENV, PROMPT, SECRET, TOKEN, generate_reference, noisy_copy, start_relay

N = 48
NOISE = 0.3  # the draft's first proposal is the target's pick about half the time here, its second often


@pytest.fixture(scope="module")
def pair(zoo, tmp_path_factory):
    target = zoo["qwen2-tied"]
    return target, noisy_copy(target, tmp_path_factory.mktemp("noisy") / "draft", NOISE)


def test_cpu_named_twice_is_two_segments():
    assert resolve_devices("cpu,cpu") == [torch.device("cpu")] * 2  # refused before: "only GPUs can share a slice"


@pytest.mark.parametrize("tree_budget", [0, 16])
def test_a_segmented_head_and_tail_answer_what_generate_does(pair, tree_budget):
    target, draft = pair
    session = Head.open(Settings(model=str(target), draft=str(draft), k=4, device="cpu,cpu",
                                 tree_budget=tree_budget))
    head, tail = session.engine.head, session.engine.link.verifier.model
    assert len(head.devices) == 2 and len(tail.devices) == 2
    jumps = []  # commits whose K/V left its slot: a path that skipped a likelier sibling, or a moved survivor
    move = head.move
    head.move = lambda src, dst: (jumps.append(any(s != d for s, d in zip(src, dst))), move(src, dst))[1]
    ids = session.encode([{"role": "user", "content": PROMPT}])
    fin = [e for e in session.reply(ids, N, Sampling()) if isinstance(e, ReplyFinished)][0]
    ref = AutoModelForCausalLM.from_pretrained(target).eval().generate(torch.tensor([ids]), max_new_tokens=N,
                                                                        do_sample=False, pad_token_id=0)
    assert list(fin.token_ids) == ref[0, len(ids):].tolist() and len(fin.token_ids) == N
    if tree_budget:
        assert any(jumps), "no committed path moved K/V: the test would not see a stale segment"


def test_relay_mode_with_segmented_halves_answers_what_generate_does(pair):
    """Relay, tail and one-shot head as processes, both halves as two segments, a tree, frames in
    flight: the reply is generate()'s."""
    target, draft = pair
    relay, url = start_relay()
    tail = subprocess.Popen([sys.executable, "-m", "sfchat.cli", "--tail", "--relay", url, "--token", TOKEN,
                             "--secret", SECRET, "--session", "seg", "--device", "cpu,cpu",
                             "--models-dir", str(target.parent)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        out = subprocess.run([sys.executable, "-m", "sfchat.cli", "--relay", url, "--token", TOKEN, "--secret",
                              SECRET, "--session", "seg", "--model", str(target), "--draft", str(draft), "--k", "4",
                              "--tree-budget", "16", "--prompt", PROMPT, "--max-new-tokens", str(N),
                              "--device", "cpu,cpu", "--json"], capture_output=True, text=True, env=ENV, timeout=300)
    finally:
        for proc in (tail, relay):
            proc.terminate()
            proc.wait(10)
    assert out.returncode == 0, out.stderr
    import json

    got = json.loads(out.stdout)
    _, ref = generate_reference(target, N)
    assert got["mode"] == "relay" and got["token_ids"] == ref and len(ref) == N
