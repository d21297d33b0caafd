"""The one thread that owns the head's models and CUDA, and the chat UI's runtime built on it.

Contract
--------
``CudaThread(settings, open_head)`` is the base of every front end that keeps a head alive (the
chat UI's ``RuntimeWorker``, the server's ``GenerationThread``): ``start()`` starts a daemon
thread that opens the head (``open_head(settings, on_event)``, by default ``open_head``: the
relay link in relay mode, dialled and redialled by one ``connect.HeadDialer``, in-process
otherwise) and then takes requests from a queue, one at a
time, calling ``serve(request)`` for each (a subclass's), until ``stop()`` queues the end; then
it closes the link and reports ``LinkState("closed")``. While no request comes it watches the
link every ``WATCH_S`` s (``Head.watch``): a relay that closed the link or stopped answering is
reported then, with what the relay says when dialled again (a refused token), not at the next
message; what the watch raises is reported as a ``LinkState("reconnecting", ...)``. CUDA graph
state is thread-local and one generation at a time is what the GPU can do: nothing but this
thread touches the head. ``loaded`` is set once the head is open or failed to open (``load_error``, a ``UserError``).

``RuntimeWorker(settings)`` implements the runtime interface the chat UI drives.
``start(listener)`` starts the thread; every event (``LoadProgress``, ``LinkState``,
``RuntimeReady``, ``ReplyStarted``, ``TokensCommitted``, ``ReplyFinished``, ``CodeWanted``,
``RuntimeFailed``) is delivered by calling ``listener`` from that thread. ``submit``, ``cancel``,
``new_chat``, ``set_code`` and ``close`` never block: they queue a request or set a flag. The
worker knows nothing of widgets.

Pairing codes (relay mode): the worker opens its head with ``open_head(settings, on_event,
ask_code=...)``. When the code is missing, too short or not the tail's (at the first
dial, or when a reconnect finds a tail that cannot resume and does not take the code), the
thread reports ``CodeWanted(reason)`` and waits for ``set_code(code)``, then dials again with
it, as often as it takes. ``close()`` ends the wait (and the thread); ``cancel()`` ends it during
a reply, which then fails with a ``RuntimeFailed`` that is not fatal (the next message dials
again, and asks again); while loading, only ``close()`` does. The wait depends on the person
alone: nothing a peer sends makes it longer.

Shutdown: after ``close`` the thread ends its reply at the next round, closes the link, drops
the models and returns; ``join(timeout)`` waits for that. The process must not exit while the
thread still holds the models: torch's C++ state torn down under a live thread aborts the
interpreter ("terminate called without an active exception", exit status 134).
"""

from __future__ import annotations

import queue
import threading
from abc import ABC, abstractmethod
from typing import Callable

from sfchat import UserError
from sfchat.config import Settings
from sfchat.events import CodeWanted, LinkState, RuntimeFailed
from sfchat.link.secure import SecretMismatch
from sfchat.node.connect import HeadDialer
from sfchat.node.head import Head, open_sources
from sfchat.params import Ask

STOP = object()  # the request that ends the thread
WATCH_S = 1.0  # how often an idle thread looks at its link
WATCH_DIAL_S = 30.0  # the most one idle dial of a lost link may take


class CodeNotGiven(Exception):
    """The wait for a pairing code ended without one: the reply was cancelled, or the runtime closed."""


def open_head(settings: Settings, on_event: Callable, ask_code: Callable[[str], str] | None = None) -> Head:
    """The default: what one-shot mode does (a relay link in relay mode, else in-process), the
    models checked before the tail is dialled (``head.open_sources``); ``ask_code(reason)`` gives
    another pairing code when the one in use is missing or wrong."""
    sources = open_sources(settings, on_event)
    dial = HeadDialer(settings, on_event, ask_code)
    return Head.open(settings, on_event, dial(), redial=dial, sources=sources)


class CudaThread(ABC):
    name = "sfchat-runtime"

    def __init__(self, settings: Settings, open_head: Callable = open_head, max_queue: int = 0):
        self.settings, self.open_head = settings, open_head
        self.requests: queue.Queue = queue.Queue(maxsize=max_queue)
        self.head: Head | None = None
        self.thread: threading.Thread | None = None
        self.loaded = threading.Event()
        self.load_error: UserError | None = None

    def start(self) -> None:
        self.thread = threading.Thread(target=self._main, name=self.name, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.requests.put(STOP)

    def join(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` s for the thread to end; True once it has (or never started).
        A thread still loading models finishes that first."""
        if self.thread is None:
            return True
        self.thread.join(timeout)
        return not self.thread.is_alive()

    # -- what a subclass does on the thread -------------------------------------------------------
    def open(self) -> Head:
        """The head, opened on the thread (a subclass may hand ``open_head`` more)."""
        return self.open_head(self.settings, self.on_event)

    def on_event(self, event) -> None:
        """Every event of loading and of the link (from the thread)."""

    @abstractmethod
    def serve(self, request) -> bool:
        """Handle one request; False ends the thread."""

    # -- the thread ------------------------------------------------------------------------------
    def _main(self) -> None:
        try:
            self.head = self.open()
        except BaseException as exc:  # phrased for the user; raised in the caller of ``start`` where it waits
            self.load_error = exc if isinstance(exc, UserError) else UserError(str(exc)) \
                if isinstance(exc, SecretMismatch) else UserError(f"loading failed: {type(exc).__name__}: {exc}")
            self.loaded.set()
            return
        self.loaded.set()
        try:
            while True:
                try:
                    request = self.requests.get(timeout=WATCH_S)
                except queue.Empty:
                    self._watch()
                    continue
                if request is STOP or not self.serve(request):
                    break
        finally:
            try:
                self.head.close()
            except Exception:
                pass
            self.on_event(LinkState("closed"))

    def _watch(self) -> None:
        try:
            self.head.watch(WATCH_DIAL_S)
        except Exception as exc:  # e.g. no pairing code given: the next message dials again
            self.on_event(LinkState("reconnecting", str(exc) or type(exc).__name__))


class RuntimeWorker(CudaThread):
    def __init__(self, settings: Settings, open_head: Callable = open_head):
        super().__init__(settings, open_head)
        self.cancelled = threading.Event()
        self.listener: Callable = lambda event: None
        self._code_given = threading.Condition()  # guards _code; notified by set_code, cancel and close
        self._code: str | None = None
        self._closing = self._replying = False

    # -- the interface the UI uses -------------------------------------------------------------
    def start(self, listener: Callable) -> None:  # type: ignore[override]
        self.listener = listener
        super().start()

    def submit(self, messages: list[dict], params: Ask) -> None:
        self.cancelled.clear()
        self.requests.put(("submit", messages, params))

    def cancel(self) -> None:
        self.cancelled.set()
        self._wake()

    def new_chat(self) -> None:
        self.requests.put(("new_chat",))

    def set_code(self, code: str) -> None:
        """The pairing code the person typed, for a runtime that asked with ``CodeWanted``."""
        with self._code_given:
            self._code = code
            self._code_given.notify_all()

    def close(self) -> None:
        self._closing = True
        self.cancelled.set()
        self.stop()
        self._wake()

    def _wake(self) -> None:
        with self._code_given:
            self._code_given.notify_all()

    # -- on the thread ---------------------------------------------------------------------------
    def on_event(self, event) -> None:
        self.listener(event)

    def open(self) -> Head:
        return self.open_head(self.settings, self.on_event, ask_code=self._ask_code)

    def _ask_code(self, reason: str) -> str:
        """Report CodeWanted and wait for ``set_code``; CodeNotGiven once closed (or cancelled in a reply)."""
        with self._code_given:
            self._code = None  # a code typed before this question answers none
        self.listener(CodeWanted(reason))
        with self._code_given:
            while self._code is None:
                if self._closing:
                    raise CodeNotGiven("the runtime was closed while waiting for the pairing code")
                if self._replying and self.cancelled.is_set():
                    raise CodeNotGiven("the reply was cancelled while waiting for the pairing code; the next "
                                       "message asks for it again")
                self._code_given.wait()
            code, self._code = self._code, None
        return code

    def _main(self) -> None:
        super()._main()
        if self.load_error is not None and not self._closing:
            self.listener(RuntimeFailed(str(self.load_error), fatal=True))

    def serve(self, request) -> bool:
        if request[0] == "new_chat":
            self.head.new_chat()
            return True
        self._replying = True
        try:
            self._reply(request[1], request[2])
        except CodeNotGiven as exc:
            if self._closing:
                return False
            self.listener(RuntimeFailed(str(exc)))
        except UserError as exc:
            self.listener(RuntimeFailed(str(exc)))
        except Exception as exc:
            self.listener(RuntimeFailed(f"{type(exc).__name__}: {exc}", fatal=True))
            return False
        finally:
            self._replying = False
        return True

    def _reply(self, messages: list[dict], params: Ask) -> None:
        for event in self.head.ask(messages, params.max_new_tokens, self.head.sampling(params.gen),
                                   self.cancelled.is_set):
            self.listener(event)
