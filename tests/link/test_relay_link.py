"""RelayLink, the blocking client the head and tail threads use, against a real relay on
loopback (run in a background thread, as the relay and the nodes are separate in production)."""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
import threading
import time

import pytest
from websockets.asyncio.client import connect

from sfchat import UserError
from sfchat.link import LinkClosed, PeerGone
from sfchat.link.relay import RelayLink

from threaded_relay import TOKEN, ThreadedRelay, relay  # noqa: F401  (fixture)


@pytest.fixture
def links(relay):
    """Factory for links that are closed after the test, whatever happens."""
    opened = []

    def open_link(role: str, session: str = "s", token: str = TOKEN) -> RelayLink:
        link = RelayLink(relay.url, token, session, role, connect_timeout=5)
        opened.append(link)
        return link

    yield open_link
    for link in opened:
        link.close()


def test_frames_cross_both_ways_in_order_from_concurrent_threads(links):
    head = links("head")
    assert not head.peer_present
    tail = links("tail")
    assert tail.peer_present
    head.wait_peer(5)
    rng = random.Random(7)
    down = [bytes([i % 256]) * rng.choice([1, 900, 70_000]) for i in range(200)] + [rng.randbytes(3 << 20)]
    up = [i.to_bytes(4, "big") * rng.choice([1, 5000]) for i in range(200)]
    senders = [threading.Thread(target=lambda: [head.send(f) for f in down]),
               threading.Thread(target=lambda: [tail.send(f) for f in up])]
    for thread in senders:
        thread.start()
    assert [tail.recv(10) for _ in down] == down
    assert [head.recv(10) for _ in up] == up
    for thread in senders:
        thread.join(10)


def test_wrong_token_is_a_user_error_about_the_token(links):
    with pytest.raises(UserError, match="token"):
        links("head", token="nope")


def test_busy_slot_is_a_user_error_with_the_relays_reason(links):
    links("tail", session="taken")
    with pytest.raises(UserError, match="session taken already has a tail"):
        links("tail", session="taken")


def test_an_address_over_its_share_of_sessions_is_a_user_error_with_the_relays_reason():
    server = ThreadedRelay(max_sessions_per_client=1)
    try:
        with RelayLink(server.url, TOKEN, "mine", "tail", connect_timeout=5):
            with pytest.raises(UserError, match=r"refused to join: too many sessions from your address \(1 at most\)"):
                RelayLink(server.url, TOKEN, "another", "tail", connect_timeout=5)
    finally:
        server.stop()
        server.dispose()


@pytest.mark.parametrize("url, message", [
    ("http://127.0.0.1:1", "ws://HOST:PORT"),
    ("ws://127.0.0.1:1", "cannot reach the relay"),
])
def test_bad_or_unreachable_url_is_a_user_error(url, message):
    with pytest.raises(UserError, match=message):
        RelayLink(url, TOKEN, "s", "head", connect_timeout=5)


@pytest.mark.parametrize("session, role", [("bad name", "head"), ("s", "verifier")])
def test_bad_session_or_role_is_a_user_error(relay, session, role):
    with pytest.raises(UserError):
        RelayLink(relay.url, TOKEN, session, role)


def test_peer_gone_then_a_new_tail_takes_over(links):
    head, tail = links("head"), links("tail")
    head.wait_peer(5)
    tail.send(b"before leaving")
    tail.close()
    assert head.recv(5) == b"before leaving"
    with pytest.raises(PeerGone):
        head.recv(5)
    assert not head.peer_present
    with pytest.raises(TimeoutError):
        head.recv(0.1)
    with pytest.raises(TimeoutError):
        head.wait_peer(0.1)
    second = links("tail")
    head.wait_peer(5)
    head.send(b"welcome back")
    assert second.recv(5) == b"welcome back"
    second.send(b"thanks")
    assert head.recv(5) == b"thanks"


def test_relay_shutdown_closes_the_link(relay, links):
    head, tail = links("head"), links("tail")
    head.wait_peer(5)
    relay.stop()
    with pytest.raises(LinkClosed, match="1001"):
        head.recv(5)
    with pytest.raises(LinkClosed):
        head.recv(5)  # and stays closed
    with pytest.raises(LinkClosed):
        head.send(b"anyone?")
    # The tail learns of the shutdown on its own connection, maybe after hearing the head left.
    with pytest.raises(LinkClosed):
        for _ in range(3):
            try:
                tail.recv(5)
            except PeerGone:
                pass
    assert not tail.peer_present
    with pytest.raises(LinkClosed):
        tail.wait_peer(5)


def test_an_idle_link_knows_it_is_closed_without_a_recv(relay, links):
    """An idle head calls no recv: the closing must show on the link by itself (it did only when
    the next message was sent, a minute later, as "link closed with code 1001")."""
    head = links("head")
    assert head.closed_reason is None
    relay.stop()
    deadline = time.monotonic() + 10
    while head.closed_reason is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert "1001" in head.closed_reason


def test_close_is_idempotent_and_final(links):
    head = links("head")
    head.close()
    head.close()
    with pytest.raises(LinkClosed):
        head.recv(1)
    with pytest.raises(LinkClosed):
        head.send(b"late")


IDLE_HEAD = """
import sys
from sfchat.link.relay import RelayLink
link = RelayLink(sys.argv[1], sys.argv[2], "idle", "head", connect_timeout=10)
print("ready", flush=True)
sys.stdin.read()  # never calls recv: idle until the test lets go
"""


def test_an_idle_node_buffers_a_bounded_number_of_bytes(relay):
    """A hostile tail (it has the relay token) sends 40 frames of 8 MiB to a head that reads
    nothing; the head keeps at most INBOX_BYTES plus a few frames, not all 320 MiB."""
    from relay_process import ENV, REPO, status_kib

    head = subprocess.Popen([sys.executable, "-c", IDLE_HEAD, relay.url, TOKEN], cwd=REPO, env=ENV,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert head.stdout.readline().strip() == "ready"
        base = status_kib(head.pid, "VmRSS")

        async def flood():
            async with connect(f"{relay.url}/session/idle?role=tail", proxy=None, compression=None,
                               additional_headers={"Authorization": f"Bearer {TOKEN}"}) as tail:
                for _ in range(40):
                    await tail.send(bytes(8 << 20))
                await asyncio.sleep(2.0)  # the relay delivers what the head is willing to read

        asyncio.run(asyncio.wait_for(flood(), 60))
        grown = status_kib(head.pid, "VmHWM") - base
    finally:
        head.stdin.close()
        head.wait(10)
    print(f"\nidle head grew by {grown / 1024:.0f} MiB under 320 MiB of frames")
    assert grown < 100 << 10, f"the idle head buffered {grown / 1024:.0f} MiB"


class HostileRelay:
    """A websocket server on loopback that welcomes a node, then floods it with relay events and
    sends one frame: what a relay's operator can do to an idle node."""

    def __init__(self, events: int):
        self.events = events
        self.sent = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        from websockets.asyncio.server import serve as ws_serve

        async def start():
            return await ws_serve(self._handle, "127.0.0.1", 0)

        self._server = asyncio.run_coroutine_threadsafe(start(), self._loop).result(10)
        self.url = f"ws://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def _handle(self, ws):
        await ws.send('{"event":"welcome","session":"s","peer_present":true}')
        for i in range(self.events):
            await ws.send('{"event":"peer_left","role":"tail"}')
            await ws.send('{"event":"dropped","reason":"no peer \\u001b[2J"}')
            await ws.send("not json" if i % 2 else '{"no":"event"}')
        await ws.send(b"the one frame")
        self.sent.set()
        await ws.wait_closed()

    def stop(self):
        self._server.close()
        asyncio.run_coroutine_threadsafe(self._server.wait_closed(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


def test_a_flood_of_relay_events_neither_grows_an_idle_node_nor_floods_its_log(caplog):
    """Round four: each peer_left queued a PeerGone no budget counted (an idle head 26 -> 149 MiB
    in 20 s) and each dropped event wrote a log line (29 MB in 10 s)."""
    hostile = HostileRelay(20_000)
    link = RelayLink(hostile.url, TOKEN, "s", "head", connect_timeout=10)
    try:
        with caplog.at_level("WARNING", logger="sfchat.link.relay"):
            assert hostile.sent.wait(120)
            deadline = time.monotonic() + 30
            while link._inbox.qsize() < 2 and time.monotonic() < deadline:
                time.sleep(0.05)  # the frame is read after the events
            assert link._inbox.qsize() == 2  # one PeerGone for 20,000 peer_left events, then the frame
            with pytest.raises(PeerGone):
                link.recv(5)
            assert link.recv(5) == b"the one frame"
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) <= 3 * 6  # the 1st, 10th, 100th ... of each kind
        assert not any("\x1b" in line for line in lines)
    finally:
        link.close()
        hostile.stop()
