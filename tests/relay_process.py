"""A real ``sfchat-relay`` process on loopback for the relay's hostile-input tests, and its memory."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

TOKEN = "relay-process-token"
ENV = dict(os.environ, PYTHONUNBUFFERED="1")
REPO = Path(__file__).resolve().parents[1]


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
