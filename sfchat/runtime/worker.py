"""The runtime thread behind the chat UI: the one thread that owns the models and CUDA.

Contract
--------
``RuntimeWorker(settings)`` implements the runtime interface the UI drives. ``start(listener)``
starts a daemon thread that connects (relay mode), loads everything and then serves requests;
every event (``LoadProgress``, ``LinkState``, ``RuntimeReady``, ``ReplyStarted``,
``TokensCommitted``, ``ReplyFinished``, ``RuntimeFailed``) is delivered by calling ``listener``
from that thread. ``submit``, ``cancel``, ``new_chat`` and ``close`` never block: they queue a
request or set a flag. CUDA graph state is thread-local, which is why nothing else may touch the
session. The worker knows nothing about widgets.

Shutdown: after ``close`` the thread ends its reply at the next round, closes the link, drops
the models and returns; ``join(timeout)`` waits for that. The process must not exit while the
thread still holds the models: torch's C++ state torn down under a live thread aborts the
interpreter ("terminate called without an active exception", exit status 134).
"""

from __future__ import annotations

import queue
import threading
from typing import Callable

from sfchat import UserError
from sfchat.config import Settings
from sfchat.events import LinkState, RuntimeFailed
from sfchat.runtime.session import ChatSession, connect_relay, make_sampling


class RuntimeWorker:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.requests: queue.Queue = queue.Queue()
        self.cancelled = threading.Event()
        self.thread: threading.Thread | None = None
        self.listener: Callable = lambda event: None

    # -- the interface the UI uses -------------------------------------------------------------
    def start(self, listener: Callable) -> None:
        self.listener = listener
        self.thread = threading.Thread(target=self._main, name="sfchat-runtime", daemon=True)
        self.thread.start()

    def submit(self, messages: list[dict], params: dict) -> None:
        self.cancelled.clear()
        self.requests.put(("submit", messages, dict(params)))

    def cancel(self) -> None:
        self.cancelled.set()

    def new_chat(self) -> None:
        self.requests.put(("new_chat",))

    def close(self) -> None:
        self.cancelled.set()
        self.requests.put(("close",))

    def join(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` s for the runtime thread to end; True once it has (or never
        started). A thread still loading models finishes that first."""
        if self.thread is None:
            return True
        self.thread.join(timeout)
        return not self.thread.is_alive()

    # -- the runtime thread --------------------------------------------------------------------
    def _main(self) -> None:
        emit = self.listener
        try:
            session = ChatSession.load(self.settings, emit, connect_relay(self.settings, emit))
        except UserError as exc:
            emit(RuntimeFailed(str(exc), fatal=True))
            return
        except Exception as exc:  # shown to the user in one line; the UI stays up
            emit(RuntimeFailed(f"loading failed: {type(exc).__name__}: {exc}", fatal=True))
            return
        while True:
            request = self.requests.get()
            if request[0] == "close":
                session.engine.link.close()
                emit(LinkState("closed"))
                return
            if request[0] == "new_chat":
                session.engine.reset()
                continue
            try:
                self._reply(session, request[1], request[2])
            except UserError as exc:
                emit(RuntimeFailed(str(exc)))
            except Exception as exc:
                emit(RuntimeFailed(f"{type(exc).__name__}: {exc}", fatal=True))
                return

    def _reply(self, session: ChatSession, messages: list[dict], params: dict) -> None:
        s = self.settings
        if s.system and not any(m.get("role") == "system" for m in messages):
            messages = [{"role": "system", "content": s.system}] + messages
        ids = session.encode(messages, s.chat_template)
        sampling = make_sampling(params.get("temperature", s.temperature), params.get("top_k", s.top_k),
                                 params.get("top_p", s.top_p), params.get("seed", s.seed))
        limit = int(params.get("max_new_tokens", s.max_new_tokens))
        for event in session.reply(ids, limit, sampling, self.cancelled.is_set):
            self.listener(event)
