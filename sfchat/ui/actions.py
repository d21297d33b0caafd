"""The chat app's commands: what the keys and the command palette do on the user's side.

Contract: ``UserActions`` is the base class of ``SfchatApp`` and uses the state that keeps (its
``session``, ``runtime``, ``meter``, ``history``, ``ready``, the reply shown) and its widgets.
Switching chats (a new one, one from the history) is refused while a reply runs (Esc cancels it
first) and greyed out in the footer meanwhile; Cancel exists only while a reply runs. The palette
lists sfchat's commands (``COMMANDS``) and Textual's generic ones, except Textual's "Keys" panel:
sfchat's own keys are in ``HelpScreen``, which "Keys" and F1 open. A ``HistoryError`` (the file
locked or damaged) becomes one error notice, said once and not at every save. A click on a link
in a reply opens it only when it is http(s) and its target has nothing to hide (``plain`` leaves
it as it is), and only after ``ConfirmScreen`` showed the target and got a "y" (the link's text
may say anything); any other link is named in a notification and not opened.

Regenerate (Ctrl+G) drops the last reply and asks for it again; edit (F4) puts the last prompt
in the editor (F4 again: the one before), and Enter sends it in its place, the conversation cut
there (``ChatSession.regenerate`` / ``edit``); Esc ends the editing and brings back what the
editor held. Both need a ready runtime, and no reply running (of this sfchat or of another one
on the same history). F5 sets the open chat's own system prompt (``SystemScreen``), stored with
the chat and used from its next reply on. Ctrl+S writes the open chat to a Markdown file
(``sfchat.ui.export``) at a path asked for (``ExportScreen``); an existing file is replaced only
after ``ConfirmScreen`` got a "y" ("n" asks for the path again).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from urllib.parse import urlsplit

from textual.app import App, SystemCommand
from textual.screen import Screen
from textual.widgets import Markdown

from sfchat.history import ChatSummary, HistoryError
from sfchat.plaintext import plain
from sfchat.ui.chat import ChatView, reply_summary
from sfchat.ui.export import ExportScreen, chat_markdown, default_name, replace, write_new
from sfchat.ui.help import HelpScreen
from sfchat.ui.metrics import MetricsPanel
from sfchat.ui.prompt import PromptInput
from sfchat.ui.screens import ConfirmScreen, HistoryScreen, SystemScreen

COMMANDS = (  # the command palette's entries: title, what it does, the action
    ("New chat", "Start a new conversation (Ctrl+N)", "new_chat"),
    ("History", "Reopen or delete an earlier chat (F2 or Ctrl+R)", "history"),
    ("Metrics panel", "Show or hide the metrics panel (F3)", "toggle_metrics"),
    ("Keys", "sfchat's keys, and what the metrics mean (F1)", "help"),
    ("Metrics explained", "What each figure of the metrics panel means", "explain_figures"),
    ("Copy reply", "Copy the last reply to the clipboard (Ctrl+Y)", "copy_reply"),
    ("Regenerate reply", "Make the last reply again, in place of the one shown (Ctrl+G)", "regenerate"),
    ("Edit message", "Edit your last message and send it again; again: the one before (F4)", "edit"),
    ("System prompt", "Set this chat's own system prompt (F5)", "system_prompt"),
    ("Export chat", "Write this chat to a Markdown file (Ctrl+S)", "export"),
)
CHAT_ACTIONS = ("new_chat", "history", "regenerate", "edit", "system_prompt", "export")  # not while a reply runs
OPENABLE = ("http", "https")  # the schemes of the links in a reply that a click may open


class UserActions(App[None]):
    """The user's commands of the chat app (keys, palette)."""

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        # Cancel exists only while a reply runs; switching chats is greyed out meanwhile.
        if action == "cancel":
            return self.session.replying or self.editing is not None
        if action in CHAT_ACTIONS:
            return None if self.session.replying else True
        return True

    async def action_cancel(self) -> None:
        if self.session.replying:
            self.runtime.cancel()
            if self._reply is not None:
                self._reply.set_info("cancelling…")
        elif self.editing is not None:
            await self._stop_editing()
            self.query_one(PromptInput).load_text(self._draft)

    def _refuse_while_replying(self) -> bool:
        if self.session.replying:
            self.notify("A reply is in progress: Esc cancels it first.", severity="warning")
        return self.session.replying

    async def action_new_chat(self) -> None:
        if self._refuse_while_replying():
            return
        await self._stop_editing()
        self.runtime.new_chat()
        self.session.new()
        self._forget_reply_figures()
        await self.show_chat()
        self.query_one(PromptInput).focus()

    def _forget_reply_figures(self) -> None:
        """Another chat: the panel and the status line stop showing the last reply's figures."""
        self.meter.new_chat()
        self.query_one(MetricsPanel).show(self.meter.figures() if self.ready else None)
        self._show_status()

    def action_history(self) -> None:
        if isinstance(self.screen, HistoryScreen) or self._refuse_while_replying():
            return
        self.push_screen(HistoryScreen(self.history, self.session.chat_id), self._open_chat)

    async def _open_chat(self, chosen: ChatSummary | None) -> None:
        if chosen is None or self._refuse_while_replying():
            return
        try:
            self.session.open(chosen.id, chosen.title)
        except HistoryError as exc:
            await self._history_failed(exc)
            return
        await self._stop_editing()
        self.runtime.new_chat()
        self._forget_reply_figures()
        await self.show_chat()
        self.query_one(PromptInput).focus()

    async def show_chat(self) -> None:
        """Show the open chat afresh: its system prompt, then its turns as the session holds them."""
        chat = self.query_one(ChatView)
        await chat.clear()
        chat.border_title = self.session.title or "new chat"
        await chat.set_system(self.session.system)
        for t in self.session.turns:
            if t.role == "assistant":
                live = "still being written by another sfchat" if t.status == "streaming" else ""
                await chat.add_reply(t.content, t.status, live or reply_summary(t.stats))
            else:
                await chat.add_user(t.content)

    def _can_resend(self, what: str) -> bool:
        """Whether a reply may be asked for now; if not, the person is told why."""
        if self._refuse_while_replying():
            return False
        if self.failed or self.ready is None:
            self.notify("The runtime has failed; restart sfchat." if self.failed else
                        f"Still loading: {what} once the model is ready.", severity="warning")
            return False
        if any(t.status == "streaming" for t in self.session.turns):
            self.notify("Another sfchat is still writing a reply of this chat: wait for it.", severity="warning")
            return False
        return True

    async def action_regenerate(self) -> None:
        if not self._can_resend("the reply can be made again"):
            return
        if not self.session.prompts():
            self.notify("No reply to make again yet.", severity="warning")
            return
        await self._stop_editing()
        try:
            messages = self.session.regenerate()
        except HistoryError as exc:
            await self._history_failed(exc)
            return
        await self.show_chat()
        await self._submit(messages)

    async def action_edit(self) -> None:
        """Put the last prompt (pressed again: the one before) in the editor; Enter sends it in its
        place, and the conversation goes on from there; Esc leaves it as it was."""
        if self._refuse_while_replying():
            return
        prompts = [i for i in self.session.prompts() if self.editing is None or i < self.editing]
        if not prompts:
            self.notify("No earlier message to edit." if self.editing is not None else "No message to edit yet.",
                        severity="warning")
            return
        prompt = self.query_one(PromptInput)
        if self.editing is None:
            self._draft = prompt.text
        self.editing = prompts[-1]
        self.refresh_bindings()
        prompt.load_text(self.session.turns[self.editing].content)
        prompt.move_cursor(prompt.document.end)
        prompt.focus()
        n, total = len(prompts), len(self.session.prompts())
        await self.query_one(ChatView).note(
            "editing", f"Editing message {n} of {total}: Enter sends it in its place (what followed it is made "
                       "again) · F4 the one before · Esc keeps it as it was")

    def action_system_prompt(self) -> None:
        if isinstance(self.screen, SystemScreen) or self._refuse_while_replying():
            return
        self.push_screen(SystemScreen(self.session.system, self.session.default_system), self._system_given)

    async def _system_given(self, system: str | None) -> None:
        if system is None or self._refuse_while_replying():
            return
        try:
            self.session.set_system(system)
        except HistoryError as exc:
            await self._history_failed(exc)
            return
        await self.query_one(ChatView).set_system(self.session.system)
        self.notify("This chat's system prompt is set: the next reply follows it." if self.session.system else
                    "This chat has no system prompt of its own now: the default applies.")

    def action_export(self, path: str | None = None) -> None:
        if self._refuse_while_replying() or isinstance(self.screen, ExportScreen):
            return
        if not self.session.turns:
            self.notify("Nothing to export yet.", severity="warning")
            return
        self.push_screen(ExportScreen(path or default_name(self.session.title)), self._export_to)

    def _export_to(self, typed: str | None, confirmed: bool = False) -> None:
        if typed is None:
            return
        path = Path(typed).expanduser()
        text = chat_markdown(self.session.title, self.session.system or self.session.default_system,
                             self.session.turns, self.session.model)
        try:
            if confirmed:
                replace(path, text)
            else:
                write_new(path, text)
        except FileExistsError:
            self.push_screen(ConfirmScreen(f"{plain(str(path))} exists. Replace it?"),
                             lambda yes: self._export_to(typed, True) if yes else self.action_export(typed))
            return
        except OSError as exc:
            self.notify(f"Not exported: {plain(exc)}", title="export", severity="error", markup=False)
            return
        self.notify(f"Exported to {plain(str(path.absolute()))}", title="export", markup=False)

    async def _stop_editing(self) -> None:
        if self.editing is not None:
            self.editing = None
            self.refresh_bindings()
            await self.query_one(ChatView).note("editing", None)

    def action_toggle_metrics(self) -> None:
        panel = self.query_one(MetricsPanel)
        shown = panel.display
        panel.set_class(shown, "-hidden")
        panel.set_class(not shown, "-shown")
        self.call_after_refresh(self._show_status)  # the status line got wider or narrower

    def action_copy_reply(self) -> None:
        text = self.session.last_reply()
        if not text:
            self.notify("No reply to copy yet.", severity="warning")
            return
        self.copy_to_clipboard(text)
        self.notify(f"Copied the last reply ({len(text)} characters).")

    def on_markdown_link_clicked(self, event: Markdown.LinkClicked) -> None:
        event.stop()
        href, target = event.href, plain(event.href)
        if target != href or urlsplit(href).scheme.lower() not in OPENABLE:
            self.notify(f"Not opened: {target} (only http and https links open)", title="link",
                        severity="warning", markup=False)
            return
        self.push_screen(ConfirmScreen(f"Open this link in your browser?\n\n{target}"),
                         lambda yes: self.open_url(href) if yes else None)

    def action_help(self, section: str = "keys") -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen(section))

    def action_explain_figures(self) -> None:
        self.action_help("figures")

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        for command in super().get_system_commands(screen):
            if command.title != "Keys":  # Textual's own panel lists its generic keys, not sfchat's
                yield command
        for title, what, action in COMMANDS:
            yield SystemCommand(title, what, getattr(self, f"action_{action}"))
        if self.session.replying:
            yield SystemCommand("Cancel reply", "Stop the reply in progress (Esc)",
                                self.action_cancel)

    async def _history_failed(self, exc: HistoryError) -> None:
        message = plain(str(exc))
        if message != self._history_error:  # a locked file: said once, not at every save
            self._history_error = message
            await self.query_one(ChatView).add_notice(f"Error: {message}", "error")
            self.notify(message, title="history", severity="error", markup=False)
