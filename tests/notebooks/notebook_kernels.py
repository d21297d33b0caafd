"""What the notebook tests share: the notebooks with their parameters set, a kernel's
environment, what a run printed, and a client of the server a notebook started."""

from __future__ import annotations

import json
import os
import re
import socket
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from relay_process import REPO


NOTEBOOKS = REPO / "notebooks"


SESSION = "notebooks"
KERNEL = "sfchat-tests"  # a kernel of this very Python, whatever other kernels the machine has


def with_parameters(name: str, **values) -> nbformat.NotebookNode:
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    tagged = [i for i, cell in enumerate(nb.cells) if "parameters" in cell.metadata.get("tags", [])]
    assert len(tagged) == 1, f"{name}: one cell tagged 'parameters'"
    known = set(re.findall(r"^([A-Z_]+) = ", nb.cells[tagged[0]].source, re.M))
    assert set(values) <= known, f"{name} has no parameters {set(values) - known}"
    injected = nbformat.v4.new_code_cell("\n".join(f"{k} = {v!r}" for k, v in values.items()),
                                         metadata={"tags": ["injected-parameters"]})
    nb.cells.insert(tagged[0] + 1, injected)
    return nb


def printed(nb) -> str:
    return "".join(out.get("text", "") for cell in nb.cells for out in cell.get("outputs", [])
                   if out.get("output_type") == "stream")


def client(nb, folder: Path, timeout: int) -> NotebookClient:
    folder.mkdir()
    return NotebookClient(nb, timeout=timeout, kernel_name=KERNEL, resources={"metadata": {"path": str(folder)}})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def kernel_env(tmp_path, monkeypatch):
    """What the notebooks' kernels inherit: this checkout first on the path, no hub, one thread,
    no SFCHAT_ settings of the machine running the tests, a state directory of the test's own (a
    tail's resumption file: tests that run at once, each with its tail of session 'notebooks', would
    overwrite each other's in the user's); and the kernel itself, this Python."""
    spec = tmp_path / "jupyter" / "kernels" / KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({"argv": [sys.executable, "-m", "ipykernel_launcher", "-f",
                                                           "{connection_file}"],
                                                  "display_name": KERNEL, "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    for name in [n for n in os.environ if n.startswith("SFCHAT_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]))
    for name, value in (("HF_HUB_OFFLINE", "1"), ("HF_HOME", str(tmp_path / "hf")), ("OMP_NUM_THREADS", "1"),
                        ("TOKENIZERS_PARALLELISM", "false"), ("XDG_DATA_HOME", str(tmp_path / "data")),
                        ("XDG_CONFIG_HOME", str(tmp_path / "config")), ("XDG_STATE_HOME", str(tmp_path / "state")),
                        ("SFCHAT_STATE_DIR", str(tmp_path / "state" / "sfchat"))):
        monkeypatch.setenv(name, value)
