"""Pilot tests of the TUI driving the real runtime thread with tiny models on the CPU."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

from sfchat.events import LoadProgress, ReplyFinished, TokensCommitted
from sfchat.history import History
from sfchat.params import Ask, GenParams
from sfchat.ui.chat import ReplyMessage

from pilots import chat_app, pilot_test, send, stored, streaming, wait_for
from real_worker import RecordingWorker, one_shot_text, settings_for


@pilot_test
async def test_reply_matches_one_shot_and_follow_up_reuses_the_cache(zoo, tmp_path):
    s = settings_for(zoo)
    worker = RecordingWorker(s)
    ask = Ask(16, GenParams(temperature=0.0))
    async with chat_app(worker, tmp_path / "h.sqlite3", ask, size=(120, 40), wait=120) as (app, pilot):
        await send(pilot, "hello world")
        await wait_for(pilot, lambda: not app.session.replying and app.session.turns, 120)
        await pilot.pause()
        first_reply = app.query_one(ReplyMessage).markdown.source
        await send(pilot, "and then")
        await wait_for(pilot, lambda: len(worker.started()) == 2 and not app.session.replying, 120)
    assert first_reply == one_shot_text(s, "hello world", 16)
    first, second = worker.started()
    # the follow-up prefilled only its new tokens: the whole first turn was still cached
    assert second.reused_tokens >= first.prompt_tokens
    assert second.prefill_tokens == second.prompt_tokens - second.reused_tokens


class HeldWorker(RecordingWorker):
    """The real worker, held after the reply's first tokens until ``release`` is set: a quiet machine
    would finish the whole reply between two looks of the test."""

    def start(self, listener) -> None:
        self.release = threading.Event()

        def held(event):
            listener(event)
            if isinstance(event, TokensCommitted):
                self.release.wait(120)

        super().start(held)


@pilot_test
async def test_escape_cancels_a_real_reply_and_keeps_its_prefix(zoo, tmp_path):
    s = settings_for(zoo, "qwen3-untied")
    full = one_shot_text(s, "tell me more", 200)
    worker = HeldWorker(s)
    db = tmp_path / "h.sqlite3"
    ask = Ask(200, GenParams(temperature=0.0))
    async with chat_app(worker, db, ask, size=(120, 40), wait=120) as (app, pilot):
        await streaming(pilot, "tell me more", 60)
        await pilot.press("escape")
        worker.release.set()
        await wait_for(pilot, lambda: not app.session.replying, 60)
        await pilot.pause()
        partial = app.query_one(ReplyMessage).markdown.source
    finished = [e for e in worker.events if isinstance(e, ReplyFinished)][-1]
    assert finished.finish_reason == "cancelled"
    assert full.startswith(partial) and len(finished.token_ids) < 200
    assert stored(db)[1] == ("assistant", partial, "cancelled")


@pilot_test
async def test_the_loading_panel_names_no_download_for_local_model_directories(zoo, tmp_path):
    """Today's finding: "tail download" (and "head download", "draft download") in local mode with
    local directories, where nothing is downloaded."""
    worker = RecordingWorker(settings_for(zoo))
    async with chat_app(worker, tmp_path / "h.sqlite3", size=(120, 40), wait=120) as (app, pilot):
        stages = [str(label.render()) for label in app.query(".load-stage")]
    assert stages and not [s for s in stages if "download" in s], stages
    assert {"head load", "tail load", "draft load"} <= set(stages), stages
    assert not [e for e in worker.events if isinstance(e, LoadProgress) and e.stage == "download"]


DRIVER = textwrap.dedent("""
    import asyncio, sys, time
    sys.path.insert(0, {tests!r})
    from sfchat.config import Settings
    from sfchat.node.worker import RuntimeWorker
    from sfchat.params import Ask, GenParams
    from sfchat.ui import SfchatApp
    from pilots import send, wait_for

    async def main():
        s = Settings(model={model!r}, draft="none", device="cpu")
        app = SfchatApp(RuntimeWorker(s), {db!r}, Ask(100000, GenParams(temperature=0.0)))
        async with app.run_test(size=(100, 30)) as pilot:
            await wait_for(pilot, lambda: app.ready is not None, 120)
            await send(pilot, "keep talking")
            await wait_for(pilot, lambda: app.state == "streaming", 60)
            await pilot.pause(2.5)  # the reply row is saved about once a second
            print("STREAMING", flush=True)
            await pilot.pause(120)

    asyncio.run(main())
""")


def test_killed_head_keeps_prompt_and_partial_reply(zoo, tmp_path):
    from transformers import AutoTokenizer

    import tinymodels

    # a long context window, so the reply is surely still streaming when the head is killed
    model = tmp_path / "long"
    tinymodels.make_model(model, "qwen3", AutoTokenizer.from_pretrained(zoo["tokenizer"]), seed=12, max_pos=8192)
    db = tmp_path / "h.sqlite3"
    script = DRIVER.format(tests=os.path.dirname(__file__), model=str(model), db=str(db))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, env=env)
    try:
        deadline = time.monotonic() + 180
        while "STREAMING" not in proc.stdout.readline():
            assert proc.poll() is None and time.monotonic() < deadline, "the app did not start streaming"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(10)
    history = History(db)  # reopening turns the reply that was streaming into "interrupted"
    (chat,) = history.list_chats()
    user, reply = history.load_chat(chat.id)
    assert (user.role, user.content, user.status) == ("user", "keep talking", "complete")
    assert reply.role == "assistant" and reply.status == "interrupted" and reply.content
    history.close()
