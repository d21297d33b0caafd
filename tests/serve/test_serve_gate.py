"""``sfchat --serve`` under connections that never finish a request: real sockets, a real server.

A slowloris holds sockets open after half a request; with uvicorn's socket-counting
``limit_concurrency`` 80 of them (67 with ``--max-queue 4``) made the server answer 503 to
everyone, before the key check. Here idle sockets count nowhere, each waits under a deadline it
cannot extend, one address cannot keep more than its share waiting, requests are counted per
client and in total, and every refusal shows in ``/metrics``.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import openai
import pytest
from serve_clients import KEY, Gate, ask, client, metrics, serving, settings_for, wait_until

from sfchat.serve.app import ServeOptions
from sfchat.serve.main import Server

AUTH = {"Authorization": f"Bearer {KEY}"}
HALF_REQUEST = b"POST /v1/chat/completions HTTP/1.1\r\nHost: sfchat\r\nContent-Type: appl"


def refused(srv: Server, reason: str) -> float:
    return metrics(srv).get(("sfchat_http_refused_total", frozenset({("reason", reason)})), 0.0)


def dial(srv: Server, source: str = "127.0.0.1", send: bytes = b"") -> socket.socket:
    sock = socket.socket()
    sock.bind((source, 0))
    sock.connect(srv.sock.getsockname()[:2])
    if send:
        sock.sendall(send)
    return sock


def state(sock: socket.socket) -> str:
    """'open' (nothing to read), 'closed', or what the server wrote before closing."""
    try:
        data = sock.recv(65536, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return "open"
    except ConnectionError:
        return "closed"
    return data.decode("latin-1") if data else "closed"


def ended(sock: socket.socket, timeout: float = 60.0) -> str:
    """What the server wrote before it closed ``sock`` ('' for nothing); fails if it stays open."""
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionError:
        pass
    except socket.timeout:
        raise AssertionError(f"the server kept the connection open for {timeout} s") from None
    return data.decode("latin-1")


def held_request(srv: Server, source: str, path: str = "/v1/chat/completions") -> socket.socket:
    """A request with the key whose headers are complete and whose body never is."""
    return dial(srv, source, f"POST {path} HTTP/1.1\r\nHost: sfchat\r\nAuthorization: Bearer {KEY}\r\n"
                             f"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{{\"mess".encode())


# -- the attack of the issue: idle half-requests, then clients with and without the key --------------
@pytest.fixture(scope="module")
def keyed(zoo):
    yield from serving(zoo, api_key=KEY, max_queue=4, header_timeout=60)


def test_half_requests_do_not_crowd_out_a_client_with_the_key(keyed):
    srv = keyed
    socks = [dial(srv, "127.0.0.2", HALF_REQUEST) for _ in range(80)]
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as h:
            assert h.get("/v1/models", headers=AUTH).status_code == 200
            bare = h.get("/v1/models")
            assert bare.status_code == 401 and "no API key" in bare.json()["error"]["message"]
        reply = ask(client(srv, KEY), srv, max_tokens=3)
        assert reply.usage.completion_tokens >= 1
        # one address may keep 64 connections waiting: the 16 oldest made room for the newest
        wait_until(lambda: refused(srv, "client_connections") == 16, "the oldest half-requests to be closed")
        assert "open" not in [state(s) for s in socks[:16]]
        assert [state(s) for s in socks[16:]] == ["open"] * 64  # the others were served while these stay open
    finally:
        for s in socks:
            s.close()
    m = metrics(srv)
    assert m[("sfchat_http_requests_total", frozenset({("route", "/v1/models"), ("code", "401")}))] == 1
    assert ("sfchat_http_requests_total", frozenset({("route", "/v1/models"), ("code", "503")})) not in m


# -- deadlines that a peer cannot extend --------------------------------------------------------------
@pytest.fixture(scope="module")
def timed(zoo):
    yield from serving(zoo, api_key=KEY, header_timeout=1.5, body_timeout=1.5)


def trickle(sock: socket.socket, data: bytes) -> threading.Thread:
    """Send ``data`` one byte every 0.1 s until the server closes ``sock``."""
    def run():
        try:
            for i in range(len(data)):
                sock.send(data[i:i + 1])
                time.sleep(0.1)
        except OSError:
            pass

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_connection_waits_for_its_request_headers_under_a_deadline(timed):
    srv = timed
    before = {r: refused(srv, r) for r in ("idle_timeout", "header_timeout")}
    idle = dial(srv)
    slow = dial(srv, send=b"POST /v1/chat/completions HTTP/1.1\r\n")
    sender = trickle(slow, b"X-Padding: " + b"a" * 600)  # a byte every 0.1 s: a minute of headers
    assert ended(idle) == ""  # nothing had come: closed without a word
    answer = ended(slow)
    assert answer.startswith("HTTP/1.1 408") and "the request headers did not arrive in time" in answer
    sender.join(10)
    assert refused(srv, "idle_timeout") >= before["idle_timeout"] + 1
    assert refused(srv, "header_timeout") == before["header_timeout"] + 1
    for s in (idle, slow):
        s.close()


def test_a_kept_alive_connection_is_closed_when_idle(timed):
    sock = dial(timed, send=f"GET /v1/models HTTP/1.1\r\nHost: sfchat\r\nAuthorization: Bearer {KEY}\r\n\r\n".encode())
    answer = ended(sock)  # the answer, then the close after the idle deadline
    assert answer.startswith("HTTP/1.1 200") and '"object":"list"' in answer
    sock.close()


def test_a_request_body_arrives_under_a_deadline(timed):
    srv = timed
    before = refused(srv, "body_timeout")
    sock = held_request(srv, "127.0.0.1")
    sender = trickle(sock, b"a" * 600)
    head, _, body = ended(sock).partition("\r\n\r\n")
    assert head.startswith("HTTP/1.1 408") and "connection: close" in head.lower()
    assert json.loads(body)["error"]["message"] == "the request body did not arrive within 1.5 s of its headers"
    sender.join(10)
    sock.close()
    assert refused(srv, "body_timeout") == before + 1
    assert metrics(srv)[("sfchat_http_requests_total",
                         frozenset({("route", "/v1/chat/completions"), ("code", "408")}))] == 1
    assert ask(client(srv, KEY), srv, max_tokens=2).usage.completion_tokens >= 1


# -- limits that count requests, per client and in total ----------------------------------------------
@pytest.fixture(scope="module")
def limited(zoo):
    yield from serving(zoo, api_key=KEY, max_requests=4, max_requests_per_client=2, max_waiting_per_client=3)


def local_client(srv: Server, source: str) -> httpx.Client:
    return httpx.Client(base_url=srv.url, headers=AUTH, timeout=30,
                        transport=httpx.HTTPTransport(local_address=source))


@pytest.fixture(scope="module")
def busy(zoo):
    """Requests stay in progress while their generation waits at the test's gate."""
    gate = Gate()
    srv = Server(settings_for(zoo), ServeOptions(port=0, api_key=KEY, max_queue=8, max_requests=4,
                                                 max_requests_per_client=2), open_head=gate.load).start()
    yield srv, gate
    for _ in range(1000):
        gate.permits.release()
    srv.close()


def streamed_request(srv: Server, source: str) -> socket.socket:
    """A whole request with the key, whose reply streams while its generation is held."""
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 50, "stream": True}).encode()
    return dial(srv, source, f"POST /v1/chat/completions HTTP/1.1\r\nHost: sfchat\r\nAuthorization: Bearer {KEY}\r\n"
                             f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)


def test_requests_in_progress_are_limited_per_client_and_in_total(busy):
    srv, gate = busy
    gate.drain()
    first = [streamed_request(srv, "127.0.0.2") for _ in range(2)]
    held = first
    try:
        wait_until(lambda: metrics(srv)[("sfchat_http_requests_in_progress", frozenset())] == 3,
                   "two held requests (and this scrape) to be in progress")
        with local_client(srv, "127.0.0.2") as same, local_client(srv, "127.0.0.1") as other:
            r = same.get("/v1/models")
            assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_requests"
            assert "your address has 2 requests in progress" in r.json()["error"]["message"]
            assert other.get("/v1/models").status_code == 200  # another client is served
            held = first + [streamed_request(srv, "127.0.0.3") for _ in range(2)]
            wait_until(lambda: other.get("/v1/models").status_code == 503, "the total limit to be reached")
            error = other.get("/v1/models").json()["error"]
            assert error["code"] == "server_busy" and "4 requests in progress" in error["message"]
            for s in held:
                s.close()
            wait_until(lambda: other.get("/v1/models").status_code == 200, "the held requests to end")
        assert refused(srv, "client_requests") == 1 and refused(srv, "requests") >= 2
    finally:
        for s in held:
            s.close()


@pytest.fixture(scope="module")
def bodies(zoo):
    yield from serving(zoo, api_key=KEY, max_requests=4, max_requests_per_client=2, max_bodies_per_client=3)


def test_half_sent_bodies_hold_no_request_slot_and_are_bounded_per_client(bodies):
    """Round four: two addresses trickling bodies kept every other client at 503 (0 of 18 honest
    requests served): a request counted once its headers were in. Now it counts once its body is
    complete, and bodies in flight are bounded apart, per client (3 here) and in all."""
    srv = bodies
    before = refused(srv, "client_bodies")
    trickling = [held_request(srv, source) for source in ("127.0.0.2", "127.0.0.3") for _ in range(5)]
    try:
        wait_until(lambda: refused(srv, "client_bodies") == before + 4, "each address's oldest bodies to be closed")
        states = [state(s) for s in trickling]
        assert states.count("open") == 6  # three bodies in flight per address, the oldest others closed:
        assert sum(s.startswith("HTTP/1.1 503") and "too many request bodies from your address" in s
                   for s in states) == 4
        with local_client(srv, "127.0.0.1") as honest:
            served = [honest.get("/v1/models").status_code for _ in range(6)]
        assert served == [200] * 6
        with openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=60,
                           http_client=local_client(srv, "127.0.0.4")) as c:
            assert ask(c, srv, max_tokens=2).usage.completion_tokens >= 1
    finally:
        for s in trickling:
            s.close()


def test_idle_connections_of_one_address_leave_the_others_alone(limited):
    srv = limited
    before = refused(srv, "client_connections")
    crowd = [dial(srv, "127.0.0.4", HALF_REQUEST) for _ in range(10)]  # 3 may wait from one address
    honest = dial(srv, "127.0.0.5", HALF_REQUEST)
    try:
        wait_until(lambda: refused(srv, "client_connections") == before + 7, "the crowd's oldest to be closed")
        assert [state(s) for s in crowd[7:]] == ["open"] * 3 and state(honest) == "open"
        with openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=60,
                           http_client=local_client(srv, "127.0.0.4")) as c:
            assert ask(c, srv, max_tokens=2).usage.completion_tokens >= 1  # the newest of the crowd
    finally:
        for s in crowd + [honest]:
            s.close()


# -- a client that hangs up mid-body, a request with two lengths, IPv6 clients ---------------------------
def test_a_client_that_hangs_up_mid_body_is_a_closed_client(bodies):
    """Round four: an unhandled ClientDisconnect, a 2.8 KB traceback per hang-up and a 500 in /metrics."""
    import logging

    srv = bodies
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("uvicorn.error")
    logger.addHandler(handler)
    try:
        for _ in range(3):
            held_request(srv, "127.0.0.5").close()
        key = ("sfchat_http_requests_total", frozenset({("route", "/v1/chat/completions"), ("code", "499")}))
        wait_until(lambda: metrics(srv).get(key, 0) >= 3, "the hang-ups to be counted as closed clients")
    finally:
        logger.removeHandler(handler)
    m = metrics(srv)
    assert not any(name == "sfchat_http_requests_total" and ("code", "500") in labels for name, labels in m)
    assert not [r for r in records if r.levelno >= logging.WARNING], [r.getMessage() for r in records]


def test_a_request_with_two_lengths_is_refused_and_nothing_smuggled_after_it_is_answered(bodies):
    srv = bodies
    auth = f"Authorization: Bearer {KEY}\r\n"
    sock = dial(srv, send=(f"POST /v1/chat/completions HTTP/1.1\r\nHost: sfchat\r\n{auth}Content-Length: 4\r\n"
                           f"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
                           f"GET /v1/models HTTP/1.1\r\nHost: sfchat\r\n{auth}\r\n").encode())
    answer = ended(sock)
    sock.close()
    assert answer.startswith("HTTP/1.1 400") and answer.count("HTTP/1.1 ") == 1, answer
    assert "Content-Length or Transfer-Encoding, not both" in answer and '"object":"list"' not in answer
    assert refused(srv, "framing") >= 1


def test_ipv6_clients_count_by_their_64():
    """Rotating addresses inside one /64 (what one host is given) does not make one client many."""
    import asyncio

    from sfchat.serve.app import Guard
    from sfchat.serve.gate import client_key
    from sfchat.serve.metrics import ServerMetrics

    assert client_key("2001:db8:1:2:aaaa::1") == client_key("2001:db8:1:2:ffff::9") == "2001:db8:1:2::/64"
    assert client_key("2001:db8:1:3::1") != client_key("2001:db8:1:2::1")
    assert client_key("::ffff:10.0.0.1") == "10.0.0.1" and client_key("10.0.0.2") == "10.0.0.2"

    async def scenario():
        release = asyncio.Event()

        async def app(scope, receive, send):
            await release.wait()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b""})

        guard = Guard(app, ServeOptions(max_requests=8, max_requests_per_client=1), ServerMetrics())
        statuses = []

        async def request(host):
            async def receive():
                return {"type": "http.request", "body": b"", "more_body": False}

            async def send(message):
                if message["type"] == "http.response.start":
                    statuses.append((host, message["status"]))

            scope = {"type": "http", "path": "/v1/models", "headers": [], "client": (host, 1234)}
            await guard(scope, receive, send)

        first = asyncio.ensure_future(request("2001:db8::1"))
        await asyncio.sleep(0.1)
        await request("2001:db8::2")  # the same /64: its one request is in progress
        other = asyncio.ensure_future(request("2001:db8:0:1::2"))  # another /64: in progress beside the first
        await asyncio.sleep(0.1)
        release.set()
        await asyncio.gather(first, other)
        return statuses

    statuses = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert sorted(statuses) == [("2001:db8:0:1::2", 200), ("2001:db8::1", 200), ("2001:db8::2", 429)]
