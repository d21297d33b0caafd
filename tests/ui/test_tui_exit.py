"""The real ``sfchat`` chat UI in a pseudo-terminal: it starts, answers, and quits with Ctrl+Q
with exit status 0 and no C++ abort ("terminate called without an active exception"), in local
mode with and without a draft. Without a terminal the chat UI refuses in one line.

The quit tests run the real SmolLM2-135M: the abort needs torch's intra-op thread pool to have
started, which the tiny test models' operations are too small to do.

Everything the process writes (Textual draws on stderr) comes through the pty's one stream,
so an abort message cannot hide from the assertions.
"""

from __future__ import annotations

import fcntl
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from command_line import cli_env

ROWS, COLUMNS = 30, 100
CTRL_Q = b"\x11"
START_S, REPLY_S, EXIT_S = 120.0, 120.0, 30.0


def sfchat_command() -> list[str]:
    """The installed ``sfchat`` script next to this Python, else the module it runs."""
    script = Path(sys.executable).with_name("sfchat")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "sfchat.cli"]


class Terminal:
    """A child process on a pty of ROWS x COLUMNS; ``output`` is all it has written."""

    def __init__(self, args: list[str], env: dict) -> None:
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", ROWS, COLUMNS, 0, 0))
        env = dict(env, TERM="xterm-256color", COLUMNS=str(COLUMNS), LINES=str(ROWS))
        self.proc = subprocess.Popen(args, stdin=slave, stdout=slave, stderr=slave, env=env,
                                     start_new_session=True)
        os.close(slave)
        self.master = master
        self.output = b""

    def read_until(self, marker: bytes, timeout: float, start: int = 0) -> bool:
        """Read until ``marker`` appears in the output after offset ``start``."""
        deadline = time.monotonic() + timeout
        while marker not in self.output[start:]:
            if time.monotonic() > deadline or not self._read(0.2):
                return marker in self.output[start:]
        return True

    def _read(self, wait: float) -> bool:
        ready, _, _ = select.select([self.master], [], [], wait)
        if ready:
            try:
                chunk = os.read(self.master, 1 << 16)
            except OSError:  # the child closed its side
                return False
            if not chunk:
                return False
            self.output += chunk
        return self.proc.poll() is None or bool(ready)

    def send(self, data: bytes) -> None:
        os.write(self.master, data)

    def wait(self, timeout: float) -> int | None:
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            self._read(0.2)
        while self._read(0.05):  # what it wrote on the way out
            pass
        return self.proc.poll()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        os.close(self.master)


@pytest.fixture
def terminal(tmp_path):
    opened: list[Terminal] = []

    def start(*flags: str) -> Terminal:
        args = sfchat_command() + ["--device", "cpu", "--history", str(tmp_path / "history.sqlite3"),
                                   *flags]
        env = cli_env(tmp_path)
        # As a user runs it: torch's own thread pool, whose teardown under a live runtime
        # thread is what aborted the process (a single thread hid it).
        env.pop("OMP_NUM_THREADS", None)
        t = Terminal(args, env)
        opened.append(t)
        return t

    yield start
    for t in opened:
        t.close()


def quits_cleanly(t: Terminal) -> None:
    t.send(CTRL_Q)
    status = t.wait(EXIT_S)
    text = t.output.decode("utf-8", "replace")
    assert status == 0, f"exit status {status}; the terminal's last output:\n{text[-1500:]}"
    assert "terminate called" not in text and "Aborted" not in text and "Traceback" not in text


def test_ctrl_q_after_a_reply_exits_0(smollm2, terminal):
    model = str(smollm2[0])
    t = terminal("--model", model, "--draft", model, "--k", "3", "--max-new-tokens", "12")
    assert t.read_until(b"ready", START_S), t.output.decode("utf-8", "replace")[-1500:]
    mark = len(t.output)
    t.send(b"hello there\r")
    assert t.read_until(b"tok/round", REPLY_S, mark), t.output.decode("utf-8", "replace")[-1500:]
    quits_cleanly(t)


def test_ctrl_q_while_idle_without_a_draft_exits_0(smollm2, terminal):
    t = terminal("--model", str(smollm2[0]), "--draft", "none")
    assert t.read_until(b"ready", START_S), t.output.decode("utf-8", "replace")[-1500:]
    quits_cleanly(t)


def test_without_a_terminal_the_chat_ui_refuses_in_one_line(zoo, tmp_path):
    out = subprocess.run(sfchat_command() + ["--model", str(zoo["qwen2-tied"]), "--device", "cpu"],
                         stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60,
                         env=cli_env(tmp_path))
    assert out.returncode == 2 and out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs a terminal" in lines[0] and "--prompt" in lines[0], out.stderr
