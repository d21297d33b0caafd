"""Regenerate (Ctrl+G), edit-and-resend (F4) and a chat's system prompt (F5) from the chat screen
driving a head elsewhere, through a real relay on loopback: the whole conversation travels with
every request, so the head is asked for the reply again with the conversation cut where the screen
cut it and opened by the chat's system prompt, and the history on the person's machine keeps what
the screen shows."""

from __future__ import annotations

from sfchat.history import History
from sfchat.params import Ask

from remote_pair import REPLY, WAIT, ScriptedHead, make_pair
from pilots import chat_app, pilot_test, retype, send, set_system, shown, wait_for


@pilot_test
async def test_regenerate_and_edit_reach_the_remote_head_with_the_conversation_cut(relay_url, tmp_path):
    head = ScriptedHead()
    host, _, client, _, _ = make_pair(relay_url, head)
    db = tmp_path / "home.sqlite3"
    async with chat_app(client, db, Ask(64), size=(80, 24), wait=WAIT) as (app, pilot):
        head.release(1000)
        await send(pilot, "first")
        await wait_for(pilot, lambda: not app.session.replying and len(app.session.turns) == 2, WAIT)
        await pilot.press("ctrl+g")
        await wait_for(pilot, lambda: len(head.submitted) == 2 and not app.session.replying, WAIT)
        assert head.submitted[1][0] == [{"role": "user", "content": "first"}]
        await send(pilot, "second")
        await wait_for(pilot, lambda: not app.session.replying and len(app.session.turns) == 4, WAIT)
        await pilot.press("f4")
        await retype(pilot, app, "second again")
        await wait_for(pilot, lambda: len(head.submitted) == 4 and not app.session.replying
                       and len(app.session.turns) == 4, WAIT)
        await pilot.pause()
        assert head.submitted[3][0] == [{"role": "user", "content": "first"}, {"role": "assistant", "content": REPLY},
                                        {"role": "user", "content": "second again"}]
        assert shown(app) == [("user", "first"), ("assistant", REPLY), ("user", "second again"), ("assistant", REPLY)]
    host.close()
    history = History(db)
    (chat,) = history.list_chats()
    assert [m.content for m in history.load_chat(chat.id)] == ["first", REPLY, "second again", REPLY]
    history.close()


@pilot_test
async def test_a_chats_system_prompt_reaches_the_remote_head(relay_url, tmp_path):
    head = ScriptedHead()
    host, _, client, _, _ = make_pair(relay_url, head)
    async with chat_app(client, tmp_path / "home.sqlite3", Ask(64), system="the screen's --system", size=(80, 24),
                        wait=WAIT) as (app, pilot):
        head.release(1000)
        await send(pilot, "first")
        await wait_for(pilot, lambda: not app.session.replying and len(app.session.turns) == 2, WAIT)
        await set_system(pilot, "Be brief.")
        await send(pilot, "second")
        await wait_for(pilot, lambda: not app.session.replying and len(app.session.turns) == 4, WAIT)
    host.close()
    assert head.submitted[0][0][0] == {"role": "system", "content": "the screen's --system"}
    assert head.submitted[1][0][0] == {"role": "system", "content": "Be brief."}
    assert [m["role"] for m in head.submitted[1][0]] == ["system", "user", "assistant", "user"]
