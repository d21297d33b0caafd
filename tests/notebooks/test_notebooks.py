"""The Kaggle notebooks, executed headless as a user runs them top to bottom: a real relay on
loopback, tiny models on the CPU, the tail notebook in a kernel of its own until it is stopped as a
user stops its cell, and the head notebook serving and chatting through it. Each notebook gets its
parameters in a cell after the one tagged "parameters", as papermill would inject them."""

from __future__ import annotations

import re
import signal
import socket
import threading
import time

import nbformat
import pytest
from nbclient.exceptions import CellExecutionError
from relay_process import REPO, TOKEN, start_relay

from sfchat.config import Settings
from sfchat.events import ReplyFinished
from sfchat.node.head import Head
from sfchat.node.prompts import make_sampling
from sfchat.plaintext import plain

from notebook_kernels import (  # noqa: F401  (fixture)
    NOTEBOOKS, SESSION, client, free_port, kernel_env, printed, with_parameters
)

PROMPT = "hello world, how are you?"
N_TOKENS = 24


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_the_tail_and_head_notebooks_pair_through_a_relay_and_chat(zoo, tmp_path, kernel_env):
    model = draft = zoo["qwen2-tied"]  # its own draft: every draft accepted; its greedy reply runs N_TOKENS long
    local = Head.open(Settings(model=str(model), draft=str(draft), device="cpu"))
    expected = [e for e in local.ask([{"role": "user", "content": PROMPT}], N_TOKENS, make_sampling(0, 0, 1.0, 0))
                if isinstance(e, ReplyFinished)][0]
    local.close()
    assert expected.text.strip()

    with open(tmp_path / "relay.log", "w") as relay_log:
        relay, port = start_relay(relay_log)
    url = f"ws://127.0.0.1:{port}"
    tail_nb = with_parameters("tail.ipynb", SFCHAT_SOURCE="", RELAY_URL=url, TOKEN=TOKEN, SESSION=SESSION,
                              DEVICE="cpu", MODELS_DIR=str(zoo["tokenizer"].parent))
    tail = client(tail_nb, tmp_path / "tail", timeout=600)
    tail_failure: list[BaseException] = []

    def run_tail():
        try:
            tail.execute()
        except BaseException as exc:  # the test reads it below: stopping the tail cell raises here by design
            tail_failure.append(exc)

    tail_thread = threading.Thread(target=run_tail, daemon=True)
    tail_thread.start()
    try:
        deadline, code = time.monotonic() + 120, None
        while code is None and time.monotonic() < deadline and tail_thread.is_alive():
            code = re.search(r"PAIRING_CODE = \"(\d+-[a-z]+-[a-z]+)\"", printed(tail_nb))
            time.sleep(0.2)
        assert code, f"the tail notebook printed no pairing code: {printed(tail_nb)!r} {tail_failure}"

        http = free_port()
        head_nb = with_parameters("head.ipynb", SFCHAT_SOURCE="", RELAY_URL=url, TOKEN=TOKEN, SESSION=SESSION,
                                  PAIRING_CODE=code.group(1), MODEL=str(model), DRAFT=str(draft), DEVICE="cpu",
                                  PORT=http, LOAD_TIMEOUT_S=300, MAX_TOKENS=N_TOKENS, FIRST_PROMPT=PROMPT)
        started = time.monotonic()
        client(head_nb, tmp_path / "head", timeout=300).execute()
        print(f"\nthe head notebook ran in {time.monotonic() - started:.1f} s")
        said = printed(head_nb)
        assert f"serving {model.name} at http://127.0.0.1:{http}/v1" in said, said  # served by its name
        reply = "\n".join(plain(line) for line in expected.text.split("\n"))
        assert reply in said, (reply, said)
        figures = re.search(r"\[\d+ rounds, ([\d.]+) tokens/round, [\d.]+ tok/s, ttft [\d.]+ s, RTT \d+ ms, "
                            r"draft/head/tail [\d.]+/[\d.]+/[\d.]+ ms per round\]", said)
        assert figures and float(figures.group(1)) > 1, said  # the rounds went through the tail with drafts
        deadline = time.monotonic() + 20  # the head notebook's kernel took its server with it
        while listening(http) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not listening(http), "the server outlived the head notebook's kernel"
        assert re.search(r"paired with a head", printed(tail_nb)), printed(tail_nb)
    finally:
        if tail.km is not None and tail.km.has_kernel:  # as a user stops the tail cell: an interrupt
            tail.km.provisioner.process.send_signal(signal.SIGINT)
        tail_thread.join(60)
        relay.terminate()
        relay.wait(10)
    assert not tail_thread.is_alive()
    assert len(tail_failure) == 1 and isinstance(tail_failure[0], CellExecutionError)
    assert "KeyboardInterrupt" in str(tail_failure[0])  # stopped in its last cell, not failed before


@pytest.mark.parametrize("name", ["tail.ipynb", "head.ipynb"])
def test_a_notebook_ships_clean_with_every_code_cell_explained(name):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata.kernelspec.name == "python3"
    assert nb.cells[0].cell_type == "markdown"
    for before, cell in zip(nb.cells, nb.cells[1:]):
        if cell.cell_type == "code":
            assert before.cell_type == "markdown", f"{name}: no explanation before {cell.source[:60]!r}"
            assert cell.outputs == [] and cell.execution_count is None, f"{name} ships with outputs"
    assert f"(notebooks/{name})" in (REPO / "README.md").read_text()


def test_a_failed_chat_in_the_head_notebook_leaves_no_turn_in_the_history():
    """A chat() whose request failed kept its user turn in `history`, so sending it again sent it twice."""
    nb = nbformat.read(NOTEBOOKS / "head.ipynb", as_version=4)
    cell = next(c.source for c in nb.cells if c.cell_type == "code" and "def chat(" in c.source)
    scope = {"PORT": free_port(), "MAX_TOKENS": 8, "served": "model", "plain": plain}  # nothing listens there
    exec(cell, scope)
    scope["client"] = scope["client"].with_options(max_retries=0)
    import openai

    with pytest.raises(openai.APIConnectionError):
        scope["chat"]("hello")
    assert scope["history"] == []
