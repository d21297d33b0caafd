"""The relay server over loopback: pairing, verbatim ordered forwarding, refusals, limits and
emulated RTT (the command line, its banner and shutdown: test_relay_cli.py). Raw websockets
clients speak to it, so these tests pin the wire contract documented in relay/server.py
(RelayLink has its own tests)."""

from __future__ import annotations

import asyncio
import random
import statistics
import time

import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from relay.server import RelayConfig, serve

from relay_dial import TOKEN, dial, event, pair, run


def config(**overrides) -> RelayConfig:
    return RelayConfig(token=TOKEN, host="127.0.0.1", port=0, **overrides)


def frames(seed: int, n: int) -> list[bytes]:
    rng = random.Random(seed)
    sizes = [rng.choice([1, 17, 1000, 40_000, 300_000]) for _ in range(n)]
    for i in (5, n // 2, n - 1):
        sizes[i] = 3 << 20
    return [i.to_bytes(4, "little") + rng.randbytes(size) for i, size in enumerate(sizes)]


async def exchange(head: ClientConnection, tail: ClientConnection, n: int = 300, seed: int = 0) -> None:
    """Send ``n`` frames each way at once; both sides must get the other's frames exactly."""
    down, up = frames(seed, n), frames(seed + 1, n)

    async def send_all(ws, items):
        for item in items:
            await ws.send(item)

    async def recv_all(ws, count):
        return [await ws.recv() for _ in range(count)]

    _, _, got_down, got_up = await asyncio.gather(
        send_all(head, down), send_all(tail, up), recv_all(tail, n), recv_all(head, n))
    assert got_down == down
    assert got_up == up


def test_head_and_tail_exchange_frames_verbatim_and_in_order():
    async def scenario():
        async with await serve(config()) as relay:
            head, tail = await pair(relay.port, "chat-1")
            await exchange(head, tail)
            await head.close()
            await tail.close()
    run(scenario())


@pytest.mark.parametrize("token", ["wrong", "", None])
def test_wrong_or_missing_token_is_refused_with_401(token):
    async def scenario():
        async with await serve(config()) as relay:
            with pytest.raises(InvalidStatus) as refused:
                await dial(relay.port, "s", "head", token=token)
            assert refused.value.response.status_code == 401
    run(scenario())


@pytest.mark.parametrize("target", [
    "/session/s?role=middle", "/session/s", "/session/s?role=head&role=tail", "/other/s?role=head",
    "/session/bad%20name?role=head", f"/session/{'x' * 65}?role=head", "/session/?role=head",
])
def test_bad_request_target_is_refused_with_400(target):
    async def scenario():
        async with await serve(config()) as relay:
            with pytest.raises(InvalidStatus) as refused:
                await connect(f"ws://127.0.0.1:{relay.port}{target}", proxy=None,
                              additional_headers={"Authorization": f"Bearer {TOKEN}"})
            assert refused.value.response.status_code == 400
    run(scenario())


def test_second_tail_is_refused_with_409_and_the_pair_keeps_working():
    async def scenario():
        async with await serve(config()) as relay:
            head, tail = await pair(relay.port, "busy")
            with pytest.raises(InvalidStatus) as refused:
                await dial(relay.port, "busy", "tail")
            assert refused.value.response.status_code == 409
            assert refused.value.response.body.decode().strip() == "session busy already has a tail"
            await exchange(head, tail, n=40)
    run(scenario())


def test_session_limit_is_refused_with_503():
    async def scenario():
        async with await serve(config(max_sessions=1)) as relay:
            await dial(relay.port, "first", "head")
            with pytest.raises(InvalidStatus) as refused:
                await dial(relay.port, "second", "head")
            assert refused.value.response.status_code == 503
    run(scenario())


@pytest.mark.parametrize("offence, code", [("text", 1003), ("oversize", 1009)])
def test_misbehaving_connection_is_closed_alone(offence, code):
    async def scenario():
        async with await serve(config(max_frame_bytes=4 << 20)) as relay:
            good_head, good_tail = await pair(relay.port, "good")
            bad_head, bad_tail = await pair(relay.port, "bad")
            await bad_head.send("hello" if offence == "text" else bytes(5 << 20))
            with pytest.raises(ConnectionClosed):
                await asyncio.wait_for(bad_head.recv(), 5)
            assert bad_head.close_code == code and bad_head.close_reason
            assert await event(bad_tail) == {"event": "peer_left", "role": "head"}
            await exchange(good_head, good_tail, n=60)
    run(scenario())


def test_frames_without_a_peer_are_dropped_and_reported_once_per_absence():
    async def scenario():
        async with await serve(config()) as relay:
            head = await dial(relay.port, "lonely", "head")
            await event(head)
            for _ in range(3):
                await head.send(b"into the void")
            assert await event(head) == {"event": "dropped", "reason": "no peer"}
            tail = await dial(relay.port, "lonely", "tail")
            await event(tail)
            assert await event(head) == {"event": "peer_joined", "role": "tail"}
            await head.send(b"now heard")
            assert await tail.recv() == b"now heard"  # nothing from the absence was buffered
            await tail.close()
            assert await event(head) == {"event": "peer_left", "role": "tail"}
            for _ in range(3):
                await head.send(b"void again")
            assert await event(head) == {"event": "dropped", "reason": "no peer"}
            await head.send(b"once more")
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(head.recv(), 0.3)
    run(scenario())


def test_a_new_tail_can_join_after_the_first_one_left():
    async def scenario():
        async with await serve(config()) as relay:
            head, tail = await pair(relay.port, "relay-race")
            await tail.send(b"last words")
            await tail.close()
            assert await head.recv() == b"last words"  # frames before the leave come first
            assert await event(head) == {"event": "peer_left", "role": "tail"}
            tail = await dial(relay.port, "relay-race", "tail")
            assert await event(tail) == {"event": "welcome", "session": "relay-race", "peer_present": True}
            assert await event(head) == {"event": "peer_joined", "role": "tail"}
            await exchange(head, tail, n=20)
    run(scenario())


def test_a_receiver_that_falls_behind_is_closed_with_a_reason():
    async def scenario():
        async with await serve(config(max_frame_bytes=256 << 10)) as relay:
            head, tail = await pair(relay.port, "slow")
            for _ in range(400):  # 100 MiB against a 1 MiB queue plus socket buffers
                await head.send(bytes(256 << 10))
            with pytest.raises(ConnectionClosed):
                while True:
                    assert isinstance(await asyncio.wait_for(tail.recv(), 5), bytes)
            assert tail.close_code == 1013 and "too slowly" in tail.close_reason
            assert await event(head) == {"event": "peer_left", "role": "tail"}
    run(scenario())


async def round_trips(port: int) -> tuple[float, float]:
    """Median ping-pong time of small frames, and the time for a burst of 50 to come back."""
    head, tail = await pair(port, "rtt")

    async def echo():
        async for message in tail:
            await tail.send(message)

    echoing = asyncio.create_task(echo())
    samples = []
    for i in range(7):
        start = time.perf_counter()
        await head.send(b"ping %d" % i)
        assert await head.recv() == b"ping %d" % i
        samples.append(time.perf_counter() - start)
    start = time.perf_counter()
    burst = [b"burst %d" % i for i in range(50)]
    for item in burst:
        await head.send(item)
    assert [await head.recv() for _ in burst] == burst
    burst_time = time.perf_counter() - start
    await head.close()
    await tail.close()
    await echoing
    return statistics.median(samples), burst_time


def test_an_emulated_bandwidth_carries_each_direction_one_frame_after_another():
    """At 8 Mbit/s (1 MB/s) four frames of 250 kB take at least a second to reach the tail, in
    order, while a small frame goes the other way. Only a lower bound: a loaded machine can be
    slower, never faster than the emulation."""
    async def scenario():
        async with await serve(config(emulate_mbps=8.0)) as relay:
            head, tail = await pair(relay.port, "bandwidth")
            big = [bytes([i]) * 250_000 for i in range(4)]
            start = time.perf_counter()
            for item in big:
                await head.send(item)
            await tail.send(b"small")
            assert await head.recv() == b"small"
            got = [await tail.recv() for _ in big]
            assert got == big
            assert time.perf_counter() - start >= 0.95
            await head.close()
            await tail.close()
    run(scenario())


def test_emulated_rtt_adds_the_round_trip_once_per_frame_not_per_queue_position():
    """A round trip takes at least the emulated 100 ms (load only adds to it); 50 frames sent at
    once come back after about one of them. Had each waited behind the one before it, they would
    take 50 x 50 ms each way, at least 2.5 s: that bound is 25 emulated round trips of slack, which
    no load of this machine reaches for 100 small messages on loopback."""
    async def scenario():
        async with await serve(config(emulate_rtt_ms=100)) as relay:
            slow_rtt, burst_time = await round_trips(relay.port)
        assert slow_rtt >= 0.099
        assert burst_time < 2.5
    run(scenario())
