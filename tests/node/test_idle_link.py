"""An idle head notices a lost relay link by itself and says what the relay answered when dialled
again (found by a new user: after the relay restarted with a new token, the head kept showing
"connected" until the next message, then said only "link closed with code 1001")."""

from __future__ import annotations

import queue
import threading
import time

from sfchat.events import LinkState, RuntimeFailed, RuntimeReady
from sfchat.node import tail as tail_node
from sfchat.node.worker import RuntimeWorker

from threaded_relay import ThreadedRelay
from relay_heads import settings


def next_event(events: queue.Queue, wanted, timeout: float = 60):
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            event = events.get(timeout=0.1)
        except queue.Empty:
            continue
        seen.append(event)
        assert not (isinstance(event, RuntimeFailed) and event.fatal), event
        if wanted(event):
            return event
    raise AssertionError(f"no such event within {timeout} s; seen: {seen}")


def test_an_idle_head_says_the_restarted_relay_refused_its_token(zoo):
    relay = ThreadedRelay()
    model = zoo["llama-tied"]
    ended = []

    def run_tail():
        try:
            tail_node.serve(settings(relay.url, "idle", model), once=True)
        except Exception as exc:
            ended.append(exc)

    tail = threading.Thread(target=run_tail, daemon=True)
    tail.start()
    events = queue.Queue()
    worker = RuntimeWorker(settings(relay.url, "idle", model))
    worker.start(events.put)
    restarted = None
    try:
        next_event(events, lambda e: isinstance(e, RuntimeReady))
        relay.stop()
        restarted = ThreadedRelay(token="the-relays-new-token", port=relay.port)
        lost = next_event(events, lambda e: isinstance(e, LinkState) and e.state == "reconnecting")
        assert "1001" in lost.detail  # the relay's close, named as soon as it happens
        refused = next_event(events, lambda e: isinstance(e, LinkState) and "refused the token" in e.detail)
        assert refused.state == "reconnecting" and relay.url in refused.detail
    finally:
        worker.close()
        assert worker.join(30)
        tail.join(30)
        relay.dispose()
        if restarted is not None:
            restarted.stop()
            restarted.dispose()
