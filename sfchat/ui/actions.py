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
"""

from __future__ import annotations

from collections.abc import Iterable
from urllib.parse import urlsplit

from textual.app import App, SystemCommand
from textual.screen import Screen
from textual.widgets import Markdown

from sfchat.history import ChatSummary, HistoryError
from sfchat.plaintext import plain
from sfchat.ui.chat import ChatView, reply_summary
from sfchat.ui.help import HelpScreen
from sfchat.ui.metrics import MetricsPanel
from sfchat.ui.prompt import PromptInput
from sfchat.ui.screens import ConfirmScreen, HistoryScreen

COMMANDS = (  # the command palette's entries: title, what it does, the action
    ("New chat", "Start a new conversation (Ctrl+N)", "new_chat"),
    ("History", "Reopen or delete an earlier chat (F2 or Ctrl+R)", "history"),
    ("Metrics panel", "Show or hide the metrics panel (F3)", "toggle_metrics"),
    ("Keys", "sfchat's keys, and what the metrics mean (F1)", "help"),
    ("Metrics explained", "What each figure of the metrics panel means", "explain_figures"),
    ("Copy reply", "Copy the last reply to the clipboard (Ctrl+Y)", "copy_reply"),
)
OPENABLE = ("http", "https")  # the schemes of the links in a reply that a click may open


class UserActions(App[None]):
    """The user's commands of the chat app (keys, palette)."""

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        # Cancel exists only while a reply runs; switching chats is greyed out meanwhile.
        if action == "cancel":
            return self.session.replying
        if action in ("new_chat", "history"):
            return None if self.session.replying else True
        return True

    def action_cancel(self) -> None:
        if self.session.replying:
            self.runtime.cancel()
            if self._reply is not None:
                self._reply.set_info("cancelling…")

    def _refuse_while_replying(self) -> bool:
        if self.session.replying:
            self.notify("A reply is in progress: Esc cancels it first.", severity="warning")
        return self.session.replying

    async def action_new_chat(self) -> None:
        if self._refuse_while_replying():
            return
        self.runtime.new_chat()
        self.session.new()
        self._forget_reply_figures()
        chat = self.query_one(ChatView)
        await chat.clear()
        chat.border_title = "new chat"
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
            messages = self.session.open(chosen.id, chosen.title)
        except HistoryError as exc:
            await self._history_failed(exc)
            return
        self.runtime.new_chat()
        self._forget_reply_figures()
        chat = self.query_one(ChatView)
        await chat.clear()
        chat.border_title = chosen.title
        for m in messages:
            if m.role == "assistant":
                live = "still being written by another sfchat" if m.status == "streaming" else ""
                await chat.add_reply(m.content, m.status, live or reply_summary(m.stats))
            else:
                await chat.add_user(m.content)
        self.query_one(PromptInput).focus()

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
