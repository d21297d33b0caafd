"""The one thread that owns the head's models and CUDA, and the chat UI's runtime built on it.

Contract
--------
``CudaThread(settings, open_head)`` is the base of every front end that keeps a head alive (the
chat UI's ``RuntimeWorker``, the server's ``GenerationThread``): ``start()`` starts a daemon
thread that opens the head (``open_head(settings, on_event)``, by default ``open_head``: the
relay link in relay mode, in-process otherwise) and then takes requests from a queue, one at a
time, calling ``serve(request)`` for each (a subclass's), until ``stop()`` queues the end; then
it closes the link and reports ``LinkState("closed")``. CUDA graph state is thread-local and
one generation at a time is what the GPU can do: nothing but this thread touches the head.
``loaded`` is set once the head is open or failed to open (``load_error``, a ``UserError``).

``RuntimeWorker(settings)`` implements the runtime interface the chat UI drives.
``start(listener)`` starts the thread; every event (``LoadProgress``, ``LinkState``,
``RuntimeReady``, ``ReplyStarted``, ``TokensCommitted``, ``ReplyFinished``, ``RuntimeFailed``) is
delivered by calling ``listener`` from that thread. ``submit``, ``cancel``, ``new_chat`` and
``close`` never block: they queue a request or set a flag. The worker knows nothing of widgets.

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
from sfchat.events import LinkState, RuntimeFailed
from sfchat.node.connect import connect_relay
from sfchat.node.head import Head
from sfchat.node.prompts import make_sampling

STOP = object()  # the request that ends the thread


def open_head(settings: Settings, on_event: Callable) -> Head:
    """The default: what one-shot mode does (a relay link in relay mode, else in-process)."""
    return Head.open(settings, on_event, connect_relay(settings, on_event))


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
    def on_event(self, event) -> None:
        """Every event of loading and of the link (from the thread)."""

    @abstractmethod
    def serve(self, request) -> bool:
        """Handle one request; False ends the thread."""

    # -- the thread ------------------------------------------------------------------------------
    def _main(self) -> None:
        try:
            self.head = self.open_head(self.settings, self.on_event)
        except BaseException as exc:  # phrased for the user; raised in the caller of ``start`` where it waits
            self.load_error = exc if isinstance(exc, UserError) else \
                UserError(f"loading failed: {type(exc).__name__}: {exc}")
            self.loaded.set()
            return
        self.loaded.set()
        try:
            while (request := self.requests.get()) is not STOP and self.serve(request):
                pass
        finally:
            try:
                self.head.close()
            except Exception:
                pass
            self.on_event(LinkState("closed"))


class RuntimeWorker(CudaThread):
    def __init__(self, settings: Settings, open_head: Callable = open_head):
        super().__init__(settings, open_head)
        self.cancelled = threading.Event()
        self.listener: Callable = lambda event: None

    # -- the interface the UI uses -------------------------------------------------------------
    def start(self, listener: Callable) -> None:  # type: ignore[override]
        self.listener = listener
        super().start()

    def submit(self, messages: list[dict], params: dict) -> None:
        self.cancelled.clear()
        self.requests.put(("submit", messages, dict(params)))

    def cancel(self) -> None:
        self.cancelled.set()

    def new_chat(self) -> None:
        self.requests.put(("new_chat",))

    def close(self) -> None:
        self.cancelled.set()
        self.stop()

    # -- on the thread ---------------------------------------------------------------------------
    def on_event(self, event) -> None:
        self.listener(event)

    def _main(self) -> None:
        super()._main()
        if self.load_error is not None:
            self.listener(RuntimeFailed(str(self.load_error), fatal=True))

    def serve(self, request) -> bool:
        if request[0] == "new_chat":
            self.head.new_chat()
            return True
        try:
            self._reply(request[1], request[2])
        except UserError as exc:
            self.listener(RuntimeFailed(str(exc)))
        except Exception as exc:
            self.listener(RuntimeFailed(f"{type(exc).__name__}: {exc}", fatal=True))
            return False
        return True

    def _reply(self, messages: list[dict], params: dict) -> None:
        s = self.settings
        sampling = make_sampling(params.get("temperature", s.temperature), params.get("top_k", s.top_k),
                                 params.get("top_p", s.top_p), params.get("seed", s.seed))
        limit = int(params.get("max_new_tokens", s.max_new_tokens))
        for event in self.head.ask(messages, limit, sampling, self.cancelled.is_set):
            self.listener(event)
