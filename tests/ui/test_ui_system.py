"""A system prompt per chat (F5): set from the screen, kept with the chat in the history, sent with
that chat's replies; left empty, the default (``--system``) applies."""

from __future__ import annotations

from sfchat.history import History
from sfchat.ui.screens import SystemScreen

from pilots import (  # noqa: F401  (fixtures)
    FakeRuntime, chat_app, db, open_history, pilot_test, replied, send, set_system, slow_runtime, static_text,
    streaming, wait_for
)


def system_line(app) -> str:
    lines = app.query("#system-line")
    return static_text(lines.first()) if lines else ""


@pilot_test
async def test_f5_sets_this_chats_system_prompt_kept_in_the_history_and_sent_with_its_replies(db):
    runtime = FakeRuntime(reply="Fine.")
    async with chat_app(runtime, db, system="You are the default.", size=(80, 24)) as (app, pilot):
        await pilot.press("f5")
        await wait_for(pilot, lambda: isinstance(app.screen, SystemScreen))
        assert "the default: You are the default." in static_text(app.screen.query_one("#system-default"))
        await pilot.press("x", "escape")  # Esc changes nothing
        await wait_for(pilot, lambda: not isinstance(app.screen, SystemScreen))
        assert app.session.system is None and not system_line(app)
        await set_system(pilot, "Answer in one word.")  # before the chat's first message
        assert "system prompt: Answer in one word." in system_line(app)
        await send(pilot, "hi")
        await replied(pilot, app, 2)
        assert runtime.submitted[0][0] == [{"role": "system", "content": "Answer in one word."},
                                           {"role": "user", "content": "hi"}]
        await pilot.press("ctrl+n")
        await send(pilot, "other")
        await replied(pilot, app, 2)
        assert runtime.submitted[1][0][0] == {"role": "system", "content": "You are the default."}
    history = History(db)
    chats = {c.title: c.id for c in history.list_chats()}
    assert history.chat_system(chats["hi"]) == "Answer in one word." and history.chat_system(chats["other"]) is None
    history.close()

    runtime = FakeRuntime(reply="Again.")
    async with chat_app(runtime, db, size=(80, 24)) as (app, pilot):  # no default this time
        await open_history(pilot)
        await pilot.press("down", "enter")  # "hi", the older chat
        await wait_for(pilot, lambda: app.session.title == "hi")
        await pilot.pause()
        assert "system prompt: Answer in one word." in system_line(app)
        await send(pilot, "more")
        await replied(pilot, app, 4)
        assert runtime.submitted[0][0][0] == {"role": "system", "content": "Answer in one word."}
        await set_system(pilot, "Now two words.")  # changed mid-chat: the next reply follows it
        await send(pilot, "again")
        await replied(pilot, app, 6)
        assert runtime.submitted[1][0][0] == {"role": "system", "content": "Now two words."}
        await set_system(pilot, "")  # emptied: no prompt of its own, and no default here
        assert not system_line(app)
        await pilot.press("ctrl+g")
        await replied(pilot, app, 6)
        assert runtime.submitted[2][0][0] == {"role": "user", "content": "hi"}
        assert app.history.chat_system(app.session.chat_id) is None


@pilot_test
async def test_the_system_prompt_cannot_change_while_a_reply_runs(db):
    async with chat_app(slow_runtime(), db, size=(80, 24)) as (app, pilot):
        await streaming(pilot, "long one")
        await pilot.press("f5")
        await pilot.pause(0.2)
        assert not isinstance(app.screen, SystemScreen)
        await pilot.press("escape")
        await replied(pilot, app, 2)
