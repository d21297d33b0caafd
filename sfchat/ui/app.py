"""The sfchat Textual application: wires the runtime, the chat session and the widgets.

Contract: ``SfchatApp`` is given a runtime object (see ``Runtime``) and starts it when
mounted; the runtime reports events by calling a listener from its own thread, and the
listener only wraps them in ``RuntimeEvent`` and posts them to the app with Textual's
thread-safe ``post_message``. Every widget, every history write and every decision happens
on the app's thread. The app closes the runtime when it exits, and the history too when it
opened it itself (given a path rather than a ``History``).

Text that came from the network (link details, runtime failure messages: close reasons, tail
errors, relay refusals) is shown only through ``sfchat.plaintext.plain`` and never as markup.

This module never imports torch, ``sfchat.model``, ``sfchat.engine`` or ``sfchat.node``: the runtime is injected.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.screen import Screen
from textual.widgets import Footer, Static

from sfchat.events import (
    Event, LinkState, LoadProgress, ReplyFinished, ReplyStarted, RuntimeFailed, RuntimeReady,
    TokensCommitted,
)
from sfchat.history import ChatSummary, History
from sfchat.plaintext import plain
from sfchat.ui.chat import ChatView, ReplyMessage, reply_summary
from sfchat.ui.meter import Meter
from sfchat.ui.metrics import MetricsPanel
from sfchat.ui.prompt import PromptInput
from sfchat.ui.screens import HistoryScreen
from sfchat.ui.session import ChatSession
from sfchat.ui.widgets import HeaderBar, LoadPanel, status_text

FLUSH_HZ = 15  # Markdown re-renders per second while a reply streams
WIDE_COLUMNS = 100  # from this width on, the metrics panel is shown unless toggled off


class Runtime(Protocol):
    """What the app needs from the runtime; all calls return at once and are thread-safe."""

    def start(self, listener: Callable[[Event], None]) -> None: ...
    def submit(self, messages: list[dict], params: dict) -> None: ...
    def cancel(self) -> None: ...
    def new_chat(self) -> None: ...
    def close(self) -> None: ...


class RuntimeEvent(Message):
    """A runtime event, carried from the runtime thread to the app's thread."""

    def __init__(self, event: Event) -> None:
        super().__init__()
        self.event = event


class SfchatApp(App[None]):
    """Chat with a split model and watch speculative decoding work."""

    CSS_PATH = "sfchat.tcss"
    TITLE = "sfchat"
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (WIDE_COLUMNS, "-wide")]
    BINDINGS = [
        # Short labels: at 80 columns the footer must hold every key, Cancel included.
        Binding("ctrl+n", "new_chat", "New"),
        Binding("f2,ctrl+h", "history", "History"),
        Binding("f3", "toggle_metrics", "Metrics"),
        # Priority, or the prompt editor would take Ctrl+Y as "redo".
        Binding("ctrl+y", "copy_reply", "Copy", priority=True),
        Binding("escape", "cancel", "Cancel"),
        Binding("ctrl+q", "quit", "Quit", priority=True),
    ]

    def __init__(
        self,
        runtime: Runtime,
        history: History | str | Path | None = None,
        params: dict[str, Any] | None = None,
        title: str = "sfchat",
    ) -> None:
        """``history``: a ``History`` (left open at exit), a database path (opened here and
        closed at exit), or None for a history kept in memory only; construct the app on the
        thread that runs it, which then owns the connection. ``params``: the generation
        parameters sent with every prompt. ``title``: the header line until the runtime is
        ready."""
        super().__init__()
        self.runtime = runtime
        self._owns_history = not isinstance(history, History)
        self.history = history if isinstance(history, History) else History(history or ":memory:")
        self.session = ChatSession(self.history)
        self.params = dict(params or {})
        self.header_title = title
        self.ready: RuntimeReady | None = None
        self.failed = False
        self.meter = Meter()
        self.state = "loading"
        self.link_state = ""
        self._reply: ReplyMessage | None = None
        self._waiting_notice: Static | None = None  # "waiting for a tail ..." until it connects
        self._metrics_dirty = False

    def compose(self) -> ComposeResult:
        yield HeaderBar(self.header_title)
        with Horizontal(id="body"):
            with Vertical(id="main"):
                yield LoadPanel(id="load")
                yield ChatView(id="chat")
                yield Static(id="status")
                yield PromptInput(id="prompt",
                                  placeholder="Message  (Enter sends · Ctrl+J newline)")
            yield MetricsPanel(id="metrics")
        yield Footer()

    async def on_mount(self) -> None:
        self.query_one(ChatView).border_title = "new chat"
        prompt = self.query_one(PromptInput)
        prompt.remember(self.history.recent_prompts())
        prompt.focus()
        self._flush_timer = self.set_interval(1 / FLUSH_HZ, self._tick, pause=True)
        self._show_status()
        if self.history.recovered:
            self.notify(f"{self.history.recovered} reply cut off by an earlier exit is marked"
                        " interrupted in the history.")
        try:
            self.runtime.start(self._forward)
        except Exception as exc:  # the runtime could not even start: say so, don't crash
            await self._runtime_failed(RuntimeFailed(str(exc) or type(exc).__name__, fatal=True))

    def _forward(self, event: Event) -> None:
        """The runtime's listener; runs on the runtime's thread."""
        self.post_message(RuntimeEvent(event))

    async def on_unmount(self) -> None:
        self.runtime.close()
        if self._owns_history:
            self.history.close()

    # -- runtime events ------------------------------------------------------------------

    async def on_runtime_event(self, message: RuntimeEvent) -> None:
        event = message.event
        match event:
            case LoadProgress():
                await self.query_one(LoadPanel).progress(event)
            case LinkState():
                await self._link_changed(event)
            case RuntimeReady():
                self._runtime_ready(event)
            case ReplyStarted():
                self.session.reply_started()
                self.meter.reply_started(event)
                self._metrics_dirty = True
                if self._reply is not None:
                    self._reply.set_info(f"prefilling {event.prefill_tokens} tokens "
                                        f"({event.reused_tokens} cached)…")
            case TokensCommitted():
                self._tokens_committed(event)
            case ReplyFinished():
                await self._reply_finished(event)
            case RuntimeFailed():
                await self._runtime_failed(event)

    async def _link_changed(self, event: LinkState) -> None:
        detail = plain(event.detail)
        self.query_one(HeaderBar).set_link(event.state, detail)
        self.query_one(MetricsPanel).set_link(event.state, detail)
        before, self.link_state = self.link_state, event.state
        # The header has room for the state only; what the user must know goes further.
        if event.state == "waiting" and detail:
            await self._drop_waiting_notice()
            self._waiting_notice = await self.query_one(ChatView).add_notice(detail)
        elif event.state in ("reconnecting", "stalled"):
            self.notify(detail or event.state, title=f"link {event.state}", severity="warning",
                        markup=False)
        elif event.state == "connected":
            await self._drop_waiting_notice()  # the tail is back: the notice is history
            if before in ("reconnecting", "stalled"):
                self.notify(detail or "the link is back", title="link connected", markup=False)

    async def _drop_waiting_notice(self) -> None:
        if self._waiting_notice is not None:
            await self._waiting_notice.remove()
            self._waiting_notice = None

    def _runtime_ready(self, ready: RuntimeReady) -> None:
        self.ready = ready
        self.session.model = ready.model
        self.meter.set_k(ready.k)
        self.query_one(HeaderBar).set_ready(ready)
        metrics = self.query_one(MetricsPanel)
        metrics.set_setup(ready)
        metrics.show(self.meter.figures())
        self.query_one(LoadPanel).display = False
        self._set_state("ready")
        self.query_one(PromptInput).focus()

    def _tokens_committed(self, event: TokensCommitted) -> None:
        if self._reply is None:
            return
        if self.state != "streaming":
            self._reply.set_info("")
            self._set_state("streaming")
        self._reply.append(event.text)
        self.session.reply_text(event.text)
        self.meter.round(event)
        self._metrics_dirty = True

    async def _reply_finished(self, event: ReplyFinished) -> None:
        turn = self.session.reply_finished(event)
        self.meter.reply_finished(event)
        if self._reply is not None and turn is not None:
            await self._reply.finish(turn.content, turn.status, reply_summary(turn.stats))
        self._end_reply()
        if event.finish_reason == "context":
            limit = f" ({self.ready.max_context} tokens)" if self.ready else ""
            await self.query_one(ChatView).add_notice(
                f"The conversation has run out of context{limit}. Start a new chat with Ctrl+N.",
                "warning")

    async def _runtime_failed(self, event: RuntimeFailed) -> None:
        turn = self.session.reply_failed()
        if self._reply is not None:
            if turn is not None and turn.content:
                await self._reply.finish(turn.content, "interrupted")
            else:
                await self._reply.remove()
        self._end_reply()
        chat = self.query_one(ChatView)
        message = plain(event.message)
        await chat.add_notice(f"Error: {message}", "error")
        self.notify(message, title="runtime error", severity="error", markup=False)
        if event.fatal:
            self.failed = True
            self.query_one(HeaderBar).set_error(message)
            self.query_one(LoadPanel).display = False
            self._set_state("failed")

    def _end_reply(self) -> None:
        self._reply = None
        self._flush_timer.pause()
        self.query_one(MetricsPanel).show(self.meter.figures())
        self._metrics_dirty = False
        self._set_state("ready" if self.ready and not self.failed else self.state)

    def _tick(self) -> None:
        """Render what streamed in since the last tick (text and figures), at FLUSH_HZ."""
        if self._reply is not None:
            self._reply.flush()
        if self._metrics_dirty:
            self._metrics_dirty = False
            self.query_one(MetricsPanel).show(self.meter.figures())
            self._show_status()

    def _set_state(self, state: str) -> None:
        # The footer is rebuilt on refresh_bindings: only when "Cancel" comes or goes.
        if (state in ("waiting", "streaming")) != (self.state in ("waiting", "streaming")):
            self.refresh_bindings()
        self.state = state
        self._show_status()

    def _show_status(self) -> None:
        figures = self.meter.figures() if self.ready else None
        status = self.query_one("#status", Static)
        status.update(status_text(self.state, figures, status.content_size.width or None))

    def on_resize(self) -> None:
        self.call_after_refresh(self._show_status)  # the status line's figures fit its width

    # -- the user's side -----------------------------------------------------------------

    async def on_prompt_input_submitted(self, message: PromptInput.Submitted) -> None:
        text = message.text.strip()
        if not text:
            return
        if self.failed:
            self.notify("The runtime has failed; restart sfchat.", severity="error")
            return
        if self.ready is None:
            self.notify("Still loading: the prompt can be sent once the model is ready.",
                        severity="warning")
            return
        if self.session.replying:
            self.notify("A reply is in progress: Esc cancels it.", severity="warning")
            return
        messages = self.session.send(text)  # stored before the runtime sees it
        prompt = self.query_one(PromptInput)
        prompt.clear()
        prompt.remember(text)
        chat = self.query_one(ChatView)
        chat.border_title = self.session.title
        await chat.add_user(text)
        self._reply = await chat.add_reply(info="waiting for the runtime…")
        self._set_state("waiting")
        self._flush_timer.resume()
        try:
            self.runtime.submit(messages, dict(self.params))
        except Exception as exc:  # a refused submit is an error notice, not a crash
            await self._runtime_failed(RuntimeFailed(str(exc) or type(exc).__name__))

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
        messages = self.session.open(chosen.id, chosen.title)
        self.runtime.new_chat()
        self._forget_reply_figures()
        chat = self.query_one(ChatView)
        await chat.clear()
        chat.border_title = chosen.title
        for m in messages:
            if m.role == "assistant":
                await chat.add_reply(m.content, m.status, reply_summary(m.stats))
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

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        yield SystemCommand("New chat", "Start a new conversation (Ctrl+N)", self.action_new_chat)
        yield SystemCommand("History", "Reopen an earlier chat (F2)", self.action_history)
        yield SystemCommand("Metrics panel", "Show or hide the metrics panel (F3)",
                            self.action_toggle_metrics)
        yield SystemCommand("Copy reply", "Copy the last reply to the clipboard (Ctrl+Y)",
                            self.action_copy_reply)
        if self.session.replying:
            yield SystemCommand("Cancel reply", "Stop the reply in progress (Esc)",
                                self.action_cancel)


def run_tui(runtime: Runtime, history: History | str | Path | None = None,
            params: dict[str, Any] | None = None, title: str = "sfchat") -> None:
    """Run the chat app in the terminal until the user quits."""
    SfchatApp(runtime, history, params, title).run()


__all__ = ["SfchatApp", "Runtime", "RuntimeEvent", "run_tui"]
