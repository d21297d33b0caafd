"""The chat screen's runtime for a head that runs elsewhere: ``sfchat --remote``, no torch, no model.

Contract
--------
``RemoteRuntime(dial, code, session)`` implements the chat UI's runtime interface
(``sfchat.ui.runtime.Runtime``) by driving a ``remote.host.ChatHost`` through the relay.
``dial()`` returns a fresh relay link in the head's role on the chat session (a
``RelayLink``); a ``ChatDialer`` (``link.dialer.Dialer`` in the chat screen's words, code
attempts in this process's budget) waits on it for the host and pairs with ``code`` (SPAKE2,
sealed end to end), and after the first pairing resumes with the secret it left, on every
reconnect, without the code: a resumption the host refuses (a host restarted in a new notebook
session) is followed by no code attempt of ours that could be guessed against, and the person is
asked for the code again (``CodeWanted``), as for a wrong one or one shorter than
``pairing.check_code`` allows (asked before anything is dialled).
``start(listener)`` starts one thread that dials, pairs, attaches and reports every event of
the host's runtime to ``listener`` (the host's figures, so the metrics panel shows the head's);
``submit``, ``cancel``, ``new_chat``, ``set_code`` and ``close`` never block: a command is
numbered, kept until the host acknowledges it, and sent again after a reconnect, so nothing is
lost or done twice. A lost link is dialled again with the one backoff (``link.backoff``), as
long as the runtime is open, and so is one that is silent for ``chat.SILENCE_S`` (the host
sends at least every ``chat.KEEPALIVE_S``; so does this runtime once attached): a relay that
withholds or replays a frame, or a host that ended the pairing, is noticed within that and
shown; meanwhile ``LinkState`` says so ("reconnecting", "waiting" for a host that is not there),
and the host's own link state is shown again once it is back (the dialer's own "connected" is
not reported: the screen shows the head's link).

History stays here: the conversation is sent whole with every ``Submit`` (the host keeps
nothing of it but its KV cache). A host restarted since (another instance) has lost the reply in
progress: that reply fails with a ``RuntimeFailed`` that says so (not fatal: send it again).
``set_code`` answers whichever question is open: this runtime's own (the chat code) or the
host's (its tail's pairing code, which then crosses sealed). Every text from the host is made
plain by ``protocol.chat_events.update_event`` before it is reported.

A reply is bounded by what was asked for (``Reply``): at most ``max_new_tokens`` token ids and
``CHARS_PER_TOKEN`` characters per token (and never more than ``chat_events.MAX_REPLY_CHARS``), kept as
a list of the rounds' texts. A head that sends more gets the part within the bounds reported,
then a ``RuntimeFailed`` (not fatal) that says the reply was cut, and a ``Cancel``; whatever more
of that reply comes is dropped. Torch-free.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from typing import Callable

from sfchat import UserError
from sfchat.events import CodeWanted, LinkState, ReplyFinished, RuntimeFailed, TokensCommitted
from sfchat.link import LinkClosed, PeerGone
from sfchat.link.backoff import redial
from sfchat.link.dialer import Dialer
from sfchat.link.pairing import check_code
from sfchat.link.secure import CodeNeeded, IntegrityError, PairingRefused, WrongCode
from sfchat.params import Ask
from sfchat.plaintext import plain
from sfchat.protocol import chat, chat_events
from sfchat.remote.outbox import Outbox

POLL_S = 1.0
ACK_EVERY = 16  # updates taken before an acknowledgement (and at every reply's end)
CHARS_PER_TOKEN = 256  # characters of a reply per token asked for (a token's text is a few; the longest, dozens)


class Closed(Exception):
    """The runtime was closed."""


class RemoteRuntime:
    def __init__(self, dial: Callable[[], object], code: str | None, session: str):
        self.session = session
        self.client = os.urandom(16).hex()
        self.commands = Outbox("sfchat-chat-client")
        self.dialer = ChatDialer(lambda timeout: dial(), session, code, on_event=self._dialer_event,
                                 ask_code=self._ask_code)
        self.listener: Callable = lambda event: None
        self._cond = threading.Condition()
        self._asking = False  # this runtime's own question (the chat code) is open
        self._answer: str | None = None
        self._closing = False
        self._link = None
        self._host = ""  # the host instance whose updates we hold
        self._seen = 0  # the last update taken from it
        self._acked = 0
        self._next_request = 0
        self._replies: dict[int, Reply] = {}  # request -> what came of it so far
        self._host_link: LinkState | None = None  # what the host last said of its own link
        self.thread: threading.Thread | None = None

    # -- the interface the UI uses -------------------------------------------------------------------
    def start(self, listener: Callable) -> None:
        self.listener = listener
        self.thread = threading.Thread(target=self._main, name="sfchat-remote", daemon=True)
        self.thread.start()

    def submit(self, messages: list[dict], asked: Ask) -> None:
        turns = tuple((m["role"], m["content"]) for m in messages)
        with self._cond:
            self._next_request += 1
            request = self._next_request
            self._replies[request] = Reply(asked.max_new_tokens)
        self.commands.put(lambda seq: chat.Submit(seq, request, turns, asked))

    def cancel(self) -> None:
        with self._cond:
            request = max(self._replies, default=0)
        if request:
            self.commands.put(lambda seq: chat.Cancel(seq, request))

    def new_chat(self) -> None:
        self.commands.put(lambda seq: chat.NewChat(seq))

    def set_code(self, code: str) -> None:
        with self._cond:
            if self._asking:
                self._answer = code
                self._cond.notify_all()
                return
        self.commands.put(lambda seq: chat.GiveCode(seq, code))

    def close(self) -> None:
        with self._cond:
            self._closing = True
            link = self._link
            self._cond.notify_all()
        self.commands.close()
        self.dialer.close()
        if link is not None:
            link.close()

    def join(self, timeout: float | None = None) -> bool:
        if self.thread is None:
            return True
        self.thread.join(timeout)
        return not self.thread.is_alive()

    # -- the thread ----------------------------------------------------------------------------------
    def _main(self) -> None:
        try:
            while True:
                link = redial(self._connect, UserError, on_retry=self._retrying, pause=self._pause)
                why = self._serve(link)
                self.commands.detach()
                link.close()
                self._check_open()
                self.listener(LinkState("reconnecting", f"the link to the head was lost ({plain(why)}): "
                                                        "dialling again; nothing of the reply is lost"))
        except Closed:
            pass
        except Exception as exc:  # a bug: said on the screen, never a silent thread
            self.listener(RuntimeFailed(f"the chat client failed: {type(exc).__name__}: {plain(exc)}", fatal=True))
        finally:
            self.commands.close()

    def _check_open(self) -> None:
        with self._cond:
            if self._closing:
                raise Closed

    def _retrying(self, exc: BaseException, delay: float) -> None:
        self._check_open()
        self.listener(LinkState("reconnecting", f"{plain(exc)}; dialling again in {delay:.1f} s"))

    def _pause(self, delay: float) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._closing, delay)

    def _connect(self, left: float | None):
        """A link paired with the host (by its code, or resumed), waiting for the host as long as it takes."""
        try:
            link = self.dialer()
        except PairingRefused as exc:
            self._check_open()
            raise UserError(plain(exc)) from None
        except LinkClosed:
            self._check_open()
            raise UserError("the relay closed the connection while waiting for the head") from None
        with self._cond:
            self._link = link
            if self._closing:
                link.close()
                raise Closed
        return link

    def _ask_code(self, reason: str) -> str:
        """Ask the person for the chat code (``CodeWanted``) and wait for the answer."""
        with self._cond:
            self._asking, self._answer = True, None
        self.listener(CodeWanted(reason))
        with self._cond:
            self._cond.wait_for(lambda: self._answer is not None or self._closing)
            self._asking = False
            if self._closing:
                raise Closed
            return self._answer.strip()

    def _dialer_event(self, event) -> None:
        if event.state != "connected":  # the host's own link state is what the screen shows once attached
            self.listener(event)

    def _serve(self, link) -> str:
        """Attach and take the host's messages until the link ends; returns why it did."""
        try:
            return self._take_all(link)
        except LinkClosed as exc:
            return str(exc) or "the link closed"

    def _take_all(self, link) -> str:
        link.send(chat.encode(chat.Attach(self.client, self._host, self._seen)))
        welcomed = False
        heard = kept_alive = time.monotonic()
        while True:
            now = time.monotonic()
            if now - heard > chat.SILENCE_S:
                return (f"nothing from the head for {chat.SILENCE_S:.0f} s: the relay may be holding frames back, "
                        "or the head ended the pairing")
            if welcomed and now - kept_alive >= chat.KEEPALIVE_S:
                kept_alive = now
                link.send(chat.encode(chat.Ack(self._seen)))
            try:
                frame = link.recv(timeout=min(POLL_S, chat.KEEPALIVE_S))
            except TimeoutError:
                self._check_open()
                continue
            except (PeerGone, LinkClosed, IntegrityError) as exc:
                return str(exc) or type(exc).__name__
            heard = time.monotonic()
            try:
                msg = chat.decode(frame)
            except chat.ChatError as exc:
                self.listener(RuntimeFailed(f"the head sent what this sfchat does not understand: {plain(exc)}"))
                return "a message that is no chat message"
            if isinstance(msg, chat.Welcome):
                self._welcome(msg, link)
                welcomed = True
            elif isinstance(msg, chat.Ack):
                self.commands.ack(msg.seen)
            elif isinstance(msg, chat.Update) and welcomed:
                self._update(msg, link)

    def _welcome(self, w: chat.Welcome, link) -> None:
        if not w.resumed:
            with self._cond:
                lost, self._replies = list(self._replies), {}
            if self._host:  # a host we knew lost our replies (restarted), or forgot this client
                for _ in lost:
                    self.listener(RuntimeFailed("the head restarted (or forgot this screen): the reply in progress "
                                                "is lost; send it again"))
            self.commands.restart(0)  # the host numbers this client's commands afresh
            self._host = w.host
        self._seen = w.base
        self.commands.attach(link, w.taken)
        if w.resumed:
            self.listener(self._host_link or LinkState("connected", "the head is back"))

    def _update(self, u: chat.Update, link) -> None:
        if u.seq != self._seen + 1:
            return  # sent before the welcome of this pairing, or again: taken already, or coming in order
        self._seen = u.seq
        event = chat_events.update_event(u)
        if isinstance(event, LinkState):
            self._host_link = event
        events = [event]
        if u.request:
            with self._cond:
                events = self._reply_events(u.request, event)
        for event in events:
            self.listener(event)
        if self._seen - self._acked >= ACK_EVERY or any(isinstance(e, (ReplyFinished, RuntimeFailed)) for e in events):
            self._acked = self._seen
            link.send(chat.encode(chat.Ack(self._seen)))

    def _reply_events(self, request: int, event) -> list:
        """What to report of a reply's event (under the lock): nothing of a reply this runtime does
        not wait for; past what was asked, the part within it and a failure that says so, and the
        head is asked to stop (the rest of that reply is dropped as it comes)."""
        reply = self._replies.get(request)
        if reply is None:
            return []  # a reply of an earlier host's numbering, or one cut already
        over = False
        if isinstance(event, TokensCommitted):
            event, over = reply.take(event)
        elif isinstance(event, chat_events.Finished):
            over = event.text is not None and len(event.text) > reply.max_chars
            event = None if over else chat_events.finished_event(event, reply.text(), tuple(reply.ids))
        events = [e for e in (event, reply.overrun() if over else None) if e is not None]
        if over:
            self.commands.put(lambda seq: chat.Cancel(seq, request))
        if over or isinstance(event, (ReplyFinished, RuntimeFailed)):
            self._replies.pop(request, None)
        return events


class ChatDialer(Dialer):
    """The dialer in the chat screen's words: its peer is the head, its code the chat code."""

    ask_text = "the chat code the head printed (sfchat --offer-chat), such as 7-crossover-clockwork"
    rival = "chat screen"

    def check(self, code: str | None) -> None:
        if not code:
            raise UserError(self.ask_text)
        check_code(code, "the chat code", "type the one the head printed")

    def reason(self, exc: Exception) -> str:
        if isinstance(exc, CodeNeeded):
            return ("the head no longer knows this screen (restarted in a new session?): type the chat code it "
                    "printed last")
        if isinstance(exc, WrongCode):
            return "wrong chat code: the head did not accept it; type the code it printed"
        return super().reason(exc)

    def waiting_text(self) -> str:
        return (f"waiting for the head on session {self.session!r}: start it with sfchat --offer-chat (the head "
                "notebook's chat cell)")


class Reply:
    """A reply the screen asked for: its text and token ids as they came, in lists (the memory a
    reply takes grows with it, never with the square of its rounds), bounded by what was asked:
    ``max_tokens`` token ids and ``max_chars`` characters (``CHARS_PER_TOKEN`` a token, at most
    ``chat_events.MAX_REPLY_CHARS``)."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.max_chars = min(max_tokens * CHARS_PER_TOKEN, chat_events.MAX_REPLY_CHARS)
        self.parts: list[str] = []
        self.ids: list[int] = []
        self.chars = 0

    def take(self, event: TokensCommitted) -> tuple[TokensCommitted, bool]:
        """The part of ``event`` within the bounds (kept), and whether the head went past them."""
        text = event.text[:self.max_chars - self.chars]
        ids = event.token_ids[:self.max_tokens - len(self.ids)]
        if text:
            self.parts.append(text)
        self.ids.extend(ids)
        self.chars += len(text)
        over = len(text) < len(event.text) or len(ids) < len(event.token_ids)
        return (dataclasses.replace(event, text=text, token_ids=tuple(ids)) if over else event), over

    def text(self) -> str:
        return "".join(self.parts)

    def overrun(self) -> RuntimeFailed:
        return RuntimeFailed(f"the head sent more than this screen asked for ({self.max_tokens} tokens, "
                             f"{self.max_chars} characters at most): the reply is cut there, and the head was "
                             "asked to stop")
