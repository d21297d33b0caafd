"""Unauthenticated connections against a real ``sfchat-relay`` with few file descriptors
(issue 13, item 5): idle TCP connections from 20 addresses, more than ``ulimit -n`` allows,
while an honest pair chats and new honest clients keep joining; the log must stay small."""

from __future__ import annotations

import asyncio
import resource
import time

import pytest
from websockets.asyncio.client import connect

from relay_process import TOKEN, start_relay

ATTACKERS, PER_ADDRESS, SECONDS, RELAY_FDS = 20, 55, 10.0, 512


def lower_fd_limit():
    resource.setrlimit(resource.RLIMIT_NOFILE, (RELAY_FDS, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))


async def idle_tcp(port: int, source: str, deadline: float, opened: list) -> None:
    """One attacker slot: hold an idle TCP connection; when the relay drops it, open another."""
    while time.monotonic() < deadline and opened[0] < 40_000:
        try:
            opened[0] += 1
            reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
        except OSError:
            await asyncio.sleep(0.5)
            continue
        try:
            await asyncio.wait_for(reader.read(), max(deadline - time.monotonic(), 0.01))
        except (OSError, TimeoutError):
            pass
        writer.transport.abort()
        await asyncio.sleep(1.0)


async def dial(port: int, session: str, role: str):
    return await connect(f"ws://127.0.0.1:{port}/session/{session}?role={role}", proxy=None, compression=None,
                         open_timeout=10, additional_headers={"Authorization": f"Bearer {TOKEN}"})


async def frame(ws) -> bytes:
    while isinstance(message := await asyncio.wait_for(ws.recv(), 10), str):
        pass
    return message


async def honest(port: int, deadline: float) -> tuple[int, int, list[str]]:
    """A pair doing rounds, and a new client joining every half second: (rounds, probes, failures)."""
    head, tail = await dial(port, "honest", "head"), await dial(port, "honest", "tail")
    rounds, probes, failures = 0, 0, []

    async def chat():
        nonlocal rounds
        while time.monotonic() < deadline:
            await head.send(b"F" * 65_000)
            assert await frame(tail) == b"F" * 65_000
            await tail.send(b"V" * 64)
            assert await frame(head) == b"V" * 64
            rounds += 1
            await asyncio.sleep(0.02)

    async def probe(i: int):
        try:
            ws = await dial(port, f"probe-{i}", "head")
            await asyncio.wait_for(ws.recv(), 10)  # the welcome
            await ws.close()
        except Exception as exc:  # noqa: BLE001 - every failure is recorded and asserted on
            failures.append(f"probe {i}: {type(exc).__name__}: {exc}")

    chatting = asyncio.create_task(chat())
    joining = []
    while time.monotonic() < deadline:
        joining.append(asyncio.create_task(probe(probes)))
        probes += 1
        await asyncio.sleep(0.5)
    await asyncio.gather(chatting, *joining)
    await head.close()
    await tail.close()
    return rounds, probes, failures


def test_idle_connections_beyond_the_fd_limit_neither_starve_honest_clients_nor_flood_the_log(tmp_path):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = ATTACKERS * PER_ADDRESS + 200
    if soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            pytest.skip(f"needs {need} file descriptors in the test process")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    with open(tmp_path / "relay.log", "w") as log:
        relay, port = start_relay(log, "--max-connections", "32", preexec=lower_fd_limit)
    try:
        async def scenario():
            deadline = time.monotonic() + SECONDS
            opened = [0]
            attack = [asyncio.create_task(idle_tcp(port, f"127.0.0.{2 + a}", deadline, opened))
                      for a in range(ATTACKERS) for _ in range(PER_ADDRESS)]
            await asyncio.sleep(1.0)  # let the attack fill the relay first
            result = await honest(port, deadline)
            await asyncio.gather(*attack)
            return (*result, opened[0])

        rounds, probes, failures, opened = asyncio.run(asyncio.wait_for(scenario(), SECONDS + 60))
        alive = relay.poll() is None
    finally:
        relay.terminate()
        relay.wait(10)
    size = (tmp_path / "relay.log").stat().st_size
    print(f"\n{opened} attacking connections from {ATTACKERS} addresses, relay ulimit -n {RELAY_FDS}: "
          f"{rounds} honest rounds, {probes - len(failures)}/{probes} new clients joined, log {size} bytes")
    assert alive and failures == [] and rounds > 0
    assert size < 128 << 10
