"""The direct transport (``link.direct``) on loopback: addresses, frames both ways, one head at a
time, heads one after another, a port that refuses strangers who do not pair, bounded messages,
and the sealed pairing on top of it as on the relay."""

from __future__ import annotations

import asyncio
import threading

import pytest
from polling import WAIT, until
from threaded_relay import relay  # noqa: F401  (the relay fixture)
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from sfchat import UserError
from sfchat.link import LinkClosed, PeerGone, direct
from sfchat.link.direct import DirectLink, DirectServer, Unreachable, address
from sfchat.link.pairing import Passcode
from sfchat.link.relay import MAX_FRAME_BYTES
from sfchat.link.resume import Resumption
from sfchat.link.secure import SecureLink, secure

CODE = "7-crossover-clockwork"


@pytest.fixture
def server():
    s = DirectServer("127.0.0.1", 0, trusted=lambda: True)
    yield s
    s.close()


def recv_frame(link, wait: float = WAIT) -> bytes:
    """The next frame, past ``PeerGone``s of heads that left before."""
    while True:
        try:
            return link.recv(wait)
        except PeerGone:
            continue


@pytest.mark.parametrize("text, expected", [("127.0.0.1:7860", ("127.0.0.1", 7860)),
                                            ("box.example.org:1", ("box.example.org", 1)),
                                            ("[::1]:65535", ("::1", 65535)), (" 10.0.0.2:80 ", ("10.0.0.2", 80))])
def test_an_address_is_host_and_port(text, expected):
    assert address(text) == expected


@pytest.mark.parametrize("text", ["", "7860", "host", "host:", ":7860", "host:0", "host:65536", "host:-1",
                                  "host:http", "::1:7860", "a b:80"])
def test_a_bad_address_is_a_clear_error(text):
    with pytest.raises(UserError, match="--direct takes HOST:PORT"):
        address(text)


def test_a_listening_address_may_ask_for_any_free_port():
    assert address("0.0.0.0:0", "--listen", listen=True) == ("0.0.0.0", 0)
    with pytest.raises(UserError, match="--listen takes HOST:PORT"):
        address("0.0.0.0", "--listen", listen=True)


def test_frames_cross_both_ways_in_order(server):
    assert server.port > 0 and not server.peer_present
    with DirectLink("127.0.0.1", server.port) as head:
        assert head.peer_present and head.closed_reason is None
        server.wait_peer(WAIT)
        for n in range(20):
            head.send(b"frame %d" % n)
        assert [server.recv(WAIT) for _ in range(20)] == [b"frame %d" % n for n in range(20)]
        assert server.last_arrival is not None
        server.send(b"x" * 100_000)
        assert head.recv(WAIT) == b"x" * 100_000
        with pytest.raises(TimeoutError):
            head.recv(0.05)


def test_heads_come_one_after_another_and_a_second_at_once_is_refused(server):
    first = DirectLink("127.0.0.1", server.port)
    server.wait_peer(WAIT)
    with pytest.raises(Unreachable, match="serves another head"):
        DirectLink("127.0.0.1", server.port)
    first.send(b"one")
    assert server.recv(WAIT) == b"one"
    first.close()
    with pytest.raises(PeerGone):
        server.recv(WAIT)
    assert until(lambda: not server.peer_present)
    server.send(b"to nobody")  # dropped, as the relay drops it
    with DirectLink("127.0.0.1", server.port) as second:
        second.send(b"two")
        assert recv_frame(server) == b"two"
        server.send(b"back")
        assert second.recv(WAIT) == b"back"


def test_a_tail_that_goes_away_is_a_closed_link_for_the_head():
    server = DirectServer("127.0.0.1", 0, trusted=lambda: True)
    head = DirectLink("127.0.0.1", server.port)
    server.close()
    with pytest.raises(LinkClosed):
        head.recv(WAIT)
    assert head.closed_reason and not head.peer_present
    with pytest.raises(LinkClosed):
        head.send(b"late")
    head.close()
    with pytest.raises(LinkClosed):
        server.recv(0.1)


def test_a_closed_port_is_unreachable_at_once():
    port = DirectServer("127.0.0.1", 0)
    number = port.port
    port.close()
    with pytest.raises(Unreachable, match=f"cannot reach the tail at 127.0.0.1:{number}"):
        DirectLink("127.0.0.1", number, connect_timeout=WAIT)


def test_a_port_taken_is_a_clear_error(server):
    with pytest.raises(UserError, match=f"cannot listen on 127.0.0.1:{server.port}"):
        DirectServer("127.0.0.1", server.port)


def test_a_connection_that_does_not_pair_in_time_is_closed(monkeypatch):
    monkeypatch.setattr(direct, "PAIR_WAIT_S", 0.3)
    server = DirectServer("127.0.0.1", 0)  # nothing ever pairs: trusted() stays False
    try:
        stranger = DirectLink("127.0.0.1", server.port)
        with pytest.raises(LinkClosed, match="4408"):
            stranger.recv(WAIT)
        stranger.close()
        assert until(lambda: not server.peer_present)
        with DirectLink("127.0.0.1", server.port) as honest:  # the place is free again
            assert honest.peer_present
    finally:
        server.close()


def test_a_message_over_the_bound_closes_that_connection_only(server):
    async def oversized():
        ws = await connect(f"ws://127.0.0.1:{server.port}/", max_size=None, compression=None)
        try:
            await ws.send(b"\0" * (MAX_FRAME_BYTES + 1))
        except ConnectionClosed:
            pass  # closed while it sent
        await ws.wait_closed()
        return ws.close_code

    assert asyncio.run(oversized()) == 1009
    with DirectLink("127.0.0.1", server.port) as head:
        head.send(b"after")
        assert recv_frame(server) == b"after"


def test_sealed_and_paired_over_a_direct_link_as_over_the_relay(server):
    """The tail's SecureLink pairs on the server as on its relay connection (in its own thread, as
    the listener runs it): a code the first time, the resumption secret it left the second."""
    tail = SecureLink(server, Passcode(CODE), "direct", "tail", log=lambda line: None, resumption=Resumption())
    taken: list[bytes] = []

    def echo():
        while True:
            try:
                frame = tail.recv(WAIT)
            except PeerGone:
                continue
            except (LinkClosed, TimeoutError):
                return
            taken.append(frame)
            tail.send(b"echo " + frame)

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()
    resumption = Resumption()
    try:
        for code, how in ((CODE, "code"), (None, "resume")):  # no code the second time
            head = secure(DirectLink("127.0.0.1", server.port), code, "direct", "head", timeout=WAIT,
                          resumption=resumption)
            try:
                assert head.paired_by == how
                head.send(how.encode())
                assert head.recv(WAIT) == b"echo " + how.encode()
            finally:
                head.close()
            assert until(lambda: not server.peer_present)
    finally:
        server.close()
        thread.join(WAIT)
    assert taken == [b"code", b"resume"]


def test_a_dialer_without_a_relay_says_that_the_tail_cannot_be_reached():
    from sfchat.link.dialer import Dialer

    closed = DirectServer("127.0.0.1", 0)
    number = closed.port
    closed.close()
    events: list = []
    dialer = Dialer(None, "direct", CODE, on_event=events.append,
                    direct=lambda timeout: DirectLink("127.0.0.1", number, connect_timeout=timeout),
                    direct_where=f"127.0.0.1:{number}")
    with pytest.raises(Unreachable, match="cannot reach the tail"):
        dialer(WAIT)
    assert dialer.via == "direct" and not events


def test_a_tail_at_two_places_serves_one_head_at_a_time_from_either(relay_url):
    """The relay slot and the listening port behind one listener, sealed with one code: a head
    served directly holds the tail; a head paired through the relay meanwhile is told it is busy;
    once the first leaves, the relay's head is served."""
    from relay_process import TOKEN
    from recorder import Recorder

    from sfchat.link.dialer import Dialer
    from sfchat.link.listener import Listener, sealed
    from sfchat.link.relay import RelayLink

    passcode, resumption, lines, handler = Passcode(CODE), Resumption(), [], Recorder()
    server = DirectServer("127.0.0.1", 0)
    relay_dial = sealed(lambda: RelayLink(relay_url, TOKEN, "two-places", "tail"), passcode, "two-places", resumption,
                        lines.append)
    direct_sealed = sealed(lambda: server, passcode, "two-places", resumption, lines.append)

    def direct_dial():
        link = direct_sealed()
        server.trusted = lambda: link.keyed
        return link

    listener = Listener([relay_dial, direct_dial], handler, log=lines.append, poll=lambda: 0.2)
    thread = threading.Thread(target=listener.serve, daemon=True)
    thread.start()

    def through_relay():
        return Dialer(lambda timeout: RelayLink(relay_url, TOKEN, "two-places", "head", connect_timeout=timeout),
                      "two-places", CODE)(WAIT)

    try:
        first = secure(DirectLink("127.0.0.1", server.port), CODE, "two-places", "head", timeout=WAIT)
        first.send(b"one")
        assert first.recv(WAIT) == b"echo one"
        second = through_relay()
        second.send(b"two")
        assert until(lambda: any("serves another head" in said for said in handler.said)), handler.said
        first.send(b"three")
        assert first.recv(WAIT) == b"echo three"  # the served head went on
        first.close()
        second.close()
        assert until(lambda: "gone" in handler.said)
        third = through_relay()
        third.send(b"four")
        assert third.recv(WAIT) == b"echo four"
        third.close()
    finally:
        listener.close()
        thread.join(WAIT)
    assert handler.taken == [b"one", b"three", b"four"]


def test_a_tail_at_two_places_keeps_serving_its_direct_head_when_the_relay_goes(relay):
    """The relay stops while a head is served through the port: that head goes on, and the
    listener dials the relay again in the background (until it is closed)."""
    from recorder import Recorder
    from threaded_relay import TOKEN

    from sfchat.link.listener import Listener
    from sfchat.link.relay import RelayLink

    server, lines, handler = DirectServer("127.0.0.1", 0, trusted=lambda: True), [], Recorder()
    listener = Listener([lambda: RelayLink(relay.url, TOKEN, "gone", "tail"), lambda: server], handler,
                        log=lines.append, poll=lambda: 0.2)
    thread = threading.Thread(target=listener.serve, daemon=True)
    thread.start()
    try:
        with DirectLink("127.0.0.1", server.port) as head:  # --insecure: plain frames on both places
            head.send(b"one")
            assert head.recv(WAIT) == b"echo one"
            relay.stop()
            assert until(lambda: any("relay connection lost" in line for line in lines)), lines
            head.send(b"two")
            assert head.recv(WAIT) == b"echo two"
    finally:
        listener.close()
        thread.join(WAIT)
    assert not thread.is_alive() and handler.taken == [b"one", b"two"]
