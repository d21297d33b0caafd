"""A model's own sampling defaults (``model.generation``): read from generation_config.json as
generate() reads them, bounded like a flag, and overridden by the user's settings."""

from __future__ import annotations

import json
import shutil

import pytest

from sfchat.config import Settings
from sfchat.model.generation import MAX_BYTES, generation_defaults, parse
from sfchat.model.source import ModelSource
from sfchat.node.head import Head
from sfchat.params import GenParams
from sfchat.protocol.wire import Sampling

QWEN = {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643], "pad_token_id": 151643,
        "repetition_penalty": 1.05, "temperature": 0.7, "top_k": 20, "top_p": 0.8}


def raw(data) -> bytes:
    return json.dumps(data).encode()


def test_a_chat_models_sampling_and_repetition_penalty_are_taken():
    assert parse(raw(QWEN)) == (GenParams(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05), ())


@pytest.mark.parametrize("data", [{"bos_token_id": 1, "eos_token_id": 2}, {"do_sample": False, "temperature": 0.7},
                                  {"do_sample": "yes", "temperature": 0.7}])
def test_without_do_sample_the_model_asks_for_greedy_as_generate_does(data):
    assert parse(raw(data)) == (GenParams(temperature=0.0), ())


def test_greedy_keeps_the_repetition_penalty_as_generate_does():
    assert parse(raw({"do_sample": False, "temperature": 0.7, "repetition_penalty": 1.2})) == \
        (GenParams(temperature=0.0, repetition_penalty=1.2), ())


@pytest.mark.parametrize("key, value, wanted", [
    ("temperature", 50, "temperature must be a number between 0 and 2, not 50.0"),
    ("temperature", True, "temperature must be a number between 0 and 2, not True"),
    ("top_k", "20", "top_k must be a whole number between 0 and 1048576, not '20'"),
    ("top_k", 20.0, "top_k must be a whole number between 0 and 1048576, not 20.0"),
    ("top_p", 0, "top_p must be a number above 0 and at most 1, not 0.0"),
    ("top_p", 1e309, "top_p must be a number above 0 and at most 1, not inf"),
    ("repetition_penalty", 0.001, "repetition_penalty must be a number between 0.01 and 10, not 0.001"),
    ("repetition_penalty", 11, "repetition_penalty must be a number between 0.01 and 10, not 11.0"),
    ("repetition_penalty", "1.1", "repetition_penalty must be a number between 0.01 and 10, not '1.1'"),
])
def test_a_value_out_of_bounds_is_left_out_and_said_so(key, value, wanted):
    values, notes = parse(raw(QWEN | {key: value}), "m")
    assert key not in values.given() and len(values.given()) == 3
    assert notes == (f"generation_config.json of m: {wanted}; left out",)


@pytest.mark.parametrize("text, why", [
    (b"[1, 2]", "is not a generation config (ValueError)"),
    (b"\xff\xfe{", "is not a generation config (UnicodeDecodeError)"),
    (b"[" * 5000 + b"]" * 5000, "is not a generation config"),
    (b" " * MAX_BYTES + b"{}", "is over 64 KiB"),
])
def test_a_file_that_is_no_generation_config_gives_no_defaults(text, why):
    values, notes = parse(text, "m")
    assert values == GenParams() and len(notes) == 1 and why in notes[0], notes


def test_the_head_takes_the_models_defaults_and_every_setting_overrides_them(zoo, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(zoo["llama-tied"], model)
    (model / "generation_config.json").write_text(json.dumps(QWEN | {"top_k": "many"}))
    src = ModelSource.open(str(model))
    assert generation_defaults(src).values == GenParams(temperature=0.7, top_p=0.8, repetition_penalty=1.05)
    head = Head.open(Settings(model=str(model), draft="none", device="cpu"))
    try:
        assert head.defaults.notes and "top_k" in head.defaults.notes[0]
        assert head.sampling(GenParams(seed=1)) == Sampling(0.7, 0, 0.8, 1, 1.05)
        assert head.sampling(GenParams(0.0, seed=1)) == Sampling(0.0, 0, 0.8, 1, 1.05)  # a request's own value wins
        assert head.sampling(GenParams(seed=1, repetition_penalty=1.0)) == Sampling(0.7, 0, 0.8, 1)
    finally:
        head.close()
    head = Head.open(Settings(model=str(model), draft="none", device="cpu", temperature=0.0, top_k=3, seed=9,
                              repetition_penalty=1.3))
    try:
        assert head.sampling() == Sampling(0.0, 3, 0.8, 9, 1.3)  # flags or the config file win
    finally:
        head.close()
