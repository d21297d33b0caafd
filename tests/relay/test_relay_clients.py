"""Limits that count per client (issue 25, items 4 and 6), on loopback with several source
addresses: one address cannot take every session or connection, the shared buffer sheds the
client holding the most rather than the largest single holder, and a tail waiting for its head
keeps its slot through any number of idle timeouts while a squatter polls for it."""

from __future__ import annotations

import asyncio
import time

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.frames import Frame, Opcode

from relay.gate import client_key
from relay.server import RelayConfig, serve
from relay_process import TOKEN, start_relay

MiB = 1 << 20


async def dial(port: int, session: str, role: str, source: str, **options):
    return await connect(f"ws://127.0.0.1:{port}/session/{session}?role={role}", proxy=None, compression=None,
                         max_size=16 * MiB, open_timeout=10, local_addr=(source, 0),
                         additional_headers={"Authorization": f"Bearer {TOKEN}"}, **options)


async def refusal(coro) -> str:
    with pytest.raises(InvalidStatus) as refused:
        await coro
    return f"{refused.value.response.status_code} {refused.value.response.body.decode().strip()}"


async def frame(ws) -> bytes:
    while isinstance(message := await asyncio.wait_for(ws.recv(), 10), str):
        pass
    return message


def test_one_address_takes_its_share_of_sessions_and_everyone_else_still_gets_in(tmp_path):
    async def scenario(port):
        held, refused = [], []
        for i in range(64):  # what one token holder did: every session of the relay, head and tail
            try:
                held.append(await dial(port, f"grab-{i}", "head", "127.0.0.2"))
                held.append(await dial(port, f"grab-{i}", "tail", "127.0.0.2"))
            except InvalidStatus as exc:
                refused.append(f"{exc.response.status_code} {exc.response.body.decode().strip()}")
        head = await dial(port, "honest", "head", "127.0.0.3")
        tail = await dial(port, "honest", "tail", "127.0.0.3")
        await head.send(b"through")
        assert await frame(tail) == b"through"
        for ws in [*held, head, tail]:
            await ws.close()
        return len(held), set(refused)

    with open(tmp_path / "relay.log", "w") as log:
        relay, port = start_relay(log)  # the defaults: 64 sessions, 8 per address
    try:
        held, refused = asyncio.run(asyncio.wait_for(scenario(port), 60))
    finally:
        relay.terminate()
        relay.wait(10)
    assert held == 16 and refused == {"503 too many connections from your address (16 at most)"}


def test_sessions_and_connections_count_per_address_and_free_up_when_closed():
    async def scenario():
        config = RelayConfig(token=TOKEN, host="127.0.0.1", port=0, max_sessions_per_client=2,
                             max_connections_per_client=4)
        async with await serve(config) as relay:
            port = relay.port
            a = [await dial(port, "one", "head", "127.0.0.2"), await dial(port, "one", "tail", "127.0.0.2"),
                 await dial(port, "two", "head", "127.0.0.2")]
            assert await refusal(dial(port, "three", "head", "127.0.0.2")) == \
                "503 too many sessions from your address (2 at most)"
            a.append(await dial(port, "two", "tail", "127.0.0.2"))  # a session it is in already
            assert await refusal(dial(port, "two", "tail", "127.0.0.2")) == "409 session two already has a tail"
            assert await refusal(dial(port, "three", "tail", "127.0.0.2")) == \
                "503 too many connections from your address (4 at most)"
            b = await dial(port, "three", "head", "127.0.0.3")  # another address: room
            for ws in a[:2]:
                await ws.close()
            await asyncio.sleep(0.1)
            a.append(await dial(port, "three", "tail", "127.0.0.2"))
            for ws in [*a[2:], b]:
                await ws.close()
    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_an_ipv6_client_counts_by_its_64_and_a_mapped_ipv4_as_the_ipv4():
    assert client_key("2001:db8:1:2::1") == client_key("2001:db8:1:2:ffff:ffff:ffff:ffff") == "2001:db8:1:2::/64"
    assert client_key("2001:db8:1:3::1") != client_key("2001:db8:1:2::1")
    assert client_key("::ffff:198.51.100.7") == client_key("198.51.100.7") == "198.51.100.7"


def test_the_buffer_sheds_the_client_holding_the_most_not_the_largest_frame():
    async def scenario():
        config = RelayConfig(token=TOKEN, host="127.0.0.1", port=0, max_frame_bytes=8 * MiB,
                             max_buffer_bytes=20 * MiB)
        async with await serve(config) as relay:
            # one address holding eight frames half sent, 16 MiB...
            half = Frame(Opcode.BINARY, bytes(4 * MiB)).serialize(mask=True)[:2 * MiB]
            crowd = [await dial(relay.port, f"crowd-{i}", "head", "127.0.0.2") for i in range(8)]
            for ws in crowd:
                ws.transport.write(half)
            deadline = time.monotonic() + 10
            while relay.budget.used < 16 * MiB - (64 << 10) and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            # ...while an honest head sends one 8 MiB prefill chunk: 24 MiB against 20
            honest = await dial(relay.port, "prefill", "head", "127.0.0.3")
            tail = await dial(relay.port, "prefill", "tail", "127.0.0.3")
            await honest.send(bytes(8 * MiB))
            assert await frame(tail) == bytes(8 * MiB)
            assert 2 <= sum(ws.transport.is_closing() for ws in crowd) <= 4  # enough to fit, no more
            for ws in [honest, tail, *crowd]:
                ws.transport.abort()
    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_a_waiting_tail_keeps_its_slot_through_idle_timeouts_while_a_squatter_polls(tmp_path):
    async def scenario(port):
        tail = await dial(port, "kaggle", "tail", "127.0.0.2")
        assert '"peer_present":false' in await tail.recv()
        answers = set()
        deadline = time.monotonic() + 4.0  # over three idle timeouts of 1.2 s
        while time.monotonic() < deadline:
            try:
                squatter = await dial(port, "kaggle", "tail", "127.0.0.3")
            except InvalidStatus as exc:
                answers.add(f"{exc.response.status_code} {exc.response.body.decode().strip()}")
            else:
                answers.add("joined")
                await squatter.close()
            await asyncio.sleep(0.1)
        head = await dial(port, "kaggle", "head", "127.0.0.4")
        await head.send(b"hello tail")
        received = await frame(tail)
        # paired and then both silent, no keepalive within the timeout: the session's deadline; both go
        await tail.send(b"hello head")
        assert await frame(head) == b"hello head"
        for ws in (head, tail):
            with pytest.raises(ConnectionClosed):
                while True:
                    await asyncio.wait_for(ws.recv(), 10)
            assert ws.close_code == 4408
        return answers, received

    with open(tmp_path / "relay.log", "w") as log:
        relay, port = start_relay(log, "--idle-timeout", "0.02")
    try:
        answers, received = asyncio.run(asyncio.wait_for(scenario(port), 40))
    finally:
        relay.terminate()
        relay.wait(10)
    assert answers == {"409 session kaggle already has a tail"} and received == b"hello tail"


def test_a_waiting_tail_that_stops_answering_pings_is_closed_and_its_slot_freed():
    async def scenario():
        config = RelayConfig(token=TOKEN, host="127.0.0.1", port=0, ping_interval=0.3, ping_timeout=0.3,
                             idle_timeout=60.0)
        async with await serve(config) as relay:
            tail = await dial(relay.port, "gone", "tail", "127.0.0.2")
            await tail.recv()
            tail.transport.pause_reading()  # a machine that vanished: no pong ever comes back
            deadline = time.monotonic() + 10
            while "gone" in relay.sessions and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            newcomer = await dial(relay.port, "gone", "tail", "127.0.0.3")
            await newcomer.close()
            tail.transport.abort()
    asyncio.run(asyncio.wait_for(scenario(), 20))


def test_a_quiet_pair_that_answers_keepalives_keeps_both_slots_while_a_squatter_polls():
    """Round four: in a quiet paired session the relay closed the peer silent longer, a squatter
    took its slot within milliseconds and the real tail got 409 from then on. Keepalives count as
    activity: a pair whose peers answer the pings keeps its slots, however long it stays quiet."""
    async def scenario():
        config = RelayConfig(token=TOKEN, host="127.0.0.1", port=0, ping_interval=0.2, ping_timeout=10,
                             idle_timeout=1.0)
        async with await serve(config) as relay:
            head = await dial(relay.port, "quiet", "head", "127.0.0.2", ping_interval=None)
            tail = await dial(relay.port, "quiet", "tail", "127.0.0.3", ping_interval=None)
            await head.send(b"one prompt")
            assert await frame(tail) == b"one prompt"
            answers = set()
            deadline = time.monotonic() + 5.0  # five idle timeouts of quiet
            while time.monotonic() < deadline:
                for role in ("head", "tail"):
                    try:
                        squatter = await dial(relay.port, "quiet", role, "127.0.0.4")
                    except InvalidStatus as exc:
                        answers.add(exc.response.status_code)
                    else:
                        answers.add("joined")
                        await squatter.close()
                await asyncio.sleep(0.1)
            await tail.send(b"still here")
            assert await frame(head) == b"still here"
            for ws in (head, tail):
                await ws.close()
            return answers

    assert asyncio.run(asyncio.wait_for(scenario(), 40)) == {409}
