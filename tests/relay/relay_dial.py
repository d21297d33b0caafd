"""A relay as a process and raw websocket clients of it: what the relay's tests share."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from websockets.asyncio.client import ClientConnection, connect


TOKEN = "t0ken-for-tests"
REPO = Path(__file__).resolve().parents[2]


def run(coro, timeout: float = 60.0):
    async def bounded():
        return await asyncio.wait_for(coro, timeout)
    return asyncio.run(bounded())


async def dial(port: int, session: str, role: str, token: str | None = TOKEN, **options) -> ClientConnection:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    return await connect(f"ws://127.0.0.1:{port}/session/{session}?role={role}", additional_headers=headers,
                         compression=None, max_size=64 << 20, proxy=None, **options)


async def event(ws: ClientConnection) -> dict:
    message = await asyncio.wait_for(ws.recv(), 5)
    assert isinstance(message, str), "expected a relay event, got a frame"
    return json.loads(message)


async def pair(port: int, session: str) -> tuple[ClientConnection, ClientConnection]:
    head = await dial(port, session, "head")
    assert await event(head) == {"event": "welcome", "session": session, "peer_present": False}
    tail = await dial(port, session, "tail")
    assert await event(tail) == {"event": "welcome", "session": session, "peer_present": True}
    assert await event(head) == {"event": "peer_joined", "role": "tail"}
    return head, tail
