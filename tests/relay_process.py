"""A real ``sfchat-relay`` process on loopback for the relay's hostile-input tests, and its memory."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time
from pathlib import Path

TOKEN = "relay-process-token"
ENV = dict(os.environ, PYTHONUNBUFFERED="1")
REPO = Path(__file__).resolve().parents[1]


async def settled(condition, timeout: float = 20.0) -> bool:
    """Whether ``condition()`` holds within ``timeout`` s: the relay acts on what a test did in its own
    time, and a loaded machine only delays it (a bound on each wait, not a measurement)."""
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    return bool(condition())


def status_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(field)


def start_relay(log, *flags: str, preexec=None, cwd=REPO) -> tuple[subprocess.Popen, int]:
    """``python -m relay`` from ``cwd`` on a free loopback port; returns (process, port)."""
    relay = subprocess.Popen(
        [sys.executable, "-m", "relay", "--host", "127.0.0.1", "--port", "0", "--token", TOKEN, *flags],
        stdout=subprocess.PIPE, stderr=log, text=True, env=ENV, cwd=cwd, preexec_fn=preexec)
    port = int(re.search(r"listening on ws://[^:]+:(\d+)", relay.stdout.readline())[1])
    return relay, port
