"""The relay in a thread of this process, and a fixture that serves one for a test."""

from __future__ import annotations

import asyncio
import threading

import pytest

from relay.server import RelayConfig, serve


TOKEN = "link-test-token"


class ThreadedRelay:
    """An in-process relay on its own event loop thread, for blocking clients to dial."""

    def __init__(self, token: str = TOKEN, port: int = 0, **options):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        config = RelayConfig(token=token, host="127.0.0.1", port=port, **options)
        self._relay = asyncio.run_coroutine_threadsafe(serve(config), self._loop).result(10)
        self.port = self._relay.port
        self.url = f"ws://127.0.0.1:{self.port}"

    def stop(self) -> None:
        async def shutdown():
            self._relay.close()
            await self._relay.wait_closed()
        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(15)

    def dispose(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()


@pytest.fixture
def relay():
    server = ThreadedRelay()
    yield server
    server.stop()
    server.dispose()
