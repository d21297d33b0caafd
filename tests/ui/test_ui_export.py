"""Ctrl+S writes the open chat to a Markdown file: at the path the person chooses (by default a new
file in the working directory), never over an existing file unasked, never through a symbolic
link, and with the chat's text made safe for a terminal that shows the file."""

from __future__ import annotations

import os

from sfchat.ui.export import ExportScreen, chat_markdown
from sfchat.ui.screens import ConfirmScreen

from pilots import (  # noqa: F401  (fixtures)
    FakeRuntime, chat_app, db, pilot_test, replied, send, set_system, wait_for, warned
)

HOSTILE = "Red \x1b[31mtext\x1b[0m and a title \x1b]0;owned\x07 bell\x07."


async def export_to(pilot, path: str | None) -> None:
    """Ctrl+S, then the path typed over the default (None: the default kept), Enter."""
    app = pilot.app
    await pilot.press("ctrl+s")
    await wait_for(pilot, lambda: isinstance(app.screen, ExportScreen))
    if path is not None:
        field = app.screen.query_one("#export-path")
        field.action_end()
        for _ in field.value:
            await pilot.press("backspace")
        for ch in path:
            await pilot.press(ch)
    await pilot.press("enter")
    await wait_for(pilot, lambda: not isinstance(app.screen, ExportScreen))


@pilot_test
async def test_ctrl_s_writes_the_chat_as_markdown_in_the_working_directory(db, tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    runtime = FakeRuntime(reply=HOSTILE)
    async with chat_app(runtime, db, size=(80, 24)) as (app, pilot):
        await pilot.press("ctrl+s")
        await pilot.pause()
        assert warned(app, "Nothing to export yet") and not isinstance(app.screen, ExportScreen)
        await set_system(pilot, "Be kind.")
        await send(pilot, "hello world")
        await replied(pilot, app, 2)
        await export_to(pilot, None)
        await wait_for(pilot, lambda: warned(app, "Exported to"))
    (written,) = work.iterdir()
    assert written.name.startswith("sfchat-hello-world-") and written.suffix == ".md"
    text = written.read_text()
    assert text.startswith("# hello world\n")
    assert "## System prompt\n\nBe kind.\n\n## You\n\nhello world\n\n## Assistant\n\nRed text and a title  bell.\n" in text
    assert "\x1b" not in text and "\x07" not in text
    assert oct(written.stat().st_mode & 0o777) == oct(0o600)


@pilot_test
async def test_an_existing_file_is_replaced_only_after_a_yes_and_a_link_is_never_followed(db, tmp_path):
    runtime = FakeRuntime(reply="The answer.")
    target, elsewhere, link = tmp_path / "chat.md", tmp_path / "precious.txt", tmp_path / "link.md"
    target.write_text("old notes")
    elsewhere.write_text("keep me")
    link.symlink_to(elsewhere)
    async with chat_app(runtime, db, size=(80, 24)) as (app, pilot):
        await send(pilot, "q")
        await replied(pilot, app, 2)
        await export_to(pilot, str(target))
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        await pilot.press("n")  # no: the path is asked for again, the file is as it was
        await wait_for(pilot, lambda: isinstance(app.screen, ExportScreen))
        assert app.screen.query_one("#export-path").value == str(target)
        assert target.read_text() == "old notes"
        await pilot.press("enter")
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        await pilot.press("y")
        await wait_for(pilot, lambda: warned(app, "Exported to"))
        assert "## Assistant\n\nThe answer.\n" in target.read_text()
        await export_to(pilot, str(link))
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        await pilot.press("y")
        await wait_for(pilot, lambda: not os.path.islink(link))
        await export_to(pilot, str(tmp_path / "no-such-dir" / "x.md"))
        await wait_for(pilot, lambda: warned(app, "Not exported"))
        assert app.is_running
    assert elsewhere.read_text() == "keep me"  # the link was replaced by the file, not written through
    assert "The answer." in link.read_text()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".sfchat")) == []


def test_the_markdown_marks_cut_replies_and_keeps_line_breaks():
    class T:
        def __init__(self, role, content, status="complete"):
            self.role, self.content, self.status = role, content, status

    text = chat_markdown("t\x1b[2J", None, [T("user", "a\nb"), T("assistant", "c\r\n\td", "cancelled")], "m",
                         when=0)
    assert text.startswith("# t\n") and "## You\n\na\nb\n" in text and "\td\n\n*(cancelled" in text
