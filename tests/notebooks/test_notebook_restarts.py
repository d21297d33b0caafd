"""The notebooks as a user lives with them, headless: a tail restarted in the same notebook session
(the head goes on by itself, as the notebooks say) and in a new one (a new code, given the way the
notebooks say); the head notebook offering its chat to a screen at home; the install cell pinning a
commit and saying what it installed."""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import nbformat
import pytest
from relay_process import TOKEN
from notebook_kernels import SESSION, client, free_port, kernel_env, printed, with_parameters  # noqa: F401

from sfchat.config import Settings
from sfchat.events import CodeWanted, ReplyFinished, RuntimeReady
from sfchat.link.relay import RelayLink
from sfchat.node.head import Head
from sfchat.node.prompts import make_sampling
from sfchat.params import Ask, GenParams
from sfchat.plaintext import plain
from sfchat.protocol.chat_events import reply_text
from sfchat.remote.client import RemoteRuntime

PROMPT, AGAIN, THIRD = "hello world, how are you?", "and how is the weather?", "one more thing"
N_TOKENS = 24
WAIT = 180.0  # a bound on each wait, not a measurement


def until(condition, what: str, timeout: float = WAIT):
    deadline = time.monotonic() + timeout
    while not (found := condition()):
        assert time.monotonic() < deadline, f"no {what} within {timeout:.0f} s"
        time.sleep(0.2)
    return found


class TailNotebook:
    """The tail notebook in a kernel of its own, run top to bottom until ``stop()`` (as a user stops its cell)."""

    def __init__(self, folder: Path, url: str, zoo) -> None:
        self.nb = with_parameters("tail.ipynb", SFCHAT_SOURCE="", RELAY_URL=url, TOKEN=TOKEN, SESSION=SESSION,
                                  DEVICE="cpu", MODELS_DIR=str(zoo["tokenizer"].parent))
        self.client = client(self.nb, folder, timeout=600)
        self.failure: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.client.execute()
        except BaseException as exc:  # stopping the tail cell raises here by design
            self.failure.append(exc)

    def said(self) -> str:
        return printed(self.nb)

    def said_before(self, line: str) -> str:
        """What the notebook printed once ``line`` is among it (the tail prints in order)."""
        return until(lambda: line in self.said() and self.said() or
                     (self.failure and pytest.fail(f"the tail notebook failed: {self.failure}")), repr(line))

    def code(self) -> str:
        return until(lambda: re.search(r"PAIRING_CODE = \"(\d+-[a-z]+-[a-z]+)\"", self.said()) or
                     (self.failure and pytest.fail(f"the tail notebook failed: {self.failure}")),
                     "pairing code from the tail notebook").group(1)

    def stop(self) -> None:
        if self.client.km is not None and self.client.km.has_kernel:
            self.client.km.provisioner.process.send_signal(signal.SIGINT)
        self.thread.join(60)
        assert not self.thread.is_alive()


class Kernel:
    """A notebook whose kernel stays up between cells, as a person's does."""

    def __init__(self, nb, folder: Path) -> None:
        self.nb, self.client = nb, client(nb, folder, timeout=300)

    def __enter__(self) -> "Kernel":
        self._setup = self.client.setup_kernel()
        self._setup.__enter__()
        self.client.reset_execution_trackers()
        return self

    def run_cells(self, count: int | None = None) -> None:
        for index, cell in enumerate(self.nb.cells[:count]):
            if cell.cell_type == "code":
                self.client.execute_cell(cell, index)

    def run(self, source: str) -> str:
        cell = nbformat.v4.new_code_cell(source)
        self.nb.cells.append(cell)
        self.client.execute_cell(cell, len(self.nb.cells) - 1)
        return "".join(out.get("text", "") for out in cell.outputs if out.get("output_type") == "stream")

    def __exit__(self, *exc) -> None:
        self._setup.__exit__(*exc)  # shuts the kernel down, as a restart does


def expected_replies(zoo) -> tuple[Path, list[str]]:
    model = zoo["qwen2-tied"]  # its own draft: every draft accepted
    local = Head.open(Settings(model=str(model), draft=str(model), device="cpu"))
    history, replies = [], []
    for prompt in (PROMPT, AGAIN, THIRD):
        history.append({"role": "user", "content": prompt})
        done = [e for e in local.ask(history, N_TOKENS, make_sampling(0, 0, 1.0, 0)) if isinstance(e, ReplyFinished)][0]
        history.append({"role": "assistant", "content": done.text})
        replies.append(done.text)
    local.close()
    return model, replies


def shown(text: str) -> str:
    return "\n".join(plain(line) for line in text.split("\n"))




def test_a_tail_restarted_in_the_same_session_and_in_a_new_one_as_the_notebooks_say(zoo, tmp_path, kernel_env,
                                                                                  relay_url, monkeypatch):
    model, (first, second, _) = expected_replies(zoo)
    tail = TailNotebook(tmp_path / "tail-1", relay_url, zoo)
    advice = " ".join(c.source for nb in (tail.nb, with_parameters("head.ipynb")) for c in nb.cells
                      if c.cell_type == "markdown")
    assert "by itself" in advice and "Change nothing on the head" in advice  # what step 1 below does
    assert "server.set_code(" in advice and "Restart & run all" not in advice  # what step 2 below does
    http = free_port()
    parameters = dict(SFCHAT_SOURCE="", RELAY_URL=relay_url, TOKEN=TOKEN, SESSION=SESSION, PAIRING_CODE=tail.code(),
                      MODEL=str(model), DRAFT=str(model), DEVICE="cpu", PORT=http, LOAD_TIMEOUT_S=300,
                      MAX_TOKENS=N_TOKENS, FIRST_PROMPT=PROMPT)
    with Kernel(with_parameters("head.ipynb", **parameters), tmp_path / "head-1") as head:
        head.run_cells()
        assert shown(first) in printed(head.nb)
        # 1. the tail stops and is started again in the same notebook session (its state directory kept)
        tail.stop()
        tail = TailNotebook(tmp_path / "tail-2", relay_url, zoo)
        tail.code()
        # the lines after the code arrive a moment later: wait for the greeting, which the tail prints after them
        assert "resumes without a code" in tail.said_before("waiting for a head")
        said = head.run(f"chat({AGAIN!r})")  # the notebooks: change nothing on the head, go on chatting
        assert shown(second) in said, said
        assert until(lambda: "resumed its pairing" in tail.said(), "resumption in the tail's log")
        tail.stop()
        # 2. a tail in a new notebook session: its resumption file is gone, it prints a new code
        monkeypatch.setenv("SFCHAT_STATE_DIR", str(tmp_path / "new-session-state"))
        tail = TailNotebook(tmp_path / "tail-3", relay_url, zoo)
        try:
            new_code = tail.code()
            assert new_code != parameters["PAIRING_CODE"]
            assert "resumes without a code" not in tail.said_before("waiting for a head")
            # the notebooks: give the running server the new code, then go on chatting (no restart)
            head.run(f"server.set_code({new_code!r})\nhistory.clear()")
            said = head.run(f"chat({THIRD!r})")
            assert shown(expected_fresh_reply(model, THIRD)) in said, said
            # the code in the parameters and the server cell run again: it replaces the server (the
            # old one's port is free again); the environment cell reads PAIRING_CODE
            head.run(f"PAIRING_CODE = {new_code!r}")
            env = next(i for i, c in enumerate(head.nb.cells) if 'os.environ["SFCHAT_CODE"]' in c.source)
            head.client.execute_cell(head.nb.cells[env], env)
            cell = next(i for i, c in enumerate(head.nb.cells) if "start_server(" in c.source)
            head.client.execute_cell(head.nb.cells[cell], cell)
            said = head.run(f"chat({THIRD!r})")
            assert "Traceback" not in said and said.strip(), said
        finally:
            tail.stop()


def expected_fresh_reply(model: Path, prompt: str) -> str:
    local = Head.open(Settings(model=str(model), draft=str(model), device="cpu"))
    done = [e for e in local.ask([{"role": "user", "content": prompt}], N_TOKENS, make_sampling(0, 0, 1.0, 0))
            if isinstance(e, ReplyFinished)][0]
    local.close()
    return done.text


def test_the_head_notebook_offers_its_chat_to_a_screen_at_home_which_types_a_new_tail_code(
        zoo, tmp_path, kernel_env, relay_url, monkeypatch):
    model, (first, second, _) = expected_replies(zoo)
    tail = TailNotebook(tmp_path / "tail-1", relay_url, zoo)
    parameters = dict(SFCHAT_SOURCE="", RELAY_URL=relay_url, TOKEN=TOKEN, SESSION=SESSION, PAIRING_CODE=tail.code(),
                      MODEL=str(model), DRAFT=str(model), DEVICE="cpu", LOAD_TIMEOUT_S=300, CHAT_FROM_HOME=True,
                      MAX_TOKENS=N_TOKENS)
    nb = with_parameters("head.ipynb", **parameters)
    remote_cell = next(i for i, c in enumerate(nb.cells) if "--offer-chat" in c.source and c.cell_type == "code")
    events: list = []
    home = None
    try:
        with Kernel(nb, tmp_path / "head") as head:
            head.run_cells(remote_cell + 1)  # Run All stops after it, on purpose, when CHAT_FROM_HOME is True
            said = printed(head.nb)
            code = re.search(r"CHAT CODE: (\S+)", said).group(1)
            command = re.search(r"(sfchat --remote --relay (\S+) --session (\S+))", said)
            assert command and command.group(2) == relay_url, said
            assert "the head is ready" in said
            home = RemoteRuntime(lambda: RelayLink(relay_url, TOKEN, command.group(3), "head"), code, command.group(3))
            home.start(events.append)
            until(lambda: any(isinstance(e, RuntimeReady) for e in events), "ready at home")
            home.submit([{"role": "user", "content": PROMPT}], Ask(N_TOKENS, GenParams(temperature=0.0)))
            done = until(lambda: [e for e in events if isinstance(e, ReplyFinished)], "a reply at home")[0]
            assert done.text == reply_text(first) and done.tokens_per_round > 1
            # the tail in a new notebook session: a new code, which the screen at home asks for and passes on
            tail.stop()
            monkeypatch.setenv("SFCHAT_STATE_DIR", str(tmp_path / "new-session-state"))
            tail = TailNotebook(tmp_path / "tail-2", relay_url, zoo)
            new_code = tail.code()
            history = [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": first},
                       {"role": "user", "content": AGAIN}]
            home.submit(history, Ask(N_TOKENS, GenParams(temperature=0.0)))
            until(lambda: [e for e in events if isinstance(e, CodeWanted)], "the tail's code asked at home")
            home.set_code(new_code)
            finished = until(lambda: [e for e in events if isinstance(e, ReplyFinished)][1:], "the second reply")
            assert finished[0].text == reply_text(second)
    finally:
        if home is not None:
            home.close()
        tail.stop()


def test_the_install_cell_pins_a_commit_and_says_what_it_installed(tmp_path, kernel_env, monkeypatch):
    """Before: the notebooks installed whatever the branch held, and said only a version."""
    fake = tmp_path / "fake-pip" / "pip"
    fake.mkdir(parents=True)
    record = tmp_path / "pip-argv"
    (fake / "__init__.py").write_text("")
    (fake / "__main__.py").write_text(f"import sys\nopen({str(record)!r}, 'w').write(repr(sys.argv[1:]))\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(fake.parent), os.environ["PYTHONPATH"]]))
    for name in ("tail.ipynb", "head.ipynb"):
        nb = with_parameters(name, SFCHAT_SOURCE="https://example.org/owner/sfchat", SFCHAT_COMMIT="0123abcd")
        install = next(i for i, c in enumerate(nb.cells) if "pip" in c.source and c.cell_type == "code")
        with Kernel(nb, tmp_path / name) as kernel:
            kernel.run_cells(install + 1)
        argv = eval(record.read_text())
        assert "sfchat[model] @ git+https://example.org/owner/sfchat@0123abcd" in argv, argv
        said = printed(nb)
        assert re.search(r"installed sfchat \S+ from \S+", said), said
    empty = with_parameters("tail.ipynb", SFCHAT_SOURCE="")
    install = next(i for i, c in enumerate(empty.cells) if "pip" in c.source and c.cell_type == "code")
    assert "git remote get-url origin" in empty.cells[install].source  # where the address comes from
    assert sys.executable
