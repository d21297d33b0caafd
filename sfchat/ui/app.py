"""The sfchat Textual application: wires the runtime, the chat session and the widgets.

Contract: ``SfchatApp`` is given a runtime object (see ``sfchat.ui.runtime.Runtime``) and
starts it when mounted; the runtime reports events by calling a listener from its own thread,
and the listener only wraps them in ``RuntimeEvent`` and posts them to the app with Textual's
thread-safe ``post_message``. Every widget, every history write and every decision happens
on the app's thread. The app closes the runtime when it exits, and the history too when it
opened it itself (given a path rather than a ``History``).

Text that came from the network (link details, runtime failure messages: close reasons, tail
errors, relay refusals, the reason a pairing code is wanted) is shown only through
``sfchat.plaintext.plain`` and never as markup.

A ``CodeWanted`` event opens ``CodeScreen`` (or gives the open one its new reason); the code
typed there goes to ``runtime.set_code``, and a refused code makes the runtime ask again.
A message sent while a reply runs is queued (one message; more text joins it) and sent when the
reply ends, cancelled or not, or at the end of the context window; a failed reply puts it back
in the editor. A reply whose prompt left the conversation's oldest turns out (the head fits a
conversation into the context window: ``ReplyStarted.dropped_turns``) gets a one-line notice
above it saying how many.
A ``HistoryError`` (the database file locked or damaged) is an error notice, never a crash; a
prompt the history could not store stays in the editor, unsent. The user's commands (keys,
palette) are in ``sfchat.ui.actions``.

This module never imports torch, ``sfchat.model``, ``sfchat.engine`` or ``sfchat.node``: the runtime is injected.
"""

from __future__ import annotations

from pathlib import Path

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widgets import Footer, Static

from sfchat.events import (
    CodeWanted, Event, LinkState, LoadProgress, ReplyFinished, ReplyStarted, RuntimeFailed, RuntimeReady,
    TokensCommitted,
)
from sfchat.history import History, HistoryError
from sfchat.params import Ask
from sfchat.plaintext import plain
from sfchat.ui.actions import UserActions
from sfchat.ui.chat import ChatView, ReplyMessage, dropped_notice, reply_summary
from sfchat.ui.meter import Meter
from sfchat.ui.metrics import MetricsPanel
from sfchat.ui.prompt import PromptInput
from sfchat.ui.runtime import Runtime, RuntimeEvent
from sfchat.ui.screens import CodeScreen
from sfchat.ui.session import ChatSession
from sfchat.ui.widgets import HeaderBar, LoadPanel, status_text

FLUSH_HZ = 15  # Markdown re-renders per second while a reply streams
WIDE_COLUMNS = 100  # from this width on, the metrics panel is shown unless toggled off


class SfchatApp(UserActions):
    """Chat with a split model and watch speculative decoding work."""

    CSS_PATH = "sfchat.tcss"
    TITLE = "sfchat"
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (WIDE_COLUMNS, "-wide")]
    BINDINGS = [
        # Short labels and a compact footer: at 80 columns it must hold every key, Cancel included.
        Binding("ctrl+n", "new_chat", "New"),
        Binding("f1", "help", "Help"),
        # Not Ctrl+H: terminals send it as Backspace.
        Binding("f2,ctrl+r", "history", "History"),
        Binding("f3", "toggle_metrics", "Metrics"),
        # Priority, or the prompt editor would take Ctrl+Y as "redo".
        Binding("ctrl+y", "copy_reply", "Copy", priority=True),
        # Not in the footer (80 columns hold no more): F1 and the palette list them.
        Binding("ctrl+g", "regenerate", "Regenerate", show=False),
        Binding("f4", "edit", "Edit message", show=False),
        Binding("f5", "system_prompt", "System prompt", show=False),
        Binding("ctrl+s", "export", "Export", show=False),
        Binding("escape", "cancel", "Cancel"),
        Binding("ctrl+q", "quit", "Quit", priority=True),
    ]

    def __init__(
        self,
        runtime: Runtime,
        history: History | str | Path | None = None,
        params: Ask | None = None,
        title: str = "sfchat",
        system: str | None = None,
    ) -> None:
        """``history``: a ``History`` (left open at exit), a database path (opened here and
        closed at exit), or None for a history kept in memory only; construct the app on the
        thread that runs it, which then owns the connection. ``params``: the generation
        parameters sent with every prompt (None: ``params.Ask()``, the default reply limit and
        all sampling left to the head). ``title``: the header line until the runtime is ready.
        ``system``: the system prompt of the chats that have none of their own (``--system``;
        None: the head's own rule)."""
        super().__init__()
        self.runtime = runtime
        self._owns_history = not isinstance(history, History)
        self.history = history if isinstance(history, History) else History(history or ":memory:")
        self.session = ChatSession(self.history, on_error=lambda exc: self.call_later(self._history_failed, exc),
                                   default_system=system)
        self.params = params or Ask()
        self.header_title = title
        self.ready: RuntimeReady | None = None
        self.failed = False
        self.meter = Meter()
        self.state = "loading"
        self.link_state = ""
        self._reply: ReplyMessage | None = None
        self._queued: str | None = None  # sent when the reply in progress ends
        self.editing: int | None = None  # the index among the turns of the prompt being edited
        self._draft = ""  # what the editor held when editing began (Esc brings it back)
        self._history_error = ""  # the last one shown: a locked file is said once, not per token
        self._metrics_dirty = False

    def compose(self) -> ComposeResult:
        yield HeaderBar(self.header_title)
        with Horizontal(id="body"):
            with Vertical(id="main"):
                yield LoadPanel(id="load")
                yield ChatView(id="chat")
                yield Static(id="status")
                yield PromptInput(id="prompt", placeholder="Enter sends · Ctrl+J newline")
            yield MetricsPanel(id="metrics")
        yield Footer(compact=True)

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
        self._flush_timer.stop()  # a reply still streaming at exit has no widgets left to draw in
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
                if event.dropped_turns:  # the notice goes above the reply it concerns
                    window = self.ready.max_context if self.ready else None
                    await self.query_one(ChatView).add_notice(dropped_notice(event.dropped_turns, window),
                                                              before=self._reply)
            case TokensCommitted():
                self._tokens_committed(event)
            case ReplyFinished():
                await self._reply_finished(event)
            case RuntimeFailed():
                await self._runtime_failed(event)
            case CodeWanted():
                self._ask_code(plain(event.reason))

    def _ask_code(self, reason: str) -> None:
        if isinstance(self.screen, CodeScreen):
            self.screen.ask_again(reason)
        else:
            self.push_screen(CodeScreen(reason), self._code_given)

    async def _code_given(self, code: str | None) -> None:
        try:
            self.runtime.set_code(code or "")
        except Exception as exc:  # a runtime that cannot take it: an error, not a crash
            await self._runtime_failed(RuntimeFailed(str(exc) or type(exc).__name__, fatal=True))

    async def _link_changed(self, event: LinkState) -> None:
        detail = plain(event.detail)
        self.query_one(HeaderBar).set_link(event.state, detail)
        self.query_one(MetricsPanel).set_link(event.state, detail)
        before, self.link_state = self.link_state, event.state
        # The header has room for the state only; what the user must know goes further.
        if event.state == "waiting" and detail:
            await self.query_one(ChatView).note("waiting", detail)
        elif event.state in ("reconnecting", "stalled"):
            self.notify(detail or event.state, title=f"link {event.state}", severity="warning",
                        markup=False)
        elif event.state == "connected":
            await self.query_one(ChatView).note("waiting", None)  # the tail is back: the notice is history
            if before in ("reconnecting", "stalled"):
                self.notify(detail or "the link is back", title="link connected", markup=False)

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
                f"The reply filled the context window{limit}. The next message leaves the oldest turns "
                "out of the model's view.", "warning")
        await self._send_queued(True)

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
        await self._send_queued(False)

    def _end_reply(self) -> None:
        self._reply = None
        self._flush_timer.pause()
        self.query_one(MetricsPanel).show(self.meter.figures())
        self._metrics_dirty = False
        self._set_state("ready" if self.ready and not self.failed else self.state)

    def _tick(self) -> None:
        """Render what streamed in since the last tick (text and figures), at FLUSH_HZ; save the
        reply about once a second (the writer's heartbeat)."""
        self.session.heartbeat()
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
        relay = self.ready is not None and self.ready.mode == "relay"
        status.update(status_text(self.state, figures, status.content_size.width or None, relay))

    def on_resize(self) -> None:
        self.call_after_refresh(self._show_status)  # the status line's figures fit its width

    # -- the user's side -----------------------------------------------------------------

    async def on_prompt_input_submitted(self, message: PromptInput.Submitted) -> None:
        text = message.text.strip()
        if not text:
            return
        if self.failed:
            self.notify("The runtime has failed; restart sfchat.", severity="error")
        elif self.ready is None:
            self.notify("Still loading: the prompt can be sent once the model is ready.",
                        severity="warning")
        elif self.session.replying:
            await self._queue(text)
        elif await self._send(text):
            self.query_one(PromptInput).clear()

    async def _send(self, text: str) -> bool:
        """Store the prompt, show it and submit it (in place of the prompt being edited, and what
        followed it, while one is); False when the history refused it."""
        editing, self.editing = self.editing, None
        try:
            # stored before the runtime sees it
            messages = self.session.send(text) if editing is None else self.session.edit(editing, text)
        except HistoryError as exc:
            self.editing = editing
            await self._history_failed(exc)
            return False
        self._history_error = ""  # the file works again: a new failure is worth saying
        self.query_one(PromptInput).remember(text)
        chat = self.query_one(ChatView)
        if editing is None:
            await chat.add_user(text)
        else:
            await chat.note("editing", None)
            self.refresh_bindings()
            await self.show_chat()
        await self._submit(messages)
        return True

    async def _submit(self, messages: list[dict]) -> None:
        """Show a reply to come and ask the runtime for it."""
        chat = self.query_one(ChatView)
        chat.border_title = self.session.title
        self._reply = await chat.add_reply(info="waiting for the runtime…")
        self._set_state("waiting")
        self._flush_timer.resume()
        try:
            self.runtime.submit(messages, self.params)
        except Exception as exc:  # a refused submit is an error notice, not a crash
            await self._runtime_failed(RuntimeFailed(str(exc) or type(exc).__name__))

    async def _queue(self, text: str) -> None:
        """A message typed while a reply runs: kept (with any queued before it) until it ends."""
        self._queued = f"{self._queued}\n\n{text}" if self._queued else text
        self.query_one(PromptInput).clear()
        await self.query_one(ChatView).note(
            "queued", f"Queued, sent when this reply ends (Esc ends it now): {self._queued}")

    async def _send_queued(self, send: bool) -> None:
        """The reply ended: send the queued message, or (``send`` False) put it back in the editor."""
        text, self._queued = self._queued, None
        await self.query_one(ChatView).note("queued", None)
        if text is None:
            return
        if send and await self._send(text):
            return
        prompt = self.query_one(PromptInput)
        prompt.load_text("\n\n".join(t for t in (text, prompt.text) if t))
        self.notify("The queued message was not sent: it is back in the editor.", severity="warning")


def run_tui(runtime: Runtime, history: History | str | Path | None = None,
            params: Ask | None = None, title: str = "sfchat", system: str | None = None) -> None:
    """Run the chat app in the terminal until the user quits."""
    SfchatApp(runtime, history, params, title, system).run()


__all__ = ["SfchatApp", "run_tui"]
