"""Relay mode with real processes on loopback: relay, tail and one-shot head."""

from __future__ import annotations

import subprocess
import sys

import pytest

from machines import ENV, SECRET, generate_reference, head, noisy_copy, start_relay, start_tail


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


N_PARITY = 64


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
