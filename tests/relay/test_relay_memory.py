"""The relay's memory, measured on a real ``sfchat-relay`` process: under token holders that start
frames and never finish them (issue 13, item 4), under tails that never read while their heads
send maximal frames (issue 25, item 3), and the frame bound it rests on. The README's bound: RSS
above rest stays under ``--max-buffer-mb`` + 2 frames + ``SLACK_MIB``."""

from __future__ import annotations

import asyncio
import time

from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed
from websockets.frames import Frame, Opcode

from relay.server import MAX_FRAME_BYTES, RelayConfig, serve
from sfchat.link import padding
from sfchat.link import relay as relay_link, secure as secure_link
from sfchat.protocol import wire
from relay_process import TOKEN, settled, start_relay, status_kib
MiB = 1 << 20
SLACK_MIB = 8  # "a few MiB" of the README's bound: per-connection state, copies of one frame's headers


def test_the_frame_bound_holds_the_largest_sealed_frame_of_the_protocol():
    positions, hidden_bytes, per_position = 512, 8192 * 2, 64  # see relay.server, "Largest frame"
    plain = wire.HEADER.size + wire.FORWARD_FIXED.size + positions * (hidden_bytes + per_position)
    sealed = padding.padded_size(plain + 1) + secure_link.OVERHEAD
    assert sealed <= MAX_FRAME_BYTES < sealed + 4 * MiB  # room for it, and the documented headroom
    assert relay_link.MAX_FRAME_BYTES == MAX_FRAME_BYTES  # both nodes accept what the relay forwards
    chunk_7b = wire.max_frame_size(3584 // 2, n_tokens=512)  # a Qwen2.5-7B prefill chunk in bf16
    assert padding.padded_size(chunk_7b + 1) + secure_link.OVERHEAD < MAX_FRAME_BYTES // 3


async def dial(port: int, session: str, role: str, source: str = "127.0.0.1", **options):
    return await connect(f"ws://127.0.0.1:{port}/session/{session}?role={role}", proxy=None, compression=None,
                         max_size=16 * MiB, additional_headers={"Authorization": f"Bearer {TOKEN}"},
                         local_addr=(source, 0), **options)


async def slow_readers(port: int, sessions: int, frame_bytes: int, frames: int, hold: float = 1.0) -> list[int]:
    """``sessions`` pairs, each from its own loopback address: the tail never reads, the head
    sends ``frames`` frames of ``frame_bytes`` as fast as the relay takes them, then all stay
    ``hold`` seconds. Returns how many each head sent before the relay closed it; every
    connection is closed on return."""
    payload = bytes(frame_bytes)
    pairs = []
    for i in range(sessions):
        source = f"127.0.1.{10 + i}"
        head = await dial(port, f"slow-{i}", "head", source)
        pairs.append((head, await dial(port, f"slow-{i}", "tail", source, max_queue=1)))

    async def push(head) -> int:
        for sent in range(frames):
            try:
                await head.send(payload)
            except ConnectionClosed:
                return sent
        return frames

    try:
        sent = list(await asyncio.gather(*(push(head) for head, _ in pairs)))
        await asyncio.sleep(hold)
        return sent
    finally:
        for head, tail in pairs:
            head.transport.abort()
            tail.transport.abort()


async def half_frames(port: int, n: int, frame_bytes: int, wave: int) -> list:
    """``n`` token holders (each from its own loopback address), each sending the first half of
    one maximal frame and then nothing."""
    half = Frame(Opcode.BINARY, bytes(frame_bytes)).serialize(mask=True)[:frame_bytes // 2]
    holders = []
    for i in range(n):
        ws = await dial(port, f"hold-{wave}-{i}", "head", f"127.0.{2 + wave}.{10 + i}")
        ws.transport.write(half)
        holders.append(ws)
        await asyncio.sleep(0.02)
    return holders


async def end_wave(holders: list, stop: asyncio.Event, chatting: asyncio.Task) -> int:
    """How many of ``holders`` the relay has cut; then the honest pair's chat stopped (``stop``, and
    ``chatting`` awaited) and the holders still open dropped."""
    cut = sum(ws.transport.is_closing() for ws in holders)
    stop.set()
    await chatting
    for ws in holders:
        if not ws.transport.is_closing():
            ws.transport.abort()
    return cut


def test_frames_still_arriving_count_against_the_buffer_and_memory_comes_back(tmp_path):
    budget_mb, n, waves = 48, 24, 2  # 24 x 6 MiB = 144 MiB of half frames per wave
    with open(tmp_path / "relay.log", "w") as log:
        relay, port = start_relay(log, "--max-buffer-mb", str(budget_mb), "--max-frame-mb", "12")
    try:
        time.sleep(0.5)
        base = status_kib(relay.pid, "VmRSS")
        peaks, afters = [], []

        async def scenario():
            head, tail = await dial(port, "honest", "head"), await dial(port, "honest", "tail")
            rounds = 0

            async def chat(stop: asyncio.Event):
                nonlocal rounds
                while not stop.is_set():
                    await head.send(b"F" * 70_000)
                    while isinstance(frame := await asyncio.wait_for(tail.recv(), 20), str):
                        pass
                    assert frame == b"F" * 70_000
                    await tail.send(b"V" * 64)
                    while isinstance(answer := await asyncio.wait_for(head.recv(), 20), str):
                        pass
                    assert answer == b"V" * 64
                    rounds += 1

            for wave in range(waves):
                stop = asyncio.Event()
                chatting = asyncio.create_task(chat(stop))
                holders = await half_frames(port, n, 12 * MiB, wave)
                await asyncio.sleep(1.0)
                peaks.append(status_kib(relay.pid, "VmHWM"))
                cut = await end_wave(holders, stop, chatting)
                await asyncio.sleep(1.5)
                afters.append(status_kib(relay.pid, "VmRSS"))
                assert cut >= n - budget_mb // 6  # the relay cut the holders that did not fit
            await head.close()
            await tail.close()
            return rounds

        rounds = asyncio.run(asyncio.wait_for(scenario(), 90))
    finally:
        relay.terminate()
        relay.wait(10)
    text = (tmp_path / "relay.log").read_text()
    print(f"\nrelay RSS {base / 1024:.0f} MiB at rest; per wave of {n} half-sent 12 MiB frames: "
          f"VmHWM {[round(p / 1024) for p in peaks]} MiB, RSS after {[round(a / 1024) for a in afters]} MiB; "
          f"{rounds} honest rounds; log {len(text)} bytes")
    assert rounds >= waves
    assert max(peaks) - base <= (budget_mb + 24) * 1024, "memory beyond --max-buffer-mb + 24 MiB"
    assert max(afters) - base <= 16 * 1024, "memory not given back after the attack"
    assert "relay buffer full" in text and "Traceback" not in text


def test_tails_that_never_read_keep_the_relay_within_its_budget_plus_two_frames(tmp_path):
    budget_mb, frame_mb, sessions, frames = 128, 12, 12, 6  # 864 MiB offered against 128
    with open(tmp_path / "relay.log", "w") as log:
        relay, port = start_relay(log, "--max-buffer-mb", str(budget_mb), "--max-frame-mb", str(frame_mb))
    try:
        time.sleep(0.5)
        rest = status_kib(relay.pid, "VmRSS")
        sent = asyncio.run(asyncio.wait_for(slow_readers(port, sessions, frame_mb * MiB, frames), 90))
        time.sleep(1.5)
        peak, after = status_kib(relay.pid, "VmHWM"), status_kib(relay.pid, "VmRSS")
    finally:
        relay.terminate()
        relay.wait(10)
    text = (tmp_path / "relay.log").read_text()
    bound = budget_mb + 2 * frame_mb + SLACK_MIB
    print(f"\nrelay RSS {rest / 1024:.0f} MiB at rest; {sessions} tails that never read, heads sending "
          f"{frame_mb} MiB frames ({sum(sent)} taken): peak {(peak - rest) / 1024:.0f} MiB above rest "
          f"(bound {bound}), {(after - rest) / 1024:.0f} MiB above rest after")
    assert sum(sent) >= sessions * 2  # the relay took the load, shedding the tails
    assert "relay buffer full" in text and "Traceback" not in text
    assert peak - rest <= bound * 1024, f"RSS rose {(peak - rest) / 1024:.0f} MiB above rest, bound {bound}"
    assert after - rest <= 16 * 1024, "memory not given back once the sessions left"


def test_a_delivered_frame_is_not_kept_while_its_session_stays_open(tmp_path):
    sessions, frame_mb = 4, 12

    async def scenario(pid: int) -> int:
        pairs = [(await dial(port, f"quiet-{i}", "head"), await dial(port, f"quiet-{i}", "tail"))
                 for i in range(sessions)]
        for head, tail in pairs:
            await head.send(bytes(frame_mb * MiB))
            while isinstance(frame := await asyncio.wait_for(tail.recv(), 20), str):
                pass
            assert len(frame) == frame_mb * MiB
        del frame
        await asyncio.sleep(1.0)  # everyone stays connected and quiet
        kept = status_kib(pid, "VmRSS")
        for head, tail in pairs:
            await head.close()
            await tail.close()
        return kept

    with open(tmp_path / "relay.log", "w") as log:
        relay, port = start_relay(log)
    try:
        time.sleep(0.5)
        rest = status_kib(relay.pid, "VmRSS")
        kept = asyncio.run(asyncio.wait_for(scenario(relay.pid), 60))
    finally:
        relay.terminate()
        relay.wait(10)
    assert kept - rest <= 4 * 1024, f"{(kept - rest) / 1024:.0f} MiB kept after {sessions} frames were delivered"


def test_a_half_sent_frame_is_counted_while_it_arrives_and_released_when_cut():
    async def scenario():
        config = RelayConfig(token=TOKEN, host="127.0.0.1", port=0, max_frame_bytes=4 * MiB,
                             max_buffer_bytes=6 * MiB)
        async with await serve(config) as relay:
            first = (await half_frames(relay.port, 1, 4 * MiB, 0))[0]
            deadline = time.monotonic() + 10
            while relay.budget.used < 2 * MiB - (64 << 10) and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert 2 * MiB - (64 << 10) <= relay.budget.used <= 2 * MiB + (64 << 10)
            more = await half_frames(relay.port, 3, 4 * MiB, 1)  # 8 MiB in all against 6
            def alive():
                return [ws for ws in [first, *more] if not ws.transport.is_closing()]
            assert await settled(lambda: len(alive()) == 3) and relay.budget.used <= 6 * MiB
            alive = alive()
            for ws in alive:
                ws.transport.abort()
            while relay.budget.used and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert relay.budget.used == 0 and relay.gate.open == 0
    asyncio.run(asyncio.wait_for(scenario(), 90))
