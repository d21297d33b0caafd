"""The relay's own limits on loopback: a shared buffer that sheds the slowest readers, the
connection limit, and 50 honest sessions completing while hostile clients attack the relay
with bounded memory."""

from __future__ import annotations

import asyncio
import hashlib
import random
import re
import subprocess
import sys
import time

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from relay.server import RelayConfig, serve
from relay_process import settled, status_kib
from threaded_relay import TOKEN
from machines import ENV


def run(coro, timeout: float = 60.0):
    async def bounded():
        return await asyncio.wait_for(coro, timeout)
    return asyncio.run(bounded())


async def dial(port: int, session: str, role: str, token: str = TOKEN, **options):
    options.setdefault("max_size", 8 << 20)
    return await connect(f"ws://127.0.0.1:{port}/session/{session}?role={role}", proxy=None, compression=None,
                         additional_headers={"Authorization": f"Bearer {token}"}, **options)


async def until_event(ws, name: str, timeout: float = 60.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        message = await asyncio.wait_for(ws.recv(), max(deadline - asyncio.get_running_loop().time(), 0.01))
        if isinstance(message, str) and f'"event":"{name}"' in message:
            return


def test_the_shared_buffer_closes_the_biggest_holders_and_frees_their_queues(caplog):
    async def scenario():  # each queue may hold 4 MiB; all of them, and what is arriving, only 4
        config = RelayConfig(token=TOKEN, host="127.0.0.1", port=0, max_frame_bytes=1 << 20,
                             max_buffer_bytes=4 << 20)
        async with await serve(config) as relay:
            slow = []
            for i in range(3):
                head = await dial(relay.port, f"slow-{i}", "head")
                tail = await dial(relay.port, f"slow-{i}", "tail", max_queue=1)  # and never reads
                slow.append((head, tail))
            honest_head = await dial(relay.port, "honest", "head")
            honest_tail = await dial(relay.port, "honest", "tail")
            await until_event(honest_head, "peer_joined")
            await until_event(honest_tail, "welcome")
            cut = set()  # slow heads the relay cut mid-frame: at that moment they held the most
            for _ in range(30):
                for head, _ in slow:
                    try:
                        await head.send(bytes(1 << 20))
                    except ConnectionClosed:
                        cut.add(head)
                await honest_head.send(b"still here")
                assert await honest_tail.recv() == b"still here"
                # plus frames of receivers closing politely, and a read past the limit
                assert relay.budget.used <= relay.budget.limit + relay.budget.linger + (256 << 10)
            for head, _ in slow:
                if head not in cut:
                    await until_event(head, "peer_left")  # its tail was closed as too slow
            for head, tail in slow:
                await head.close()
                tail.transport.abort()  # it paused reading: a polite close would wait for its timeout
            await honest_head.send(b"after the flood")
            assert await honest_tail.recv() == b"after the flood"
            await honest_head.close()
            await honest_tail.close()
            assert await settled(lambda: relay.budget.used == 0 and not relay.budget.holders)
            return len(cut)
    n_cut = run(scenario())
    assert caplog.text.count("relay buffer full: this side reads too slowly; closing it") >= 3 - n_cut >= 1


def test_the_connection_limit_refuses_with_503():
    async def scenario():
        async with await serve(RelayConfig(token=TOKEN, host="127.0.0.1", port=0, max_connections=3)) as relay:
            held = [await dial(relay.port, f"c{i}", "head") for i in range(3)]
            with pytest.raises(InvalidStatus) as refused:
                await dial(relay.port, "c9", "head")
            assert refused.value.response.status_code == 503 and b"3 connections" in refused.value.response.body
            await held[0].close()
            await asyncio.sleep(0.1)
            held[0] = await dial(relay.port, "c9", "head")  # room again
            for ws in held:
                await ws.close()
    run(scenario())


SESSIONS, ROUNDS, FORWARD_BYTES, PREFILL = 50, 60, 9 * 3584 * 2, (4, 256 << 10)


async def honest(port: int, i: int, paired: asyncio.Event, ready: list) -> int:
    """One head/tail pair doing what sfchat does: a prefill burst, then verify rounds."""
    name = f"honest-{i}"
    head = await dial(port, name, "head")
    tail = await dial(port, name, "tail")
    await until_event(head, "peer_joined")
    ready.append(name)
    if len(ready) == SESSIONS:
        paired.set()
    rng = random.Random(i)

    async def tail_side():
        for _ in range(ROUNDS + PREFILL[0]):
            frame = await tail.recv()
            while isinstance(frame, str):
                frame = await tail.recv()
            if frame[:1] == b"F":
                await tail.send(b"V" + hashlib.sha256(frame).digest())

    async def head_side():
        for _ in range(PREFILL[0]):
            await head.send(b"P" + rng.randbytes(PREFILL[1]))
        for _ in range(ROUNDS):
            frame = b"F" + rng.randbytes(FORWARD_BYTES)
            await head.send(frame)
            assert await head.recv() == b"V" + hashlib.sha256(frame).digest()

    await asyncio.gather(tail_side(), head_side())
    await head.close()
    await tail.close()
    return ROUNDS


async def outcome(coro) -> str:
    """How a hostile attempt ended: an HTTP status or a close code."""
    try:
        result = await coro
        return result if isinstance(result, str) else type(result).__name__
    except InvalidStatus as exc:
        return f"http {exc.response.status_code}"
    except ConnectionClosed as exc:
        return f"close {exc.rcvd.code if exc.rcvd else 1006}"


async def hostile(port: int, paired: asyncio.Event) -> dict:
    kept = []  # connections that only need to exist
    async def bad_token(i):
        await dial(port, f"x{i}", "head", token=f"guess-{i}")

    async def text(i):
        ws = await dial(port, f"text-{i}", "head")
        await ws.send("<script>")
        while True:
            await ws.recv()

    async def oversize(i):
        ws = await dial(port, f"big-{i}", "head")
        await ws.send(bytes(2 << 20))
        while True:
            await ws.recv()

    async def garbage(i):
        ws = await dial(port, f"void-{i}", "tail")
        for _ in range(50):
            await ws.send(random.randbytes(random.randrange(1, 4096)))
        await until_event(ws, "dropped")
        await ws.close()
        return "dropped"

    async def flood(i):
        head = await dial(port, f"flood-{i}", "head")
        kept.append(await dial(port, f"flood-{i}", "tail"))
        while True:
            await head.send(b"!" * 64)

    async def slow_reader(i):
        head = await dial(port, f"slow-{i}", "head")
        kept.append(await dial(port, f"slow-{i}", "tail", max_queue=1))  # never reads
        for _ in range(40):
            await head.send(bytes(1 << 20))
        await until_event(head, "peer_left")
        return "peer closed"

    async def idle(i):  # a pair gone quiet past the session's deadline: both are closed (4408)
        ws = await dial(port, f"idle-{i}", "head", ping_interval=None)  # only the relay's pings, every 20 s
        kept.append(tail := await dial(port, f"idle-{i}", "tail", ping_interval=None))
        await asyncio.sleep(1.0)
        await tail.send(b"last word")
        while True:
            await ws.recv()

    async def raw_tcp(i):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(random.randbytes(4096) + b"\r\n\r\n")
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 15)
        writer.close()
        return "http " + answer.split(b" ", 2)[1].decode() if answer.startswith(b"HTTP/") else "eof"

    async def steal(i):
        await paired.wait()
        await dial(port, f"honest-{i}", "tail")
        return "joined"

    kinds = {"bad token": (bad_token, 200), "text": (text, 20), "oversize": (oversize, 10),
             "garbage": (garbage, 10), "flood": (flood, 5), "slow reader": (slow_reader, 5), "idle": (idle, 5),
             "raw tcp": (raw_tcp, 10), "slot stealer": (steal, 10)}
    results = {}
    for kind, (attack, n) in kinds.items():
        results[kind] = asyncio.gather(*(outcome(attack(i)) for i in range(n)))
    return {kind: sorted(set(await task)) for kind, task in results.items()}


def test_fifty_sessions_complete_while_hostile_clients_attack_and_memory_stays_bounded(tmp_path):
    log = tmp_path / "relay.log"
    with open(log, "w") as err:
        relay = subprocess.Popen(
            [sys.executable, "-m", "relay", "--host", "127.0.0.1", "--port", "0", "--token", TOKEN,
             "--max-frame-mb", "1", "--max-connections", "200", "--max-sessions", "200", "--max-frames-per-s", "1000",
             "--max-pending", "400", "--max-pending-per-ip", "400",  # every client here is 127.0.0.1
             "--max-sessions-per-ip", "400", "--max-connections-per-ip", "400",
             "--max-mb-per-s", "64", "--max-buffer-mb", "64", "--idle-timeout", "0.3"],
            stdout=subprocess.PIPE, stderr=err, text=True, env=ENV)
    try:
        port = int(re.search(r"listening on ws://[^:]+:(\d+)", relay.stdout.readline())[1])
        time.sleep(0.5)
        before = status_kib(relay.pid, "VmRSS")
        peak = [before]

        async def scenario():
            paired, ready = asyncio.Event(), []
            stop = asyncio.Event()

            async def sample():
                while not stop.is_set():
                    peak.append(status_kib(relay.pid, "VmRSS"))
                    await asyncio.sleep(0.1)

            sampler = asyncio.create_task(sample())
            t0 = time.perf_counter()
            attacks = asyncio.create_task(hostile(port, paired))
            done = await asyncio.gather(*(honest(port, i, paired, ready) for i in range(SESSIONS)))
            honest_s = time.perf_counter() - t0
            outcomes = await attacks
            stop.set()
            await sampler
            return done, honest_s, outcomes

        done, honest_s, outcomes = run(scenario(), timeout=90)
        after, hwm = status_kib(relay.pid, "VmRSS"), status_kib(relay.pid, "VmHWM")
    finally:
        relay.terminate()
        relay.wait(10)
    text = log.read_text()
    frames = SESSIONS * (2 * ROUNDS + PREFILL[0])
    volume = SESSIONS * (ROUNDS * (FORWARD_BYTES + 34) + PREFILL[0] * PREFILL[1]) / 2 ** 20
    print(f"\n{SESSIONS} honest sessions, {frames} frames ({volume:.0f} MiB) in {honest_s:.1f} s; relay RSS "
          f"{before / 1024:.0f} MiB before, peak {max(peak) / 1024:.0f} MiB (VmHWM {hwm / 1024:.0f}), "
          f"{after / 1024:.0f} MiB after; hostile outcomes {outcomes}")
    assert done == [ROUNDS] * SESSIONS
    assert outcomes["bad token"] == ["http 401"]
    assert outcomes["text"] == ["close 1003"] and outcomes["oversize"] == ["close 1009"]
    assert outcomes["garbage"] == ["dropped"] and outcomes["slow reader"] == ["peer closed"]
    assert outcomes["flood"] == ["close 1008"] and outcomes["idle"] == ["close 4408"]
    assert outcomes["slot stealer"] == ["http 409"]
    assert set(outcomes["raw tcp"]) <= {"http 400", "eof"}
    assert hwm - before < 256 << 10, "relay memory grew by more than 256 MiB"
    assert text.count("bad or missing token") == 1  # 200 refusals, one line
    assert text.count("exceeded") == 1 and text.count("sent nothing for") == 1
    assert "Traceback" not in text
