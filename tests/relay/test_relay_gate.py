"""The relay's gate before the handshake (pending limits, eviction, handshake timeout), its file
descriptor check at start and its rate-limited log, one mechanism at a time."""

from __future__ import annotations

import asyncio
import io
import logging
import resource
import subprocess
import sys
import time

import pytest
from websockets.asyncio.client import connect

from relay.logs import RateLimitedHandler
from relay.server import RelayConfig, StartupError, descriptor_room, serve
from relay_process import ENV, REPO, TOKEN, settled


def run(coro, timeout: float = 30.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def idle(port: int, source: str):
    """A TCP connection that never sends its handshake request."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    await asyncio.sleep(0.05)  # let the relay accept it, in order
    return reader, writer


async def dropped(reader: asyncio.StreamReader, within: float = 5.0) -> bool:
    try:
        return await asyncio.wait_for(reader.read(), within) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


async def joins(port: int) -> bool:
    async with connect(f"ws://127.0.0.1:{port}/session/honest?role=head", proxy=None, open_timeout=5,
                       additional_headers={"Authorization": f"Bearer {TOKEN}"}) as ws:
        return '"welcome"' in await asyncio.wait_for(ws.recv(), 5)


def test_an_address_over_its_pending_limit_evicts_its_own_oldest_handshake():
    async def scenario():
        config = RelayConfig(token=TOKEN, host="127.0.0.1", port=0, max_pending=16, max_pending_per_host=3)
        async with await serve(config) as relay:
            held = [await idle(relay.port, "127.0.0.2") for _ in range(5)]
            assert [await dropped(r, 1.0) for r, _ in held[:2]] == [True, True]
            assert relay.gate.n_pending == 3 and not await dropped(held[2][0], 0.3)
            assert await joins(relay.port)  # from another address: unaffected
            for _, writer in held:
                writer.transport.abort()
    run(scenario())


def test_a_full_pending_pool_evicts_from_the_most_crowded_address_not_the_newcomer():
    async def scenario():
        config = RelayConfig(token=TOKEN, host="127.0.0.1", port=0, max_pending=4, max_pending_per_host=8)
        async with await serve(config) as relay:
            crowd = [await idle(relay.port, "127.0.0.2") for _ in range(3)]
            lone = await idle(relay.port, "127.0.0.3")
            newcomer = await idle(relay.port, "127.0.0.4")  # pool full: 127.0.0.2's oldest goes
            assert await dropped(crowd[0][0], 1.0)
            assert not await dropped(lone[0], 0.3) and not await dropped(newcomer[0], 0.3)
            assert await joins(relay.port)  # evicts another of the crowd, then completes
            for _, writer in [*crowd, lone, newcomer]:
                writer.transport.abort()
    run(scenario())


def test_a_handshake_that_never_comes_is_closed_after_the_timeout():
    async def scenario():
        config = RelayConfig(token=TOKEN, host="127.0.0.1", port=0, open_timeout=0.5)
        async with await serve(config) as relay:
            reader, writer = await idle(relay.port, "127.0.0.2")
            assert await dropped(reader, 10.0)
            writer.transport.abort()
            assert await settled(lambda: relay.gate.n_pending == 0 and relay.gate.open == 0)
    run(scenario())


def test_too_few_file_descriptors_for_the_limits_is_a_startup_error(monkeypatch):
    monkeypatch.setattr(resource, "getrlimit", lambda _: (300, 300))
    monkeypatch.setattr(resource, "setrlimit", lambda *_: None)
    assert descriptor_room(100) == 300 - 192
    with pytest.raises(StartupError, match="ulimit -n allows 300"):
        descriptor_room(200)


def test_the_cli_refuses_limits_the_descriptors_cannot_hold():
    def cap():
        resource.setrlimit(resource.RLIMIT_NOFILE, (512, 512))

    done = subprocess.run([sys.executable, "-m", "relay", "--port", "0", "--token", TOKEN,
                           "--max-connections", "1000"], cwd=REPO, env=ENV, preexec_fn=cap,
                          capture_output=True, text=True, timeout=20)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().startswith("sfchat-relay: error: --max-connections plus --max-pending need")


def test_the_log_handler_writes_at_most_its_burst_plus_its_rate():
    out = io.StringIO()
    handler = RateLimitedHandler(out, rate=1000.0, burst=8000.0, max_record=300)
    logger = logging.getLogger("relay-log-test")
    logger.propagate, logger.level = False, logging.INFO
    logger.addHandler(handler)
    start = time.monotonic()
    try:
        for i in range(20_000):
            logger.warning("refused 10.0.%d.%d: bad or missing token", i // 256 % 256, i % 256)
        time.sleep(0.6)
        try:
            raise OSError(24, "Too many open files")
        except OSError:
            logger.exception("x" * 5000)  # a traceback record: cut
        time.sleep(0.3)
        logger.warning("after the flood")
    finally:
        logger.removeHandler(handler)
    elapsed = time.monotonic() - start
    text = out.getvalue()
    assert len(text) <= 8000 + 1000 * elapsed + 200
    assert "log records not written: log rate limit" in text and text.endswith("after the flood\n")
    assert "characters cut]" in text and max(len(line) for line in text.splitlines()) <= 300 + 40
