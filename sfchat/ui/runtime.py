"""What the chat UI needs from its runtime, and the message that carries the runtime's events.

Contract: a runtime (``sfchat.node.worker.RuntimeWorker``, or a fake in the tests) implements
``Runtime``: every call returns at once and is thread-safe. ``start(listener)`` begins loading;
from then on the runtime reports every ``sfchat.events`` event by calling ``listener`` from its
own thread. ``submit`` asks for a reply to ``messages`` (the whole conversation) with the
generation parameters ``params`` (a ``params.Ask``), ``cancel`` stops it, ``new_chat`` drops the
cached context, ``set_code`` answers a ``CodeWanted`` with the pairing code the user typed,
``close`` ends the runtime. ``RuntimeEvent`` is the Textual message
the app's listener wraps an event in, to hand it to the app's thread with ``post_message``.
Torch-free: nothing here knows how a runtime is built.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from textual.message import Message

from sfchat.events import Event
from sfchat.params import Ask


class Runtime(Protocol):
    def start(self, listener: Callable[[Event], None]) -> None: ...
    def submit(self, messages: list[dict], params: Ask) -> None: ...
    def cancel(self) -> None: ...
    def new_chat(self) -> None: ...
    def set_code(self, code: str) -> None: ...
    def close(self) -> None: ...


class RuntimeEvent(Message):
    """A runtime event, carried from the runtime thread to the app's thread."""

    def __init__(self, event: Event) -> None:
        super().__init__()
        self.event = event
