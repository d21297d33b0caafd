"""The chat screen's dialer (``remote.client.ChatDialer``, ``link.dialer.Dialer`` in the screen's
words): a host that forgot the screen gets no code attempt; the person is asked, in the screen's words."""

from __future__ import annotations

import queue
import threading

from polling import WAIT, until
from relay_process import TOKEN

from sfchat.events import CodeWanted, LinkState
from sfchat.link.pairing import Passcode
from sfchat.link.relay import RelayLink
from sfchat.link.resume import Resumption
from sfchat.link.secure import SecureLink
from sfchat.remote.client import RemoteRuntime

CODE = "4-crossover-clockwork"
SESSION = "dialled-chat"


def next_event(events: queue.Queue, kind: type, where=lambda event: True):
    while True:
        event = events.get(timeout=WAIT)
        if isinstance(event, kind) and where(event):
            return event


class PairingHost:
    """The host's end of the chat link that answers pairings only (the chat itself is not this test's)."""

    def __init__(self, url: str) -> None:
        self.passcode = Passcode(CODE)
        self.link = SecureLink(RelayLink(url, TOKEN, SESSION, "tail"), self.passcode, SESSION, "tail",
                               resumption=Resumption())
        self.stopped = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self.stopped.is_set():
            try:
                self.link.recv(0.1)
            except TimeoutError:
                continue
            except Exception:
                if self.stopped.is_set():
                    return
                self.link.restart()

    def wait_keyed(self) -> bool:
        return until(lambda: self.link.keyed)

    def leave(self) -> None:
        self.stopped.set()
        self.link.close()


def test_a_host_that_forgot_the_screen_is_tried_with_no_code_and_the_person_is_asked(relay_url):
    first = PairingHost(relay_url)
    client = RemoteRuntime(lambda: RelayLink(relay_url, TOKEN, SESSION, "head"), CODE, SESSION)
    events: queue.Queue = queue.Queue()
    client.start(events.put)
    second = None
    try:
        assert first.wait_keyed()
        first.leave()  # the host restarts in a new notebook session: no resumption secret
        next_event(events, LinkState, lambda e: e.state == "waiting" and "sfchat --offer-chat" in e.detail)
        second = PairingHost(relay_url)
        asked = next_event(events, CodeWanted)
        assert "no longer knows this screen" in asked.reason
        assert second.passcode.failures == 0 and not second.link.keyed  # no code of ours was there to guess at
        client.set_code(CODE)
        assert second.wait_keyed()
    finally:
        client.close()
        first.leave()
        if second is not None:
            second.leave()
    assert client.join(WAIT)
