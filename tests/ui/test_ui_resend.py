"""Regenerate the last reply (Ctrl+G) and edit a message to send it again (F4), through the keys,
against the fake runtime: what the runtime is asked, what the screen shows and what the history
keeps afterwards."""

from __future__ import annotations

from sfchat.ui.chat import Notice, ReplyMessage
from sfchat.ui.prompt import PromptInput

from pilots import (  # noqa: F401  (fixtures)
    FakeRuntime, chat_app, db, notices, pilot_test, replied, retype, send, shown, slow_runtime, stored, streaming,
    warned
)


@pilot_test
async def test_ctrl_g_makes_the_last_reply_again_in_place_of_the_old_one(db):
    runtime = FakeRuntime(reply="First answer.")
    async with chat_app(runtime, db, size=(80, 24)) as (app, pilot):
        await pilot.press("ctrl+g")
        await pilot.pause()
        assert warned(app, "No reply to make again yet") and not runtime.submitted
        await send(pilot, "tell me")
        await replied(pilot, app, 2)
        runtime.reply = "Second answer."
        await pilot.press("ctrl+g")
        await replied(pilot, app, 2)
        assert shown(app) == [("user", "tell me"), ("assistant", "Second answer.")]
        assert runtime.submitted[1][0] == [{"role": "user", "content": "tell me"}]
        assert len(app.query(ReplyMessage)) == 1
    assert stored(db) == [("user", "tell me", "complete"), ("assistant", "Second answer.", "complete")]


@pilot_test
async def test_regenerate_is_refused_while_a_reply_runs_and_redoes_a_cancelled_one(db):
    runtime = slow_runtime()
    async with chat_app(runtime, db, size=(80, 24)) as (app, pilot):
        await streaming(pilot, "long one")
        await pilot.press("ctrl+g")
        await pilot.pause()
        assert len(runtime.submitted) == 1 and app.session.replying  # greyed out: nothing happened
        await pilot.press("escape")
        await replied(pilot, app, 2)
        assert app.session.turns[1].status == "cancelled"
        runtime.reply, runtime.round_s = "Short now.", 0.002
        await pilot.press("ctrl+g")
        await replied(pilot, app, 2)
        assert shown(app) == [("user", "long one"), ("assistant", "Short now.")]
    assert stored(db) == [("user", "long one", "complete"), ("assistant", "Short now.", "complete")]


@pilot_test
async def test_f4_edits_the_last_message_and_the_reply_is_made_again(db):
    runtime = FakeRuntime(reply="R1")
    async with chat_app(runtime, db, size=(80, 24)) as (app, pilot):
        await send(pilot, "first")
        await replied(pilot, app, 2)
        runtime.reply = "R2"
        await send(pilot, "second")
        await replied(pilot, app, 4)
        await pilot.press("f4")
        prompt = app.query_one(PromptInput)
        assert prompt.text == "second"
        assert "Editing message 2 of 2" in notices(app)
        runtime.reply = "R2 again"
        await retype(pilot, app, "second, better")
        await replied(pilot, app, 4)
        assert runtime.submitted[-1][0] == [{"role": "user", "content": "first"},
                                            {"role": "assistant", "content": "R1"},
                                            {"role": "user", "content": "second, better"}]
        assert shown(app) == [("user", "first"), ("assistant", "R1"), ("user", "second, better"),
                              ("assistant", "R2 again")]
        assert prompt.text == "" and "Editing" not in notices(app) and app.editing is None
    assert stored(db) == [("user", "first", "complete"), ("assistant", "R1", "complete"),
                          ("user", "second, better", "complete"), ("assistant", "R2 again", "complete")]


@pilot_test
async def test_f4_twice_edits_the_message_before_and_esc_leaves_everything_as_it_was(db):
    runtime = FakeRuntime(reply="R")
    async with chat_app(runtime, db, size=(80, 24)) as (app, pilot):
        await pilot.press("f4")
        await pilot.pause()
        assert warned(app, "No message to edit yet")
        for text in ("one", "two"):
            await send(pilot, text)
            await replied(pilot, app, 2 if text == "one" else 4)
        await pilot.press("d", "r", "a", "f", "t")
        await pilot.press("f4", "f4")
        prompt = app.query_one(PromptInput)
        assert prompt.text == "one" and "Editing message 1 of 2" in notices(app)
        await pilot.press("f4")
        await pilot.pause()
        assert warned(app, "No earlier message to edit") and prompt.text == "one"
        await pilot.press("escape")  # no edit: the draft comes back, nothing was cut
        await pilot.pause()
        assert prompt.text == "draft" and app.editing is None and not any(
            "Editing" in str(n.render()) for n in app.query(Notice))
        assert len(app.session.turns) == 4 and len(runtime.submitted) == 2
        await pilot.press("f4", "f4")
        runtime.reply = "R one"
        await retype(pilot, app, "uno")
        await replied(pilot, app, 2)
        assert runtime.submitted[-1][0] == [{"role": "user", "content": "uno"}]
        assert shown(app) == [("user", "uno"), ("assistant", "R one")]
    assert stored(db) == [("user", "uno", "complete"), ("assistant", "R one", "complete")]
