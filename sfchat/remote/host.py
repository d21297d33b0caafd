"""The chat host: a head's runtime offered, through the relay, to one chat screen at a time.

Contract
--------
``ChatHost(runtime, dial, log, watch)`` serves ``runtime`` (the chat UI's runtime interface,
``sfchat.ui.runtime.Runtime``: in ``sfchat --offer-chat`` the head's ``RuntimeWorker``) to a
chat client (``remote.client.RemoteRuntime``). ``dial()`` returns the host's relay link: a
``SecureLink`` in the tail's role on the chat session, with a ``Passcode`` (the chat code the
host printed) and a ``ResumeFile``, so a client pairs by the code once and resumes after
that, as a head does with its tail; code attempts wait for their turn in the code's budget.
``serve()`` starts the runtime and serves until ``close()`` (from another thread) behind a
``link.listener.Listener``, the tail's: the host is its handler (``take``, ``tick``,
``peer_gone``, ``pairing_ended``, ``link_lost``); a relay connection that is lost is dialled
again with the one backoff (a relay that keeps refusing the token stops it), nothing a client
sends ends it, and every line of the host's log passes the process's one rate limit
(``nodelog.limited``). An attached client is sent an ``Ack`` every ``chat.KEEPALIVE_S``; one
that is not heard for ``chat.SILENCE_S``, or whose frame fails the link's integrity check, loses
its pairing (the listener restarts it: the same relay connection waits for it to pair again),
and, no longer kept alive, notices.
``watch(event)`` sees every runtime event first (the command line prints some).

Updates (every runtime event, as a ``protocol.chat.Update``) are numbered and kept in an
``Outbox`` until the client acknowledges them; a client that comes back (the same client id,
this host instance, a ``seen`` still covered) gets every update after ``seen``, so a reconnect
of either side mid-reply loses nothing. Commands (``Submit``, ``Cancel``, ``NewChat``,
``GiveCode``) are taken in their numbers' order, each once, and acknowledged. Reply events
carry the client's request number (``Update.request``); a reply's text travels once, in its
rounds. A client the host does not know (another id, or one whose updates were forgotten) gets
a fresh start: the reply in progress is cancelled and no more of it is sent (its events belong
to no request of the new client), and the host's state is sent first (the model once ready or
the loading progress, the link, a pending question for the tail's code, a fatal failure).

Bounds: at most ``MAX_REPLIES`` of a client's replies are pending (more are refused with a
``RuntimeFailed``); at most ``MAX_KEPT`` updates are kept for a client; past that, the updates it has not
been sent yet are folded (rounds of one reply merged, superseded progress and link states
dropped), and a client that still has more unacknowledged is forgotten (its next attach starts
afresh). Frames that are not chat messages are refused with a line in the log, never a crash;
the log shows only plain text. Torch-free: the runtime is injected.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections import deque
from typing import Callable

from sfchat.events import (
    CodeWanted, LinkState, LoadProgress, ReplyFinished, ReplyStarted, RuntimeFailed, RuntimeReady, TokensCommitted,
)
from sfchat.link import LinkClosed
from sfchat.link.listener import Listener
from sfchat.nodelog import limited
from sfchat.plaintext import plain
from sfchat.protocol import chat, chat_events
from sfchat.remote.outbox import Outbox

POLL_S = 1.0  # how often the receiving loop looks whether the host was closed
MAX_KEPT = 4096  # updates kept for a client that has not acknowledged them
MAX_REPLIES = 2  # replies of the client given to the runtime or held, at most (the screen asks for one at a time)
ORPHAN = 0  # the request of a reply no attached client asked for


class ChatHost:
    def __init__(self, runtime, dial: Callable[[], object], log: Callable[[str], None] = print,
                 watch: Callable[[object], None] = lambda event: None):
        self.runtime, self.log, self.watch = runtime, limited(log), watch
        self.instance = os.urandom(16).hex()
        self.updates = Outbox("sfchat-chat-host")
        self._lock = threading.RLock()  # everything below; never held while the link sends
        self._client: str | None = None  # the client the kept updates are for
        self._taken = 0  # the last command number taken from that client
        self._requests: deque[int] = deque()  # replies given to the runtime and not finished, oldest first
        self._waiting: deque[chat.Submit] = deque()  # submits held while an orphaned reply ends
        self._streamed: list[str] = []  # the texts of the reply in progress so far, round by round
        self._ready: RuntimeReady | None = None
        self._link_state: LinkState | None = None
        self._progress: dict[tuple[str, str], LoadProgress] = {}
        self._code_wanted: CodeWanted | None = None
        self._fatal: RuntimeFailed | None = None
        self._attached = False  # a client is attached on the present pairing (this thread's)
        self._heard = self._kept_alive = time.monotonic()  # the client's last frame, our last keepalive
        self.listener = Listener(dial, self, log=self.log, poll=lambda: min(POLL_S, chat.KEEPALIVE_S),
                                 ending="ending this chat client's pairing")

    # -- the runtime's events (its thread) -----------------------------------------------------------
    def _on_event(self, event) -> None:
        self.watch(event)
        with self._lock:
            self._remember(event)
            reply = isinstance(event, (ReplyStarted, TokensCommitted, ReplyFinished)) or \
                (isinstance(event, RuntimeFailed) and not event.fatal and bool(self._requests))
            request = self._requests[0] if reply and self._requests else ORPHAN
            match event:
                case ReplyStarted():
                    self._streamed = []
                case TokensCommitted():
                    self._streamed.append(event.text)
                case ReplyFinished():
                    event = chat_events.Finished.of(event, "".join(self._streamed))
                    self._streamed = []
                    self._reply_ended()
                case RuntimeFailed() if reply:
                    self._reply_ended()
                case RuntimeFailed() if event.fatal:  # it concerns every client: it names no request
                    self._requests.clear()
                    self._waiting.clear()
            if reply and request == ORPHAN:
                return  # a reply of a client that is gone: the present one asked for none of it
            self._keep(request, event)

    def _remember(self, event) -> None:
        match event:
            case RuntimeReady():
                self._ready, self._progress = event, {}
            case LinkState():
                self._link_state = event
            case LoadProgress():
                self._progress[(event.node, event.stage)] = event
            case CodeWanted():
                self._code_wanted = event
            case RuntimeFailed() if event.fatal:
                self._fatal = event

    def _reply_ended(self) -> None:
        if self._requests:
            self._requests.popleft()
        if ORPHAN not in self._requests:
            while self._waiting:
                self._forward(self._waiting.popleft())

    def _keep(self, request: int, event) -> None:
        self.updates.put(lambda seq: chat.Update(seq, request, event))
        if len(self.updates) > MAX_KEPT and self.updates.rewrite_unsent(fold) > MAX_KEPT:
            self.log("the chat client has not acknowledged the last updates: it will start afresh")
            self._client = None
            self.updates.restart(self.updates.last)

    # -- the client's messages (the serving thread) ------------------------------------------------
    def _take(self, msg, link) -> None:
        if isinstance(msg, chat.Attach):
            self._attach(msg, link)
        elif isinstance(msg, chat.Ack):
            self.updates.ack(msg.seen)
        elif isinstance(msg, (chat.Submit, chat.Cancel, chat.NewChat, chat.GiveCode)):
            with self._lock:
                if self._client is None or msg.seq != self._taken + 1:
                    return  # taken before, or a gap the client will fill when it sends again
                self._taken = msg.seq
                self._command(msg)
                taken = self._taken
            link.send(chat.encode(chat.Ack(taken)))
        else:
            self.log(f"ignored a {type(msg).__name__} from the chat client (a host's message)")

    def _command(self, msg) -> None:
        match msg:
            case chat.Submit():
                if sum(r != ORPHAN for r in self._requests) + len(self._waiting) >= MAX_REPLIES:
                    self.log(f"refused a reply request: {MAX_REPLIES} of this chat client's are pending already")
                    self._keep(msg.request, RuntimeFailed("the head is still busy with your earlier messages"))
                elif ORPHAN in self._requests:
                    self._waiting.append(msg)
                else:
                    self._forward(msg)
            case chat.Cancel():
                held = [s for s in self._waiting if s.request == msg.request]
                if held:
                    self._waiting.remove(held[0])
                    self._keep(msg.request, chat_events.Finished("cancelled", None, 0, 0, 0, (), 0,
                                                                 {k: 0.0 for k in chat_events.FIGURES}))
                elif self._requests and self._requests[0] == msg.request:
                    self.runtime.cancel()
            case chat.NewChat():
                self.runtime.new_chat()
            case chat.GiveCode():
                self._code_wanted = None
                self.runtime.set_code(msg.code)

    def _forward(self, msg: chat.Submit) -> None:
        self._requests.append(msg.request)
        self.runtime.submit([{"role": r, "content": c} for r, c in msg.messages], msg.params)

    def _attach(self, msg: chat.Attach, link) -> None:
        with self._lock:
            resumed = msg.client == self._client and msg.host == self.instance and self.updates.kept_after(msg.seen)
            if resumed:
                base = msg.seen
            else:
                self._fresh_client(msg.client)
                base = self.updates.last
                for event in self._snapshot():
                    self._keep(ORPHAN, event)
            welcome = chat.Welcome(self.instance, resumed, base, self._taken)
        link.send(chat.encode(welcome))
        self.updates.attach(link, base)
        self._attached = True
        self.log(f"a chat client {'came back' if resumed else 'attached'}")

    def _fresh_client(self, client: str) -> None:
        """Forget the earlier client: its reply in progress is cancelled and sent to nobody."""
        if self._requests and self._requests[0] != ORPHAN:
            self.runtime.cancel()
        self._requests = deque(ORPHAN for _ in self._requests)
        self._waiting.clear()
        self._client, self._taken = client, 0
        self.updates.restart(self.updates.last)

    def _snapshot(self) -> list:
        state: list = [self._ready] if self._ready else list(self._progress.values())
        state += [e for e in (self._link_state, self._code_wanted, self._fatal) if e is not None]
        return state

    # -- serving: the handler behind the listener (the serving thread) --------------------------------
    @property
    def link(self):
        """The relay link the listener holds now (None before the first dial)."""
        return self.listener.link

    def serve(self) -> None:
        """Start the runtime and serve chat clients until ``close()``."""
        self.runtime.start(self._on_event)
        try:
            self.listener.serve()
        finally:
            self.updates.close()
            self.runtime.close()

    def take(self, frame: bytes, link) -> None:
        self._heard = time.monotonic()
        try:
            msg = chat.decode(frame)
        except chat.ChatError as exc:
            self.log(f"refused a frame from the chat client: {plain(exc)}")
            return
        try:
            self._take(msg, link)
        except LinkClosed:
            raise
        except Exception as exc:  # a runtime that refuses a command: said, never the host's end
            self.log(f"the chat client's {type(msg).__name__} failed: {plain(exc)}")

    def tick(self, link) -> None:
        now = time.monotonic()
        if self._attached and now - self._heard > chat.SILENCE_S:
            self.listener.end_pairing(f"nothing from the chat client for {chat.SILENCE_S:.0f} s (the relay may be "
                                      "holding its frames back)")
        elif self._attached and now - self._kept_alive >= chat.KEEPALIVE_S:
            self._kept_alive = now
            with self._lock:
                taken = self._taken
            link.send(chat.encode(chat.Ack(taken)))

    def peer_gone(self) -> None:
        self._detach()
        self.log("the chat client left; its updates are kept for when it comes back")

    def pairing_ended(self, link, exc) -> None:
        """The paired client is no longer trusted or heard: it must pair (resume) again, and it
        notices (this host's keepalives stop)."""
        self._detach()

    def link_lost(self) -> None:
        self._detach()
        self._heard = self._kept_alive = time.monotonic()

    def _detach(self) -> None:
        self._attached = False
        self.updates.detach()

    def close(self) -> None:
        self.listener.close()


def fold(unsent: list) -> list:
    """Updates no client has seen, shorter: a reply's consecutive rounds merged into one (as long as
    the result stays within the protocol's bounds), progress and link states that a later one
    supersedes dropped."""
    latest = {}
    for i, u in enumerate(unsent):
        if isinstance(u.event, LoadProgress):
            latest[("progress", u.event.node, u.event.stage)] = i
        elif isinstance(u.event, LinkState):
            latest[("link",)] = i
    keep = set(latest.values())
    out: list = []
    for i, u in enumerate(unsent):
        e = u.event
        if isinstance(e, (LoadProgress, LinkState)) and i not in keep:
            continue
        last = out[-1] if out else None
        if isinstance(e, TokensCommitted) and last is not None and isinstance(last.event, TokensCommitted) \
                and last.request == u.request \
                and len(last.event.text) + len(e.text) <= chat_events.MAX_CHUNK_CHARS \
                and len(last.event.token_ids) + len(e.token_ids) <= chat_events.MAX_CHUNK_TOKENS:
            merged = TokensCommitted(last.event.text + e.text, last.event.token_ids + e.token_ids,
                                     dataclasses.replace(e.stats, committed=last.event.stats.committed + e.stats.committed),
                                     e.elapsed_s)
            out[-1] = dataclasses.replace(last, event=merged)
            continue
        out.append(u)
    return out

