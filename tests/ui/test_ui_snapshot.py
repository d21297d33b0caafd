"""Snapshot of the main screen mid-conversation, metrics panel filled.

The runtime here emits fixed events synchronously (no thread, no clock), so the screen is
the same on every run. Regenerate with ``pytest tests/ui/test_ui_snapshot.py --snapshot-update``
and look at the SVG under tests/ui/__snapshots__/ before committing it.
"""

from __future__ import annotations

from sfchat.tally import Tally
from sfchat.params import Ask
from sfchat.events import (
    LinkState, LoadProgress, ReplyFinished, ReplyStarted, RoundStats, RuntimeReady,
    TokensCommitted,
)
from sfchat.ui import SfchatApp
from sfchat.ui.prompt import PromptInput

K = 8
READY = RuntimeReady(model="Qwen/Qwen2.5-7B-Instruct", draft="Qwen/Qwen2.5-0.5B-Instruct",
                     split=14, n_layers=28, dtype="fp16", k=K, device="cuda:0", mode="relay",
                     max_context=32768)
ACCEPTED = (8, 5, 8, 2, 8, 6, 0, 8, 4, 8, 7, 3, 8, 8, 1, 5, 8, 6, 8, 2)
REPLIES = [
    "A **KV cache** keeps the attention keys and values of every token already seen, so "
    "each new token attends to them instead of recomputing the whole prefix.",
    "Because the tail checks all *K* drafted tokens in **one** pass, a WAN round trip "
    "costs once per round instead of once per token:\n\n"
    "- the draft proposes 8 tokens on the head\n"
    "- the tail verifies them and adds one of its own\n"
    "- on average ~5 tokens are committed per round trip\n\n"
    "```python\ntokens_per_s = tokens_per_round / round_s\n```",
]


class ScriptedRuntime:
    """Emits a fixed loading sequence and fixed replies, synchronously, from the caller."""

    def __init__(self) -> None:
        self._replies = iter(REPLIES)

    def start(self, listener) -> None:
        self._emit = listener
        listener(LoadProgress("head", "load", 14, 14, "layers 0-13"))
        listener(LoadProgress("tail", "load", 14, 14, "layers 14-27"))
        listener(LinkState("connected", "relay.example.net"))
        listener(READY)

    def submit(self, messages, params) -> None:
        text = next(self._replies)
        words = [w + " " for w in text.split(" ")]
        words[-1] = words[-1][:-1]
        self._emit(ReplyStarted(prompt_tokens=31 * len(messages), reused_tokens=0,
                                prefill_tokens=31 * len(messages)))
        i, rounds, tally = 0, 0, Tally(K)
        while i < len(words):
            accepted = ACCEPTED[rounds % len(ACCEPTED)]
            chunk = "".join(words[i:i + accepted + 1])
            i += accepted + 1
            rounds += 1
            rtt = 84.0 + (rounds * 7) % 23
            stats = RoundStats(accepted=accepted, committed=accepted + 1, draft_ms=24.0 + rounds % 3,
                               head_ms=18.0, tail_ms=21.0, rtt_ms=rtt, round_ms=150.0 + (rounds * 11) % 40,
                               wait_ms=rtt + 21.0, depth=K + 1, tree_nodes=K + 1, forward_bytes=(K + 1) * 7168)
            self._emit(TokensCommitted(chunk, tuple(range(accepted + 1)), stats, 0.1 * rounds))
            tally.add(stats, 0.1 * rounds)
        self._emit(ReplyFinished("eos", text, tuple(range(len(words))), 31 * len(messages), **tally.figures()))

    def cancel(self) -> None:
        pass

    def new_chat(self) -> None:
        pass

    def close(self) -> None:
        pass


async def converse(pilot) -> None:
    """Two prompts, both answered; the prompt editor holds a half-typed third one."""
    app = pilot.app
    prompt = app.query_one(PromptInput)
    prompt.cursor_blink = False
    for text in ("What does a KV cache hold?", "Why does speculation help over a WAN?"):
        prompt.load_text(text)
        await pilot.press("enter")
        await pilot.pause()
    prompt.load_text("And with K=")
    prompt.move_cursor(prompt.document.end)
    await pilot.pause()


def test_main_screen_snapshot(snap_compare):
    app = SfchatApp(ScriptedRuntime(), None, Ask(512), "sfchat")
    assert snap_compare(app, terminal_size=(130, 42), run_before=converse)
