"""Settings from the TOML file, the environment and the flags: one check of every value, whatever
its source, and a refusal that names the setting and where it came from."""

from __future__ import annotations

import math
import re
from dataclasses import fields

import pytest

from sfchat import UserError
from sfchat.config import Settings, merged


def write(tmp_path, text: str):
    path = tmp_path / "config.toml"
    path.write_text(text)
    return path


# values that ended in "internal error" or were taken as they were
@pytest.mark.parametrize("line, wanted", [
    ('split = "two"', r"split must be a whole number between 0 and \d+, not 'two'"),
    ("seed = [1, 2]", r"seed must be a whole number of at most 64 bits, not \[1, 2\]"),
    ("seed = 1.5", r"seed must be a whole number of at most 64 bits, not 1\.5"),
    ("temperature = nan", r"temperature must be a number between 0 and 2, not nan"),
    ("temperature = inf", r"temperature must be a number between 0 and 2, not inf"),
    ("temperature = 5", r"temperature must be a number between 0 and 2, not 5\.0"),
    ("top_k = 99999999999", r"top_k must be a whole number between 0 and 1048576, not 99999999999"),
    ("system = 5", r"system must be text without control characters, not 5"),
    ("round_timeout = nan", r"round_timeout must be a number above 0 and at most 86400, not nan"),
    ("round-timeout = 0", r"round-timeout must be a number above 0 and at most 86400, not 0\.0"),
    ("reconnect_timeout = -1", r"reconnect_timeout must be a number between 0 and 86400, not -1\.0"),
    ("max_new_tokens = 0", r"max_new_tokens must be a whole number between 1 and \d+, not 0"),
    ("max_context = 1e9", r"max_context must be a whole number between 2 and \d+, not 1000000000\.0"),
    ("top_p = 0", r"top_p must be a number above 0 and at most 1, not 0\.0"),
    ("repetition_penalty = 0", r"repetition_penalty must be a number between 0\.01 and 10, not 0\.0"),
    ("repetition-penalty = 10.5", r"repetition-penalty must be a number between 0\.01 and 10, not 10\.5"),
    ("repetition_penalty = nan", r"repetition_penalty must be a number between 0\.01 and 10, not nan"),
    ('k = "three"', r"k must be auto or a whole number between 0 and 32, not 'three'"),
    ("k = true", r"k must be auto or a whole number between 0 and 32, not True"),
    ("max_in_flight = 17", r"max_in_flight must be a whole number between 1 and 16, not 17"),
    ("draft_ahead = 65", r"draft_ahead must be a whole number between 0 and 64, not 65"),
    ('dtype = "fp8"', r"dtype must be one of auto, float32, float16, bfloat16, not 'fp8'"),
    ("load_in_4bit = 1", r"load_in_4bit must be true or false, not 1"),
    ('model = ""', r"model must be a one-line string without control characters, not ''"),
    ('token = "abc\\n"', r"token must be a one-line string without control characters, not 'abc\\n'"),
    ('session = "my chat"', r"session must be 1 to 64 characters of .*, not 'my chat'"),
    ('system = "be \\u001b[31mred"', r"system must be text without control characters"),
])
def test_a_bad_value_in_the_file_is_one_error_naming_the_key_and_the_file(tmp_path, line, wanted):
    path = write(tmp_path, line + "\n")
    with pytest.raises(UserError) as caught:
        merged({}, path)
    message = str(caught.value)
    assert message.startswith(f"config file {path}: "), message
    assert "\n" not in message
    assert re.search(wanted, message), message


def test_good_values_are_taken_as_the_setting_holds_them(tmp_path):
    path = write(tmp_path, 'temperature = 1\nseed = -3\nk = "auto"\ntree-budget = 16\nsplit = 0\n'
                           'system = "two\\nlines"\nround_timeout = 0.5\ntop_p = 1\n')
    s = merged({}, path)
    assert (s.temperature, type(s.temperature)) == (1.0, float)
    assert (s.seed, s.k, s.tree_budget, s.split, s.system, s.round_timeout, s.top_p) == \
        (-3, "auto", 16, 0, "two\nlines", 0.5, 1.0)


@pytest.mark.parametrize("flag, value, wanted", [
    ("temperature", 5.0, "--temperature must be a number between 0 and 2, not 5.0"),
    ("temperature", math.nan, "--temperature must be a number between 0 and 2, not nan"),
    ("round_timeout", math.inf, "--round-timeout must be a number above 0 and at most 86400, not inf"),
    ("top_k", 99999999999, "--top-k must be a whole number between 0 and 1048576, not 99999999999"),
    ("k", "-1", "--k must be auto or a whole number between 0 and 32, not -1"),
    ("tree_budget", "lots", "--tree-budget must be auto or a whole number between 0 and 255, not 'lots'"),
    # a frame is the root and its drafts: 256 drafts would be a frame the tail refuses (257 nodes)
    ("tree_budget", 256, "--tree-budget must be auto or a whole number between 0 and 255, not 256"),
    # every frame is padded to it: more rows than a frame may hold nodes would be a shape the tail refuses
    ("frame_rows", 257, "--frame-rows must be auto or a whole number between 0 and 256, not 257"),
    ("direct", "203.0.113.7", "--direct must be HOST:PORT (such as 203.0.113.7:7860, box.example.org:7860 or "
                              "[::1]:7860), not '203.0.113.7'"),
    ("direct", "box:0", "--direct must be HOST:PORT (such as 203.0.113.7:7860, box.example.org:7860 or [::1]:7860), "
                        "not 'box:0'"),
    ("direct", "::1:7860", "--direct must be HOST:PORT (such as 203.0.113.7:7860, box.example.org:7860 or "
                           "[::1]:7860), not '::1:7860'"),
    ("listen", "0.0.0.0:65536", "--listen must be HOST:PORT (port 0: any free one; such as 203.0.113.7:7860, "
                                "box.example.org:7860 or [::1]:7860), not '0.0.0.0:65536'"),
])
def test_flags_go_through_the_same_check(flag, value, wanted):
    with pytest.raises(UserError) as caught:
        merged({flag: value})
    assert str(caught.value) == wanted


def test_a_flag_given_as_text_is_parsed_and_wins_over_the_file(tmp_path):
    s = merged({"k": "5", "tree_budget": "auto", "temperature": 2.0}, write(tmp_path, "k = 3\ntemperature = 0.5\n"))
    assert (s.k, s.tree_budget, s.temperature) == (5, "auto", 2.0)


@pytest.mark.parametrize("var, value, wanted", [
    ("SFCHAT_SESSION", "my chat", "SFCHAT_SESSION must be 1 to 64 characters"),
    ("SFCHAT_TOKEN", "pasted\r", "SFCHAT_TOKEN must be a one-line string without control characters"),
    ("SFCHAT_CODE", "7-a\x1b[2J", "SFCHAT_CODE must be a one-line string without control characters"),
])
def test_environment_values_go_through_the_same_check(monkeypatch, var, value, wanted):
    monkeypatch.setenv(var, value)
    with pytest.raises(UserError) as caught:
        merged({})
    assert str(caught.value).startswith(wanted), caught.value


def test_every_setting_has_a_rule_and_every_default_keeps_it():
    from sfchat.config import RULES

    names = {f.name for f in fields(Settings)}
    assert set(RULES) == names
    defaults = Settings()
    for name in names:
        value = getattr(defaults, name)
        if value is not None:  # None: unset, filled later (models, split) or never needed
            assert RULES[name].check(value) == value, name


def test_addresses_of_the_direct_link_are_taken_as_given():
    s = merged({"direct": "[::1]:7860", "listen": "0.0.0.0:0"})
    assert (s.direct, s.listen) == ("[::1]:7860", "0.0.0.0:0")


@pytest.mark.parametrize("argv, wanted", [
    (["--listen", "0.0.0.0:7860"], "--listen is the tail's"),
    (["--tail", "--direct", "box:7860"], "--direct is the head's"),
])
def test_each_end_of_a_direct_link_takes_only_its_own_flag(argv, wanted):
    from sfchat.flags import build_parser, refuse_ignored, settings_from

    args = build_parser().parse_args(argv)
    with pytest.raises(UserError, match=wanted):
        refuse_ignored(args, settings_from(args))


def test_compiled_attention_is_off_unless_a_node_asks_for_it(tmp_path):
    from sfchat.flags import build_parser, settings_from

    assert settings_from(build_parser().parse_args([])).compile_attention is False
    for argv in (["--compile-attention"], ["--tail", "--compile-attention"]):  # head and tail decide each their own
        args = build_parser().parse_args(argv)
        assert settings_from(args).compile_attention is True
    assert merged({}, write(tmp_path, "compile-attention = true\n")).compile_attention is True
    assert settings_from(build_parser().parse_args([])).compile_frames is False
    assert settings_from(build_parser().parse_args(["--compile-frames"])).compile_frames is True
    assert merged({}, write(tmp_path, "compile-frames = true\n")).compile_frames is True
