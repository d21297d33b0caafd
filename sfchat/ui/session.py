"""The conversation on screen and its persistence in the history.

Contract: ``ChatSession`` is the single place that turns what happens to a conversation
(prompt sent, reply started / streamed / finished / failed, chat opened, new chat) into
``History`` writes and into the message list the runtime is given. It knows nothing of
widgets or of the runtime itself.

Write discipline (what a crash may lose): the prompt is stored before the runtime sees it;
the reply row is created with status "streaming" when the reply starts, rewritten at most
once per ``SAVE_INTERVAL_S`` while it streams, and written a last time when it ends. The app
calls ``heartbeat`` on its timer while a reply runs: it saves the row also while no text comes
(a long prefill, a tail reconnecting), so that another sfchat on the same history sees a live
writer and leaves the row alone. A ``HistoryError`` from storing a prompt reaches the caller of
``send`` (nothing was sent); one from saving a reply goes to ``on_error`` and the reply goes on
(the session's state never waits for the file).

The conversation given to the runtime opens with a system message when the chat has a system
prompt of its own (``system``, stored with the chat) or, failing that, when ``default_system``
(``--system``) is set; otherwise the head applies its own rule. ``regenerate`` drops the last
reply (from the screen's turns and the history) and asks for it again; ``edit(index, text)``
cuts the conversation before the prompt at ``index``, and sends ``text`` in its place: the
reply is made again from there. Both refuse (``ValueError``) what they cannot do: a reply in
progress, no prompt to answer, an index that is no prompt.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sfchat.events import ReplyFinished
from sfchat.history import History, HistoryError, Message, title_from_prompt

SAVE_INTERVAL_S = 1.0


@dataclass
class Turn:
    """One message of the conversation as the session holds it."""

    role: str
    content: str
    status: str = "complete"
    stats: dict[str, Any] | None = None
    id: int | None = None  # its row in the history (None: never stored)


def reply_stats(event: ReplyFinished) -> dict[str, Any]:
    """The figures of a finished reply worth keeping next to it (no text, no token ids)."""
    return event.figures()


class ChatSession:
    """The open chat: its turns, the reply in progress, and their rows in the history."""

    def __init__(self, history: History, model: str = "",
                 clock: Callable[[], float] = time.monotonic,
                 on_error: Callable[[HistoryError], None] = lambda exc: None,
                 default_system: str | None = None) -> None:
        self.history = history
        self.on_error = on_error
        self.model = model
        self.default_system = default_system or None
        self._clock = clock
        self.chat_id: int | None = None
        self.title = ""
        self.system: str | None = None  # the chat's own system prompt
        self.turns: list[Turn] = []
        self._reply: Turn | None = None
        self._reply_id: int | None = None
        self._saved_at = 0.0

    @property
    def replying(self) -> bool:
        """True from ``send`` until the reply finishes or fails."""
        return self._reply is not None

    def new(self) -> None:
        self.chat_id, self.title, self.turns, self.system = None, "", [], None
        self._reply = self._reply_id = None

    def open(self, chat_id: int, title: str) -> list[Message]:
        """Make a stored chat the open one; the next prompt continues it."""
        messages = self.history.load_chat(chat_id)
        system = self.history.chat_system(chat_id)
        self.new()
        self.chat_id, self.title, self.system = chat_id, title, system
        self.turns = [Turn(m.role, m.content, m.status, m.stats, m.id) for m in messages if m.role != "system"]
        return messages

    def set_system(self, system: str | None) -> None:
        """The open chat's own system prompt (None or blank: the default); stored with the chat."""
        system = system if system and system.strip() else None
        if self.chat_id is not None:
            self.history.set_system(self.chat_id, system)
        self.system = system

    def conversation(self) -> list[dict[str, str]]:
        """What the runtime is given: the system prompt that applies, then the turns."""
        system = self.system or self.default_system
        # Every earlier reply is context, cut-off ones included (the user saw that text);
        # only replies that produced nothing at all are left out.
        return [{"role": "system", "content": system}] * bool(system) + [
            {"role": t.role, "content": t.content} for t in self.turns if t.content or t.role != "assistant"]

    def send(self, prompt: str) -> list[dict[str, str]]:
        """Store the prompt and return the conversation to submit, ending with it."""
        if self.chat_id is None:
            self.title = title_from_prompt(prompt)
            self.chat_id = self.history.new_chat(self.title, self.model, self.system)
        msg_id = self.history.add_message(self.chat_id, "user", prompt)
        self.turns.append(Turn("user", prompt, id=msg_id))
        return self._start_reply()

    def _start_reply(self) -> list[dict[str, str]]:
        self._reply = Turn("assistant", "", "streaming")
        self._reply_id = None
        self._saved_at = float("-inf")
        return self.conversation()

    def prompts(self) -> list[int]:
        """Indexes of the user's prompts among ``turns``."""
        return [i for i, t in enumerate(self.turns) if t.role == "user"]

    def regenerate(self) -> list[dict[str, str]]:
        """Drop the reply after the last prompt and return the conversation to submit again."""
        prompts = self.prompts()
        if self.replying or not prompts:
            raise ValueError("a reply is in progress" if self.replying else "no prompt to answer yet")
        self._cut(prompts[-1] + 1)
        return self._start_reply()

    def edit(self, index: int, prompt: str) -> list[dict[str, str]]:
        """Cut the conversation before the prompt at ``index``, then send ``prompt`` in its place."""
        if self.replying or index not in self.prompts():
            raise ValueError("a reply is in progress" if self.replying else f"turn {index} is no prompt")
        self._cut(index)
        return self.send(prompt)

    def _cut(self, index: int) -> None:
        """Forget ``turns[index:]``, in the history first (a failure there leaves both as they were)."""
        stored = [t.id for t in self.turns[index:] if t.id is not None]
        if stored and self.chat_id is not None:
            self.history.delete_messages(self.chat_id, stored)
        del self.turns[index:]

    def reply_started(self) -> None:
        if self._reply is None or self._reply_id is not None:
            return
        assert self.chat_id is not None
        self._saved_at = self._clock()  # a failed write is tried again a save interval later, not per token
        self._reply_id = self._save(self.history.add_message, self.chat_id, "assistant", "", "streaming")

    def reply_text(self, text: str) -> None:
        """Add streamed text; stored when the last save is old enough."""
        if self._reply is None:
            return
        self._reply.content += text
        if self._reply_id is not None:
            self.heartbeat()
        elif self._clock() - self._saved_at >= SAVE_INTERVAL_S:
            self.reply_started()

    def heartbeat(self) -> None:
        """Save the streaming reply when its last save is ``SAVE_INTERVAL_S`` old."""
        if self._reply is not None and self._reply_id is not None and \
                self._clock() - self._saved_at >= SAVE_INTERVAL_S:
            self._saved_at = self._clock()
            self._save(self.history.update_message, self._reply_id, self._reply.content)

    def reply_finished(self, event: ReplyFinished) -> Turn | None:
        """Store the reply as the runtime reports it in full; returns the finished turn."""
        if self._reply is None:
            return None
        reply = self._reply
        reply.content = event.text or reply.content
        reply.status = "cancelled" if event.finish_reason == "cancelled" else "complete"
        reply.stats = reply_stats(event)
        self._close_reply(reply)
        return reply

    def reply_failed(self) -> Turn | None:
        """The runtime gave up on the reply: keep what arrived, marked interrupted."""
        if self._reply is None:
            return None
        reply = self._reply
        reply.status = "interrupted"
        if self._reply_id is None and not reply.content:
            # Nothing was produced: no empty reply row, the prompt stands alone.
            self._reply = None
            return reply
        self._close_reply(reply)
        return reply

    def _close_reply(self, reply: Turn) -> None:
        assert self.chat_id is not None
        reply_id, self._reply, self._reply_id = self._reply_id, None, None
        self.turns.append(reply)
        if reply_id is None:
            reply.id = self._save(self.history.add_message, self.chat_id, "assistant", reply.content, reply.status,
                                  reply.stats)
        else:
            reply.id = reply_id
            self._save(self.history.update_message, reply_id, reply.content, reply.status, reply.stats)

    def _save(self, write: Callable, *args: Any) -> Any:
        """A reply's write; a failing file is reported, and the reply goes on (None)."""
        try:
            return write(*args)
        except HistoryError as exc:
            self.on_error(exc)
            return None

    def last_reply(self) -> str | None:
        """Text of the newest reply, the one streaming included."""
        if self._reply is not None and self._reply.content:
            return self._reply.content
        return next((t.content for t in reversed(self.turns) if t.role == "assistant"), None)
